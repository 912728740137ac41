"""What a check is handed at a step, and what the oracle computes at a checked step, once, for every check of it.

Owns: `StepEvidence` (what every rank sent and read at one point of a step, and the oracle's side of it), `OracleStep`
and `compute`: the state the step's forward ran from (the values the optimizer holds, the buffers before the forward),
the forwards the oracle runs with the draws the ranks recorded (dpcompare.verify.model_facts.replica_forwards, the split settled by
dpcompare.verify.model_facts.batch_split), the float64 oracle's gradient, the run-precision reference and its regrouped twin
(dpcompare.verify.instruments.run_reference), whether the loss scale overflows there, and the snapshot the step's update check
starts from (`Pending`); after the step's checks, the notes on those forwards (`note_forwards`). Where the step cannot
be computed it says why, as a `Finding`: draws that cannot be replayed, or a training that diverged numerically.
Everything runs on generators forked from the run's. Imports no adapter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from dpcompare.contract import batches
from dpcompare.contract.amp import ScalerState
from dpcompare.contract.optim_state import read_hparams
from dpcompare.verify.randomness import draw_recording as mk
from dpcompare.verify.randomness import random_modules
from dpcompare.verify.instruments.run_instruments import Bench
from dpcompare.verify.instruments.check_context import CheckContext, Finding, Point
from dpcompare.verify.oracle.gradient_oracle import Grads, Masks, Piece, replica_pieces
from dpcompare.verify.randomness.draw_recording import MaskRecord
from dpcompare.verify.judgement.precision_recipe import ScaleStep
from dpcompare.verify.instruments.backend_reads import Pending, Reads
from dpcompare.verify.judgement.held_values import Compact
from dpcompare.verify.judgement.tolerance import all_finite, rel_fro_of


@dataclass(slots=True)
class OracleStep:
    """The oracle's side of one checked step."""

    state: dict
    """The run's state the forward ran from, loaded into every copy."""
    pieces: list[Piece]
    """The forwards the oracle ran, with the ranks' draws."""
    forward_masks: list[Masks] | None
    """Each forward of the layout's draws (None: the forward draws no random numbers)."""
    grads: Grads
    """The backend's reduced gradient, read in float64 on the CPU (zeros where it gave none; held in its own dtype)."""
    oracle: Grads
    """The float64 oracle's gradient."""
    floor: Grads
    """The run-precision reference's gradient: what the backend is judged against."""
    spread: Grads
    """Its regrouped twin: the floor is their distance."""
    wire: torch.dtype | None
    """The wire the reference sent the ranks' shares through (None: its rounding is bounded instead)."""
    none: frozenset[str]
    """The parameters a single process gives no gradient."""
    scaler: ScalerState | None
    """The loss scaler at the step's backward (None: the loss is not scaled)."""
    scale_step: ScaleStep | None
    """The loss scaler's record of this step (None: the loss is not scaled)."""
    overflow: bool
    """The recipe overflows at this step's loss scale: the backend must skip the step, nothing else is judged."""
    pending: Pending
    """What the step's update check starts from."""

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def local(self, bench: Bench, batch: Any, layout) -> Callable[[], list[Grads]]:
        """Each rank's local (unreduced) gradient, on demand: for a diagnosis that holds a figure against it."""
        return lambda: [bench.oracle.floor_of(self.state, replica_pieces(batch, layout, self.forward_masks, ranks=[r]),
                                              self.loss_scale) for r in range(layout.world_size)]


