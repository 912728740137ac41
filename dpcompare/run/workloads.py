"""The built-in workloads: a model and its deterministic synthetic data, built from one seed.

Owns: the built-in models (mlp, mlp-wide (compute-bound), mlp-dropout, mlp-unused with a head forward never calls
and a frozen layer, cnn with BatchNorm, a small causal transformer LM with a tied head) and the synthetic global
batch of every step. What a workload is and how a global batch is sharded are the contract's
(`dpcompare.contract.workload`). Every rank builds the same weights from the seed; the trainer verifies that with a
fingerprint instead of assuming it. A user workload is a function `(seed: int) -> Workload`, loaded with
`--model package.module:function`.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from dpcompare.contract.workload import Workload


def _generator(seed: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


def token_stream(seed: int, step: int, global_batch: int, vocab: int, seq: int, max_stride: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable stream: each token is the previous one plus a per-sequence stride, mod vocab; next-token targets."""
    g = _generator(seed, step)
    start = torch.randint(0, vocab, (global_batch, 1), generator=g)
    stride = torch.randint(1, max_stride, (global_batch, 1), generator=g)
    stream = (start + stride * torch.arange(seq + 1)) % vocab
    return stream[:, :-1].contiguous(), stream[:, 1:].contiguous()


IGNORE_INDEX = -100
"""The target of a position the loss leaves out (F.cross_entropy's default ignore_index, transformers' convention)."""
PAD_ID = 0
"""The input token of a padded position (its output is never a target: the causal models never read it for an earlier
position)."""


def pad_at_end(tokens: torch.Tensor, targets: torch.Tensor, seed: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sample of a next-token batch cut to a length drawn from (seed, step) alone (every rank draws the same), at
    least 2 and at most the context, the rest padded with PAD_ID; the targets IGNORE_INDEX from the last real token on
    (its next token is padding), as a collator pads a batch of varying lengths."""
    n, seq = tokens.shape
    g = torch.Generator().manual_seed((seed * 1_000_003 + step) ^ (1 << 61))
    lengths = torch.randint(min(seq, max(2, seq // 4)), seq + 1, (n, 1), generator=g)
    where = torch.arange(seq)
    return tokens.masked_fill(where >= lengths, PAD_ID), targets.masked_fill(where >= lengths - 1, IGNORE_INDEX)


def token_batch(seed: int, step: int, global_batch: int, vocab: int, seq: int, max_stride: int, token_data: str
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_stream`'s batch, padded at the end (`pad_at_end`) unless `token_data` is "packed"."""
    x, y = token_stream(seed, step, global_batch, vocab, seq, max_stride)
    return (x, y) if token_data == "packed" else pad_at_end(x, y, seed, step)


def _cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


# -- MLP ---------------------------------------------------------------------------------------------
def mlp(seed: int) -> Workload:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 10))
    weight = torch.randn(32, 10, generator=_generator(seed, -1))

    def make_batch(step: int, global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(global_batch, 32, generator=_generator(seed, step))
        return x, (x @ weight).argmax(dim=1)

    return Workload("mlp", model, make_batch, _cross_entropy)


def mlp_wide(seed: int) -> Workload:
    """3 x Linear(512, 512) + GELU and a 10-way head (~0.8 M parameters, 3.2 MB of float32 gradients): a step
    is compute-bound on a CPU core (several ms at a local batch of 32), so it times the backend rather than
    Python overhead. The regression suite's default model."""
    torch.manual_seed(seed)
    width = 512
    model = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width), nn.GELU(),
                          nn.Linear(width, width), nn.GELU(), nn.Linear(width, 10))
    weight = torch.randn(width, 10, generator=_generator(seed, -1))

    def make_batch(step: int, global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(global_batch, width, generator=_generator(seed, step))
        return x, (x @ weight).argmax(dim=1)

    return Workload("mlp-wide", model, make_batch, _cross_entropy)


def mlp_dropout(seed: int) -> Workload:
    """The MLP with dropout after each hidden layer, in training mode: a forward that draws random numbers."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Dropout(0.2), nn.Linear(64, 64), nn.GELU(),
                          nn.Dropout(0.2), nn.Linear(64, 10))
    return Workload("mlp-dropout", model, mlp(seed).make_batch, _cross_entropy)


class _PartlyUsed(nn.Module):
    """An MLP with an auxiliary head that forward never calls (its parameters get no gradient) and a frozen
    input projection (requires_grad=False): what fine-tuning and multi-head models look like."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(32, 32)
        self.embed.requires_grad_(False)
        self.body = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 10))
        self.aux_head = nn.Linear(64, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self.embed(x))


def mlp_unused(seed: int) -> Workload:
    torch.manual_seed(seed)
    return Workload("mlp-unused", _PartlyUsed(), mlp(seed).make_batch, _cross_entropy)


# -- CNN with BatchNorm --------------------------------------------------------------------------------
def cnn(seed: int) -> Workload:
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 16, 3, padding=1, stride=2), nn.BatchNorm2d(16), nn.ReLU(),
        nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(64, 10),
    )

    def make_batch(step: int, global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = _generator(seed, step)
        x = torch.randn(global_batch, 1, 12, 12, generator=g)
        return x, torch.randint(0, 10, (global_batch,), generator=g)

    return Workload("cnn", model, make_batch, _cross_entropy)


# -- causal transformer LM -----------------------------------------------------------------------------
class _Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        mask = torch.triu(torch.ones(n, n, dtype=torch.bool, device=x.device), diagonal=1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    """Token + position embedding, pre-norm causal attention blocks, output head tied to the embedding."""

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, layers: int = 2, seq: int = 16) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.blocks = nn.ModuleList(_Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.ln(x) @ self.tok.weight.t()


def lm(seed: int, token_data: str = "padded") -> Workload:
    """TinyLM on token streams (`token_data`: padded at the end, or packed); the loss the mean over the targets not
    IGNORE_INDEX."""
    torch.manual_seed(seed)
    vocab, seq = 64, 16
    model = TinyLM(vocab=vocab, seq=seq)

    def make_batch(step: int, global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        return token_batch(seed, step, global_batch, vocab, seq, 4, token_data)

    return Workload("lm", model, make_batch, _cross_entropy, tokens_per_sample=seq, ignore_index=IGNORE_INDEX)
