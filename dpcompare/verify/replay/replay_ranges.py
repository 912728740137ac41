"""The update check divided over the ranks: each parameter's owner replays the optimizer step of its own range.

Owns: `UpdateRequest` (what rank 0 asks every other rank), `judge_range` (one range's figures and the optimizer state
the step leaves it: the same arithmetic on every rank), `divided` (rank 0's side: asks, judges its own range, and gives
back every range's figures and the state left, held by the owners) and `serve` (a helper's side, in the Helper's loop
of dpcompare.verify.memory.divider). Used by dpcompare.verify.checks.update_check where the ranks share the checks. Imports no
adapter.

Each owner already holds its range of the reduced gradient and of the optimizer state the step started from (held in
ranges at the reduce, dpcompare.verify.memory.divider.Divider.hold and hold_state). Rank 0 sends it its range of the step's
parameters and of the values the backend's step reached, as rank 0 read them, and under --clip-grad-norm the clipping
coefficient: the norm of every range's per-tensor norms, stacked in the parameters' order as one process stacks them.
Each owner replays its parameters in float64 and in the run dtype (dpcompare.verify.replay.optimizer_replay.reference_step: SGD
and AdamW step every parameter alone, so a range steps as it would within the whole) and reduces `compare`'s figures
over its range; rank 0 judges them all in the parameters' order (dpcompare.verify.judgement.tolerance.judge_figures): the figures
one process computes. The float64 replay's state after the step, the next checked step's expected state, stays with
its owner; rank 0 holds a RemoteState of it. A diagnosis of a failed update still replays on rank 0, each parameter
read from its owner (`Replayed.delta`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

from dpcompare.contract.optim_state import OptimizerFactory, OptState
from dpcompare.verify.judgement.held_values import Compact, Difference
from dpcompare.verify.ranks.verifier_group import Peers, Remote, RemoteState, of_its_shape
from dpcompare.verify.ranks.range_plan import Plan
from dpcompare.verify.ranks import range_cuts
from dpcompare.verify.judgement.tolerance import range_figures
from dpcompare.verify.replay.optimizer_replay import StepResult, grad_norms, reference_step, scale_of

Meta = dict[str, tuple[tuple[int, ...], torch.dtype]]


@dataclass(frozen=True, slots=True)
class UpdateRequest:
    """Every rank replays its range of the step's update (`divided`)."""

    names: tuple[str, ...]
    """The parameters judged, in the model's order."""
    grads: int
    """The number the reduced gradient is held under by its owners."""
    none: frozenset[str]
    """The parameters replayed with no gradient (a single process gives them none)."""
    leaves_none: frozenset[str] | None
    """Those the state the step leaves is replayed without (the backend's own None): None where they are `none`."""
    state: dict[str, tuple[dict, dict[str, int]]]
    """By parameter, the optimizer state the step started from: its entries rank 0 holds, and the numbers its others
    are held under by its owner (RemoteState.where)."""
    params: int | None
    """The number the step's values are held under by their owners (None: rank 0 sends each owner its range)."""
    dtypes: dict[str, tuple[torch.dtype | None, torch.dtype]]
    """By parameter, the dtypes of the step's values (None: held) and of the values it reached, as rank 0 sends
    them."""
    run_dtype: torch.dtype
    u: float
    """The run dtype's unit roundoff (the figures' relative error floor)."""
    clip: float | None
    """--clip-grad-norm: every rank sends its per-tensor norms, and is sent the coefficients."""
    slot: str = "update"
    drop: tuple[int, ...] = ()
    at: int = 0
    """The step replayed: a scheduled reference's hyper-parameters are that step's (dpcompare.verify.replay.optimizer_rebuild)."""


class Replayed:
    """The divided replay, read as a StepResult is: `state` (the state the step leaves, held by the owners: already
    the backend's own None's, `leaves`) and `delta` (the float64 replay's update, replayed here when read: for a
    diagnosis of a failed update, each parameter read from its owner)."""

    leaves = True

    def __init__(self, state: RemoteState, replay: Callable[[], StepResult]) -> None:
        self.state, self._replay, self._delta = state, replay, None

    @property
    def delta(self) -> Mapping[str, torch.Tensor]:
        if self._delta is None:
            self._delta = self._replay().delta
        return self._delta


