"""Whether the update check sees a wrong gradient divisor: its power for an optimizer whose update hides the
gradient's scale (Adam, AdamW, Lion, any sign-based one: scale-invariant).

Owns: `divisor_power`, measured at the first checked step from a fresh optimizer state: the update replayed in float64
with the reduced gradient k times the one checked (a backend that divides by the wrong number: a sum for a mean, one
world size for another), judged by the update check's own rule against the float64 replay and its run-dtype floor
(dpcompare.verify.judgement.tolerance.compare). From a fresh state a divisor wrong since the first step (every moment scaled
alike) gives exactly that update, so what is found is the update check's power against it, computed, not assumed; the
gradient check, which holds the reduced gradient itself against the oracle's, carries the divisor whatever the
optimizer. Imports no adapter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from dpcompare.verify.judgement.tolerance import compare, norm_of

SCALES = (2.0, 4.0, 16.0, 256.0, 65536.0)
"""The gradient multiples tried, smallest first: the first the update check flags is its power. Powers of two: the
replay takes a multiplied gradient exactly, a piece at a time (dpcompare.verify.replay.optimizer_replay.reference_step's
`multiple`)."""
LINEAR = 0.5
"""An update whose norm moves by more than this share of itself under a doubled gradient (SGD's doubles) is no
scale-invariant one: nothing more is measured."""


@dataclass(frozen=True, slots=True)
class DivisorPower:
    change: float
    """The update's relative change (its rel_fro distance) under a gradient 2x the one checked."""
    tolerance: float
    """The update check's tolerance on the whole model's update at that step."""
    detected: float | None
    """The smallest of SCALES whose update the check flags (None: none of them; 2: through the optimizer's eps)."""


def divisor_power(replay: Callable[[float], Mapping[str, torch.Tensor]], reference: Mapping[str, torch.Tensor],
                  floor: Mapping[str, torch.Tensor], names: list[str], *, dtype: str, depth: int
                  ) -> DivisorPower | None:
    """`replay(k)`: the update from the step's start with the gradient k times the one checked (read a
    piece at a time: no parameter's update is made whole here); `reference`, `floor`:
    the update check's float64 replay and its run-dtype floor. None where the update follows the gradient's scale (a
    doubled gradient moves its norm by more than LINEAR of itself: SGD's, which the update check holds to a wrong
    divisor as the gradient check does) or is zero; else the change at 2x, the tolerance, and the smallest multiple
    flagged (Adam's eps can make it see a 2x gradient where the gradients are small)."""
    base = norm_of(reference, names)
    doubled = replay(SCALES[0])
    if base == 0.0 or not math.isfinite(base) or abs(norm_of(doubled, names) / base - 1.0) > LINEAR:
        return None
    first: DivisorPower | None = None
    for k in SCALES:
        values = doubled if k == SCALES[0] else replay(k)
        params, model = compare(values, reference, floor, dtype=dtype, world_size=1, depth=depth, names=names)
        flagged = not model.ok or any(not p.ok for p in params)
        if first is None:
            first = DivisorPower(model.rel_fro_err, model.tolerance_rel_fro, None)
        if flagged:
            return DivisorPower(first.change, first.tolerance, k)
    return first


def note(optimizer: str, step: int, power: DivisorPower, gradient_power: float) -> str:
    """The result's words on it."""
    tried = ", ".join(f"x{k:g}" for k in SCALES)
    moved = (f"at step {step} a reduced gradient 2x the one checked moves its update by {power.change:.2e} of itself "
             f"(the update check's tolerance: {power.tolerance:.2e})")
    if power.detected is None:
        seen = f"so the update check cannot see a wrong gradient divisor (it flags none of {tried})"
    elif power.detected == SCALES[0]:
        seen = ("so the update check still sees a divisor wrong by 2 or more here, through the part of the update "
                "that is not scale-invariant (its epsilon, a weight decay added to the gradient)")
    else:
        seen = (f"so the update check cannot see a divisor wrong by 2 (of {tried}, the first it flags is "
                f"x{power.detected:g})")
    return (f"the run's optimizer ({optimizer}) is scale-invariant: {moved}, {seen}, replayed from the fresh state; the "
            "gradient check carries the divisor: it holds the reduced gradient itself against the oracle's, and "
            f"catches a {gradient_power:.2e} change of it at that step")
