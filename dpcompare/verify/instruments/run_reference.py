"""The run-precision reference of a checked step: what the reduced gradient is judged against, and its floor.

Owns: the forwards the reference runs (each rank's own, as its loss scale and its rounding act rank by rank, except
one forward under global BatchNorm, and the global batch where the loss is not a mean over its samples, as
dpcompare.verify.model_facts.batch_split finds it: there the run's split is judged against what a single process computes); the same
function regrouped as data parallelism may legitimately regroup it, whose distance from the reference is the floor
(under --compile the regrouped twin runs a compiled copy: a compiled run's kernels round differently from the eager
reference's, and that is measured here, not assumed; where a rank's share is not a power of two, the twin divides by
it after the backward where the reference multiplies the loss by it, as a backend that averages does); and the wire a
backend declares narrower than the run dtype (--compression, or what its precision recipe sends), emulated where
every rank's share is a piece of its own and the wire changes no more than its rounding (`Verdict.wire_rounding`
"measured"), bounded otherwise. The reference itself is computed by the oracle's run-precision copy
(dpcompare.verify.oracle.gradient_oracle). Imports no adapter.
"""

from __future__ import annotations

import math

import torch

from dpcompare.verify.oracle.gradient_oracle import Grads, Layout, Masks, Oracle, Piece, replica_pieces, same_sum
from dpcompare.verify.judgement.held_values import Compact
from dpcompare.verify.model_facts.batch_split import SplitCheck, in_ranks_order
from dpcompare.verify.judgement.tolerance import TOLERANCE_FACTOR, UNIT_ROUNDOFF, WIRE_DTYPE, norm_of, rel_fro
from dpcompare.verify.judgement.verdict import Verdict


