"""Workloads whose loss is normalised over items, and whose split moves the gradient for another reason, for
tests/test_normalisation.py, loaded like a user's `--model package.module:function`:

- the built-in lm's padded token streams with the loss returning (sum, count) (a user's own token loss: the count
  only its forward knows), and with a plain F.cross_entropy mean whose workload names no ignore_index (the -100
  targets are visible);
- a two-tower contrastive model whose loss takes the other samples of its batch as negatives (samples interact);
- a two-tower model with a per-sample loss over fixed prototypes (its split computes the global batch).

Not a test module (no `test_` prefix): pytest does not collect it.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from dpcompare.run.workloads import IGNORE_INDEX, Workload, lm


def _token_sum_and_count(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The sum of the token losses over the targets not ignored, and their count (transformers' ForCausalLMLoss with
    reduction="sum", before it divides by num_items_in_batch)."""
    flat = target.reshape(-1)
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), flat, ignore_index=IGNORE_INDEX, reduction="sum")
    return total, (flat != IGNORE_INDEX).sum()


def padded_lm_sum_count(seed: int) -> Workload:
    base = lm(seed)
    return Workload("padded-lm-sum-count", base.model, base.make_batch, _token_sum_and_count,
                    tokens_per_sample=base.tokens_per_sample)


def padded_lm_undeclared(seed: int) -> Workload:
    """The built-in lm as a user would write it: F.cross_entropy's mean over the targets not -100, no ignore_index
    named in the Workload."""
    base = lm(seed)
    return Workload("padded-lm-undeclared", base.model, base.make_batch,
                    lambda logits, y: F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)),
                    tokens_per_sample=base.tokens_per_sample)


class Towers(nn.Module):
    """Two towers embedding two views of a sample (CLIP-like), L2-normalised."""

    def __init__(self, dim: int = 16, width: int = 32, out: int = 16) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(dim, width), nn.GELU(), nn.Linear(width, out))
        self.b = nn.Sequential(nn.Linear(dim, width), nn.GELU(), nn.Linear(width, out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = F.normalize(self.a(x[:, 0]), dim=-1), F.normalize(self.b(x[:, 1]), dim=-1)
        return torch.stack([a, b], dim=1)


def _views(seed: int):
    def make_batch(step: int, global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        base = torch.randn(global_batch, 16, generator=g)
        views = torch.stack([base + 0.1 * torch.randn(global_batch, 16, generator=g),
                             base + 0.1 * torch.randn(global_batch, 16, generator=g)], dim=1)
        return views, torch.randint(0, 8, (global_batch,), generator=g)

    return make_batch


def in_batch_negatives(seed: int) -> Workload:
    """InfoNCE: each sample's first view against every second view of its batch (the others are its negatives)."""
    torch.manual_seed(seed)

    def loss_fn(out: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
        logits = out[:, 0] @ out[:, 1].t() / 0.1
        return F.cross_entropy(logits, torch.arange(len(out), device=out.device))

    return Workload("in-batch-negatives", Towers(), _views(seed), loss_fn)


def prototype_towers(seed: int) -> Workload:
    """The same towers, each sample's loss its own: both views against 8 fixed class prototypes."""
    torch.manual_seed(seed)
    prototypes = F.normalize(torch.randn(8, 16, generator=torch.Generator().manual_seed(seed + 1)), dim=-1)

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = out @ prototypes.to(out.dtype).to(out.device).t() / 0.1
        return F.cross_entropy(logits.reshape(-1, 8), y.repeat_interleave(2))

    return Workload("prototype-towers", Towers(), _views(seed), loss_fn)
