"""The grad_norm check (--clip-grad-norm): the total norm the backend clipped by against the oracle's global norm.

Owns: at each checked step of a run clipped at --clip-grad-norm X, after the optimizer step, the total norm the backend
reports clipping by (before clipping: `Adapter.clip_grad_norm()` or `grad_norm_after_step()`) against the float64
oracle's global norm of the same step's gradient (dpcompare.verify.instruments.step_evidence); its tolerance, the record kept per
checked step (`GradNormCheck`), and the diagnosis of a wrong norm (a rank's local norm taken before the reduce, one
rank's part of the gradient, the loss-scaled norm, the norm after clipping, the norm of the summed gradient). The
clipping rule the references apply is dpcompare.verify.replay.clipping_rule's. Imports no adapter.

Tolerance (written here once). The norm is 1-Lipschitz in the gradient: a gradient within the gradient check's
bounds has a norm within them too, so the rule is the gradient check's, on one scalar:
    |n - ||o||| / ||o||  <=  factor * (max(floor_norm, floor_dp, depth * u) + world_size * u_wire + ceil(log2 T) * u)
with n the reported norm, o the oracle gradient (every trainable parameter as one vector of T elements), floor_norm
the run-precision reference's norm's distance from the oracle's (|||r|| - ||o||| / ||o||), floor_dp the whole-model
floor of the gradient check (what data parallelism's regrouping changes), and ceil(log2 T) * u the norm's own sum
of T squares in the run dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from dpcompare.verify.instruments.run_instruments import Bench
from dpcompare.verify.replay.clipping_rule import clip_coefficient
from dpcompare.verify.instruments.check_context import CheckContext, Finding
from dpcompare.verify.instruments.step_evidence import StepEvidence
from dpcompare.verify.judgement.tolerance import FACTOR, MODEL, Grads, ParamError, flat
from dpcompare.verify.judgement.verdict import Divergence, GradNormCheck, StepCheck, Verdict, worst

MATCH = 1e-3
"""A candidate norm names the fault when the reported norm is within the check's tolerance of it, or within this
relative distance (the candidates are few, and a reported norm several percent off lands on one of them or on none)."""


@dataclass(frozen=True, slots=True)
class Expected:
    """What the gradient check of a step knew about its norm: the oracle's, and the tolerance the backend's is held to."""

    oracle: Grads
    norm: float
    floor: float
    tolerance: float
    local: Callable[[], list[Grads]]
    """Each rank's local gradient, computed on demand (for the diagnosis)."""
    loss_scale: float | None


def expected(ctx: CheckContext, oracle: Grads, floor: Grads, model: ParamError, local: Callable[[], list[Grads]],
             loss_scale: float | None) -> Expected:
    """The oracle's norm and the tolerance of the step whose gradient check compared `floor` (the run-precision
    reference) with `oracle` (`model`: its whole-model comparison)."""
    names = list(ctx.names)
    norm = float(torch.linalg.vector_norm(flat(oracle, names)))
    reference = float(torch.linalg.vector_norm(flat(floor, names)))
    elements = sum(oracle[n].numel() for n in names)
    gap = abs(reference - norm) / norm if norm > 0 else 0.0
    floor_eff = max(gap, model.judged_floor_rel_fro, ctx.floor_min)
    tolerance = FACTOR * (floor_eff + ctx.world_size * ctx.u_wire + math.ceil(math.log2(max(elements, 2))) * ctx.u)
    return Expected(oracle, norm, floor_eff, tolerance, local, loss_scale)