@dataclass(frozen=True, slots=True, kw_only=True)
class StepEvidence:
    """What the checks are handed at one point of one step (`at`)."""

    step: int
    at: Point
    checked: bool
    """A checked step (--check-every): the ranks sent their reads, and the oracle ran."""
    batch: Any
    """The step's global batch (inputs, targets)."""
    ranks: list[dict]
    """What each rank sent, in rank order (dpcompare.run.verification): its generator's digest and draws at every step
    of a random forward; at a checked step its shard's and reduced gradients' digests, norms and buffers too."""
    records: list[MaskRecord] | None
    """Each rank's recorded draws (None: the forward draws no random numbers)."""
    masters: dict[str, torch.Tensor]
    """The values the optimizer steps, full, as last read on every rank: before the step at `reduced`, after it at
    `updated`."""
    scaler_before: ScalerState | None
    """The loss scaler as the step's backward used it (None: the loss is not scaled)."""
    reads: Reads | None = None
    """At a checked step: what every rank read after the reduce."""
    oracle: OracleStep | None = None
    """At a checked step: what the oracle computed (None: unchecked, or it could not be computed)."""
    reported_norm: float | None = None
    """At `updated` under --clip-grad-norm: the total norm the backend reports clipping by."""


def compute(ctx: CheckContext, bench: Bench, step: StepEvidence) -> OracleStep | Finding:
    """The oracle's side of the checked step `step`, or the finding that it cannot be computed."""
    records = step.records
    try:
        pieces = bench.forwards.pieces(step.batch, records)
        forward_masks = bench.forwards.masks(batches.rows(step.batch[0]), records) if records is not None else None
    except mk.MaskMismatch as exc:
        return bench.mask_failure(step.step, exc)
    if records is not None:
        bench.verdict.stochastic["capture_bytes_per_step"] = max(r.nbytes for r in records)
    scaler = bench.backend.scaler_state()
    loss_scale = scaler.scale if scaler is not None else 1.0
    with random_modules.isolated(ctx.device):
        # The step's parameters, snapshotted once: the update check starts from them, and the forwards' state holds
        # the same tensors (not a second copy).
        params = Compact({n: step.masters[n] for n in ctx.names})
        state = bench.run_state(step.masters, step.ranks[0]["buffers"]["before"], params)
        reduced = step.reads.grads
        # Held as the backend computed them (float32: 4 bytes an element), read in float64 (exactly); where the ranks
        # share the oracle, in ranges by the parameters' owners, beside the oracle's sums (each owner judges its range).
        given = {n: (reduced[n] if reduced.get(n) is not None else torch.zeros_like(step.masters[n]))
                 for n in ctx.names}
        grads = Compact(given) if bench.divider is None else bench.divider.hold(given)
        del given
        if bench.divider is not None:
            # held in ranges from here on: rank 0 keeps what each parameter's read was (None, or its shape and dtype),
            # not the values (the backend's .grad, which the run lets go after its optimizer step, or a full copy)
            step.reads.grads = {n: None if g is None else torch.empty_like(g, device="meta")
                                for n, g in reduced.items()}
        left_none = frozenset(n for n in ctx.names if reduced.get(n) is None)
        try:
            pieces, oracle, none, floor, spread, wire = _gradients(bench, step, state, records, forward_masks, pieces,
                                                                   loss_scale)
        except mk.MaskMismatch as exc:
            return bench.mask_failure(step.step, exc)
    # A run whose single process overflows too has diverged: that is no backend difference. Under a loss scale, the
    # recipe's overflow is the scaler's to handle: the step must be skipped.
    overflow = not _finite(floor)
    for what, g, diverged in (("float64 oracle's gradient", oracle, True),
                              (f"{ctx.floor_name} single-process gradient", floor, scaler is None)):
        if diverged and not _finite(g):
            return Finding(unverifiable=f"the training diverged numerically at step {step.step}: the {what} is not "
                                        "finite at the run's parameters (the loss or the parameters overflowed), so "
                                        "nothing from there on can be compared; lower --lr", stop=True)
    scale_step = None
    if scaler is not None:
        scale_step = ScaleStep(step.step, loss_scale, overflow, not _finite(grads))
        bench.verdict.precision.steps.append(scale_step)
    if not _finite(spread):
        spread = floor  # the regrouped sum overflows where the ranks' does not: no measured spread
    pending = Pending(
        step.step, params, grads.without(left_none), none,
        step.reads.state, read_hparams(bench.optimizer) if bench.optimizer is not None else [],
        scale_step, scaler.skipped_steps if scaler is not None else 0)
    return OracleStep(state, pieces, forward_masks, grads, oracle, floor, spread, wire, none, scaler, scale_step,
                      overflow, pending)


