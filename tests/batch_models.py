"""Workloads whose batches are structures of tensors, as users' are (tests/test_batches.py):

- `dict_attention`: a transformers-style batch, one dict of `input_ids`, `attention_mask` (padding at the end) and
  `labels` (-100 on the padding), the model called as model(**batch) and returning its own loss and logits, the
  attention masked by the padding; the loss the mean over the labelled tokens, or their sum over the
  `num_items_in_batch` it is given (transformers' convention; its twin `dict_attention_drops_the_count` ignores it);
- `two_towers`: two inputs, model(*inputs): a query tower and a document tower scored against each other per sample;
- `dataclass_inputs`: the inputs a dataclass, called by the workload's own forward(model, inputs);
- `seq_first`: sequence-first tensors (T, B, F), `sample_dim=1`.
Each makes its global batch from (seed, step) alone, so every rank builds the same one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from dpcompare import Workload

VOCAB, SEQ, DIM = 32, 12, 16


def _g(seed: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


class MaskedEncoder(nn.Module):
    """Embedding, one self-attention layer masked by the padding, a head; returns {"loss", "logits"} as transformers'
    models do when given labels."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.attn = nn.MultiheadAttention(DIM, 2, batch_first=True)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor | None = None,
                num_items_in_batch: torch.Tensor | None = None):
        h = self.embed(input_ids)
        a, _ = self.attn(h, h, h, key_padding_mask=attention_mask == 0, need_weights=False)
        logits = self.head(self.norm(h + a))
        out = {"logits": logits}
        if labels is not None:
            # transformers' convention: the sum over the labelled tokens over num_items_in_batch where given
            total = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100, reduction="sum")
            count = num_items_in_batch if num_items_in_batch is not None and self.takes_count else (labels != -100).sum()
            out["loss"] = total / count
        return out

    takes_count = True


def dict_attention(seed: int) -> Workload:
    torch.manual_seed(seed)
    model = MaskedEncoder()

    def make_batch(step: int, global_batch: int) -> dict[str, torch.Tensor]:
        g = _g(seed, step)
        ids = torch.randint(0, VOCAB, (global_batch, SEQ), generator=g)
        lengths = torch.randint(SEQ // 3, SEQ + 1, (global_batch,), generator=g)
        mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
        labels = torch.randint(0, VOCAB, (global_batch, SEQ), generator=g).masked_fill(mask == 0, -100)
        return {"input_ids": ids * mask, "attention_mask": mask, "labels": labels}

    return Workload("dict-attention", model, make_batch, lambda out, batch: out["loss"], tokens_per_sample=SEQ,
                    ignore_index=-100, num_items_kwarg="num_items_in_batch")


def dict_attention_drops_the_count(seed: int) -> Workload:
    """The twin: the workload says its model takes the step's count, and the model leaves it out (each forward's own
    mean): `different` under --loss-normalisation global."""
    w = dict_attention(seed)
    w.model.takes_count = False
    return w


class TwoTowers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.query = nn.Sequential(nn.Linear(10, DIM), nn.Tanh(), nn.Linear(DIM, DIM))
        self.doc = nn.Sequential(nn.Linear(6, DIM), nn.Tanh(), nn.Linear(DIM, DIM))

    def forward(self, q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        return (self.query(q) * self.doc(d)).sum(-1)


def two_towers(seed: int) -> Workload:
    torch.manual_seed(seed)

    def make_batch(step: int, global_batch: int):
        g = _g(seed, step)
        q, d = torch.randn(global_batch, 10, generator=g), torch.randn(global_batch, 6, generator=g)
        return (q, d), torch.randn(global_batch, generator=g)

    return Workload("two-towers", TwoTowers(), make_batch, F.mse_loss)


@dataclass
class Inputs:
    pixels: torch.Tensor
    extra: torch.Tensor
    note: str = "not a tensor: passed through"


class Fused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.mix = nn.Linear(4 * 6 * 6 + 3, 5)

    def forward(self, pixels: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        return self.mix(torch.cat([F.relu(self.conv(pixels)).flatten(1), extra], dim=1))


def dataclass_inputs(seed: int) -> Workload:
    torch.manual_seed(seed)

    def make_batch(step: int, global_batch: int):
        g = _g(seed, step)
        inputs = Inputs(torch.randn(global_batch, 1, 8, 8, generator=g), torch.randn(global_batch, 3, generator=g))
        return inputs, torch.randint(0, 5, (global_batch,), generator=g)

    def forward(model: nn.Module, inputs: Inputs) -> torch.Tensor:
        assert inputs.note.startswith("not a tensor")
        return model(inputs.pixels, extra=inputs.extra)

    return Workload("dataclass-inputs", Fused(), make_batch, F.cross_entropy, forward=forward)


class SeqFirst(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(4, DIM)
        self.head = nn.Linear(DIM, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)  # (T, B, DIM)
        return self.head(out)


def seq_first(seed: int) -> Workload:
    torch.manual_seed(seed)

    def make_batch(step: int, global_batch: int):
        g = _g(seed, step)
        return torch.randn(7, global_batch, 4, generator=g), torch.randint(0, 3, (7, global_batch), generator=g)

    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.reshape(-1, 3), y.reshape(-1))

    return Workload("seq-first", SeqFirst(), make_batch, loss, sample_dim=1)


def disagreeing(seed: int) -> Workload:
    """A batch whose tensors disagree on the number of samples (refused)."""
    torch.manual_seed(seed)

    def make_batch(step: int, global_batch: int):
        g = _g(seed, step)
        return (torch.randn(global_batch, 10, generator=g), torch.randn(global_batch + 1, 6, generator=g)), \
            torch.randn(global_batch, generator=g)

    return Workload("disagreeing", TwoTowers(), make_batch, F.mse_loss)


def vector_loss(seed: int) -> Workload:
    """A loss that returns one value a sample (refused)."""
    w = two_towers(seed)
    w.loss_fn = lambda out, y: (out - y) ** 2
    return w