def judge_range(factory: OptimizerFactory, device: torch.device, names: list[str], params: Mapping[str, torch.Tensor],
                masters: Mapping[str, torch.Tensor], grads: Mapping[str, torch.Tensor | None], state: OptState,
                state_like: OptState, run_dtype: torch.dtype, u: float, scales: tuple, leaves: Any = None
                ) -> tuple[dict, dict[str, dict]]:
    """Per parameter of `names` (this range), `range_figures` "sums" of the update from `params` to `masters` against
    the float64 replay from `state` with `grads`, its floor the replay in `run_dtype` (dpcompare.verify.checks.update_check's
    `compare`, reduced here); and the float64 replay's state after the step, in the dtypes of `state_like`'s entries
    (with `leaves`, where given: the gradient the backend's own None's leave the state with). `scales`: clipping's
    coefficients (float64, run dtype, `leaves`'s float64; None: not clipped)."""
    ref = reference_step(factory, params, grads, state, torch.float64, device, scale=scales[0], state_like=state_like,
                         keep_state=leaves is None)
    floor = reference_step(factory, params, grads, state, run_dtype, device, scale=scales[1], keep_state=False)
    delta = Difference(masters, params)
    figures = range_figures("sums", (delta, ref.delta, ref.delta, floor.delta, floor.delta), names, u)
    del floor
    after = ref.state if leaves is None else reference_step(factory, params, leaves, state, torch.float64, device,
                                                            scale=scales[2], state_like=state_like).state
    return figures, after


def _norms(grads: Mapping[str, torch.Tensor | None], names: list[str], run_dtype: torch.dtype,
           device: torch.device) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """This range's per-tensor norms of the reduced gradient as held, in float64 and in the run dtype (on the CPU)."""
    n64, nrun = grad_norms(names, grads, torch.float64, device), grad_norms(names, grads, run_dtype, device)
    return {n: (n64[n].cpu(), nrun[n].cpu()) for n in n64}


def _scales(peers: Peers, request: UpdateRequest, own: dict, device: torch.device) -> tuple:
    """Rank 0: clipping's coefficients from every range's norms (in the parameters' order, as one process stacks them),
    sent to every rank; a helper: its norms sent, the coefficients received. (None, None, None) where not clipped."""
    if request.clip is None:
        return None, None, None
    parts = peers.gather(own)
    if peers.rank == 0:
        # a parameter cut over several ranks: the norm of its pieces' norms, in float64 and in the run dtype
        norms = {n: tuple(range_cuts.norm_of([t[i] for t in ts]) for i in range(2))
                 for n, ts in range_cuts.by_parameter(parts).items()}

        def scale(i: int, none: frozenset[str]):
            return scale_of([norms[n][i].to(device) for n in request.names if n in norms and n not in none],
                            request.clip)
        leaves = request.none if request.leaves_none is None else request.leaves_none
        scales = tuple(None if s is None else s.cpu() for s in (scale(0, request.none), scale(1, request.none),
                                                                  scale(0, leaves)))
        return peers.broadcast(scales)
    return peers.broadcast(None)


def _split(after: dict[str, dict], shapes: Mapping[str, torch.Size]) -> tuple[dict[str, dict], dict[str, Meta]]:
    """The state a range's step left, cut into what rank 0 holds (every entry that is not a floating tensor of its
    parameter's shape: a step count) and, by entry key, the (shape, dtype) of those its owner holds."""
    local, meta = {}, {}
    for n, entries in after.items():
        local[n] = {}
        for key, v in entries.items():
            if of_its_shape(v, shapes[n]):
                meta.setdefault(key, {})[n] = (tuple(v.shape), v.dtype)
            else:
                local[n][key] = v
    return local, meta


def divided(divider: Any, factory: OptimizerFactory, device: torch.device, names: list[str], params: Compact | Remote,
            masters: Mapping[str, torch.Tensor], grads: Remote, state: RemoteState, run_dtype: torch.dtype, u: float,
            clip: float | None, leaves: Remote | None, at: int = 0) -> tuple[dict, RemoteState]:
    """Rank 0: every rank replays its range of the update (see the module docstring): the figures of every parameter of
    `names` (`judge_range`'s, in their order) and the state the step leaves (with `leaves`'s None's where given), held
    by the owners. `params`: the step's values, held here (sent to each owner) or by the owners already."""
    plan, peers = divider.owner, divider.peers
    held = params.key if isinstance(params, Remote) and params.divided_by is divider else None
    request = UpdateRequest(tuple(names), grads.key, grads.none, None if leaves is None else leaves.none,
                            {n: state.where(n) for n in names if n in state}, held,
                            {n: (None if held is not None else params.held(n).dtype, masters[n].dtype) for n in names},
                            run_dtype, u, clip, at=at)
    divider.ask(request)
    divider.updates += 1
    for n in names:  # each holder's piece of the step's values and of those it reached, in the names' order
        for piece in plan.holders(n):
            if piece.rank != 0:
                for t in ((params.held(n),) if held is None else ()) + (masters[n],):
                    range_cuts.send_to(plan, n, t, piece.rank, peers.group)
    mine = [n for n in names if plan.holds(n, 0)]
    shapes = {n: plan.shape(n, 0, masters[n].shape) for n in mine}
    # rank 0's own pieces: a parameter cut over several ranks is replayed here on its piece alone
    own_grads = _part(grads, mine)
    own_leaves = None if leaves is None else _part(leaves, mine)
    own_params = Compact({n: params.part(n) if held is not None else plan.take(n, 0, params.held(n)) for n in mine},
                         copy=False)
    own_masters = {n: plan.take(n, 0, masters[n]) for n in mine}
    own_state = {n: state.part(n) for n in mine if n in state}
    part, after = _judged(lambda scales: judge_range(
        factory, device, mine, own_params, own_masters, own_grads, own_state, state.like(), run_dtype, u, scales,
        own_leaves), peers, request, own_grads if leaves is None else own_leaves, mine, device, shapes)
    parts = peers.gather(part)
    failed = next((p for p in parts if isinstance(p, str)), None)
    keys = None if failed is not None else {k: divider.new_key() for k in sorted({k for p in parts for k in p[2]})}
    peers.broadcast(keys)
    if failed is not None:
        raise RuntimeError(f"a rank replaying its range of the update failed: {failed}")
    local, meta = {}, {}
    for p in parts:
        for n, entries in p[1].items():
            local.setdefault(n, entries)  # a step count: the same on each piece
        for k, kept in p[2].items():  # held whole-shaped, as rank 0 reads them
            meta.setdefault(k, {}).update({n: (tuple(masters[n].shape), dtype) for n, (_, dtype) in kept.items()})
    pieces = range_cuts.by_parameter(p[0] for p in parts)  # in rank order: a cut parameter's pieces in their order
    figures = {n: range_cuts.merge_figures("sums", pieces[n]) for n in names if n in pieces}
    remotes = {k: divider.remote(key, Compact({n: after[n][k] for n in mine if n in meta[k]}, copy=False),
                                 [n for n in names if n in meta[k]], meta[k]) for k, key in keys.items()}
    return figures, RemoteState({n: local[n] for n in names if n in local}, remotes, meta)


