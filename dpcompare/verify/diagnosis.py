"""Diagnosis: why a check failed, found by testing what each known fault would have produced.

Owns: the hypotheses for a failed gradient check and for a failed update check, the methods of
_GradientHypotheses and _UpdateHypotheses, tried in a fixed order. Each hypothesis builds the gradient (or
update) its fault would give and claims a failing parameter only when that candidate really explains the
error: it matches the backend's value within the parameter's tolerance and removes at least 3/4 of its
distance from the reference. When one hypothesis explains every failing parameter, it alone is named (the
first in order); otherwise each hypothesis in turn claims what it explains, and the rest is said to match
none of the known patterns, listing the relations tested, rather than given to a cause that does not fit.
The reason names the cause, the parameters it explains when that is not all of them, and the fix. Imports
no adapter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from dpcompare.verify.equivalence import (TOLERANCE_FACTOR, UNIT_ROUNDOFF, WIRE_DTYPE, Grads, Layout, Masks, Oracle,
                                          flat, global_pieces, rel_fro, replica_pieces, tensor_digest)
from dpcompare.contract.optim_state import OptimizerFactory, OptState
from dpcompare.verify.update_check import reference_step, state_summary
from dpcompare.contract.workload import shard


@dataclass(slots=True)
class Diagnosis:
    cause: str
    """A short code: summed, averaged_twice, loss_sum, loss_scale_not_undone, loss_scale_undone_twice, scaled,
    unsynchronised, stale, swapped, zeroed_partition, unapplied_shard, wire_dtype, wire_underflow, wire_overflow, batchnorm, duplicated_data,
    wrong_shards, non_finite, skipped_step, lr_scaled, double_step, optimizer_state, unused_zero_grad, weight_decay,
    clipped, unknown."""
    reason: str
    parameters: list[str] = field(default_factory=list)


EXPLAINED_SHARE = 0.25
"""A candidate explains a parameter only when its distance to the backend's value is at most this share of
the reference's: it accounts for at least 3/4 of the error, not merely for something within tolerance."""

SCALE_AGREEMENT = 1e-3
"""A scale factor explains a set of parameters only when each one's own fitted scale agrees with it to this
relative precision: a scale that fits the sum of several unrelated parameters is no cause."""


def _share(reference: Grads, names: list[str]) -> float:
    return float(torch.linalg.vector_norm(flat(reference, names))) / math.sqrt(max(len(names), 1))


def _matching(values: Grads, candidate: Grads, reference: Grads, names: list[str], tol: dict[str, float],
              share: float) -> list[str]:
    """The parameters whose value the candidate explains: within tolerance of it, and at most EXPLAINED_SHARE of
    the value's distance from the reference (a small value is within tolerance of many wrong candidates)."""
    out = []
    for n in names:
        if not bool(torch.isfinite(candidate[n]).all()):
            continue
        residual = rel_fro(values[n], candidate[n], share)
        if residual <= tol[n] and residual <= EXPLAINED_SHARE * rel_fro(values[n], reference[n], share):
            out.append(n)
    return out


def _scale_fit(values: Grads, reference: Grads, names: list[str]) -> float:
    v, r = flat(values, names), flat(reference, names)
    denom = float(r @ r)
    return float(v @ r) / denom if denom > 0 else math.nan


def _common_scale(values: Grads, reference: Grads, names: list[str],
                  preferred: tuple[float, ...] = ()) -> tuple[float, list[str]]:
    """The scale c with values ~ c * reference that the most parameters share, refitted on them, and those
    parameters: each one's own least-squares scale agrees with c to SCALE_AGREEMENT. Tried: the fit over all
    of `names`, the `preferred` values, and every parameter's own scale (the first with the most agreeing wins)."""
    own: dict[str, float] = {}
    for p in names:
        v, r = values[p].reshape(-1), reference[p].reshape(-1)
        rr = float(r @ r)
        if rr > 0 and bool(torch.isfinite(v).all()):
            own[p] = float(v @ r) / rr

    def agreeing(c: float) -> list[str]:
        return [p for p, cp in own.items() if abs(cp - c) <= SCALE_AGREEMENT * abs(c)]

    if not own:
        return math.nan, []
    tried = [c for c in (_scale_fit(values, reference, list(own)), *preferred, *own.values()) if math.isfinite(c) and c]
    if not tried:
        return 0.0, list(own)
    group = agreeing(max(tried, key=lambda c: len(agreeing(c))))
    if not group:
        return math.nan, []
    c = _scale_fit(values, reference, group)
    return c, [p for p in group if abs(own[p] - c) <= SCALE_AGREEMENT * abs(c)]


def _which(params: list[str], all_names: list[str]) -> str:
    if set(params) >= set(all_names):
        return "every checked parameter"
    shown = ", ".join(params[:6]) + (f" and {len(params) - 6} more" if len(params) > 6 else "")
    return shown


_Hypothesis = Callable[[list[str]], list[Diagnosis]]
"""Takes the failing parameters not yet explained; returns the diagnoses its fault explains."""


def _explain(failing: list[str], hypotheses: list[_Hypothesis], all_names: list[str],
             none_reason: str) -> list[Diagnosis]:
    """One cause where one explains every failing parameter (the first in order): a fault that changes the
    whole gradient leaves a few parameters that other candidates fit by chance, and naming those would name
    faults that did not happen. Otherwise each hypothesis in order claims what it explains of the rest, and
    what none explains is said to match none."""
    if not failing:
        return []
    tried: dict[int, list[Diagnosis]] = {}
    for i, hypothesis in enumerate(hypotheses):
        tried[i] = hypothesis(list(failing))
        for d in tried[i]:
            if set(d.parameters) >= set(failing):
                d.parameters = list(failing)
                return _prefixed([d], all_names)
    remaining = list(failing)
    found: list[Diagnosis] = []
    for i, hypothesis in enumerate(hypotheses):
        if not remaining:
            break
        for d in tried[i] if remaining == failing else hypothesis(remaining):
            d.parameters = [n for n in remaining if n in d.parameters]
            if d.parameters:
                found.append(d)
                remaining = [n for n in remaining if n not in d.parameters]
    if remaining:
        found.append(Diagnosis("unknown", none_reason, remaining))
    return _prefixed(found, all_names)


def _prefixed(found: list[Diagnosis], all_names: list[str]) -> list[Diagnosis]:
    """Each reason says which parameters it is about, unless it is the only one and covers all of them."""
    for d in found:
        if len(found) > 1 or not set(d.parameters) >= set(all_names):
            d.reason = f"on {_which(d.parameters, all_names)}: {d.reason}"
    return found


