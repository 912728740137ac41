"""What a workload is: a model, its synthetic global batch and its loss (`Workload`), and how a global batch
is sharded across ranks (`shard`, DistributedSampler's rule: rank r takes samples r, r+N, r+2N, ...). The
built-in models are in `dpcompare.run.workloads`; a user workload is a function `(seed: int) -> Workload`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn


@dataclass(slots=True)
class Workload:
    name: str
    model: nn.Module
    make_batch: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]
    """(step, global_batch) -> (inputs, targets) of the whole global batch, identical on every rank."""
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """Mean loss over the samples given: the mean of equal shards' losses is the global-batch loss."""
    tokens_per_sample: int = 1
    source: str = "dpcompare"
    """Where the network's definition comes from (e.g. "torchvision 0.26.0"): recorded in the result."""


def shard(batch: tuple[torch.Tensor, torch.Tensor], rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank's shard of a global batch, strided like DistributedSampler (rank::world_size)."""
    x, y = batch
    return x[rank::world_size], y[rank::world_size]
