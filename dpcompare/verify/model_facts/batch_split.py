"""Whether the ranks' split of a step's batch computes the global batch's gradient.

Owns: the measurement, in float64 on rank 0: the gradient of the ranks' split (each rank's forwards, weighted by
their share), of the global batch in one forward, and of the global batch with its samples in the order the ranks
hold them. That reordering is the same function for any model whose loss is a mean over independent samples; what
it changes is the rounding of ops the model computes below float64 inside its float64 copy (Gemma's RMSNorm upcasts
to float32 whatever the input's dtype), so its distance from the global batch is the agreement the split can be
asked for (never less than SPLIT_AGREEMENT; so it is measured only where the split is further than that). A
reordering that moves the gradient beyond what float32 inside the model could (depth x float32's unit roundoff) is
not credited as rounding. Three findings (`SplitFinding`):

  global         the split computes the global batch's gradient (the workload contract);
  loss_not_mean  the split's gradient is a scalar multiple of the global one (a loss reduced with sum: 1/N): the
                 oracle and the reference stay the global batch, so the run's scaled gradient shows at the check;
  per_replica    the forward depends on how the batch is split (control flow on the local batch's size or
                 content, samples that interact): data parallelism computes each rank's forwards, so the oracle and
                 the reference compute those, as for BatchNorm without --sync-bn, and the note states their
                 distance from the global batch.

Where two ranks or more share the oracle's forwards (dpcompare.verify.memory.divider), the first measurement is of two
ranks' forwards joined against their shards (`measure_pair`): where they agree within SPLIT_AGREEMENT the split is
`global`, and nothing of the global batch is computed; anything else is measured on the global batch as above.
Measured at the first checked step, and again at a later one where the run-precision reference (the ranks' split)
moves away from the float64 oracle (the global batch) by more than the tolerance factor times its distance at the
first (a split that changes nothing at one step may at another: control flow on the batch's content). Imports no
adapter.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass
from typing import Callable, Literal, Mapping

import torch

from dpcompare.contract import batches
from dpcompare.verify.randomness import draw_recording as mk
from dpcompare.verify.oracle.gradient_oracle import Grads, Layout, Masks, Oracle, Piece, replica_pieces
from dpcompare.verify.model_facts.replica_forwards import Forwards
from dpcompare.verify.model_facts.split_causes import SPLIT_AGREEMENT, counts_of, find_cause, in_proportion
from dpcompare.verify.memory.streamed_distance import distance_of
from dpcompare.verify.judgement.tolerance import TOLERANCE_FACTOR, UNIT_ROUNDOFF, rel_fro_of
from dpcompare.verify.judgement.verdict import Verdict


Semantics = Literal["global", "loss_not_mean", "per_replica"]


@dataclass(slots=True)
class SplitFinding:
    semantics: Semantics
    step: int
    """The checked step it was measured at."""
    distance_rel_fro: float
    """The split's float64 gradient from the global batch's (relative Frobenius)."""
    rounding_rel_fro: float | None
    """The global batch reordered from itself, in float64: the rounding of what the model computes below float64
    (None: not measured: the split was within SPLIT_AGREEMENT of the global batch, which the rounding could only
    have widened, or the captured dropout masks are not batch-first)."""
    agreement: float
    """What the split had to be within to count as the global batch."""
    scale: float | None = None
    """loss_not_mean: the split's gradient over the global one."""
    floors: float | None = None
    """per_replica: the distance in the run's noise floors (its precision floor at that step)."""
    forwards: int = 1
    """The forwards data parallelism split each step's batch into (ranks x micro-batches x device replicas)."""
    ranks: list[int] | None = None
    """The ranks whose forwards it was measured on, joined into one forward against their shards (`measure_pair`);
    None: the global batch."""
    cause: dict | None = None
    """per_replica: why, as its test found it (dpcompare.verify.model_facts.split_causes: the name, None where no test held, and
    every test's figures), or {"name": "rounding"} where the distance is below the run's noise floor."""

    def to_dict(self) -> dict:
        return {k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in asdict(self).items()}


