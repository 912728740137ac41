"""Module buffers: do the ranks agree, and which data-parallel semantics does each buffer follow?

Owns: the buffer check of a checked step. Every rank snapshots its buffers (every registered buffer, float,
integer or bool) before its forward and after its backward; rank 0 predicts, with forwards of the float64
oracle's model from those snapshots, what each buffer would be under each semantics a backend can give it:

  global_batch      the global batch's statistics, one forward per micro-batch across ranks (a single
                    process, synchronised BatchNorm)
  rank0_broadcast   rank 0's buffers broadcast at the step's first forward, then each rank's own shard
                    (DDP with broadcast_buffers, its default, which broadcasts before any forward that
                    follows a synchronised one: the history is rank 0's shards)
  own_shard         each rank's own buffers and shard, never synchronised after the start (Horovod,
                    DeepSpeed; nn.DataParallel keeps replica 0's)

A buffer matches a semantics when every rank's value is within tolerance of it (integer and bool buffers:
exactly). Buffers that differ across ranks are a semantic difference of the backend (evaluation and
checkpoints then differ by rank), stated, never a failure. A buffer that matches no semantics fails the
verdict only when the prediction is reproducible (a second float64 prediction gives the same value: the
buffer is a function of the forward, not the model's own clock or random source) -- then the backend did
it: an extra training-mode forward, an update skipped, a buffer overwritten. Checking never touches the
run's buffers: the snapshots are copies, the predictions run on the oracle's own models. Imports no adapter.

Tolerance (float buffers): rel_fro(value, prediction) <= factor * (max(floor, depth * u) + world_size * u),
floor = how far a run-dtype prediction lands from the float64 one (rank 0's own shard), as for gradients.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from dpcompare.contract import batches
from dpcompare.verify.oracle.module_boundaries import module_boundaries
from dpcompare.verify.oracle.gradient_oracle import TOLERANCE_FACTOR, UNIT_ROUNDOFF, Divergence, Layout, Masks, Oracle, Piece
from dpcompare.verify.oracle.model_dtypes import as_input, is_float, state_distance
from dpcompare.verify.judgement.held_values import release
from dpcompare.verify.randomness.draw_recording import MaskReplayer, combine

SEMANTICS = {
    "global_batch": "the global batch's statistics",
    "rank0_broadcast": "rank 0's buffers broadcast at the forward, then each rank's own shard",
    "own_shard": "each rank's own buffers and shard",
}
REPRODUCIBLE = 1e-12
"""Two float64 predictions of a buffer that is a function of the forward agree to rounding (bitwise on one
device); a buffer fed by a clock or a random source other than the captured masks does not."""

Buffers = dict[str, torch.Tensor]


def snapshot(module: nn.Module) -> Buffers:
    """Copies of every registered buffer, on the CPU (the run's own buffers are never handed out)."""
    return {name: b.detach().to("cpu", copy=True) for name, b in module.named_buffers()}


@dataclass(slots=True)
class _Entry:
    name: str
    dtype: str
    steps: list[int] = field(default_factory=list)
    ranks_agree: bool = True
    max_rel_diff_between_ranks: float = 0.0
    updated: bool = False
    semantics: list[str] | None = None
    """Matched at every checked step (None until the first check)."""
    nearest: list[str] | None = None
    """Of those, the closest at every checked step (several when their predictions coincide): where rounding
    lets more than one semantics pass, this is the one the buffer follows."""
    unexplained: dict | None = None
    """The first step where no semantics matched: the distances to each, and whether the prediction was
    reproducible (then it failed the verdict)."""
    from_samples: bool | None = None
    """Whether the forward's update of it reads the samples (BatchNorm's statistics: True) or the model's state
    alone (spectral_norm's power iteration, a count of forwards: False), as rank 0's buffers updated by each rank's
    shard and by the global batch show; None until a checked step with two ranks or more updated it."""

    def to_dict(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "steps": self.steps, "ranks_agree": self.ranks_agree,
                "max_rel_diff_between_ranks": self.max_rel_diff_between_ranks, "updated_by_forward": self.updated,
                "semantics": self.semantics or [], "nearest": self.nearest or [], "tried": list(SEMANTICS), "unexplained": self.unexplained,
                "from_samples": self.from_samples}


class BufferCheck:
    def __init__(self, oracle: Oracle, depth: int, dtype: str) -> None:
        self.oracle, self.depth = oracle, depth
        self.u = UNIT_ROUNDOFF[dtype]
        self._entries: dict[str, _Entry] = {}
        self.noted = False
        self._differing: list[str] = []
        self.step = -1
        self.unwritten: list[int] = []
        """The checked steps at which no rank's buffers moved and the training forward wrote none: the first where
        rank 0's float64 forward showed it, then those that took it from there without running that forward again
        (a forward that wrote no buffer is taken to write none while no rank's buffers move; a rank's that moves, or
        a forward that draws random numbers, runs every prediction again)."""

    def entries(self) -> list[dict]:
        return [e.to_dict() for e in self._entries.values()]

    # -- predictions -----------------------------------------------------------------------------------------
    def _run(self, model: nn.Module, replayer: MaskReplayer, state: dict, start: Buffers, pieces: list[Piece],
             times: int = 1) -> Buffers:
        """The buffers after the training-mode forwards of `pieces` (each `times` times) from `start`."""
        model.load_state_dict(state)
        with torch.no_grad():
            for name, b in model.named_buffers():
                if name in start:
                    b.copy_(start[name].to(b.device, b.dtype) if is_float(b) else start[name].to(b.device))
            model.train()
            for piece in pieces:
                for _ in range(times):
                    x = as_input(piece.x, model, self.oracle.device)
                    # the run-dtype prediction computes as the run does: under its autocast, if it has one
                    run = model is self.oracle.model_run
                    recipe = self.oracle.recipe.autocast() if run else contextlib.nullcontext()
                    gathered = self.oracle.recipe.gathering(model) if run else contextlib.nullcontext()
                    bounded = module_boundaries(model, run and self.oracle.recipe.module_boundaries)
                    with replayer.applying(piece.masks) if piece.masks else contextlib.nullcontext(), recipe, gathered, \
                            bounded:
                        batches.call(model, x)
            after = snapshot(model)
        if model is self.oracle.model64 or model is self.oracle.model_run:
            release(model)  # loaded again before its next use
        return after

    def _f64(self, state: dict, start: Buffers, pieces: list[Piece], times: int = 1) -> Buffers:
        return self._run(self.oracle.model64, self.oracle.replay64, state, start, pieces, times)

    # -- the check -------------------------------------------------------------------------------------------
    def check(self, step: int, state: dict, batch, layout: Layout, evidence: list[dict],
              masks: list[Masks] | None) -> Divergence | None:
        """`evidence[r]`: rank r's {"before": Buffers, "after": Buffers}. Returns the failure to record, if any."""
        before = [e["before"] for e in evidence]
        after = [e["after"] for e in evidence]
        if not after[0]:
            return None
        self.step = step
        x, y = batch
        positions = layout.positions(batches.rows(x))
        k, ws = layout.grad_accum, layout.world_size

        def pieces_of(rank: int, micros: range) -> list[Piece]:
            return [Piece(batches.take(x, idx), batches.take(y, idx), 1.0, masks[i] if masks else None)
                    for i, (r, j, d, idx) in enumerate(positions) if r == rank and j in micros and d == 0]

        predicted, own, again, run_dtype = self._predictions(state, before, after, x, y, positions, masks, k, ws,
                                                             pieces_of)
        failure = None
        differing = []
        for name, mine in after[0].items():
            entry = self._entries.setdefault(name, _Entry(name, str(mine.dtype).replace("torch.", "")))
            entry.steps.append(step)
            if not all(name in a for a in after):
                continue
            between = max((state_distance(a[name], mine) for a in after[1:]), default=0.0)
            entry.max_rel_diff_between_ranks = max(entry.max_rel_diff_between_ranks, between)
            if between > 0.0:
                entry.ranks_agree = False
                differing.append(name)
            entry.updated = entry.updated or state_distance(own[0][name], before[0][name]) > 0.0
            if state_distance(again[name], own[0][name]) > (REPRODUCIBLE if is_float(mine) else 0.0):
                # Not a function of the forward (a clock, a random source of its own): no semantics can be judged.
                entry.semantics, entry.nearest = [], []
                if entry.unexplained is None:
                    entry.unexplained = {"step": step, "distances": None, "tolerance": None, "reproducible": False}
                continue
            if entry.updated and ws > 1:
                entry.from_samples = bool(entry.from_samples) or _of_the_samples(name, predicted)
            floor = state_distance(run_dtype[name], own[0][name]) if is_float(mine) else 0.0
            tol = TOLERANCE_FACTOR * (max(floor, self.depth * self.u) + ws * self.u) if is_float(mine) else 0.0
            matched, distances = [], {}
            for semantics, per_rank in predicted.items():
                if per_rank[0] is None:
                    distances[semantics] = None
                    continue
                worst = max(state_distance(after[r][name], per_rank[r][name]) for r in range(ws))
                distances[semantics] = worst
                if worst <= tol:
                    matched.append(semantics)
            matched = [s for s in SEMANTICS if s in matched]
            entry.semantics = matched if entry.semantics is None else [s for s in entry.semantics if s in matched]
            best = min((distances[s] for s in matched), default=None)
            closest = [s for s in matched if distances[s] <= best] if best is not None else []
            entry.nearest = closest if entry.nearest is None else [s for s in entry.nearest if s in closest]
            if matched or entry.unexplained is not None:
                continue
            entry.unexplained = {"step": step, "distances": distances, "tolerance": tol, "reproducible": True}
            if failure is None:
                failure = self._failure(step, name, distances, tol, floor, state, before, after, pieces_of, k)
        if differing:
            self.noted = True
            self._differing = list(dict.fromkeys([*self._differing, *differing]))
        return failure

    def _predictions(self, state: dict, before: list[Buffers], after: list[Buffers], x, y, positions,
                     masks: list[Masks] | None, k: int, ws: int, pieces_of):
        """Every semantics' prediction of every rank's buffers (`predicted`), each rank's own (`own`), rank 0's again
        (`again`: whether the forward is a function of its inputs) and in the run dtype (`run_dtype`: the floor)."""
        predicted: dict[str, list[Buffers | None]] = {}
        quiet = masks is None and all(_unmoved(a, b) for a, b in zip(after, before))
        if quiet and self.unwritten:
            self.unwritten.append(self.step)  # the forward wrote none before, and no rank's moved: not run again
            first = before[0]
        else:
            first = self._f64(state, before[0], pieces_of(0, range(k)))
        if quiet and _unmoved(first, before[0]):
            if not self.unwritten:
                self.unwritten.append(self.step)
            # The training forward writes no buffer (rank 0's float64 forward leaves every one as it was) and no rank's
            # moved: every semantics predicts each rank's buffers as they were before (rank 0's where they are
            # broadcast), with no forward more (a model's constant buffers, rotary frequencies, cost nothing).
            own = list(before)
            predicted["own_shard"] = own
            predicted["rank0_broadcast"] = [before[0]] * ws
            predicted["global_batch"] = [before[0]] * ws
            again = run_dtype = first
        else:
            own = [first] + [self._f64(state, before[r], pieces_of(r, range(k))) for r in range(1, ws)]
            predicted["own_shard"] = own
            # DDP broadcasts before a forward that follows a synchronised one: the step's first micro-batch.
            predicted["rank0_broadcast"] = [self._f64(state, before[0], pieces_of(r, range(k))) for r in range(ws)]
            whole = self._global(state, before[0], x, y, positions, masks, k)
            predicted["global_batch"] = [whole] * ws if whole is not None else [None] * ws

            again = self._f64(state, before[0], pieces_of(0, range(k)))
            run_dtype = self._run(self.oracle.model_run, self.oracle.replay_run, state, before[0],
                                  pieces_of(0, range(k)))
        return predicted, own, again, run_dtype

    def _global(self, state: dict, start: Buffers, x, y, positions, masks: list[Masks] | None, k: int) -> Buffers | None:
        """The buffers a single process (or synchronised BatchNorm) leaves: one forward per micro-batch, each
        across all ranks; None when the captured masks cannot be joined into one forward."""
        pieces = []
        for j in range(k):
            chosen = [(i, idx) for i, (_, micro, _, idx) in enumerate(positions) if micro == j]
            joined = torch.cat([idx for _, idx in chosen]).sort().values
            joined_masks = None
            if masks:
                local = [torch.searchsorted(joined, idx) for _, idx in chosen]
                try:
                    joined_masks = combine([masks[i] for i, _ in chosen], local, len(joined))
                except RuntimeError:
                    return None
            pieces.append(Piece(batches.take(x, joined), batches.take(y, joined), 1.0, joined_masks))
        return self._f64(state, start, pieces)

    def _failure(self, step: int, name: str, distances: dict, tol: float, floor: float, state: dict,
                 before: list[Buffers], after: list[Buffers], pieces_of, k: int) -> Divergence:
        nearest = min((d for d in distances.values() if d is not None), default=math.inf)
        tried = ", ".join(f"{SEMANTICS[s]} ({'not computed' if d is None else f'{d:.2e}'})" for s, d in distances.items())
        rank = next((r for r in range(len(after)) if state_distance(after[r][name], before[r][name]) == 0.0), None)
        twice = [self._f64(state, before[r], pieces_of(r, range(k)), times=2) for r in range(len(after))]
        if all(state_distance(after[r][name], twice[r][name]) <= max(tol, 0.0) for r in range(len(after))):
            cause, why = "buffer_updated_twice", ("every rank updated it twice per forward: an extra training-mode "
                                                  "forward (or a module called twice) in the backend")
        elif rank is not None and state_distance(before[rank][name], self._f64(state, before[rank], pieces_of(rank, range(k)))[name]) > 0:
            cause, why = "buffer_not_updated", (f"rank {rank} left it unchanged where its forward updates it: the forward "
                                                "ran in eval mode, or the backend restored the buffer after it")
        else:
            cause, why = "buffer_semantics", "no semantics a data-parallel backend gives a buffer explains it"
        return Divergence(step, name, nearest, tol, nearest / max(floor, self.depth * self.u),
                          f"module buffer {name} after step {step} matches none of the semantics tried ({tried}; "
                          f"tolerance {tol:.1e}): {why}", check="buffers", cause=cause, parameters=[name])

    def note(self) -> str | None:
        """The `buffers_per_rank` note, once buffers were seen to differ across ranks."""
        if not self.noted:
            return None
        names = self._differing
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        follows = [s for s in SEMANTICS if any(s in (self._entries[n].nearest or []) for n in names)]
        how = (" (" + "; ".join(SEMANTICS[s] for s in follows) + ")") if follows else ""
        return (f"module buffers differ across ranks after the step: {shown}{how}; evaluation and checkpoints taken on "
                "different ranks differ: broadcast rank 0's buffers (or average them) before evaluating or saving, or "
                "use --sync-bn for BatchNorm statistics")

    def weights_note(self) -> str | None:
        """The `buffers_from_weights` note: floating buffers the forward updates from the model's state alone, in
        which every rank agrees (spectral_norm's u and v)."""
        names = [n for n, e in self._entries.items() if e.from_samples is False and e.ranks_agree and e.semantics
                 and e.dtype.startswith(("float", "bfloat"))]
        if not names:
            return None
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        return (f"module buffers the training forward updates from the model's own state, not from its samples (each "
                f"rank's shard and the global batch move them alike): {shown}; each rank updates its own copy at every "
                "forward (a spectral_norm layer runs its power iteration on its replica of the weight), and as every "
                "rank holds the same weights, every rank computes the values one process computes in as many "
                "forwards, with no broadcast")


def _of_the_samples(name: str, predicted: dict[str, list[Buffers | None]]) -> bool:
    """Whether rank 0's buffers updated by each rank's shard and by the global batch (every one of these float64
    predictions starts from rank 0's buffers) part: the update reads the samples, not the model's state alone."""
    values = [p[name] for p in (*predicted["rank0_broadcast"], *predicted["global_batch"]) if p is not None]
    return any(state_distance(v, values[0]) > (REPRODUCIBLE if is_float(v) else 0.0) for v in values[1:])


def _unmoved(now: Buffers, then: Buffers) -> bool:
    """Every buffer of `now` is bitwise what it was in `then`."""
    return all(name in then and state_distance(t, then[name]) == 0.0 for name, t in now.items())
