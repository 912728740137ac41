"""Mixed precision as the backends run it: autocast and dynamic loss scaling with torch.amp.GradScaler.

Owns: the autocast context of a run's forward and loss (`--amp bf16|fp16`), and `GradScaling`, the loss scaler
the adapters whose own documented AMP recipe is GradScaler use (reference, dp, ddp; Horovod with its
synchronize/skip_synchronize order; DeepSpeed's stage-0 torch_autocast engine keeps one of its own). It counts
the steps it skipped, so the verification can hold every backend's skips against the oracle's prediction.
Imports no adapter and no backend runtime.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import ContextManager

import torch

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
AMP_NAMES = {"bf16": "bfloat16", "fp16": "float16"}


def autocast(device: torch.device, amp: str) -> ContextManager[None]:
    """torch.autocast over `device` in the `--amp` dtype; a no-op context without --amp."""
    if amp == "none":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=AMP_DTYPES[amp])


@dataclass(frozen=True, slots=True)
class ScalerState:
    """What a backend's loss scaler holds now: the scale the next backward multiplies the loss by, and how many
    optimizer steps it has skipped so far because the scaled gradients held inf or NaN."""

    scale: float
    skipped_steps: int
    method: str
    """Whose scaler: "torch.amp.GradScaler", "DeepSpeed fp16 dynamic loss scaler", ..."""


class GradScaling:
    """torch.amp.GradScaler used the documented way: `scale(loss).backward()` per micro-batch, `unscale(optimizer)`
    once the gradients are reduced (before anything reads them), then `step(optimizer)`, which skips the update
    when the unscaled gradients hold inf or NaN, and updates the scale (halved on a skip, doubled after 2000
    clean steps). A step whose update is dropped (the ablation's arms) never unscales, so the scaler keeps no
    half-finished state."""

    def __init__(self, device: torch.device, init_scale: float) -> None:
        self.scaler = torch.amp.GradScaler(device.type, init_scale=init_scale)
        self.skipped = 0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss)

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """scaler.step, then update. A skipped step is one whose scale the update lowered: GradScaler backs off on
        every inf/NaN it finds."""
        before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        if self.scaler.get_scale() < before:
            self.skipped += 1

    def state(self) -> ScalerState:
        return ScalerState(self.scaler.get_scale(), self.skipped, "torch.amp.GradScaler")