def in_ranks_order(piece: Piece, layout: Layout) -> Piece | None:
    """`piece` (one forward of the global batch) with its samples in the order the ranks hold them (rank by rank,
    micro-batch by micro-batch), its dropout masks reordered alike; None where a mask is not batch-first."""
    n = batches.rows(piece.x)
    order = torch.cat([idx for *_, idx in layout.positions(n)])
    if piece.masks is not None and any(m.dim() == 0 or m.shape[0] != n for ms in piece.masks.values() for m in ms):
        return None
    masks = {k: [m[order] for m in ms] for k, ms in piece.masks.items()} if piece.masks is not None else None
    return Piece(batches.take(piece.x, order), batches.take(piece.y, order), piece.weight, masks, piece.rank)


class SplitCheck:
    """The finding of a run whose oracle runs `forwards` (dpcompare.verify.model_facts.replica_forwards), measured by `oracle` (its
    float64 copy), for a model of `depth`. `applies`: the batch is split and nothing else decided the forwards yet
    (BatchNorm without --sync-bn runs the ranks' forwards; with it, one forward stands for the ranks')."""

    def __init__(self, oracle: Oracle, forwards: Forwards, *, depth: int, applies: bool, verdict: Verdict) -> None:
        self.oracle, self.forwards, self.layout = oracle, forwards, forwards.layout
        self.depth, self.applies, self.verdict = depth, applies, verdict
        self.finding: SplitFinding | None = None
        self.unmeasured = False
        """The ranks' masks cannot be joined into one forward (not batch-first): no global batch to hold the split
        to."""
        self.baseline: float | None = None
        """The run-precision reference's distance from the float64 oracle where the split was found global."""
        self._shards: tuple[int, Grads] | None = None
        self._pair: tuple[int, Grads, frozenset[str]] | None = None
        """The shards `measure_pair` measured, where the pair was every rank (two ranks): the step's split itself."""
        """The step and the split's float64 gradient the last measurement computed, where the ranks computed it
        (divided) and it was within SPLIT_AGREEMENT of the global batch's (`shards`)."""

    def settle(self, step: int, state: dict, batch, records, masks: list[Masks] | None, pieces: list[Piece],
               oracle: Grads) -> tuple[list[Piece], Grads]:
        """At the first checked step: the finding (`measure`), the forwards switched to what it says, and the step's
        pieces and float64 oracle as they then are (recomputed where they changed; the oracle's `none` with them)."""
        if not self.applies or self.finding is not None or self.unmeasured:
            return pieces, oracle
        return self._decide(step, state, batch, records, masks, pieces, oracle)

    def reconsider(self, step: int, state: dict, batch, records, masks: list[Masks] | None, pieces: list[Piece],
                   oracle: Grads, floor: Grads) -> tuple[list[Piece], Grads] | None:
        """At every checked step after the first, while the split was found to compute the global batch: where the
        run-precision reference (`floor`, the ranks' split) has moved from the float64 oracle (`oracle`, the global
        batch, from `pieces`) by more than the tolerance factor times what it was at the first checked step (its
        precision), the split is measured again at this step. The step's pieces and oracle where the forwards changed
        (the step is judged on them), else None. Costs nothing more where nothing moved."""
        f = self.finding
        if not self.applies or f is None or f.semantics != "global" or len(pieces) != 1:
            return None
        names = self.oracle.names
        moved = rel_fro_of(floor, oracle, names)
        if f.step == step or self.baseline is None:
            self.baseline = max(moved, self.depth * UNIT_ROUNDOFF["float64"])
            return None
        if moved <= TOLERANCE_FACTOR * self.baseline:
            return None
        now = self._decide(step, state, batch, records, masks, pieces, oracle)
        return now if self.finding.semantics != "global" else None

    def agrees(self, whole_loss: float, split_loss: float) -> bool:
        """Whether the ranks' shards still compute the global batch's loss (`whole_loss`, one float64 forward of the
        global batch or of two ranks' forwards joined, dpcompare.verify.instruments.run_instruments's `joined_pair`; `split_loss`, the same
        samples' float64 losses as the shards computed them, weighted and added): within the agreement the first
        measurement asked of the gradients, relative to the loss."""
        f = self.finding
        allowed = max(f.agreement if f is not None else SPLIT_AGREEMENT, SPLIT_AGREEMENT)
        return abs(whole_loss - split_loss) <= allowed * max(abs(whole_loss), abs(split_loss), 1e-300)

    def recheck(self, step: int, state: dict, batch, records, masks: list[Masks] | None, pieces: list[Piece],
                oracle: Grads) -> tuple[list[Piece], Grads] | None:
        """The split measured again at this step against the global batch's float64 gradient (`oracle`, from
        `pieces`): the step's pieces and oracle where the forwards changed, else None (as `reconsider`)."""
        now = self._decide(step, state, batch, records, masks, pieces, oracle)
        return now if self.finding.semantics != "global" else None

    def _decide(self, step: int, state: dict, batch, records, masks: list[Masks] | None, pieces: list[Piece],
                oracle: Grads) -> tuple[list[Piece], Grads]:
        try:
            whole = self.forwards.whole(batch, masks)
        except mk.MaskMismatch:
            self.unmeasured = True
            self._normalisation_alone(step, state, batch, masks)
            return pieces, oracle
        split = replica_pieces(batch, self.layout, masks)
        finding = self.measure(step, state, split, whole, oracle, known_is_whole=len(pieces) == 1, batch=batch,
                               masks=masks)
        self.forwards.per_replica = finding.semantics == "per_replica"
        self.forwards.joined = finding.semantics == "loss_not_mean"
        now = self.forwards.pieces(batch, records)
        if len(now) != len(pieces):
            oracle = self.oracle.oracle_of(state, now)
        return now, oracle

    def _normalisation_alone(self, step: int, state: dict, batch, masks: list[Masks] | None) -> None:
        """Where the ranks' draws cannot be joined into the global batch's forward (not batch-first), the global batch
        is not measured; but the loss's normalisation still is, on the ranks' own forwards: weighted by their share of
        the samples (what each rank's own count computes) against their share of the step's items (what the step's
        count computes). Recorded as a per-replica finding without a distance from the global batch."""
        split = replica_pieces(batch, self.layout, masks)
        counted = counts_of(self.oracle, self.layout, state, split)
        if counted is None or in_proportion(split, counted[0]):
            return
        counts, how = counted
        none = self.oracle.none
        own = self.oracle.oracle_of(state, split)
        total = sum(counts)
        by_items = self.oracle.oracle_of(state, [dataclasses.replace(p, weight=c / total)
                                                 for p, c in zip(split, counts) if c > 0])
        self.oracle.none = none
        distance = rel_fro_of(own, by_items, self.oracle.names)
        if distance <= SPLIT_AGREEMENT:  # weighted by the step's items already (--loss-normalisation global): no split
            return
        evidence = {"normalisation": {
            "items_per_rank": [sum(c for p, c in zip(split, counts) if p.rank == r) for r in range(self.layout.world_size)],
            "items_per_forward": counts, "counted": how, "weighted_by_items_distance_rel_fro": distance,
            "global_batch": "not measured: the ranks' draws cannot be joined into one forward (not batch-first)"}}
        self.finding = SplitFinding("per_replica", step, math.nan, None, SPLIT_AGREEMENT,
                                    forwards=self.layout.world_size * self.layout.grad_accum * self.layout.replicas,
                                    cause={"name": "normalisation", "evidence": evidence})
        self.verdict.split = self.finding.to_dict()

    def measure_pair(self, step: int, state: dict, joined: list[Piece], split: list[Piece], ranks: list[int]) -> bool:
        """At the first checked step, where two ranks or more share the oracle: the split measured on two ranks'
        forwards (`split`, the shards of `ranks`) against the same samples joined into one forward (`joined`), a
        float64 forward and backward of two ranks' samples on rank 0 where the global batch's would be N ranks'.
        Records a `global` finding and returns True where they agree within SPLIT_AGREEMENT; else records nothing
        and returns False (the global batch then measures it, as `measure` does, for every other finding and its
        note). The oracle's `none` is left as it was."""
        none = self.oracle.none
        # the shards first (held in ranges by their owners), then the joined forward's gradient, each parameter's
        # compared with the shards' as backward completes it (dpcompare.verify.memory.streamed_distance): never held whole on rank 0
        shards = self.oracle.oracle_of(state, split)
        shards_none = self.oracle.none
        distance = distance_of(self.oracle, state, joined, shards)
        self.oracle.none = none
        if not distance <= SPLIT_AGREEMENT:
            return False
        if len(set(ranks)) == self.layout.world_size:  # two ranks: the pair's shards are every rank's forwards
            self._pair = (step, shards, shards_none)
        del shards
        self.finding = SplitFinding("global", step, distance, None, SPLIT_AGREEMENT, ranks=list(ranks),
                                    forwards=self.layout.world_size * self.layout.grad_accum * self.layout.replicas)
        self.verdict.split = self.finding.to_dict()
        return True

    def pair_shards(self, step: int) -> tuple[Grads, frozenset[str]] | None:
        """Where `measure_pair` at `step` found the split `global` on a pair that is every rank (two ranks): the
        shards' float64 gradient and the names it left None, computed from the very pieces of every rank's forwards
        (the same gradient their own computation gives, to the bit), so the step's oracle need not compute them again.
        Given once, then let go."""
        out, self._pair = self._pair, None
        return (out[1], out[2]) if out is not None and out[0] == step else None

    def shards(self, step: int) -> Grads | None:
        """The split's float64 gradient the measurement at `step` computed on the ranks (held in ranges by its owners),
        where it found the split within SPLIT_AGREEMENT of the global batch: what the step's oracle can be instead of
        the global batch's (held whole on rank 0), as at every later step. Given once, then let go (one of another
        step is let go, never given)."""
        out, self._shards = self._shards, None
        return out[1] if out is not None and out[0] == step else None

    def measure(self, step: int, state: dict, split: list[Piece], whole: list[Piece], known: Grads,
                known_is_whole: bool, batch=None, masks: list[Masks] | None = None) -> SplitFinding:
        """The finding at `step` from the run's `state`: `split`, the ranks' forwards; `whole`, the global batch in one
        forward (the ranks' masks joined); `known`, the float64 gradient of one of the two (`known_is_whole`), already
        computed. Records it (`finding`), with the cause its test found where the split moves the gradient (`batch`,
        the step's global batch, and `masks`, each forward's draws, given); the oracle's `none` is left as it was."""
        none = self.oracle.none
        names = self.oracle.names
        # Every figure reduced parameter by parameter: the two gradients are never concatenated, and the one computed
        # here is let go before the reordered one is.
        other = self.oracle.oracle_of(state, split if known_is_whole else whole)
        s, w = (other, known) if known_is_whole else (known, other)
        distance = rel_fro_of(s, w, names)
        ww = sum(_dot(w[n], w[n]) for n in names)
        scale = sum(_dot(s[n], w[n]) for n in names) / ww if ww > 0 else math.nan
        # how far from a multiple of the global batch's gradient (a loss that is not a mean)
        multiple = rel_fro_of(s, _Scaled(w, scale), names) if math.isfinite(scale) else math.inf
        divided = getattr(other, "divided_by", None) is not None
        self._shards = (step, other) if known_is_whole and divided and distance <= SPLIT_AGREEMENT else None
        del s, other
        # The reordering only widens the agreement: where the split is within the least one already, it is not run
        # (a float64 forward and backward of the global batch on rank 0 alone, while the other ranks wait).
        reordered = in_ranks_order(whole[0], self.layout) if distance > SPLIT_AGREEMENT else None
        rounding = rel_fro_of(self.oracle.oracle_of(state, [reordered]), w, names) if reordered is not None else None
        self.oracle.none = none
        # Float32 inside the model rounds its float64 gradient by up to about depth x float32's unit roundoff; a
        # reordering that moves it further is no rounding (the samples interact through their order).
        credited = rounding if rounding is not None and rounding <= self.depth * UNIT_ROUNDOFF["float32"] else 0.0
        finding = SplitFinding("global", step, distance, rounding, max(SPLIT_AGREEMENT, TOLERANCE_FACTOR * credited),
                               forwards=self.layout.world_size * self.layout.grad_accum * self.layout.replicas)
        if distance > finding.agreement:
            if math.isfinite(scale) and abs(scale - 1.0) > finding.agreement and multiple <= finding.agreement:
                finding.semantics, finding.scale = "loss_not_mean", scale
            else:
                finding.semantics = "per_replica"
                if batch is not None:
                    finding.cause = find_cause(self.oracle, self.layout, state, batch, w, finding.agreement,
                                               masks).to_dict()
                    self.oracle.none = none
        self.finding = finding
        self.verdict.split = finding.to_dict()
        return finding

    def note(self, floor_rel: float) -> None:
        """The finding's note, once the step's precision floor (`floor_rel`, relative) is known."""
        f = self.finding
        if f is None or f.semantics == "global" or any(n.code.startswith("split_") for n in self.verdict.notes):
            return
        rounding = ("" if f.rounding_rel_fro is None else
                    f"; the global batch reordered moves it {f.rounding_rel_fro:.3g}, the rounding of what the model "
                    "computes below float64")
        if f.semantics == "loss_not_mean":
            self.verdict.note("split_not_global",
                              f"the loss is not a mean over its samples: in float64 the ranks' split of the batch "
                              f"computes {f.scale:.6g}x the global batch's gradient at step {f.step} (a loss reduced "
                              f"with sum gives 1/{f.forwards}"
                              f"){rounding}; the oracle and the run-precision reference are the global batch, so the "
                              "run is judged against what a single process computes; reduce the loss with mean")
            return
        f.floors = f.distance_rel_fro / floor_rel if floor_rel > 0 else None
        if f.floors is not None and f.floors < 1.0:
            # below what the run's own precision rounds: no split a check could see, and no note
            f.cause = {"name": "rounding", "evidence": {"floors": f.floors, **((f.cause or {}).get("evidence") or {})}}
            self.verdict.split = f.to_dict()
            return
        self.verdict.split = f.to_dict()
        ws, k, r = self.layout.world_size, self.layout.grad_accum, self.layout.replicas
        split = " x ".join([f"{ws} rank(s)"] + ([f"{k} micro-batches"] if k > 1 else []) +
                           ([f"{r} device replicas"] if r > 1 else []))
        floors = f", {f.floors:.3g}x the noise floor" if f.floors is not None else ""
        away = (f"at step {f.step} the global batch's gradient is {f.distance_rel_fro:.3g} away (relative, in float64)"
                f"{floors}{rounding}")
        cause = f.cause or {}
        name, evidence = cause.get("name"), cause.get("evidence") or {}
        if name == "normalisation" and not math.isfinite(f.distance_rel_fro):
            counts = evidence["normalisation"]
            self.verdict.note("split_normalisation",
                              f"the loss is normalised per rank{' and per micro-batch' if k > 1 else ''} (items per "
                              f"rank at step {f.step}: {', '.join(map(str, counts['items_per_rank']))}): each of the "
                              f"{split} divides its loss by its own count, and the oracle and the reference compute "
                              f"exactly that; weighted by their share of the step's items instead, the same forwards' "
                              f"gradient is {counts['weighted_by_items_distance_rel_fro']:.3g} away (relative, in "
                              "float64): what --loss-normalisation global changes (the global batch itself is not "
                              "measured: the ranks' random draws cannot be joined into one forward)")
            return
        if name == "normalisation":
            counts = evidence["normalisation"]
            self.verdict.note("split_normalisation",
                              f"the loss is normalised per rank{' and per micro-batch' if k > 1 else ''} (items per "
                              f"rank at step {f.step}: {', '.join(map(str, counts['items_per_rank']))}): each of the "
                              f"{split} divides its loss by its own count, and the oracle and the reference compute "
                              f"exactly that; {away}; weighted by their share of the step's items, the same forwards "
                              f"are {counts['reweighted_distance_rel_fro']:.3g} from it, so the normalisation is the "
                              "cause: --loss-normalisation global divides every forward by the step's count, summed "
                              "over the ranks and micro-batches (transformers' num_items_in_batch)")
            return
        self.verdict.note("split_dependent_forward",
                          f"{_CAUSES.get(name, _NO_CAUSE)(evidence)}: each of the {split} computes its own forwards, "
                          f"and the oracle and the reference compute exactly those; {away}")


