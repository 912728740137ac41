"""Optimizers, schedules and workloads of the user's own for tests/test_recipe_optim.py.

- `lm_grouped`: the built-in `lm` (TinyLM: embeddings, LayerNorms, Linear layers with biases) with its own AdamW over
  two parameter groups (weight decay 0.1 on the matrices, none and half the learning rate on norms and biases) and a
  linear warmup then a cosine decay (LambdaLR), as Workload.optimizer and Workload.scheduler.
- For `--optimizer package.module:function`: `adam_095` (Adam, betas (0.9, 0.95)), `sgd_nesterov`, `adamw_foreach`,
  `lion` (lion-pytorch's Lion: from a package other than torch); for `--scheduler`: `warmup_cosine`.
- Refused ones: an optimizer factory that raises, one that leaves a parameter out, a scheduler that steps the optimizer
  itself, one that needs a metric (ReduceLROnPlateau).

Not a test module (no `test_` prefix): pytest does not collect it.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from dpcompare.run import workloads

LR = 2e-3
STEPS = 4
WARMUP = 2


def decay_groups(model: nn.Module, weight_decay: float = 0.1, no_decay_lr: float = LR / 2) -> list[dict]:
    """Weight decay on the matrices (weights, embeddings); none, and half the learning rate, on norms and biases."""
    decay, rest = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else rest).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0, "lr": no_decay_lr}]


def adamw_groups(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(decay_groups(model), lr=LR)


def warmup_cosine(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """Linear warmup over WARMUP steps, then a cosine decay to a tenth over the rest of STEPS."""
    def factor(step: int) -> float:
        if step < WARMUP:
            return (step + 1) / WARMUP
        progress = min(1.0, (step - WARMUP) / max(1, STEPS - WARMUP))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def lm_grouped(seed: int) -> workloads.Workload:
    workload = workloads.lm(seed)
    workload.optimizer, workload.scheduler = adamw_groups, warmup_cosine
    return workload


def adam_095(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=LR, betas=(0.9, 0.95))


def sgd_nesterov(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4)


def adamw_foreach(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.05, foreach=True)


def lion(model: nn.Module) -> torch.optim.Optimizer:
    from lion_pytorch import Lion

    return Lion(decay_groups(model, weight_decay=0.5, no_decay_lr=1e-4), lr=2e-4)


# -- refused ------------------------------------------------------------------------------------------------------
def raising(model: nn.Module) -> torch.optim.Optimizer:
    raise KeyError("no_such_group")


def leaves_out(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(list(model.parameters())[1:], lr=LR)


class _SteppingScheduler(torch.optim.lr_scheduler.LambdaLR):
    """A schedule that also steps the optimizer (a training loop folded into it)."""

    def step(self, *args, **kwargs):
        self.optimizer.step()
        return super().step(*args, **kwargs)


def steps_the_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return _SteppingScheduler(optimizer, lambda step: 1.0)


def plateau(optimizer: torch.optim.Optimizer):
    return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)


def raising_scheduler(optimizer: torch.optim.Optimizer):
    raise ValueError("warmup must be positive")