def params_in_ranges(bench: Bench, step: StepEvidence) -> None:
    """Past the checks of a checked step's reduce, where the ranks share the checks: the step's parameters (the update
    check's start) held in ranges by their owners until the update check (its owners replay their ranges from them:
    dpcompare.verify.replay.replay_ranges), and the state the copies loaded (the same tensors, and the buffers before the
    forward) let go. Not where a check reads the oracle's side after the optimizer step (grad_norm, whose diagnosis
    recomputes a rank's local gradient from that state)."""
    o = step.oracle
    if bench.divider is None or o is None or o.pending is None or not isinstance(o.pending.params, Compact):
        return
    params = o.pending.params
    o.pending.params = bench.divider.hold({n: params.held(n) for n in params})
    o.state = {}


def note_forwards(ctx: CheckContext, bench: Bench, step: StepEvidence) -> None:
    """After the checks of a compared step (not one whose loss scale overflowed): the notes on the forwards the oracle
    ran, measured at the first such step: per-replica BatchNorm's and a split-dependent forward's distance from the
    global batch, in floors of the gradient check."""
    o, names = step.oracle, list(ctx.names)
    bench.forwards.note_per_replica(step.step, o.state, step.batch, o.oracle, o.floor, o.pieces)
    bench.split.note(max(rel_fro_of(o.floor, o.oracle, names), ctx.floor_min))


def _gradients(bench: Bench, step: StepEvidence, state: dict, records, forward_masks, pieces: list[Piece],
               loss_scale: float) -> tuple[list[Piece], Grads, frozenset[str], Grads, Grads, torch.dtype | None]:
    """The oracle's and the reference's gradients of the step, the split settled (and reconsidered where the reference
    moved away from the oracle since); raises MaskMismatch where the draws do not fit the forwards."""
    split, batch = bench.split, step.batch
    shared = bench.shared(pieces, batch, forward_masks)
    paired = bench.split_on_a_pair(step.step, state, batch, forward_masks, pieces) if shared is pieces else None
    shared = paired or shared  # the split just measured on two ranks' forwards: their shards stand for it
    substituted = shared is not pieces  # the ranks' shards stand for one forward of the global batch
    kept = split.pair_shards(step.step) if paired is not None else None  # two ranks: the pair's shards are them
    if kept is not None:
        bench.oracle.none = kept[1]
    pieces, oracle = split.settle(step.step, state, batch, records, forward_masks, pieces,
                                  kept[0] if kept is not None else bench.oracle.oracle_of(state, shared))
    shards = split.shards(step.step)
    if shards is not None and bench.shared(pieces, batch, forward_masks) is not pieces:
        # just measured within 1e-9 of the global batch's: the ranks' shards stand for it from this step on, as at the
        # later steps, and the global batch's gradient (whole on rank 0) is let go
        oracle = shards
    joined = bench.joined_pair(batch, forward_masks) if substituted and paired is None else None
    if joined is not None and not split.agrees(bench.oracle.loss_of(state, joined[0]), joined[1]):
        # The ranks' shards stood for the global batch; two ranks' forwards joined into one say they no longer do
        # (samples that interact through the batch, agreeing at the first step only): measured again on the global
        # batch itself.
        whole = bench.oracle.oracle_of(state, pieces)
        pieces, oracle = split.recheck(step.step, state, batch, records, forward_masks, pieces, whole) or (pieces,
                                                                                                           whole)
    none = bench.oracle.none
    floor, spread, wire = bench.reference.measure(state, batch, pieces, forward_masks, loss_scale, step.step)
    if (now := split.reconsider(step.step, state, batch, records, forward_masks, pieces, oracle, floor)):
        pieces, oracle = now  # the split changes the gradient here, not at the first step: as the ranks ran
        none = bench.oracle.none
        floor, spread, wire = bench.reference.measure(state, batch, pieces, forward_masks, loss_scale, step.step)
    return pieces, oracle, none, floor, spread, wire


def _finite(grads: Grads) -> bool:
    return all_finite(grads)