def _statistic(evidence: dict) -> str:
    stat = evidence["statistic"]
    also = (", and the loss is normalised per rank too: the forwards weighted by their share of the step's items"
            if (evidence.get("normalisation") or {}).get("tested", True) and "normalisation" in evidence else "")
    return (f"each forward computes a statistic of its own samples ({stat['taken_out']}{also} brings the split to "
            f"{stat['distance_rel_fro']:.3g} from the global batch): the ranks normalise or balance over their own "
            "samples (--sync-bn synchronises BatchNorm; a router's load-balancing loss is each rank's own)")


def _interact(evidence: dict) -> str:
    rows = evidence["samples"]["rows_distance_rel"]
    return (f"the samples interact in the loss: the model computes each sample's output alone (a rank's outputs are "
            f"the global forward's rows within {rows:.3g}), so the loss couples the samples of a forward (in-batch "
            "negatives, a loss over the batch), and each rank's couples only its own")


def _control_flow(evidence: dict) -> str:
    samples = evidence["samples"]
    read, moved, n = samples.get("own_read"), samples.get("kept_rows_moved_rel"), samples.get("replacements")
    if read:
        where = f"the model's own code reads a tensor's value into Python ({read}): it branches on the local batch's content"
    elif samples.get("branch") == "size":
        where = (f"a sample's output depends on the batch it is in, but in {n} batches of the same size holding other "
                 f"samples it moved {moved:.3g}: the forward branches on the local batch's size")
    elif samples.get("branch") == "content":
        where = (f"the other samples' values move a sample's output ({moved:.3g}) with no gradient through them "
                 f"({samples.get('cross_sample_gradient_rel', 0.0):.3g}): the forward branches on the local batch's "
                 "content in tensor ops (capacity routing, a top-k)")
    else:
        where = "a sample's output depends on the batch it is in"
    return f"control flow on the local batch: {where}"