class RunReference:
    """The run-precision reference and its floor at each checked step, for a run of `world_size` ranks split as
    `layout` says, in `dtype`, sending its gradients through `wire` (none, fp16 or bf16)."""

    def __init__(self, oracle: Oracle, layout: Layout, *, dtype: str, world_size: int, wire: str,
                 wired: frozenset[str] | None = None, has_batchnorm: bool,
                 sync_bn: bool, verdict: Verdict, split: SplitCheck, compiled: bool = False) -> None:
        self.oracle, self.layout, self.dtype, self.world_size, self.wire = oracle, layout, dtype, world_size, wire
        self.wired = wired
        """The parameters whose gradients travel on the wire where only some do (None: all of them)."""
        self.compiled = compiled
        """--compile: the regrouped twin runs compiled, so the floor holds the compiler's rounding too."""
        self.has_batchnorm, self.sync_bn, self.verdict = has_batchnorm, sync_bn, verdict
        self.names = oracle.names
        self.split = split
        """Whether the ranks' split computes the global batch's gradient (dpcompare.verify.model_facts.batch_split)."""
        self.step = -1
        """The checked step being measured."""
        self.recomputed: dict = {}
        """Where the regrouped twin is the reference's own arithmetic (one rank's one forward; two ranks' forwards, one
        each, whose reversed sum is the same addition: dpcompare.verify.oracle.gradient_oracle.same_sum): the
        steps it was recomputed at (`recomputed`), whether it came out bitwise the reference there (`identical`), and
        the steps that reused the reference instead (`reused`). Such a twin only shows a nondeterministic kernel: once
        it came out identical, later steps take the reference as their floor's second computation (the floor is then
        depth x u, the smallest it can be)."""

    def measure(self, state: dict, batch, pieces: list[Piece], forward_masks: list[Masks] | None,
                loss_scale: float, step: int = -1) -> tuple[Grads, Grads, torch.dtype | None]:
        """The reference (floor), its regrouped twin (spread) and the wire dtype the reference sent the ranks' shares
        through (None: the reduction's rounding is bounded instead), at the run's `state` and loss scale, for the
        step whose oracle ran `pieces`. The oracle's `none` stays as that oracle left it; raises MaskMismatch where
        the captured masks do not fit the reference's forwards."""
        self.step = step
        run_pieces = self._floor_pieces(batch, pieces, forward_masks)
        wire = self._emulated_wire(run_pieces)
        if wire is None:
            floor = self.oracle.floor_of(state, run_pieces, loss_scale)
            spread = self._spread(state, run_pieces, floor, loss_scale)
        else:  # the wire's rounding is measured, not bounded: the reduction's allowance is the run dtype's
            unsent: Grads = {}
            floor = self.oracle.wire_floor_of(state, run_pieces, wire, loss_scale, unsent=unsent, wired=self.wired)
            if self._wire_loses(floor, unsent):
                # Beyond rounding (gradients flushed to zero or overflowed on it): judged against the
                # reference without the wire, with its rounding bounded, so what it lost shows.
                wire = None
                floor = self.oracle.floor_of(state, run_pieces, loss_scale)
                spread = self.oracle.floor_of(state, self._spread_pieces(run_pieces),
                                              self._twin_scale(run_pieces, loss_scale), compiled=self.compiled)
            else:
                self.verdict.wire_rounding = "measured"
                spread = self.oracle.wire_floor_of(state, run_pieces, wire, loss_scale, regrouped=True,
                                                    wired=self.wired)
        return floor, spread, wire

    def _spread(self, state: dict, run_pieces: list[Piece], floor: Grads, loss_scale: float) -> Grads:
        """The regrouped twin of `floor`; where it is the same arithmetic (`same_sum`), computed until it once came
        out bitwise equal to the reference, then the reference itself (`recomputed`)."""
        pieces = self._spread_pieces(run_pieces)
        scale = self._twin_scale(run_pieces, loss_scale)
        same = not self.compiled and scale == loss_scale and same_sum(pieces, run_pieces)
        if same and self.recomputed.get("identical"):
            if self.step not in self.recomputed["reused"]:
                self.recomputed["reused"].append(self.step)
            return floor
        spread = self.oracle.floor_of(state, pieces, scale, compiled=self.compiled)
        if same:
            self.recomputed.setdefault("recomputed", []).append(self.step)
            self.recomputed.setdefault("reused", [])
            self.recomputed["identical"] = _bitwise(floor, spread)
        return spread

    def _twin_scale(self, pieces: list[Piece], loss_scale: float) -> float:
        """The loss scale the regrouped twin runs at. Where every forward's share of the global batch is the same 1/N
        and N is not a power of two, the reference multiplies each loss by 1/N in the graph, while a backend that
        averages the reduced gradient (DDP, Horovod's Average, DeepSpeed) takes the loss's gradient unscaled and
        divides afterwards. The two round 1/N differently, and a backward that cancels (BatchNorm's over a rank's
        samples: its input's gradient is what is left of the output's less its projections) carries that rounding far
        above the unit roundoff. The twin then takes the other way (its losses multiplied by N in the graph, so by
        one, its sum divided by N after), so the floor holds both places the division is legitimately done. Under a
        recipe the reference divides afterwards already; with a power of two the two ways are the same bits."""
        shares = {p.weight for p in pieces}
        share = next(iter(shares), 1.0)
        if loss_scale != 1.0 or len(shares) != 1 or math.frexp(share)[0] == 0.5 or self.oracle.recipe.active:
            return loss_scale
        if "divided_after" not in {n.code for n in self.verdict.notes}:
            self.verdict.note("divided_after", f"each forward's share of the global batch is 1/{1 / share:.6g}, not a "
                              "power of two: the reference multiplies each loss by it in the graph and the floor's "
                              "regrouped twin divides its sum by it after the backward, as a backend that averages "
                              "the reduced gradient does; the two round it differently")
        return 1.0 / share

    def _floor_pieces(self, batch, pieces: list[Piece], forward_masks: list[Masks] | None) -> list[Piece]:
        """The forwards of the run-precision reference: each rank's own (as its loss scale and its rounding act rank
        by rank, and as each rank's shard sums into the reduction), except with global BatchNorm, one forward, and
        where the loss is not a mean, the global batch, as the oracle (the run's split is judged against it)."""
        finding = self.split.finding
        if ((self.has_batchnorm and self.sync_bn) or len(pieces) > 1 or not self.layout.splits_the_batch
                or (finding is not None and finding.semantics == "loss_not_mean")):
            return pieces
        return replica_pieces(batch, self.layout, forward_masks)

    def _spread_pieces(self, pieces: list[Piece]) -> list[Piece]:
        """The same function grouped the way data parallelism may legitimately group it differently, for the floor of
        what it alone changes: the ranks' forwards summed in reverse order (a recomputation too: a nondeterministic
        kernel shows here); where one forward stands for several ranks' samples (global BatchNorm under --sync-bn) its
        samples in the order the ranks hold them, so the statistics are reduced in another order. A rank's own forward
        is never regrouped: every backend runs it as it is, and in a chaotic regime (BatchNorm over a few samples at
        bf16) a regrouped forward would measure that chaos, not data parallelism."""
        if len(pieces) != 1 or not self.layout.splits_the_batch:
            return list(reversed(pieces))
        return [in_ranks_order(pieces[0], self.layout) or pieces[0]]

    def _emulated_wire(self, pieces: list[Piece]) -> torch.dtype | None:
        """The wire dtype the run-precision reference sends the ranks' shares through: the declared one
        (--compression, or the backend's recipe) where it is narrower than the run dtype and every rank's share is a
        piece of its own; None: the reduction's rounding is bounded (world_size x its unit roundoff) instead."""
        name = WIRE_DTYPE[self.wire]
        if name is None or UNIT_ROUNDOFF[name] <= UNIT_ROUNDOFF[self.dtype]:
            return None
        return getattr(torch, name) if len({p.rank for p in pieces}) == self.world_size else None

    def _wire_loses(self, sent: Grads, unsent: Grads) -> bool:
        """Whether the declared wire changes the reference beyond its rounding (world_size x its unit roundoff, times
        the factor) anywhere: gradients below its smallest subnormal flushed to zero, or above its range."""
        u = UNIT_ROUNDOFF[WIRE_DTYPE[self.wire]]
        names = [n for n in self.names if n in sent]
        share = norm_of(unsent, names) / max(len(names), 1) ** 0.5
        return any(not bool(torch.isfinite(sent[n]).all())
                   or rel_fro(sent[n], unsent[n], share) > TOLERANCE_FACTOR * self.world_size * u for n in names)


def _bitwise(a: Grads, b: Grads) -> bool:
    """Whether two gradients are bitwise the same, parameter by parameter, as held."""
    held = lambda g, n: g.held(n) if isinstance(g, Compact) else g[n]  # noqa: E731
    return a.keys() == b.keys() and all((held(a, n) is None and held(b, n) is None) or (
        held(a, n) is not None and held(b, n) is not None and torch.equal(held(a, n), held(b, n))) for n in a)