class GradNorm:
    """The grad_norm check of every checked step of a run clipped at --clip-grad-norm."""

    name = "grad_norm"
    at = "updated"
    reads_oracle = True
    after_stop = False
    reads_references_after_update = True  # the oracle's gradient and the references, for the norms and the diagnosis
    last_to_read_step = False
    recorded_after = "update"  # its entries stand after the update's, where results have always held them

    @classmethod
    def applies(cls, ctx: CheckContext) -> bool:
        return ctx.settings.clip_grad_norm is not None

    @classmethod
    def summary(cls, verdict: Verdict, policy: dict) -> dict:
        """The check's entry in the verdict's `checks` (status off without --clip-grad-norm): failed where a reported
        norm was wrong, even once the run had failed before."""
        norms = [c.grad_norm for c in verdict.checks if c.grad_norm is not None]
        return {"status": "fail" if any(g.reported is not None and not g.ok for g in norms) else
                verdict.check_status(cls.name, any(g.reported is not None for g in norms)),
                "noise_ratio": worst([g.noise_ratio for g in norms if math.isfinite(g.noise_ratio)]),
                "max_rel_err": worst([g.rel_err for g in norms if math.isfinite(g.rel_err)]),
                "min_detectable_rel": worst([g.tolerance for g in norms]),
                "clip": norms[0].clip if norms else None,
                "clipped_steps": [g.step for g in norms if g.clipped]}

    @staticmethod
    def step_record(check: StepCheck) -> dict | None:
        """The check's record beside a step's gradient (None: no norm was judged at it)."""
        return check.grad_norm.to_dict() if check.grad_norm is not None else None

    def __init__(self, ctx: CheckContext, bench: Bench) -> None:
        self.bench, self.verdict = bench, bench.verdict
        self._unreported = False

    def judge(self, ctx: CheckContext, step: StepEvidence) -> Finding | None:
        checks = self.verdict.checks
        if step.oracle.overflow or not checks or checks[-1].step != step.step:
            return None  # a step whose loss scale overflowed (skipped: nothing was clipped)
        o = step.oracle
        local = o.local(self.bench, step.batch, ctx.layout)
        finding = judge_norm(ctx, checks[-1], expected(ctx, o.oracle, o.floor, checks[-1].model, local,
                                                       o.loss_scale if o.scaler is not None else None),
                             step.reported_norm, diagnose=self.verdict.first_divergence is None)
        if finding is not None and finding.unverifiable is not None:
            if self._unreported:  # said once, at the first step
                return None
            self._unreported = True
        return finding


def judge_norm(ctx: CheckContext, check: StepCheck, expected: Expected, reported: float | None,
               diagnose: bool = True) -> Finding | None:
    """The backend's `reported` norm against `expected`, recorded on `check` (the step's gradient check); a failure
    with its diagnosis (`diagnose` False: the run failed before, its failure unnamed), or, for a norm never reported,
    the part that cannot be checked."""
    clip, step, o = ctx.settings.clip_grad_norm, check.step, expected.norm
    if reported is None:
        rel_err = math.nan
    elif o > 0:
        rel_err = abs(reported - o) / o if math.isfinite(reported) else math.inf
    else:
        rel_err = 0.0 if reported == 0 else math.inf
    allowance = expected.tolerance / FACTOR
    ok = reported is not None and rel_err <= expected.tolerance
    record = GradNormCheck(step, clip, reported, o, o > clip, clip_coefficient(o, clip), rel_err,
                           expected.floor, expected.tolerance, rel_err / allowance if allowance > 0 else math.inf, ok)
    check.grad_norm = record
    if reported is None:
        return Finding(unverifiable=f"the backend reported no total gradient norm at step {step} under "
                                    f"--clip-grad-norm {clip:g} (its clip_grad_norm() and grad_norm_after_step() gave "
                                    "none): the norm it clipped by cannot be checked")
    if ok or not diagnose:
        return None
    cause, what = _diagnose(ctx, expected, reported)
    return Finding(Divergence(
        step, MODEL, rel_err, expected.tolerance, record.noise_ratio,
        f"the total gradient norm the backend reports clipping by is {reported:.6g} where the float64 oracle's global "
        f"norm is {o:.6g} ({rel_err:.3g} relative, tolerance {expected.tolerance:.3g}): {what}; {FIXES.get(cause, FIX)}",
        check="grad_norm", cause=cause, parameters=list(ctx.names)))


def _diagnose(ctx: CheckContext, expected: Expected, reported: float) -> tuple[str, str]:
    """The known wrong norm the reported one is, as (cause, sentence), else (grad_norm, what it is not)."""
    o, n, clip, names = expected.norm, ctx.world_size, ctx.settings.clip_grad_norm, list(ctx.names)
    candidates: list[tuple[str, float, str]] = []
    if expected.loss_scale not in (None, 1.0):
        candidates.append(("grad_norm_scaled", o * expected.loss_scale,
                           f"it is the norm of the scaled gradients (x the loss scale {expected.loss_scale:g}): the "
                           "loss scale was not divided out"))
    if o > clip:
        candidates.append(("grad_norm_after_clip", clip,
                           "it is the norm after clipping (the clip value): the backend reports the clipped norm"))
    if n > 1:
        candidates.append(("grad_norm_summed", n * o, f"it is the norm of the ranks' summed gradient ({n}x the "
                           "mean's)"))
        for rank, local in enumerate(expected.local()):
            candidates.append(("grad_norm_local", float(torch.linalg.vector_norm(flat(local, names))),
                               f"it is rank {rank}'s local gradient's norm, taken before the all-reduce"))
        for rank in range(n):
            candidates.append(("grad_norm_partition", _shard_norm(expected.oracle, names, rank, n),
                               f"it is the norm of rank {rank}'s dim-0 shard of every parameter (FSDP's local "
                               "shards), not reduced over the ranks"))
            candidates.append(("grad_norm_partition", _partition_norm(expected.oracle, names, rank, n),
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
