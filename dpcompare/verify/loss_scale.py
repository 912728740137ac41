"""The loss scaler at a checked step: a step the recipe overflows must be skipped, a finite one must not be.

Owns: the judgement of the scaler's side of a step (its `ScaleStep`, dpcompare.verify.precision). Where the
oracle's rank-by-rank emulation of the recipe overflows at the step's loss scale, the backend's reduced gradient
must hold inf or NaN too and its optimizer step must be skipped (the master weights unchanged to the bit, the skip
counted); a finite step must not be skipped; and a scaler that never lowers its scale after an overflow
(STUCK_SKIPS steps in a row skipped at one scale) skips every step from there on, which fails the verdict.
Imports no adapter: it reads the backend's scaler through `Adapter.scaler_state()`.
"""

from __future__ import annotations

import math

import torch

from dpcompare.contract import Adapter
from dpcompare.verify.precision import ScaleStep
from dpcompare.verify.reads import Pending
from dpcompare.verify.verdict import Divergence, Verdict

STUCK_SKIPS = 3
"""Consecutive steps skipped on overflow at one unchanged loss scale that make a stuck scaler: a dynamic scaler lowers
its scale at every overflow (GradScaler) or at every second one (DeepSpeed's, hysteresis 2); one that never does skips
every step from there on."""


def skipped_since(backend: Adapter, pending: Pending) -> bool:
    """Whether the backend counted a skipped step since `pending` was taken (before the step's optimizer step)."""
    scaler = backend.scaler_state()
    return scaler is not None and scaler.skipped_steps > pending.skipped_before


class LossScaleJudge:
    """Judges the loss scaler of the run's checked steps into `verdict` (`amp`: the run's --amp, for the reasons)."""

    def __init__(self, backend: Adapter, verdict: Verdict, amp: str, names: list[str]) -> None:
        self.backend, self.verdict, self.amp, self.names = backend, verdict, amp, names
        self._stuck: tuple[float, int] = (math.nan, 0)
        """The loss scale of the last skipped steps and how many in a row were skipped at it."""

    def expect_skip(self, scale_step: ScaleStep) -> None:
        """The recipe overflows at this step's loss scale in the oracle's emulation of the ranks: the backend's
        reduced gradient must hold inf or NaN too, and its optimizer step must be skipped (checked after it)."""
        if scale_step.reduced_non_finite:
            return
        scale_step.ok = False
        scale_step.reason = (f"at step {scale_step.step} the ranks' {self.amp} gradients overflow at loss scale "
                             f"{scale_step.scale:.9g} (the oracle's rank-by-rank emulation of the recipe holds inf or "
                             "NaN), but the backend's reduced gradient is finite: the backend does not scale the loss "
                             "as its recipe says, or reduces before the scaled gradients are formed, so it will not "
                             "skip the steps the other backends skip")
        self.verdict.diverge(Divergence(scale_step.step, "(loss scale)", math.nan, 0.0, math.nan, scale_step.reason,
                                        check="loss_scale", cause="overflow_not_seen"))

    def judge(self, pending: Pending, masters: dict[str, torch.Tensor]) -> bool:
        """The loss scaler's side of a step: its scale afterwards and whether the backend skipped. A step the recipe
        overflows must be skipped (master weights unchanged to the bit); a finite one must not be. Returns True
        when the step was an overflow (nothing further to check)."""
        scale_step = pending.scale
        scaler = self.backend.scaler_state()
        skipped = skipped_since(self.backend, pending)
        unchanged = all(torch.equal(masters[n].detach().double().cpu(), pending.params[n]) for n in self.names)
        scale_step.skipped = skipped and unchanged
        scale_step.scale_after = scaler.scale if scaler is not None else None
        if not scale_step.predicted_overflow:
            if scale_step.ok is None:
                scale_step.ok = not scale_step.skipped
            return False
        if scale_step.ok is False:  # the overflow was not seen: already recorded at the gradient check
            return True
        moved = [n for n in self.names if not torch.equal(masters[n].detach().double().cpu(), pending.params[n])]
        if scale_step.skipped:
            scale_step.ok = True
            # The state the next step starts from is the one this step found: a skipped step changes nothing.
            self._backoff(pending.step, scale_step)
            return True
        scale_step.ok = False
        stepped = not skipped and moved
        scale_step.reason = (f"at step {pending.step} the scaled {self.amp} gradients overflowed (loss scale "
                             f"{scale_step.scale:.9g}; the reduced gradient holds inf or NaN) and the backend "
                             + (f"still stepped the optimizer: {len(moved)} parameter(s) moved, first {moved[0]}; a "
                                "loss scaler must skip a step whose unscaled gradients are not finite (GradScaler.step, "
                                "DeepSpeed's overflow check)" if stepped else
                                "did not count the step as skipped" + (f" and moved {moved[0]}" if moved else "")))
        self.verdict.diverge(Divergence(pending.step, moved[0] if moved else "(loss scale)", math.inf, 0.0, math.inf,
                                        scale_step.reason, check="loss_scale",
                                        cause="stepped_on_overflow" if stepped else "skip_not_counted",
                                        parameters=moved))
        return True

    def _backoff(self, step: int, scale_step: ScaleStep) -> None:
        """A scaler whose scale never comes down after overflows skips every step: `different` once STUCK_SKIPS steps
        in a row were skipped at one scale."""
        scale, count = self._stuck
        after = scale_step.scale_after if scale_step.scale_after is not None else scale_step.scale
        count = count + 1 if after == scale and scale_step.scale == scale else 1
        self._stuck = (after, count)
        if count < STUCK_SKIPS or self.verdict.first_divergence is not None:
            return
        reason = (f"steps {step - count + 1}-{step} all overflowed and were skipped at the same loss scale "
                  f"{after:.9g}: the scaler never lowers its scale after an overflow (a dynamic loss scaler backs off "
                  "at every overflow, or every second one with DeepSpeed's hysteresis), so every later step is "
                  "skipped too and the model never trains")
        scale_step.reason = reason
        self.verdict.diverge(Divergence(step, "(loss scale)", math.inf, 0.0, math.inf, reason, check="loss_scale",
                                        cause="scale_never_lowered"))