def _part(remote: Remote, names: list[str]) -> Compact:
    """Rank 0's own part of `names` of `remote` (each held whole or as rank 0's piece), its None's kept."""
    return Compact({n: remote.part(n) for n in names}, copy=False)


def _judged(judge: Callable[[tuple], tuple[dict, dict]], peers: Peers, request: UpdateRequest,
            grads: Mapping[str, torch.Tensor | None], mine: list[str], device: torch.device,
            shapes: Mapping[str, torch.Size]) -> tuple[tuple | str, dict]:
    """This rank's part (its figures, the state left that rank 0 holds, and the meta of the rest; or the error, said by
    rank 0 with every rank in step) and the state its range's step left; the clipping coefficients exchanged first."""
    try:
        own = _norms(grads, mine, request.run_dtype, device) if request.clip is not None else {}
    except Exception as exc:  # noqa: BLE001 - every rank still takes part in the exchange below
        own = {}
        error = f"rank {peers.rank}: {type(exc).__name__}: {exc}"
    else:
        error = None
    scales = _scales(peers, request, own, device)
    if error is not None:
        return error, {}
    try:
        figures, after = judge(scales)
        local, meta = _split(after, shapes)
        return (figures, local, meta), after
    except Exception as exc:  # noqa: BLE001
        return f"rank {peers.rank}: {type(exc).__name__}: {exc}", {}


def serve(request: UpdateRequest, peers: Peers, owner: Plan, held: dict[int, Any],
          shapes: Mapping[str, torch.Size], device: torch.device, factory: OptimizerFactory | None) -> None:
    """A helper: receives its range of the step's values and of those reached, replays it (`judge_range`), sends rank 0
    its figures, and holds the state its range's step left under the numbers rank 0 gives."""
    me = peers.rank
    mine = [n for n in request.names if owner.holds(n, me)]
    shapes = {n: owner.shape(n, me, shapes[n]) for n in mine}  # a cut parameter's: its piece's
    params, masters = {}, {}
    for n in mine:
        for out, dtype in zip((params, masters), request.dtypes[n]):
            if dtype is not None:  # None: the step's values, held here already
                out[n] = torch.empty(shapes[n], dtype=dtype)
                dist.recv(out[n], src=0, group=peers.group)
    if request.params is not None:
        params = {n: held[request.params].held(n) for n in mine}
    grads = held.get(request.grads, Compact({}))
    state = {n: {**local, **{k: held[key].held(n) for k, key in keys.items()}}
             for n, (local, keys) in request.state.items() if owner.holds(n, me)}
    leaves = None if request.leaves_none is None else grads.without(request.leaves_none)

    def judge(scales: tuple) -> tuple[dict, dict]:
        if factory is None:
            raise RuntimeError("this rank was given no optimizer factory to replay its range of the update with")
        at = getattr(factory, "at", None)  # a scheduled reference: the step's hyper-parameters
        return judge_range(at(request.at) if at is not None else factory, device, mine, Compact(params, copy=False), masters, grads.without(request.none),
                           state, state, request.run_dtype, request.u, scales, leaves)
    part, after = _judged(judge, peers, request, grads, mine, device, shapes)
    del params, masters, state
    peers.gather(part)
    keys = peers.broadcast(None)
    for k, key in (keys or {}).items():  # each entry key's range held under its number (the meta `_split` gave)
        held[key] = Compact({n: after[n][k] for n in part[2].get(k, {})}, copy=False)
