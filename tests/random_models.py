"""Models whose forward draws random numbers outside nn.Dropout, loaded like a user's `--model package.module:function`.

Each is a small transformer-shaped stack of blocks (an `nn.ModuleList`, so --activation-checkpointing and FSDP find
them) over a float sequence, with one way of drawing that users' models have:
  functional_dropout   F.dropout inside the block's own forward with a float attribute for p (OPT's layers)
  drop_path            stochastic depth: torch.rand per sample, + keep probability, floor_ (timm's and Swin's)
  sdpa_dropout         scaled_dot_product_attention(dropout_p=...) in a hand-written attention
  transformer_layer    nn.TransformerEncoderLayer with dropout (its nn.MultiheadAttention drops attention weights)
  all_random           the first three in one model
  numpy_noise          noise from NumPy's generator: no torch random op draws it, so nothing can replay it

Not a test module (no `test_` prefix): pytest does not collect it.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from dpcompare import Workload

DIM, SEQ, FEATURES, CLASSES = 16, 6, 8, 5


class _Stack(nn.Module):
    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.embed = nn.Linear(FEATURES, DIM)
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h.mean(dim=1))


class FunctionalDropoutBlock(nn.Module):
    """OPT's layer: the dropout probability is a float attribute, dropout a functional call in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(DIM), nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)
        self.dropout = 0.2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(F.gelu(self.fc1(self.norm(x))), p=self.dropout, training=self.training)
        return x + F.dropout(self.fc2(h), p=self.dropout, training=self.training)


def drop_path(x: torch.Tensor, drop_prob: float, training: bool) -> torch.Tensor:
    """timm's drop_path (and transformers' Swin's): each sample's residual branch kept whole or dropped."""
    if drop_prob == 0.0 or not training:
        return x
    keep = 1 - drop_prob
    shape = (x.shape[0],) + (1,) * (x.ndim - 1)
    random_tensor = keep + torch.rand(shape, dtype=x.dtype, device=x.device)
    random_tensor.floor_()
    return x.div(keep) * random_tensor


class DropPathBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(DIM), nn.Linear(DIM, DIM)
        self.drop_prob = 0.3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + drop_path(torch.tanh(self.fc(self.norm(x))), self.drop_prob, self.training)


class SdpaBlock(nn.Module):
    """A hand-written causal self-attention that hands its dropout to scaled_dot_product_attention."""

    def __init__(self, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.norm, self.qkv, self.proj = nn.LayerNorm(DIM), nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.dropout_p = 0.2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (z.reshape(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(self.norm(x)).chunk(3, dim=-1))
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout_p if self.training else 0.0, is_causal=True)
        return x + self.proj(a.transpose(1, 2).reshape(b, t, DIM))


class NumpyNoiseBlock(nn.Module):
    """Adds noise drawn from NumPy's generator: a random source no torch random op sees."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)
        self.rng = np.random.default_rng(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.training:
            h = h + torch.from_numpy(self.rng.standard_normal(h.shape)).to(h.dtype) * 0.1
        return x + h


def _workload(name: str, seed: int, make_blocks) -> Workload:
    torch.manual_seed(seed)
    model = _Stack(make_blocks())
    weight = torch.randn(FEATURES, CLASSES, generator=torch.Generator().manual_seed(seed + 17))

    def make_batch(step: int, global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(global_batch, SEQ, FEATURES, generator=torch.Generator().manual_seed(seed * 1_000_003 + step))
        return x, (x.mean(dim=1) @ weight).argmax(dim=1)

    return Workload(name, model, make_batch, F.cross_entropy, source="tests.random_models")


def functional_dropout(seed: int) -> Workload:
    return _workload("functional-dropout", seed, lambda: [FunctionalDropoutBlock(), FunctionalDropoutBlock()])


def drop_path_model(seed: int) -> Workload:
    return _workload("drop-path", seed, lambda: [DropPathBlock(), DropPathBlock()])


def sdpa_dropout(seed: int) -> Workload:
    return _workload("sdpa-dropout", seed, lambda: [SdpaBlock(), SdpaBlock()])


def transformer_layer(seed: int) -> Workload:
    return _workload("transformer-layer", seed, lambda: [
        nn.TransformerEncoderLayer(DIM, 2, dim_feedforward=2 * DIM, dropout=0.1, batch_first=True) for _ in range(2)])


def all_random(seed: int) -> Workload:
    return _workload("all-random", seed, lambda: [FunctionalDropoutBlock(), DropPathBlock(), SdpaBlock()])


def numpy_noise(seed: int) -> Workload:
    return _workload("numpy-noise", seed, lambda: [DropPathBlock(), NumpyNoiseBlock()])
