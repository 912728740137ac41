"""The run's optimizer, built the same way for the run and for the update check's reference step."""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch

from dpcompare.run.config import RunConfig


def make_optimizer(cfg: RunConfig, params) -> torch.optim.Optimizer:
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def optimizer_factory(cfg: RunConfig) -> Callable[..., torch.optim.Optimizer]:
    """The run's optimizer over any parameters, with hyper-parameters overridden (for the update check)."""
    return lambda params, **overrides: make_optimizer(replace(cfg, **overrides), params)