def reason_of(found: list[Diagnosis]) -> str:
    return "; ".join(d.reason for d in found)


# -- gradients ---------------------------------------------------------------------------------------
@dataclass(slots=True)
class GradientEvidence:
    """What rank 0 knows at a failed gradient check."""

    step: int
    grads: Grads
    oracle_grads: Grads
    tolerance: dict[str, float]
    oracle: Oracle
    state: dict
    batch: tuple[torch.Tensor, torch.Tensor]
    world_size: int
    grad_accum: int
    shard_digests: list[str]
    has_batchnorm: bool
    sync_bn: bool
    compression: str
    dtype: str
    layout: Layout = Layout()
    """How the backend split the global batch into forwards."""
    per_replica: bool = False
    """The oracle was each replica's own forwards (BatchNorm without --sync-bn), not the global batch."""
    masks: list[Masks | None] | None = None
    """The dropout masks each forward of the layout drew, when the model draws random numbers."""
    previous: tuple[int, Grads] | None = None
    """(step, reduced gradient) of the previous step when it was checked."""
    loss_scale: float | None = None
    """The loss scale of this step's backward, when the run scales its loss (--amp fp16)."""
    judged_tolerance: dict[str, float] | None = None
    """The gradient check's own bounds (against the run-precision reference); `tolerance` is how close a candidate
    must come to be named."""
    missing: frozenset[str] = frozenset()
    """Parameters the backend's reduced_grads() gave no gradient at all (None) though the loss reaches them."""
    rank_norms: list[dict[str, float]] | None = None
    """Each rank's reduced gradient norm per parameter, when the ranks' reduced gradients differ."""

    @property
    def stochastic(self) -> bool:
        return bool(self.masks)

    def compute(self, pieces: list) -> Grads:
        """A candidate's gradient in the run's own precision recipe (the reference the backend is judged against), so
        it shares the backend's rounding and only the fault tells them apart."""
        return self.oracle.floor_of(self.state, pieces, self.loss_scale or 1.0)

    def local(self) -> list[Grads]:
        """Each rank's own gradient of its shard (its micro-batches, the masks it drew), in the run's precision."""
        return [self.compute(replica_pieces(self.batch, self.layout, self.masks, ranks=[rank]))
                for rank in range(self.world_size)]