def _model_interaction(evidence: dict) -> str:
    samples = evidence["samples"]
    cross = samples.get("cross_sample_gradient_rel")
    through = f", and its gradient reaches the other samples' inputs ({cross:.3g})" if cross is not None else ""
    return (f"the model mixes the samples of a forward: a sample's output moves {samples['kept_rows_moved_rel']:.3g} "
            f"(relative) when the other samples of its forward are replaced{through} (attention, pooling or "
            "statistics across the batch)")


def _no_cause(evidence: dict) -> str:
    tried = ", ".join(k for k in evidence) or "none"
    return (f"the forward depends on how the batch is split, and no tested cause holds (tested: {tried}; their figures "
            "are in the result's split.cause)")


_CAUSES: dict[str | None, Callable[[dict], str]] = {"statistic": _statistic, "samples_interact": _interact,
                                                    "control_flow": _control_flow,
                                                    "model_interaction": _model_interaction}
_NO_CAUSE = _no_cause


def _dot(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.dot(a.reshape(-1).double(), b.reshape(-1).double()))


class _Scaled(Mapping[str, torch.Tensor]):
    """`grads` times `scale`, each parameter computed as it is read."""

    def __init__(self, grads: Grads, scale: float) -> None:
        self._grads, self._scale = grads, scale

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._grads[name] * self._scale

    def __iter__(self):
        return iter(self._grads)

    def __len__(self) -> int:
        return len(self._grads)
