"""Workloads with a planted fault for the negative tests, loaded like a user's `--model package.module:function`.

Not a test module (no `test_` prefix): pytest does not collect it.
"""

from __future__ import annotations

import time

import torch
from torch import nn
from torch.nn import functional as F

from dpcompare.run.workloads import Workload, cnn, mlp


def sum_loss_mlp(seed: int) -> Workload:
    """The MLP with its loss reduced with `sum` over the samples instead of `mean`: every rank's loss is the
    sum over its shard, and the mean of those sums is 1/N of the global-batch sum."""
    base = mlp(seed)
    return Workload("sum-loss-mlp", base.model, base.make_batch, lambda out, y: F.cross_entropy(out, y, reduction="sum"))


def dropout_cnn(seed: int) -> Workload:
    """The CNN (BatchNorm) with dropout before its head: a random forward whose samples are coupled by
    BatchNorm: the oracle joins the ranks' captured masks into one forward (--sync-bn) or applies each
    replica's own."""
    base = cnn(seed)
    layers = list(base.model.children())
    model = nn.Sequential(*layers[:-1], nn.Dropout(0.2), layers[-1])
    return Workload("dropout-cnn", model, base.make_batch, base.loss_fn)


class _ClockBuffer(nn.Module):
    """Identity whose float buffer records the wall clock at every training forward: a buffer of the model's own
    that no replay of the forward can predict (and that differs between ranks)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("last_seen", torch.zeros(1))

    def forward(self, x):
        if self.training:
            self.last_seen.fill_(float(time.perf_counter_ns() % 1_000_003))
        return x


def clock_buffer_mlp(seed: int) -> Workload:
    base = mlp(seed)
    layers = list(base.model.children())
    model = nn.Sequential(*layers[:2], _ClockBuffer(), *layers[2:])
    return Workload("clock-buffer-mlp", model, base.make_batch, base.loss_fn)


def tiny_loss_mlp(seed: int) -> Workload:
    """The MLP with its loss scaled by 1e-20: gradients far below fp16's smallest subnormal (6e-8), which an fp16
    wire flushes to zero (the loss scaling a GradScaler would have applied is missing)."""
    base = mlp(seed)
    return Workload("tiny-loss-mlp", base.model, base.make_batch, lambda out, y: 1e-20 * base.loss_fn(out, y))