class _GradientHypotheses:
    """The known faults of a reduced gradient, in the order they are tried. Each method takes the failing
    parameters not yet explained and returns the diagnoses whose candidate gradient explains the backend's.
    Each rank's local gradient, and each candidate that takes a forward and backward, is computed once, on first
    use."""

    def __init__(self, ev: GradientEvidence) -> None:
        self.ev = ev
        self.names = ev.oracle.names
        self.n = ev.world_size
        self.g, self.o = ev.grads, ev.oracle_grads
        self.share = _share(self.o, self.names)
        self._locals: list[Grads] = []
        self._candidates: dict[Any, Grads] = {}

    def ordered(self) -> list[_Hypothesis]:
        return [self.no_gradient, self.ranks_disagree, self.wire_range, self.non_finite, self.data, self.swapped,
                self.scaled, self.zeroed, self.unsynchronised, self.stale, self.rank_scaled, self.batchnorm, self.wire]

    def none_reason(self) -> str:
        none = ("the reduced gradient matches none of the known fault patterns (sum, 1/N, a scale factor, one rank's "
                "local gradient, a stale gradient, a factor per rank (local clipping), two same-shape gradients exchanged, a part never written, an fp16 "
                "or bf16 wire's rounding, underflow or overflow, per-rank or per-micro-batch BatchNorm, duplicated data)")
        if self.ev.stochastic:
            none += "; the model draws random numbers: the oracle applied the dropout masks each rank drew"
        return none

    def local(self) -> list[Grads]:
        if not self._locals:
            self._locals.extend(self.ev.local())
        return self._locals

    def candidate(self, key: Any, build: Callable[[], Grads]) -> Grads:
        if key not in self._candidates:
            self._candidates[key] = build()
        return self._candidates[key]

    def match(self, candidate: Grads, remaining: list[str]) -> list[str]:
        return _matching(self.g, candidate, self.o, remaining, self.ev.tolerance, self.share)

    def no_gradient(self, remaining: list[str]) -> list[Diagnosis]:
        """No gradient at all: the backend's reduced_grads() gave None where the loss reaches the parameter."""
        absent = [p for p in remaining if p in self.ev.missing]
        if not absent:
            return []
        every = set(absent) >= set(self.names)
        return [Diagnosis("no_gradient", ("the backend holds no gradient at all after the reduce" if every else
                          "these parameters have no gradient at all after the reduce") + " (reduced_grads() gives None "
                          "though the loss reaches them): the backward's gradients never reached the parameters the "
                          "optimizer steps — gradient synchronisation switched off on every micro-batch (FSDP's "
                          "set_requires_gradient_sync(False) on the last one too, so no reduce-scatter ran), or the "
                          "gradients were freed or zeroed before the step", absent)]

    def ranks_disagree(self, remaining: list[str]) -> list[Diagnosis]:
        """The ranks hold different reduced gradients: a factor applied on some ranks only, after the reduce."""
        norms = self.ev.rank_norms
        if not norms or len(norms) < 2:
            return []
        out = []
        for rank, mine in enumerate(norms[1:], start=1):
            ratios = {p: mine[p] / norms[0][p] for p in remaining if norms[0].get(p) and p in mine}
            if not ratios:
                continue
            values = list(ratios.values())
            c = sorted(values)[len(values) // 2]
            agreeing = [p for p, v in ratios.items() if abs(v - c) <= SCALE_AGREEMENT * abs(c) and abs(c - 1) > 1e-3]
            if agreeing:
                scale = self.ev.loss_scale
                hint = (f" (the loss scale of this step is {scale:g})" if scale and scale != 1.0 else "")
                out.append(Diagnosis("rank_scale", f"after the reduce, rank {rank}'s gradient is {c:.4g}x rank 0's on "
                                     f"{len(agreeing)} parameter(s){hint}: a scale, unscale or divisor applied on some "
                                     "ranks only (a rank-local GradScaler or loss-scale state, a per-rank division); "
                                     "every rank must hold the same reduced gradient", agreeing))
                break
        return out

    def wire_range(self, remaining: list[str]) -> list[Diagnosis]:
        """An all-reduce on a narrow wire whose range the gradients leave: flushed to zero or turned into inf."""
        if self.n < 2:
            return []
        declared = WIRE_DTYPE[self.ev.compression]
        for wire_name in [declared] if declared else ["float16", "bfloat16"]:
            found = self._wire_range(wire_name, declared is not None, remaining)
            if found:
                return found
        return []

    def _wire_range(self, wire_name: str, declared: bool, remaining: list[str]) -> list[Diagnosis]:
        g, o, share, n = self.g, self.o, self.share, self.n
        wire = getattr(torch, wire_name)
        info = torch.finfo(wire)
        local = self.local()
        base = self.candidate("mean", lambda: _mean(local, self.names))
        # The wire's own rounding differs from the simulation's by the order of the sum: allow that much.
        wire_tol = TOLERANCE_FACTOR * n * UNIT_ROUNDOFF[wire_name]
        claimed, flushed, overflowed, elements, sizes, dominant, summed_first = [], 0, 0, 0, [], False, False
        for p in remaining:
            err = rel_fro(g[p], o[p], share) if bool(torch.isfinite(g[p]).all()) else math.inf
            for pre_divide in (True, False):
                sim = _simulate_wire(local, [p], wire, pre_divide)[p]
                finite = torch.isfinite(sim)
                if not _same_non_finite(g[p], sim):
                    continue
                residual = rel_fro(g[p][finite], sim[finite], share)
                if not (residual <= max(self.ev.tolerance[p], wire_tol) and residual <= EXPLAINED_SHARE * err):
                    continue
                terms = torch.stack([(l[p].float() / n if pre_divide else l[p].float()) for l in local])
                lost = (sim == 0) & (terms != 0).any(dim=0)
                over = ~finite & torch.isfinite(base[p])
                off = torch.isfinite(g[p]) & torch.isfinite(o[p])
                error = float(torch.linalg.vector_norm((g[p] - o[p])[off]))
                # The range, not the rounding, must be what makes this parameter fail.
                dominant |= bool(over.any()) or float(torch.linalg.vector_norm(base[p][lost])) >= 0.5 * error > 0
                claimed.append(p)
                flushed, overflowed = flushed + int(lost.sum()), overflowed + int(over.sum())
                elements += sim.numel()
                # What travelled: the terms and, for an overflow, their sum (it overflows first when divided after).
                on_wire = terms.abs().amax(dim=0).double()
                on_wire = torch.maximum(on_wire, terms.double().sum(dim=0).abs()) if over.any() else on_wire
                sizes.append(on_wire[over if over.any() else lost])
                summed_first |= bool(over.any()) and not pre_divide
                break
        if not claimed or not dominant or not (flushed or overflowed):
            return []
        short = {"float16": "fp16", "bfloat16": "bf16"}[wire_name]
        size = torch.cat(sizes)
        undeclared = ("" if declared else f"; the backend all-reduces in {wire_name} though no --compression was given "
                      f"(pass --compression {short} to judge its rounding with that wire's tolerance)")
        wider = "use a wider wire (bf16 keeps float32's range)" if wire_name == "float16" else "all-reduce in float32"
        if overflowed:
            return [Diagnosis("wire_overflow", f"gradients of size up to ~{float(size.max()):.1e} exceed {short}'s "
                              f"largest value {info.max:g} on the wire and become inf: {overflowed} of {elements} "
                              "elements overflowed; scale the loss down before the all-reduce, "
                              f"{'divide by the world size before summing, ' if summed_first else ''}or "
                              f"{wider}{undeclared}", claimed)]
        tiny = info.smallest_normal * info.eps
        return [Diagnosis("wire_underflow", f"gradients of size ~{float(size.median()):.1e} underflow to zero on the "
                          f"{short} wire (its smallest subnormal is {tiny:.1e}): {flushed} of {elements} elements "
                          "flushed; scale the loss before the all-reduce (a GradScaler / loss scaling) or "
                          f"{wider}{undeclared}", claimed)]

    def non_finite(self, remaining: list[str]) -> list[Diagnosis]:
        bad = [p for p in remaining if not bool(torch.isfinite(self.g[p]).all())]
        return [Diagnosis("non_finite", "the backend's reduced gradient holds inf or NaN where the float64 oracle is "
                          "finite: an overflow inside the backend (a narrower wire dtype, an unscaled fp16 sum)", bad)]

    def data(self, remaining: list[str]) -> list[Diagnosis]:
        ev, n = self.ev, self.n
        seen: dict[str, int] = {}
        for rank, digest in enumerate(ev.shard_digests):
            if digest in seen:
                return [Diagnosis("duplicated_data",
                                  f"ranks {seen[digest]} and {rank} read the same shard (duplicated data): each rank must "
                                  "read a disjoint 1/N of the global batch (DistributedSampler-style sharding)", remaining)]
            seen[digest] = rank
        cast = next(ev.oracle.model_run.parameters()).dtype  # the runner feeds floating inputs in the weights' dtype
        expected = [tensor_digest(x.to(cast) if x.is_floating_point() else x)
                    for x in (shard(ev.batch, r, n)[0] for r in range(n))]
        if sorted(ev.shard_digests) != sorted(expected):
            return [Diagnosis("wrong_shards", "the ranks' shards are not the shards of the global batch: the data stream "
                              "differs between ranks (seed, sampler or shuffling)", remaining)]
        return []

    def swapped(self, remaining: list[str]) -> list[Diagnosis]:
        """Two same-shape parameters, each holding the other's gradient."""
        g, o, share, tol = self.g, self.o, self.share, self.ev.tolerance
        err = {p: rel_fro(g[p], o[p], share) for p in remaining}

        def holds(a: str, b: str) -> bool:
            residual = rel_fro(g[a], o[b], share)
            return residual <= tol[a] and residual <= EXPLAINED_SHARE * err[a]

        pairs: list[tuple[str, str]] = []
        for i, a in enumerate(remaining):
            if any(a in pair for pair in pairs):
                continue
            for b in remaining[i + 1:]:
                if o[a].shape == o[b].shape and not any(b in pair for pair in pairs) and holds(a, b) and holds(b, a):
                    pairs.append((a, b))
                    break
        if not pairs:
            return []
        which = ", and of ".join(f"{a} and {b} (same shape {tuple(o[a].shape)})" for a, b in pairs)
        return [Diagnosis("swapped", f"the gradients of {which} were exchanged: the reducer wrote each into the "
                          "other's .grad (a bucket-to-parameter mapping off by one, parameters registered in different "
                          "orders on different ranks)", [p for pair in pairs for p in pair])]

    def scaled(self, remaining: list[str]) -> list[Diagnosis]:
        g, o, n = self.g, self.o, self.n
        s = self.ev.loss_scale
        preferred = ((float(n), 1.0 / n) if n > 1 else ()) + ((s, 1.0 / s) if s and s != 1.0 else ())
        c, agreeing = _common_scale(g, o, remaining, preferred)
        if not math.isfinite(c) or c == 0.0 or abs(c - 1.0) < 1e-3:
            return []  # a zero gradient is no scale factor; the wire's underflow is tested apart
        explained = self.match({p: c * o[p] for p in agreeing}, agreeing)
        if s and s != 1.0 and abs(c - s) <= 1e-3 * s:
            return [Diagnosis("loss_scale_not_undone", f"the reduced gradient is {c:.6g}x the oracle, the loss scale "
                              f"{s:g} of this step: the scaled gradients reached the check (and the optimizer) without "
                              "being unscaled; call scaler.unscale_(optimizer) after the reduce, or step through "
                              "scaler.step(optimizer), which unscales", explained)]
        if s and s != 1.0 and abs(c * s - 1.0) <= 1e-3:
            return [Diagnosis("loss_scale_undone_twice", f"the reduced gradient is 1/{s:g} ({c:.4g}x) of the oracle: "
                              f"the loss scale {s:g} was undone twice (GradScaler.unscale_ and a division of its "
                              "own, or an unscale before and inside the step); undo it once", explained)]
        if n > 1 and abs(c - n) <= 1e-3 * n:
            return [Diagnosis("summed", f"the reduced gradient is {n}x the oracle: gradients were summed, not averaged; "
                              "divide by the world size (op=Average / a mean comm hook)", explained)]
        if n > 1 and abs(c * n - 1.0) <= 1e-3:
            if _loss_is_sum(self.ev):
                return [Diagnosis("loss_sum", f"the reduced gradient is 1/{n} of the oracle because the loss is reduced "
                                  "with sum, not mean: the mean of the ranks' sums is 1/N of the global-batch sum; "
                                  "reduce the loss with mean (reduction='mean')", explained)]
            return [Diagnosis("averaged_twice", f"the reduced gradient is 1/{n} of the oracle: it was divided by the "
                              "world size twice (a loss scaled by 1/N and an averaging all-reduce); divide once", explained)]
        return [Diagnosis("scaled", f"the reduced gradient is {c:.4g}x the oracle: a scale factor was applied and not "
                          "undone (loss scaling, a wrong divisor)", explained)]

    def zeroed(self, remaining: list[str]) -> list[Diagnosis]:
        """Elements of the reduced gradient that are exactly zero where the oracle's are not, the rest right: a part
        of the reduction never written back (a sharded backend's partition of the reduce-scatter, a bucket)."""
        holes = [p for p in remaining if bool(((self.g[p] == 0) & (self.o[p] != 0)).any())]
        candidate = {p: torch.where(self.g[p] == 0, torch.zeros_like(self.o[p]), self.o[p]) for p in holes}
        claimed = _matching(self.g, candidate, self.o, holes, self.ev.tolerance, self.share)
        if not claimed:
            return []
        zero = ((flat(self.g, self.names) == 0) & (flat(self.o, self.names) != 0)).nonzero().reshape(-1)
        total = sum(self.g[p].numel() for p in self.names)
        first, last = int(zero[0]), int(zero[-1])
        if not bool(flat(self.g, self.names).any()):
            return [Diagnosis("no_gradient", "the reduced gradient is exactly zero everywhere where the oracle's is "
                              "not: no gradient reached the reduce, or it was zeroed before the step (zero_grad between "
                              "backward and step, gradient synchronisation off on every micro-batch)", claimed)]
        return [Diagnosis("zeroed_partition",
                          f"the reduced gradient is exactly zero on {zero.numel()} of its {total} elements "
                          f"({zero.numel() / total:.0%}; elements {first}-{last} of the gradient flattened in parameter "
                          "order) where the oracle's are not, and right elsewhere: part of the reduction was never "
                          "written back; with a sharded backend (ZeRO, FSDP) that is one rank's partition of the "
                          f"reduce-scatter (1/{self.n} of the gradient is {total // max(self.n, 1)} elements)", claimed)]

    def unsynchronised(self, remaining: list[str]) -> list[Diagnosis]:
        if self.n < 2:
            return []
        for rank, l in enumerate(self.local()):
            explained = self.match(l, remaining)
            if explained and set(explained) >= set(self.names):
                return [Diagnosis("unsynchronised", f"the reduced gradient equals rank {rank}'s local gradient: gradients "
                                  "were not synchronised on this step (sync switched off, or the reduction skipped)", explained)]
            if explained:
                return [Diagnosis("unsynchronised", f"these hold rank {rank}'s local gradient: they were left out of the "
                                  "all-reduce while the other parameters were averaged (parameters ignored by the reducer, "
                                  "or a hook that skips them)", explained)]
        return []

    def stale(self, remaining: list[str]) -> list[Diagnosis]:
        if self.ev.previous is None:
            return []
        prev_step, prev = self.ev.previous
        explained = self.match(prev, remaining)
        return [Diagnosis("stale", f"the reduced gradient is step {prev_step}'s: a stale gradient (the reduction did not "
                          "wait for this step's all-reduce, or a buffer from the previous step was used)", explained)]

    def rank_scaled(self, remaining: list[str]) -> list[Diagnosis]:
        """The mean of the ranks' local gradients, each multiplied by a factor of its own: each rank clipped its local
        gradient before the reduce (factor min(1, max_norm / its norm)), or undid a loss scale of its own."""
        n, local = self.n, self.local()
        if n < 2 or not remaining:
            return []
        columns = torch.stack([flat(l, remaining) / n for l in local], dim=1)
        target = flat(self.g, remaining)
        if not bool(torch.isfinite(target).all()):
            return []
        c = [float(v) for v in torch.linalg.lstsq(columns, target.unsqueeze(1)).solution.reshape(-1)]
        if all(abs(v - 1.0) <= SCALE_AGREEMENT for v in c) or all(abs(v - c[0]) <= SCALE_AGREEMENT * abs(c[0]) for v in c):
            return []  # the plain mean, or one common factor (`scaled` names that)
        explained = self.match({p: sum(v * l[p] for v, l in zip(c, local)) / n for p in remaining}, remaining)
        if set(explained) != set(remaining) or min(c) <= 0:
            return []  # a rank's factor acts on its whole gradient: it explains every failing parameter or nothing
        names = self.names
        norms = [float(torch.linalg.vector_norm(flat(l, names))) for l in local]
        after = [v * m for v, m in zip(c, norms)]
        cap = max(after)
        clipped = [r for r, v in enumerate(c) if v < 1.0 - SCALE_AGREEMENT]
        per_rank = ", ".join(f"rank {r} x{v:.4g} (local norm {m:.3g})" for r, (v, m) in enumerate(zip(c, norms)))
        if clipped and all(abs(after[r] - cap) <= SCALE_AGREEMENT * cap for r in clipped) and all(
                abs(c[r] - 1.0) <= SCALE_AGREEMENT and after[r] <= cap * (1 + SCALE_AGREEMENT)
                for r in range(n) if r not in clipped):
            return [Diagnosis("local_clip", f"each rank clipped its own local gradient to norm {cap:.4g} before the "
                              f"all-reduce ({per_rank}): clipping must see the reduced gradient's global norm; clip after "
                              "the reduce (clip_grad_norm_ on the averaged gradient; under ZeRO or FSDP, the norm over "
                              "every partition), or in none of the backends", explained)]
        return [Diagnosis("rank_scale", f"each rank's local gradient reached the reduce multiplied by a factor of its "
                          f"own ({per_rank}): a loss scale, unscale or divisor that differs between ranks (a rank-local "
                          "GradScaler state, a per-rank loss weighting); every rank must apply the same factor",
                          explained)]

    def batchnorm(self, remaining: list[str]) -> list[Diagnosis]:
        ev, names, layout = self.ev, self.names, self.ev.layout
        if not ev.has_batchnorm or not layout.splits_the_batch:
            return []
        out = []
        if ev.per_replica:
            # The oracle normalised each forward's own samples, as data parallelism without SyncBN does.
            explained = self.match(self.candidate("global", lambda: ev.compute(global_pieces(ev.batch))), remaining)
            out.append(Diagnosis("batchnorm", "BatchNorm normalised the global batch as one, though --sync-bn was not "
                                 "given: the backend synchronises BatchNorm statistics on its own (each replica should "
                                 f"normalise its local batch of {ev.batch[0].shape[0] // layout.world_size}); pass --sync-bn "
                                 "to judge it as one computation", explained))
            return out
        if layout.world_size > 1:
            per_rank = Layout(layout.world_size, 1, layout.replicas)
            explained = self.match(self.candidate("per_rank", lambda: ev.compute(
                replica_pieces(ev.batch, per_rank, None))), remaining)
            out.append(Diagnosis("batchnorm", f"BatchNorm normalised each rank's shard with that shard's own statistics "
                                 f"(local batch {ev.batch[0].shape[0] // layout.world_size}) though --sync-bn was given: "
                                 "the backend's sync_batchnorm left BatchNorm layers unsynchronised", explained))
        k = ev.grad_accum
        if k > 1:
            groups = _micro_batch_groups(ev.batch, layout.world_size, k)
            explained = self.match(self.candidate("micro_batches", lambda: _mean(
                [ev.compute(global_pieces(group)) for group in groups], names)), remaining)
            size = groups[0][0].shape[0]
            out.append(Diagnosis("batchnorm", f"BatchNorm normalised each micro-batch ({size} samples across ranks, "
                                 f"synchronised BatchNorm) with its own statistics under gradient accumulation "
                                 f"(--grad-accum {k}), so the accumulated gradient is not the global-batch gradient; any "
                                 "backend does this: use --grad-accum 1, a larger micro-batch, or drop --sync-bn to judge "
                                 "each micro-batch as its own replica", explained))
        return out

    def wire(self, remaining: list[str]) -> list[Diagnosis]:
        if self.n < 2:
            return []
        g, share, local = self.g, self.share, self.local()
        tolerance = self.ev.judged_tolerance or self.ev.tolerance
        base = self.candidate("mean", lambda: _mean(local, self.names))
        declared = WIRE_DTYPE[self.ev.compression]
        for wire_name in ("float16", "bfloat16"):
            if declared == wire_name:
                continue
            short = {"float16": "fp16", "bfloat16": "bf16"}[wire_name]
            sims = [_simulate_wire(local, remaining, getattr(torch, wire_name), pre_divide)
                    for pre_divide in (True, False)]
            explained = []
            for p in remaining:
                # Rounding's exact size depends on the backend's order of summation: the simulation is only
                # asked to account for most of the error, not to match within the float32 tolerance.
                d0 = rel_fro(g[p], base[p], share)
                d1 = min(rel_fro(g[p], s[p], share) for s in sims)
                if d0 > tolerance[p] and d1 <= EXPLAINED_SHARE * d0:
                    explained.append(p)
            if explained:
                err = max(rel_fro(g[p], base[p], share) for p in explained)
                return [Diagnosis("wire_dtype", f"rounding of the size of {wire_name} on the wire (error {err:.2e} = "
                                  f"{err / UNIT_ROUNDOFF[wire_name]:.2f} x its unit roundoff; an all-reduce in {wire_name} "
                                  "reproduces the reduced gradient): the backend compresses gradients it did not declare; "
                                  f"pass --compression {short} to judge it with that wire's tolerance, or turn the "
                                  "compression off", explained)]
        return []


def diagnose_gradient(ev: GradientEvidence, failing: list[str]) -> list[Diagnosis]:
    """Name the one known fault whose gradient explains every failing parameter, else the faults that each
    explain some of them and what matches none."""
    h = _GradientHypotheses(ev)
    return _explain(failing, h.ordered(), h.names, h.none_reason())


def _mean(grads: list[Grads], names: list[str]) -> Grads:
    return {p: torch.stack([g[p] for g in grads]).mean(dim=0) for p in names}


def _micro_batch_groups(batch: tuple[torch.Tensor, torch.Tensor], n: int, k: int):
    """Micro-batch j of every rank, joined: what synchronised BatchNorm normalises under gradient accumulation."""
    per_rank = [tuple(t.chunk(k) for t in shard(batch, r, n)) for r in range(n)]
    return [(torch.cat([per_rank[r][0][j] for r in range(n)]), torch.cat([per_rank[r][1][j] for r in range(n)]))
            for j in range(k)]


def _simulate_wire(local: list[Grads], names: list[str], wire: torch.dtype, pre_divide: bool) -> Grads:
    """The average of the ranks' float32 gradients all-reduced in `wire`: divided before the sum (DDP's
    compression hooks) or after it (Horovod's Compression), each partial sum rounded to `wire`."""
    n = len(local)
    out = {}
    for p in names:
        acc = None
        for l in local:
            term = l[p].float()
            term = (term / n if pre_divide else term).to(wire)
            acc = term if acc is None else (acc.float() + term.float()).to(wire)
        out[p] = acc.double() if pre_divide else (acc.float() / n).double()
    return out


def _same_non_finite(values: torch.Tensor, simulated: torch.Tensor) -> bool:
    """Inf and NaN at the same places, infs of the same sign: what a simulated overflow must reproduce."""
    a, b = ~torch.isfinite(values), ~torch.isfinite(simulated)
    return bool(torch.equal(a, b)) and bool(torch.equal(torch.sign(values[a & ~values.isnan()]),
                                                        torch.sign(simulated[b & ~simulated.isnan()])))


def _loss_is_sum(ev: GradientEvidence) -> bool:
    """The workload's loss grows with the number of samples (sum) rather than staying a mean."""
    model = ev.oracle.model64
    model.load_state_dict(ev.state)
    with torch.no_grad():
        x, y = ev.batch
        x = x.to(ev.oracle.device)
        x = x.double() if x.is_floating_point() else x
        whole = float(ev.oracle.loss_fn(model(x), y.to(ev.oracle.device)))
        half = float(ev.oracle.loss_fn(model(x[: len(x) // 2]), y[: len(y) // 2].to(ev.oracle.device)))
    return abs(whole) > 0 and abs(whole / max(abs(half), 1e-300)) > 1.5


# -- updates -----------------------------------------------------------------------------------------
@dataclass(slots=True)
class UpdateEvidence:
    """What rank 0 knows at a failed update check."""

    step: int
    names: list[str]
    delta: Grads
    """The backend's update theta_after - theta_before."""
    reference: Grads
    tolerance: dict[str, float]
    params: Grads
    """theta_before."""
    grads: dict[str, torch.Tensor | None]
    """The backend's reduced gradient, None where a single process gives none (the parameter is not in the loss)."""
    expected_state: OptState
    backend_state: OptState | None
    factory: OptimizerFactory
    device: torch.device
    world_size: int
    lr: float
    weight_decay: float
    backend_hparams: list[dict[str, Any]] = field(default_factory=list)
    expected_from: str = "a fresh optimizer's"
    skipped: bool = False
    """The backend's loss scaler counted this step as skipped."""

    def step_with(self, grads: dict[str, torch.Tensor | None] | None = None, state: OptState | None = None,
                  times: int = 1, **overrides: Any) -> Grads:
        return reference_step(self.factory, self.params, self.grads if grads is None else grads,
                              self.expected_state if state is None else state, torch.float64, self.device,
                              times=times, **overrides).delta


class _UpdateHypotheses:
    """The known faults of an optimizer update, in the order they are tried. Each method takes the failing
    parameters not yet explained and returns the diagnoses whose candidate update matches the backend's."""

    NONE = ("the update matches none of the known patterns (learning rate x N, a double step, optimizer state, "
            "weight decay, clipping by the global norm or by parts' norms, a scaled step size, a part never applied)")

    def __init__(self, ev: UpdateEvidence) -> None:
        self.ev = ev
        self.names, self.d, self.ref = ev.names, ev.delta, ev.reference
        self.share = _share(self.ref, self.names)
        self.n = ev.world_size
        self.backend_lr = sorted({float(h["lr"]) for h in ev.backend_hparams if "lr" in h})
        self.lr_said = (f"the backend's optimizer runs at lr {', '.join(f'{v:g}' for v in self.backend_lr)}, --lr is "
                        f"{ev.lr:g}" if self.backend_lr and self.backend_lr != [ev.lr] else f"--lr is {ev.lr:g}")

    def ordered(self) -> list[_Hypothesis]:
        return [self.non_finite, self.skipped, self.lr_scaled, self.double_step, self.state, self.unused_zero_grad,
                self.weight_decay, self.clipped, self.clipped_in_parts, self.scale, self.unapplied]

    def match(self, candidate: Grads, remaining: list[str]) -> list[str]:
        return _matching(self.d, candidate, self.ref, remaining, self.ev.tolerance, self.share)

    def non_finite(self, remaining: list[str]) -> list[Diagnosis]:
        bad = [p for p in remaining if not bool(torch.isfinite(self.d[p]).all())]
        return [Diagnosis("non_finite", "the backend's update holds inf or NaN where the reference's is finite", bad)]

    def unapplied(self, remaining: list[str]) -> list[Diagnosis]:
        """A block of a parameter that did not move where the reference's does, the rest right: one rank's shard of
        a sharded parameter kept (or rolled back to) its old values after the step."""
        out = []
        for p in remaining:
            held = (self.d[p] == 0) & (self.ref[p] != 0)
            if not bool(held.any()):
                continue
            candidate = {p: torch.where(held, torch.zeros_like(self.ref[p]), self.ref[p])}
            if not _matching(self.d, candidate, self.ref, [p], self.ev.tolerance, self.share):
                continue
            rows = held.reshape(held.shape[0], -1).any(dim=1).nonzero().reshape(-1) if held.dim() else held.reshape(1)
            where = (f"rows {int(rows[0])}-{int(rows[-1])} of {held.shape[0]}" if held.dim() and rows.numel()
                     else f"{int(held.sum())} element(s)")
            share = held.shape[0] and rows.numel() / held.shape[0] if held.dim() else 1.0
            out.append(Diagnosis("unapplied_shard",
                                 f"{where} of {p} did not move where the reference update moves them ({share:.0%} of its "
                                 "rows), and the rest of the update is right: one rank's shard of the parameter kept or "
                                 f"got back its old values after the step (with {self.n} rank(s) a dim-0 shard is about "
                                 f"1/{self.n} of the rows): the sharded step or the all-gather after it lost that part",
                                 [p]))
        return out

    def skipped(self, remaining: list[str]) -> list[Diagnosis]:
        """The loss scaler skipped a step whose gradient is finite (it found inf/NaN where there was none)."""
        if not self.ev.skipped:
            return []
        still = [p for p in remaining if not bool(self.d[p].any())]
        return [Diagnosis("skipped_step", f"the backend's loss scaler skipped step {self.ev.step} (the weights did not "
                          "move and it counted a skip) although the reduced gradient passed the check and is finite: "
                          "it tests for overflow on something other than the unscaled reduced gradient (a rank's "
                          "gradient before the reduce, a stale flag), so it skips where the other backends step",
                          still)]

    def lr_scaled(self, remaining: list[str]) -> list[Diagnosis]:
        ev, n, backend_lr = self.ev, self.n, self.backend_lr
        if n < 2 or (backend_lr and all(math.isclose(v, ev.lr) for v in backend_lr)):
            return []  # the backend's optimizer runs at the run's learning rate: not this
        unsure = ("" if backend_lr else "; the backend's learning rate could not be read, and a double step of Adam "
                  "from a fresh state gives the same update")
        return [Diagnosis("lr_scaled", f"the update is {n}x the reference: the learning rate is scaled by the world size "
                          f"(the linear-scaling rule applied in this backend only; {self.lr_said}); apply it in every "
                          f"backend or in none{unsure}", self.match(ev.step_with(lr=ev.lr * n), remaining))]

    def double_step(self, remaining: list[str]) -> list[Diagnosis]:
        ratio = _norm_ratio(self.d, self.ref, remaining)
        return [Diagnosis("double_step", f"the optimizer step was applied twice (||update|| / ||reference|| = {ratio:.2f}): "
                          "step() runs twice per training step (in the wrapper and in the loop); call it once",
                          self.match(self.ev.step_with(times=2), remaining))]

    def state(self, remaining: list[str]) -> list[Diagnosis]:
        ev = self.ev
        if ev.backend_state is None or _same_state(ev.backend_state, ev.expected_state):
            return []
        trap = FRESH_STEPPED_TRAP if ev.step == 0 else ""
        return [Diagnosis("optimizer_state", f"the optimizer state before step {ev.step} is not {ev.expected_from}: it "
                          f"holds {state_summary(ev.backend_state)} where {state_summary(ev.expected_state)} was "
                          f"expected, and the update taken from the backend's own state matches{trap}",
                          self.match(ev.step_with(state=ev.backend_state), remaining))]

    def unused_zero_grad(self, remaining: list[str]) -> list[Diagnosis]:
        ev = self.ev
        none = [p for p in remaining if ev.grads.get(p) is None]
        if not none:
            return []
        zeros = dict(ev.grads, **{p: torch.zeros_like(ev.params[p]) for p in none})
        return [Diagnosis("unused_zero_grad", "these parameters take no part in the loss; the backend gave them a zero "
                          "gradient instead of None, so its optimizer steps them (weight decay, momentum) where a single "
                          "process leaves them alone", self.match(ev.step_with(grads=zeros), none))]

    def weight_decay(self, remaining: list[str]) -> list[Diagnosis]:
        ev, d, ref = self.ev, self.d, self.ref
        out = []
        if ev.weight_decay > 0:
            out.append(Diagnosis("weight_decay", f"weight decay was not applied (--weight-decay is {ev.weight_decay:g})",
                                 self.match(ev.step_with(weight_decay=0.0), remaining)))
        theta = flat(ev.params, remaining)
        resid = flat(d, remaining) - flat(ref, remaining)
        denom = float(theta @ theta)
        c = -float(resid @ theta) / denom if denom > 0 else 0.0
        if c != 0.0 and math.isfinite(c):
            candidate = {p: ref[p] - c * ev.params[p] for p in remaining}
            word = "applied where the run configures" if c > 0 else "missing where the run configures"
            out.append(Diagnosis("weight_decay", f"weight decay differs: the parameters {'shrink' if c > 0 else 'grow'} by "
                                 f"an extra {abs(c):.3g} of themselves per step (lr x wd = {abs(c):.3g}, wd = "
                                 f"{abs(c) / ev.lr:.3g} {word} --weight-decay {ev.weight_decay:g})",
                                 self.match(candidate, remaining)))
        return out

    def clipped(self, remaining: list[str]) -> list[Diagnosis]:
        ev, d = self.ev, self.d
        usable = {p: g for p, g in ev.grads.items() if g is not None}
        if not usable:
            return []
        total = float(torch.linalg.vector_norm(flat(usable, list(usable))))

        def scaled(s: float) -> Grads:
            return ev.step_with(grads={p: (None if g is None else s * g) for p, g in ev.grads.items()})

        def loss(s: float) -> float:
            return rel_fro(flat(d, remaining), flat(scaled(s), remaining))

        # Fit on a log scale: the match needs the scale to a relative precision near the tolerance.
        from scipy.optimize import minimize_scalar  # scipy takes seconds to import: only where it is used

        fit = minimize_scalar(lambda t: loss(10.0**t), bounds=(-9.0, 0.0), method="bounded",
                              options={"xatol": 1e-10, "maxiter": 200})
        s = float(10.0**fit.x)
        if s > 1 - 1e-4:
            return []
        return [Diagnosis("clipped", f"the gradient was clipped before the step (scaled by {s:.3g}: total norm "
                          f"{total:.3g} capped at {s * total:.3g}); set the same clipping in every backend or none "
                          "(DeepSpeed clips at 1.0 by default since 0.19.3: gradient_clipping)",
                          self.match(scaled(s), remaining))]

    def clipped_in_parts(self, remaining: list[str]) -> list[Diagnosis]:
        """The gradient clipped part by part, each part (a ZeRO partition, an FSDP shard, a parameter group) by its own
        norm: each parameter's gradient scaled by its part's factor. Fitted per parameter where the update is affine
        in the gradient (SGD, with or without momentum); Adam's is not, and is left to the other hypotheses."""
        ev = self.ev
        if "betas" in ev.factory([torch.nn.Parameter(torch.zeros(1))]).defaults:
            return []  # Adam-like: the update is not affine in the gradient
        usable = [p for p in remaining if ev.grads.get(p) is not None and bool(ev.grads[p].any())]
        if len(usable) < 2:
            return []
        zero = ev.step_with(grads={p: (None if g is None else torch.zeros_like(g)) for p, g in ev.grads.items()})
        full = ev.step_with()
        factors = {}
        for p in usable:
            b = (full[p] - zero[p]).reshape(-1)
            bb = float(b @ b)
            if bb > 0:
                factors[p] = float((self.d[p] - zero[p]).reshape(-1) @ b) / bb
        clipped = {p: f for p, f in factors.items() if 0 < f < 1 - 1e-4}
        groups: list[list[str]] = []
        for p in [n for n in self.names if n in clipped]:  # parts are runs of parameters in parameter order
            if groups and abs(clipped[groups[-1][0]] - clipped[p]) <= SCALE_AGREEMENT * clipped[p]:
                groups[-1].append(p)
            else:
                groups.append([p])
        if len(groups) < 2:
            return []  # one factor for every parameter: clipping by the global norm, which `clipped` names
        scaled = {p: (None if g is None else clipped.get(p, 1.0) * g) for p, g in ev.grads.items()}
        explained = self.match(ev.step_with(grads=scaled), remaining)
        if not explained:
            return []
        parts = []
        for group in groups:
            norm = float(torch.linalg.vector_norm(flat({p: ev.grads[p] for p in group}, group)))
            f = clipped[group[0]]
            parts.append(f"{group[0]}{'..' + group[-1] if len(group) > 1 else ''} x{f:.3g} (norm {norm:.3g} capped "
                         f"at {f * norm:.3g})")
        return [Diagnosis("clipped_in_parts", f"the gradient was clipped part by part, each part by its own norm: "
                          f"{'; '.join(parts)}; clipping must use the global norm over every part (under ZeRO and "
                          "FSDP each rank holds a partition: the norm is an all-reduce of the partitions' squared "
                          "norms)", explained)]

    def scale(self, remaining: list[str]) -> list[Diagnosis]:
        c, agreeing = _common_scale(self.d, self.ref, remaining)
        if not math.isfinite(c) or c == 0.0 or abs(c - 1.0) < 1e-3:
            return []
        return [Diagnosis("scaled", f"the update is {c:.4g}x the reference: the step size differs ({self.lr_said})",
                          self.match({p: c * self.ref[p] for p in agreeing}, agreeing))]


def diagnose_update(ev: UpdateEvidence, failing: list[str]) -> list[Diagnosis]:
    """Name the one known fault whose update explains every failing parameter, else the faults that each
    explain some of them and what matches none."""
    h = _UpdateHypotheses(ev)
    return _explain(failing, h.ordered(), h.names, h.NONE)


def _norm_ratio(a: Grads, b: Grads, names: list[str]) -> float:
    nb = float(torch.linalg.vector_norm(flat(b, names)))
    return float(torch.linalg.vector_norm(flat(a, names))) / nb if nb > 0 else math.inf


def _same_state(a: OptState, b: OptState) -> bool:
    """Two optimizer states that step the same way: equal keys and values, where a missing entry and an
    all-zero buffer count as the same (a zero momentum buffer steps like none). Values agree to 1e-4 of
    their scale: the expected state is a float64 step from the backend's float32 one, so they differ by
    rounding; a state that is not the expected one (a step count, a reset buffer) differs by far more."""
    for p in set(a) | set(b):
        ea, eb = a.get(p, {}), b.get(p, {})
        for key in set(ea) | set(eb):
            va, vb = ea.get(key), eb.get(key)
            if va is None or vb is None:
                present = va if vb is None else vb
                if not (torch.is_tensor(present) and present.dim() > 0 and not bool(present.any())):
                    return False
                continue
            if torch.is_tensor(va) and torch.is_tensor(vb):
                va, vb = va.double(), vb.double()
                scale = float(vb.abs().max()) if vb.numel() else 0.0
                if float((va - vb).abs().max() if va.numel() else 0.0) > 1e-4 * max(scale, 1e-30):
                    return False
            elif va != vb:
                return False
    return True


def state_difference(backend: OptState, expected: OptState, names: list[str]) -> tuple[list[str], str] | None:
    """(the parameters, in `names` order, whose optimizer state is not the expected one, and a phrase on the first
    showing the entry that differs and both values), or None. A missing entry and an all-zero buffer count as the
    same (a zero momentum buffer steps like none); tensors agree to 1e-4 of their largest value (the expected state
    is a float64 replay of the backend's own step, so the two differ by rounding alone)."""
    wrong, phrase = [], ""
    for name in names:
        ea, eb = backend.get(name, {}), expected.get(name, {})
        for key in sorted(set(ea) | set(eb)):
            text = _entry_difference(name, key, ea.get(key), eb.get(key))
            if text is not None:
                phrase = phrase or text
                wrong.append(name)
                break
    return (wrong, phrase) if wrong else None


def _entry_difference(name: str, key: str, have: Any, want: Any) -> str | None:
    def zero(v: Any) -> bool:
        return torch.is_tensor(v) and v.dim() > 0 and not bool(v.any())

    if have is None or want is None:
        present = have if want is None else want
        if zero(present):
            return None
        size = f"of norm {float(torch.linalg.vector_norm(present.double())):.4g}" if torch.is_tensor(present) else \
            f"= {present}"
        return (f"{name} holds {key} {size} where none was expected" if want is None else
                f"{name} holds no {key} where one {size} was expected")
    if torch.is_tensor(have) and torch.is_tensor(want):
        a, b = have.double().reshape(-1), want.double().reshape(-1)
        if a.numel() != b.numel():
            return f"{name}'s {key} has {a.numel()} elements where {b.numel()} were expected"
        if not a.numel():
            return None
        gap = (a - b).abs()
        scale = float(b.abs().max())
        worst = int(gap.argmax())
        if float(gap[worst]) <= 1e-4 * max(scale, 1e-30):
            return None
        where = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), tuple(want.shape))) if want.dim() > 1 \
            else worst
        return (f"{name}'s {key} differs from it: element {where} is {float(a[worst]):.6g} where {float(b[worst]):.6g} "
                f"was expected (the largest difference, {float(gap[worst]) / max(scale, 1e-30):.3g} of the expected "
                f"{key}'s largest value; norms {float(torch.linalg.vector_norm(a)):.6g} and "
                f"{float(torch.linalg.vector_norm(b)):.6g})")
    if float(have) != float(want):
        return f"{name} has {key} {float(have):g} where {float(want):g} was expected"
    return None


FRESH_STEPPED_TRAP = (" — at step 0 this is a fresh optimizer that already ran step() on zero gradients: Horovod's "
                      "broadcast_optimizer_state does that (horovod/horovod#3743; broadcast after the first step, or "
                      "not at all), and so do DeepSpeed's fp16/bf16 optimizer wrappers when they are built "
                      "(initialize_optimizer_states: with Adam the first real step then runs at step count 2)")


def step_count_mismatch(backend: OptState, expected: OptState, names: list[str]) -> tuple[list[str], str] | None:
    """(the parameters, in `names` order, whose optimizer step count (Adam's `step`, a whole number: no rounding
    excuses it) is not the expected one, and a phrase on the first), or None. A missing count is 0 (a fresh
    optimizer's)."""
    wrong = []
    phrase = ""
    for name in names:
        have = float(backend.get(name, {}).get("step", 0))
        want = float(expected.get(name, {}).get("step", 0))
        if have != want:
            phrase = phrase or f"{name} has optimizer step count {have:g} where {want:g} was expected"
            wrong.append(name)
    return (wrong, phrase) if wrong else None
