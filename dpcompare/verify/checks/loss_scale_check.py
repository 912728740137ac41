"""The loss scaler at a checked step: a step the recipe overflows must be skipped, a finite one must not be.

Owns: the loss_scale check, in two entries of the list. `OverflowSeen`, after the reduce: where the oracle's
rank-by-rank emulation of the recipe overflows at the step's loss scale (its `ScaleStep`, dpcompare.verify.judgement.precision_recipe),
the backend's reduced gradient must hold inf or NaN too. `SkipJudged`, after the optimizer step: that step must be
skipped (the master weights unchanged to the bit, the skip counted), a finite step must not be, and a scaler that never
lowers its scale after an overflow (STUCK_SKIPS steps in a row skipped at one scale) skips every step from there on,
which fails the verdict. Imports no adapter: it reads the backend's scaler through `Adapter.scaler_state()`.
"""

from __future__ import annotations

import math

import torch

from dpcompare.contract import Adapter
from dpcompare.verify.instruments.run_instruments import Bench
from dpcompare.verify.instruments.check_context import CheckContext, Finding
from dpcompare.verify.instruments.step_evidence import StepEvidence
from dpcompare.verify.judgement.precision_recipe import ScaleStep
from dpcompare.verify.instruments.backend_reads import Pending
from dpcompare.verify.judgement.verdict import Divergence

STUCK_SKIPS = 3
"""Consecutive steps skipped on overflow at one unchanged loss scale that make a stuck scaler: a dynamic scaler lowers
its scale at every overflow (GradScaler) or at every second one (DeepSpeed's, hysteresis 2); one that never does skips
every step from there on."""


def skipped_since(backend: Adapter, pending: Pending) -> bool:
    """Whether the backend counted a skipped step since `pending` was taken (before the step's optimizer step)."""
    scaler = backend.scaler_state()
    return scaler is not None and scaler.skipped_steps > pending.skipped_before


class OverflowSeen:
    """The recipe overflows at this step's loss scale in the oracle's emulation of the ranks: the backend's reduced
    gradient must hold inf or NaN too (its optimizer step must then be skipped: `SkipJudged`)."""

    name = "loss_scale"
    at = "reduced"
    reads_oracle = True
    after_stop = False
    reads_references_after_update = False
    last_to_read_step = False

    @classmethod
    def applies(cls, ctx: CheckContext) -> bool:
        return True  # a backend may scale its loss under any --amp: the scaler's state says (None: not scaled)

    def __init__(self, ctx: CheckContext, bench: Bench) -> None:
        pass

    def judge(self, ctx: CheckContext, step: StepEvidence) -> Finding | None:
        scale_step = step.oracle.scale_step
        if not step.oracle.overflow or scale_step.reduced_non_finite:
            return None
        scale_step.ok = False
        scale_step.reason = (f"at step {scale_step.step} the ranks' {ctx.settings.amp} gradients overflow at loss scale "
                             f"{scale_step.scale:.9g} (the oracle's rank-by-rank emulation of the recipe holds inf or "
                             "NaN), but the backend's reduced gradient is finite: the backend does not scale the loss "
                             "as its recipe says, or reduces before the scaled gradients are formed, so it will not "
                             "skip the steps the other backends skip")
        return Finding(Divergence(scale_step.step, "(loss scale)", math.nan, 0.0, math.nan, scale_step.reason,
                                  check="loss_scale", cause="overflow_not_seen"))


class SkipJudged:
    """The loss scaler's side of a checked step after its optimizer step: its scale afterwards and whether the backend
    skipped. A step the recipe overflows must be skipped (master weights unchanged to the bit); a finite one must
    not be."""

    name = "loss_scale"
    at = "updated"
    reads_oracle = True
    after_stop = False
    reads_references_after_update = False
    last_to_read_step = False

    @classmethod
    def applies(cls, ctx: CheckContext) -> bool:
        return True

    def __init__(self, ctx: CheckContext, bench: Bench) -> None:
        self.backend, self.verdict = bench.backend, bench.verdict
        self._stuck: tuple[float, int] = (math.nan, 0)
        """The loss scale of the last skipped steps and how many in a row were skipped at it."""

    def judge(self, ctx: CheckContext, step: StepEvidence) -> Finding | None:
        pending = step.oracle.pending
        scale_step, names, masters = pending.scale, ctx.names, step.masters
        if scale_step is None:
            return None
        scaler = self.backend.scaler_state()
        skipped = skipped_since(self.backend, pending)
        unchanged = all(torch.equal(masters[n].detach().double(), pending.params[n]) for n in names)
        scale_step.skipped = skipped and unchanged
        scale_step.scale_after = scaler.scale if scaler is not None else None
        if not scale_step.predicted_overflow:
            if scale_step.ok is None:
                scale_step.ok = not scale_step.skipped
            return None
        if scale_step.ok is False:  # the overflow was not seen: already recorded at the gradient check
            return None
        moved = [n for n in names if not torch.equal(masters[n].detach().double(), pending.params[n])]
        if scale_step.skipped:
            scale_step.ok = True
            # The state the next step starts from is the one this step found: a skipped step changes nothing.
            return self._backoff(pending.step, scale_step)
        scale_step.ok = False
        stepped = not skipped and moved
        scale_step.reason = (f"at step {pending.step} the scaled {ctx.settings.amp} gradients overflowed (loss scale "
                             f"{scale_step.scale:.9g}; the reduced gradient holds inf or NaN) and the backend "
                             + (f"still stepped the optimizer: {len(moved)} parameter(s) moved, first {moved[0]}; a "
                                "loss scaler must skip a step whose unscaled gradients are not finite (GradScaler.step, "
                                "DeepSpeed's overflow check)" if stepped else
                                "did not count the step as skipped" + (f" and moved {moved[0]}" if moved else "")))
        return Finding(Divergence(pending.step, moved[0] if moved else "(loss scale)", math.inf, 0.0, math.inf,
                                  scale_step.reason, check="loss_scale",
                                  cause="stepped_on_overflow" if stepped else "skip_not_counted", parameters=moved))

    def _backoff(self, step: int, scale_step: ScaleStep) -> Finding | None:
        """A scaler whose scale never comes down after overflows skips every step: `different` once STUCK_SKIPS steps
        in a row were skipped at one scale."""
        scale, count = self._stuck
        after = scale_step.scale_after if scale_step.scale_after is not None else scale_step.scale
        count = count + 1 if after == scale and scale_step.scale == scale else 1
        self._stuck = (after, count)
        if count < STUCK_SKIPS or self.verdict.first_divergence is not None:
            return None
        reason = (f"steps {step - count + 1}-{step} all overflowed and were skipped at the same loss scale "
                  f"{after:.9g}: the scaler never lowers its scale after an overflow (a dynamic loss scaler backs off "
                  "at every overflow, or every second one with DeepSpeed's hysteresis), so every later step is "
                  "skipped too and the model never trains")
        scale_step.reason = reason
        return Finding(Divergence(step, "(loss scale)", math.inf, 0.0, math.inf, reason, check="loss_scale",
                                  cause="scale_never_lowered"))
