"""Workloads for the honesty benchmarks, loaded by the ranks as `--model benchmarks.workloads:NAME`.

Owns: models big enough that a step on this CPU box takes tens of milliseconds and DDP moves several MB
per step, so launch noise and per-step bookkeeping do not dominate the figures. Same contract as
dpcompare.run.workloads: every rank builds the same weights and the same global batch from the seed.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from dpcompare.run.workloads import Workload

WIDTH = 1024
HIDDEN_LAYERS = 4
CLASSES = 10


def _generator(seed: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + step)  # dpcompare.run.workloads' per-step stream rule


def wide_mlp(seed: int) -> Workload:
    """4 x Linear(1024, 1024) + GELU, then a 10-way head: ~4.2 M parameters, ~16.8 MB of float32 gradients
    (one 1 MiB first bucket and one ~15.8 MB bucket under DDP's defaults)."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(HIDDEN_LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.GELU()]
    model = nn.Sequential(*layers, nn.Linear(WIDTH, CLASSES))
    teacher = torch.randn(WIDTH, CLASSES, generator=_generator(seed, -1))

    def make_batch(step: int, global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(global_batch, WIDTH, generator=_generator(seed, step))
        return x, (x @ teacher).argmax(dim=1)

    return Workload("wide_mlp", model, make_batch, F.cross_entropy)
