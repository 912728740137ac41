"""Gradient hypotheses: the known faults of a reduced gradient, and the gradient each would have produced.

Owns: _GradientHypotheses, whose methods are the hypotheses for a failed gradient check, in the order they are
tried (no gradient at all, ranks that disagree, a wire's range, non-finite values, duplicated or wrong shards,
swapped gradients, a scale factor, a partition never written, an unsynchronised gradient, the mean of one replica
group only, a stale gradient, a factor per rank, BatchNorm statistics, a wire's rounding), each rank's local gradient
and each candidate computed once; and what they build candidates from: the mean of the ranks' gradients, the micro-batches synchronised BatchNorm
normalises, whether the loss is a sum. The wire's hypotheses simulate the all-reduce
(dpcompare.verify.diagnosis.wire_hypotheses). Imports no adapter.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import torch

from dpcompare.contract import batches
from dpcompare.verify.oracle.gradient_oracle import (WIRE_DTYPE, Grads, Layout, flat, global_pieces, rel_fro, replica_pieces,
                                          tensor_digest)
from dpcompare.contract.workload import shard
from dpcompare.verify.oracle.model_dtypes import float_dtype
from dpcompare.verify.diagnosis.failure_evidence import GradientEvidence
from dpcompare.verify.diagnosis.explanation import (EXPLAINED_SHARE, SCALE_AGREEMENT, Diagnosis, _common_scale, _Hypothesis,
                                          _matching, _share)
from dpcompare.verify.diagnosis.wire_hypotheses import wire_range_diagnoses, wire_rounding_diagnoses


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
        return [self.no_gradient, self.redrawn_masks, self.ranks_disagree, self.wire_range, self.non_finite, self.data, self.swapped,
                self.scaled, self.zeroed, self.unsynchronised, self.replica_group, self.stale, self.local_count,
                self.rank_scaled,
                self.batchnorm, self.wire]

    def none_reason(self) -> str:
        none = ("the reduced gradient matches none of the known fault patterns (sum, 1/N, a scale factor, one rank's "
                "local gradient, the mean of one replica group's ranks, a stale gradient, a factor per rank (local "
                "clipping), two same-shape gradients exchanged, a part never written, an fp16 or bf16 wire's rounding, "
                "underflow or overflow, per-rank or per-micro-batch BatchNorm, duplicated data)")
        if self.ev.stochastic:
            none += "; the model draws random numbers: the oracle replayed the numbers each rank drew"
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

    def redrawn_masks(self, remaining: list[str]) -> list[Diagnosis]:
        """A checkpointed block's recomputation in backward ran its dropout with other masks than its forward drew (no
        generator state restored): seen directly by the mask capture, which holds the recomputed dropout outputs it
        sees to the forward's masks. The backward then differentiates another function than the forward computed, so
        every parameter the block's gradient flows into is off: all the failing ones are claimed."""
        if not self.ev.redrawn or not remaining:
            return []
        names = sorted(self.ev.redrawn)
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        return [Diagnosis("recompute_redrew_masks", "activation checkpointing recomputed dropout in backward with other "
                          f"masks than the forward drew ({shown}; {names[0]}: {self.ev.redrawn[names[0]]}): the "
                          "backward differentiates a function the forward never computed (allenai/OLMo-core PR #828); "
                          "recompute from the forward's generator state (torch.utils.checkpoint's "
                          "preserve_rng_state=True, its default)", list(remaining))]

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
        local = self.local()
        base = self.candidate("mean", lambda: _mean(local, self.names))
        return wire_range_diagnoses(self.ev, local, base, self.share, wire_name, declared, remaining)

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
        cast = float_dtype(ev.oracle.model_run)  # the runner feeds floating inputs in the weights' dtype
        expected = [tensor_digest(batches.to(x, "cpu", cast)) for x in (shard(ev.batch, r, n)[0] for r in range(n))]
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

    def replica_group(self, remaining: list[str]) -> list[Diagnosis]:
        """The mean of the local gradients of rank 0's group of ranks only, not of every rank: a replica group that
        reduced within itself and never across the groups (HSDP without its cross-replica all-reduce). Tried for every
        group size strictly between 1 and N that divides N, as a (replicate, shard) mesh lays groups out: rank 0's row
        (ranks 0 .. size-1, the shard group) and rank 0's column (every N/size-th rank). A group's mean acts on the
        whole gradient: it explains every failing parameter or nothing."""
        n = self.n
        sizes = [d for d in range(2, n) if n % d == 0]
        if not sizes or not remaining:
            return []
        local = self.local()
        for size in sizes:
            for ranks in (tuple(range(size)), tuple(range(0, n, n // size))):
                mean = self.candidate(("group", ranks), lambda ranks=ranks: _mean([local[r] for r in ranks], self.names))
                if set(self.match(mean, remaining)) != set(remaining):
                    continue
                groups = n // size
                others = "the other group" if groups == 2 else f"the other {groups - 1} groups"
                return [Diagnosis("replica_group_only", f"the reduced gradient is the mean of the local gradients of "
                                  f"ranks {', '.join(map(str, ranks))} only ({size} of the {n} ranks: one of {groups} "
                                  f"replica groups), not of every rank: the group reduced its gradients within itself "
                                  f"and never with {others}, as HSDP whose cross-replica all-reduce did not run "
                                  "(fully_shard on a 1-D shard sub-mesh per group, the replicate dimension dropped, the "
                                  "all-reduce skipped or undone; pytorch/pytorch#140183: HYBRID_SHARD training as if "
                                  "on one node); pass fully_shard the whole 2-D mesh (replicate, shard), so the groups "
                                  "all-reduce their gradient shards", list(remaining))]
        return []

    def stale(self, remaining: list[str]) -> list[Diagnosis]:
        if self.ev.previous is None:
            return []
        prev_step, prev = self.ev.previous
        now = self.ev.digests or {}
        # the previous step's reduced gradient to the bit (its digest: the gradient itself is not held over the step)
        explained = [n for n in remaining if now.get(n, "none") != "none" and now.get(n) == prev.get(n)]
        if not explained:
            return []
        return [Diagnosis("stale", f"the reduced gradient is step {prev_step}'s: a stale gradient (the reduction did not "
                          "wait for this step's all-reduce, or a buffer from the previous step was used)", explained)]

    def local_count(self, remaining: list[str]) -> list[Diagnosis]:
        """Under --loss-normalisation global, each forward divided by its own item count: the step's count was not
        summed over the ranks and micro-batches (transformers#34191's class of bug)."""
        ev, layout = self.ev, self.ev.layout
        if not layout.global_count or layout.items is None or not layout.splits_the_batch:
            return []
        own = dataclasses.replace(layout, global_count=False)
        explained = self.match(self.candidate("local_count", lambda: ev.compute(
            replica_pieces(ev.batch, own, ev.masks))), remaining)
        if not explained:
            return []
        y = ev.batch[1]
        per_rank = [sum(layout.items(batches.take(y, p[3])) for p in layout.positions(batches.rows(y)) if p[0] == r)
                    for r in range(layout.world_size)]
        micro = " and micro-batch" if layout.grad_accum > 1 else ""
        return [Diagnosis("local_normalisation", f"each rank{micro} divided its loss by its own item count (items per "
                          f"rank: {', '.join(map(str, per_rank))}) though --loss-normalisation global asks for the "
                          "step's count: the count's all-reduce over the ranks (and its sum over the micro-batches) is "
                          "missing before the backward; sum it as transformers' num_items_in_batch is summed",
                          explained)]

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
                                 f"normalise its local batch of {batches.rows(ev.batch[0]) // layout.world_size}); pass --sync-bn "
                                 "to judge it as one computation", explained))
            return out
        if layout.world_size > 1:
            per_rank = Layout(layout.world_size, 1, layout.replicas)
            explained = self.match(self.candidate("per_rank", lambda: ev.compute(
                replica_pieces(ev.batch, per_rank, None))), remaining)
            out.append(Diagnosis("batchnorm", f"BatchNorm normalised each rank's shard with that shard's own statistics "
                                 f"(local batch {batches.rows(ev.batch[0]) // layout.world_size}) though --sync-bn was given: "
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
        """The rounding of a narrow wire the backend did not declare."""
        if self.n < 2:
            return []
        local = self.local()
        base = self.candidate("mean", lambda: _mean(local, self.names))
        return wire_rounding_diagnoses(self.ev, local, base, self.share, remaining)


def _mean(grads: list[Grads], names: list[str]) -> Grads:
    return {p: torch.stack([g[p] for g in grads]).mean(dim=0) for p in names}


def _micro_batch_groups(batch, n: int, k: int):
    """Micro-batch j of every rank, joined: what synchronised BatchNorm normalises under gradient accumulation."""
    per_rank = [tuple(batches.chunk(t, k) for t in shard(batch, r, n)) for r in range(n)]
    return [(batches.cat([per_rank[r][0][j] for r in range(n)]), batches.cat([per_rank[r][1][j] for r in range(n)]))
            for j in range(k)]


def _loss_is_sum(ev: GradientEvidence) -> bool:
    """The workload's loss grows with the number of samples (sum) rather than staying a mean."""
    model = ev.oracle.model64
    model.load_state_dict(ev.state)
    with torch.no_grad():
        x, y = batches.to(ev.batch[0], ev.oracle.device, torch.float64), batches.to(ev.batch[1], ev.oracle.device)
        whole = float(ev.oracle.loss_fn(batches.call(model, x), y))
        half_of = slice(0, batches.rows(x) // 2)
        half = float(ev.oracle.loss_fn(batches.call(model, batches.take(x, half_of)), batches.take(y, half_of)))
    return abs(whole) > 0 and abs(whole / max(abs(half), 1e-300)) > 1.5
