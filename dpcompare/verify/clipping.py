"""Gradient clipping by the global norm as the references apply it, and the grad_norm check.

Owns: the clipping rule every reference step applies under --clip-grad-norm, torch.nn.utils.clip_grad_norm_'s
arithmetic (the 2-norm of the per-tensor 2-norms, in the gradients' own dtype; every gradient multiplied by
min(1, max_norm / (norm + 1e-6))); and the grad_norm check: at each checked step the total norm the backend reports
clipping by (before clipping) against the float64 oracle's global norm of the same step, its tolerance, the record
kept per checked step, and the diagnosis of a wrong norm (a rank's local norm taken before the reduce, one rank's
part of the gradient, the loss-scaled norm, the norm after clipping, the norm of the summed gradient).

Tolerance (written here once). The norm is 1-Lipschitz in the gradient: a gradient within the gradient check's
bounds has a norm within them too, so the rule is the gradient check's, on one scalar:
    |n - ||o||| / ||o||  <=  factor * (max(floor_norm, floor_dp, depth * u) + world_size * u_wire + ceil(log2 T) * u)
with n the reported norm, o the oracle gradient (every trainable parameter as one vector of T elements), floor_norm
the run-precision reference's norm's distance from the oracle's (|||r|| - ||o||| / ||o||), floor_dp the whole-model
floor of the gradient check (what data parallelism's regrouping changes), and ceil(log2 T) * u the norm's own sum
of T squares in the run dtype. Imports no adapter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from dpcompare.verify.tolerance import FACTOR, MODEL, UNIT_ROUNDOFF, Grads, ParamError, flat
from dpcompare.verify.verdict import Divergence, GradNormCheck, Verdict

CLIP_EPS = 1e-6
"""torch.nn.utils.clip_grad_norm_'s (and DeepSpeed's) guard in max_norm / (norm + eps)."""

MATCH = 1e-3
"""A candidate norm names the fault when the reported norm is within the check's tolerance of it, or within this
relative distance (the candidates are few, and a reported norm several percent off lands on one of them or on none)."""


def total_norm(grads: Iterable[torch.Tensor]) -> torch.Tensor:
    """The global 2-norm of `grads` as clip_grad_norm_ computes it: the norm of the per-tensor norms."""
    norms = [torch.linalg.vector_norm(g) for g in grads]
    if not norms:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack(norms))


def clip_coefficient(norm: float, max_norm: float) -> float:
    """What clipping multiplies every gradient by: min(1, max_norm / (norm + 1e-6))."""
    return min(1.0, max_norm / (norm + CLIP_EPS))


def clip_(grads: list[torch.Tensor], max_norm: float) -> float:
    """Clip `grads` in place by their global norm (torch.nn.utils.clip_grad_norm_'s arithmetic, in their dtype);
    returns the norm before clipping."""
    if not grads:
        return 0.0
    norm = total_norm(grads)
    coefficient = torch.clamp(max_norm / (norm + CLIP_EPS), max=1.0)
    for g in grads:
        g.mul_(coefficient.to(g.dtype))
    return float(norm)


@dataclass(slots=True)
class _Expected:
    """What the gradient check of a step knew about its norm, kept until the backend reports its own."""

    step: int
    oracle: Grads
    norm: float
    floor: float
    tolerance: float
    local: Callable[[], list[Grads]]
    loss_scale: float | None


class GradNormJudge:
    """The grad_norm check of every checked step of a run clipped at `clip`, recorded into `verdict`."""

    def __init__(self, *, clip: float, dtype: str, depth: int, world_size: int, u_wire: float, names: list[str],
                 verdict: Verdict) -> None:
        self.clip, self.u, self.depth, self.world_size, self.u_wire = clip, UNIT_ROUNDOFF[dtype], depth, world_size, u_wire
        self.names, self.verdict = names, verdict
        self.expected: _Expected | None = None
        self._unreported = False

    def expect(self, step: int, oracle: Grads, floor: Grads, model: ParamError, local: Callable[[], list[Grads]],
               loss_scale: float | None) -> None:
        """At the gradient check of `step`: the oracle's norm and the tolerance the backend's will be held to.
        `model`: the gradient check's whole-model comparison; `local`: each rank's local gradient, computed on
        demand (for the diagnosis)."""
        norm = float(torch.linalg.vector_norm(flat(oracle, self.names)))
        reference = float(torch.linalg.vector_norm(flat(floor, self.names)))
        elements = sum(oracle[n].numel() for n in self.names)
        gap = abs(reference - norm) / norm if norm > 0 else 0.0
        floor_eff = max(gap, model.judged_floor_rel_fro, self.depth * self.u)
        tolerance = FACTOR * (floor_eff + self.world_size * self.u_wire + math.ceil(math.log2(max(elements, 2))) * self.u)
        self.expected = _Expected(step, oracle, norm, floor_eff, tolerance, local, loss_scale)

    def judge(self, step: int, reported: float | None) -> None:
        """After the optimizer step of `step`: the backend's reported norm against the expected one, recorded on the
        step's check; a failure is the run's divergence (check grad_norm) with its diagnosis, a norm never reported
        makes the verdict unverifiable."""
        expected, self.expected = self.expected, None
        if expected is None or expected.step != step or not self.verdict.checks or self.verdict.checks[-1].step != step:
            return  # an unchecked step, or one whose loss scale overflowed (skipped: nothing was clipped)
        o = expected.norm
        if reported is None:
            rel_err = math.nan
        elif o > 0:
            rel_err = abs(reported - o) / o if math.isfinite(reported) else math.inf
        else:
            rel_err = 0.0 if reported == 0 else math.inf
        allowance = expected.tolerance / FACTOR
        ok = reported is not None and rel_err <= expected.tolerance
        record = GradNormCheck(step, self.clip, reported, o, o > self.clip, clip_coefficient(o, self.clip), rel_err,
                               expected.floor, expected.tolerance, rel_err / allowance if allowance > 0 else math.inf, ok)
        self.verdict.checks[-1].grad_norm = record
        if reported is None:
            reason = (f"the backend reported no total gradient norm at step {step} under --clip-grad-norm "
                      f"{self.clip:g} (its clip_grad_norm() and grad_norm_after_step() gave none): the norm it clipped "
                      "by cannot be checked")
            if not self._unreported:  # said once, at the first step
                self._unreported = True
                self.verdict.unverifiable.append(reason)
            return
        if ok or self.verdict.first_divergence is not None:
            return
        cause, what = self._diagnose(expected, reported)
        self.verdict.diverge(Divergence(
            step, MODEL, rel_err, expected.tolerance, record.noise_ratio,
            f"the total gradient norm the backend reports clipping by is {reported:.6g} where the float64 oracle's global "
            f"norm is {o:.6g} ({rel_err:.3g} relative, tolerance {expected.tolerance:.3g}): {what}; {FIXES.get(cause, FIX)}",
            check="grad_norm", cause=cause, parameters=list(self.names)))

    def _diagnose(self, expected: _Expected, reported: float) -> tuple[str, str]:
        """The known wrong norm the reported one is, as (cause, sentence), else (grad_norm, what it is not)."""
        o, n = expected.norm, self.world_size
        candidates: list[tuple[str, float, str]] = []
        if expected.loss_scale not in (None, 1.0):
            candidates.append(("grad_norm_scaled", o * expected.loss_scale,
                               f"it is the norm of the scaled gradients (x the loss scale {expected.loss_scale:g}): the "
                               "loss scale was not divided out"))
        if o > self.clip:
            candidates.append(("grad_norm_after_clip", self.clip,
                               "it is the norm after clipping (the clip value): the backend reports the clipped norm"))
        if n > 1:
            candidates.append(("grad_norm_summed", n * o, f"it is the norm of the ranks' summed gradient ({n}x the "
                               "mean's)"))
            for rank, local in enumerate(expected.local()):
                candidates.append(("grad_norm_local", float(torch.linalg.vector_norm(flat(local, self.names))),
                                   f"it is rank {rank}'s local gradient's norm, taken before the all-reduce"))
            for rank in range(n):
                candidates.append(("grad_norm_partition", _shard_norm(expected.oracle, self.names, rank, n),
                                   f"it is the norm of rank {rank}'s dim-0 shard of every parameter (FSDP's local "
                                   "shards), not reduced over the ranks"))
                candidates.append(("grad_norm_partition", _partition_norm(expected.oracle, self.names, rank, n),
                                   f"it is the norm of rank {rank}'s 1/{n} partition of the flattened gradient (a ZeRO "
                                   "partition's), not reduced over the ranks"))
        for cause, value, what in candidates:
            if abs(reported - value) <= max(expected.tolerance * o, MATCH * value):
                return cause, what
        return "grad_norm", (f"it is {reported / o:.4g}x the oracle's, and none of the known wrong norms (a rank's local "
                             "norm before the reduce, one rank's shard or partition, the loss-scaled norm, the norm after "
                             "clipping, the summed gradient's)" if o > 0 else "the oracle's gradient is zero")


FIX = ("the norm must be taken over every parameter's whole reduced gradient (under ZeRO or FSDP, the partitions' squared "
       "norms all-reduced)")
FIXES = {"grad_norm_scaled": "the loss scale must be divided out before the norm is taken (a clip by the scaled norm "
                             "clips by the loss scale too much; the update check shows it)",
         "grad_norm_after_clip": "the norm to report is the one taken before clipping (clip_grad_norm_'s return value)"}
"""What to do about a wrong norm, by cause (FIX: every norm taken over part of the gradient, or before the reduce)."""


def _shard_norm(grads: Grads, names: list[str], rank: int, world_size: int) -> float:
    """The norm of `rank`'s dim-0 chunk of every gradient (torch.chunk's split, as FSDP2 shards a parameter)."""
    parts = []
    for name in names:
        g = grads[name]
        chunks = g.chunk(world_size, dim=0) if g.dim() else ((g,) if rank == 0 else ())
        if rank < len(chunks):
            parts.append(chunks[rank].reshape(-1))
    return float(torch.linalg.vector_norm(torch.cat(parts))) if parts else 0.0


def _partition_norm(grads: Grads, names: list[str], rank: int, world_size: int) -> float:
    """The norm of `rank`'s contiguous 1/world_size of the flattened gradient (ZeRO's partition of its flat buffer)."""
    whole = flat(grads, names)
    size = -(-whole.numel() // world_size)
    return float(torch.linalg.vector_norm(whole[rank * size:(rank + 1) * size]))
