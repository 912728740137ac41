"""The oracle's arithmetic divided over the ranks: every rank runs its own forwards of a checked step, and each
parameter's sum is held by the rank that owns it.

Owns: `Divider` (rank 0: asks every rank for its share of a gradient; holds rank 0's range of each sum and reads or
reduces the others where they are held) and `Helper` (every other rank: computes its share with copies of its own,
holds its range of each sum, and serves rank 0's reads and reductions of it). The verifier's own process group and
the parameters' owners are dpcompare.verify.ranks.verifier_group's (`Peers` is importable from here too); the reference
trajectory's ranges are dpcompare.verify.trajectory.trajectory_ranges's, whose steps the Helper serves. Imports no adapter.

A gradient the oracle or the run-precision reference computes is a sum over forwards (the ranks' shards, their
micro-batches: `Piece`s with a `position` in the `Layout`). Where the forwards belong to more than one rank, rank 0
sends every rank the request (which copy: float64 or the run's precision; the state to load, which each rank loads
into its copy a tensor at a time as it arrives, holding none of it beside the copy; the forwards, by position, in the
order rank 0 would run them; the recipe's loss scale and rank count) and every rank runs its own forwards with the
draws its ranks recorded, on its own device, into its copy's gradients, exactly as rank 0 would have run them. Each
parameter's owner then adds the ranks' sums in the order the ranks first appear in the request (the reverse order
for a regrouped floor), in the copy's own dtype, as autograd would have accumulated them on one process: with one
forward per rank the sum is rank 0's old sequential accumulation to the bit. Rank 0 gets a `Remote`: its own range held, the others read from their owners one parameter at a time, or
reduced by them (`per_parameter`: a figure per parameter, computed where the sums are) while they serve; the reduced
gradient as rank 0 read it is held the same way (`hold`). An owner lets its range go once rank 0 has let the sum go.

Trust: the collectives are trusted (gloo's own tests and nccl-tests verify them); what dpcompare judges is how each
backend uses them. The state every rank loads is rank 0's (the values the backend's optimizer holds, as rank 0 read
them), never the rank's own: a backend whose replicas drifted apart is judged on rank 0's values, as before.

What stays on rank 0 alone: a forward of the whole global batch (a model whose split changes its gradient is found
by comparing it with the split; global BatchNorm under --sync-bn; a loss that is not a mean), one rank's local
gradient (a diagnosis), a wire emulated share by share, the compiled twin under --compile, and the module buffers'
predictions.
"""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from dpcompare.contract import batches
from dpcompare.contract.optim_state import OptState
from dpcompare.verify.randomness import draw_recording as mk
from dpcompare.verify.randomness import random_modules
from dpcompare.verify.replay import replay_ranges
from dpcompare.verify.memory.handed_gradients import hand_off
from dpcompare.verify.oracle import weights_on_use
from dpcompare.verify.oracle.gradient_oracle import (Grads, Layout, Piece, accumulate_raw, finish_gradient, loaded,
                                                     verification_copy)
from dpcompare.verify.judgement.held_values import Compact, releasable, release
from dpcompare.verify.randomness.draw_recording import MaskReplayer
from dpcompare.verify.judgement.precision_recipe import NONE as NO_RECIPE
from dpcompare.verify.judgement.precision_recipe import Recipe
from dpcompare.verify.ranks.oracle_messages import Request, Status, receive_into, send_state
from dpcompare.verify.ranks.range_plan import Plan
from dpcompare.verify.replay.optimizer_replay import uncut
from dpcompare.verify.ranks import range_cuts
from dpcompare.verify.judgement.tolerance import range_figures
from dpcompare.verify.ranks.verifier_group import (FLUSH_BYTES, Peers, Remote, RemoteState, StateHolder, of_its_shape, owners,
                                   to_owners)

__all__ = ["Divider", "Helper", "Peers", "Request", "StateHolder", "Status", "uncut"]

class Divider:
    """Rank 0's side: `gradient` divides a sum over forwards of more than one rank among the ranks (see the module
    docstring); `done` ends a point of the step for every helper."""

    def __init__(self, peers: Peers, layout: Layout) -> None:
        self.peers, self.layout = peers, layout
        self.requests = 0
        """Requests divided so far (the verdict says the arithmetic was divided)."""
        self.updates = 0
        """Updates replayed by the ranges' owners so far (dpcompare.verify.replay.replay_ranges)."""
        self.last_loss = 0.0
        """The last request's forwards' losses, weighted as their gradients and added in their order."""
        self.last_losses: dict[int, float] = {}
        """The same, by rank: each rank's own forwards' losses added."""
        self._owner: Plan | None = None
        """Which rank holds which elements of each trainable parameter's sums (dpcompare.verify.ranks.range_plan)."""
        self._shapes: dict[str, torch.Size] = {}
        """Parameter -> its shape (what an owner receives a held value of its range as)."""
        self._key = 0
        self._dropped: list[int] = []
        """The gradients let go on rank 0 (their `Remote`s collected) that the owners still hold."""
        self.serving = False
        """Whether the helpers are serving (between `open` and `done`): a gradient's other ranges can be read."""
        self._hands: dict[str, bool] = {}
        """By copy ("64", "run"): whether its gradients are sent to their owners as backward completes them
        (dpcompare.verify.memory.handed_gradients): until a request finds one completed twice in one backward."""
        self.handed = 0
        """Requests whose gradients were so sent."""
        self.alone = 0
        """Requests whose forwards rank 0 computed alone, their sums held by the owners (`holds`)."""

    def divides(self, pieces: list[Piece]) -> bool:
        """Whether `pieces` are forwards of the layout of more than one rank (a whole-batch forward is not)."""
        return (len({p.rank for p in pieces}) > 1 and all(p.position is not None for p in pieces))

    def holds(self, pieces: list[Piece]) -> bool:
        """Whether a sum over `pieces` is held in ranges by the parameters' owners: forwards the ranks divide, or, while
        the helpers serve, forwards rank 0 computes alone (the global batch in one forward), whose gradient each
        parameter's owner then takes as rank 0's backward completes it, never held whole on rank 0."""
        return bool(pieces) and (self.divides(pieces) or self.serving)

    def gradient(self, slot: str, model: nn.Module, replayer: MaskReplayer | None, state: dict | None,
                 pieces: list[Piece], loss_fn: Callable, device: torch.device, recipe: Recipe = NO_RECIPE,
                 loss_scale: float = 1.0, ranks: int | None = None) -> tuple[Grads, frozenset[str]]:
        """accumulate_gradient's result over `pieces`, each rank running its own at `state` (rank 0's `model` loads it
        here; None: `model` holds it already, and so must the helpers: it is sent from `model`). Each parameter's sum
        is held by the rank that owns it (dpcompare.verify.ranks.verifier_group.owners): what is returned is a `Remote`, rank 0's
        own range held, the rest sent by its owner when read."""
        ranks = (ranks or len({p.rank for p in pieces})) if recipe.active else 1
        # rank 0 computing every forward (`holds`: the global batch in one forward) sends no state: no helper computes
        alone = not self.divides(pieces)
        # Sent with every request: a helper loads it into its copy as it arrives and keeps none of it (its copy's
        # parameters, gradients and the state whole would peak together; a second broadcast costs less than that)
        send = state if state is not None else model.state_dict()
        meta = None if alone else [(k, tuple(t.shape), t.dtype) for k, t in send.items()]
        self._key += 1
        key = self._key
        # each gradient sent to its owners as backward completes it, unless a request showed one completed twice
        hand = self._hands.get(slot, True) and not recipe.active and loss_scale == 1.0
        self.peers.broadcast(self._with_drops(Request(
            slot, meta, () if alone else tuple(p.position for p in pieces),
            () if alone else tuple(p.weight for p in pieces), recipe.active, loss_scale, ranks, key, hand=hand,
            alone=alone)))
        if not alone:
            send_state(self.peers, send)
        self.requests += not alone
        self.alone += alone
        self.handed += hand and not alone
        own = list(pieces) if alone else [p for p in pieces if p.rank == 0]
        order = [0] if alone else list(dict.fromkeys(p.rank for p in pieces))
        if self._owner is None:
            self.own(model)
        status, raw, sums, exchanged = Status(False), None, {}, False
        try:
            with loaded(model, state, not recipe.active) if state is not None else nullcontext():
                if hand:
                    exchanged = True
                    none, loss, twice = hand_off(self.peers, self._owner, model, loss_fn, own, device, replayer,
                                                 order, sums)
                    status = Status(True, none, loss) if own else status
                    if twice:
                        status = Status(False, error=f"rank 0: {twice[0]}'s gradient was completed twice in one "
                                                     "backward, after it was sent to its owner", twice=True)
                elif own:
                    raw, none, _, loss = accumulate_raw(model, loss_fn, own, device, replayer, recipe, loss_scale,
                                                        ranks)
                    status = Status(True, none, loss)
        except mk.MaskMismatch as exc:
            status = Status(False, mismatch=(exc.module, exc.reason))
        finally:
            if hand and not exchanged:  # every rank settles every parameter, whatever happened here
                hand_off(self.peers, self._owner, model, loss_fn, [], device, None, order, sums)
        statuses = self.peers.gather(status)
        failed = next((s for s in statuses if s.mismatch is not None or s.error is not None), None)
        self.peers.broadcast(failed is None)  # the helpers send their shares only where every rank computed its own
        if failed is not None:
            model.zero_grad(set_to_none=True)
            if hand and all(s.twice for s in statuses if s.error is not None) and failed.mismatch is None:
                # a gradient completed twice in one backward (a reentrant recomputation): this copy's are computed
                # whole before they are sent, from now on, starting with this one
                self._hands[slot] = False
                self.handed -= not alone
                return self.gradient(slot, model, replayer, state, pieces, loss_fn, device, recipe, loss_scale, ranks)
            if failed.mismatch is not None:
                raise mk.MaskMismatch(*failed.mismatch)
            raise RuntimeError(f"a rank computing its share of the oracle failed: {failed.error}")
        none = frozenset.intersection(*[s.none for s in statuses if s.computed])
        self.last_loss = 0.0
        for r in order:  # the losses added in the gradients' order
            self.last_loss += statuses[r].loss
        self.last_losses = {r: statuses[r].loss for r in order}
        model.zero_grad(set_to_none=True)  # `raw` holds rank 0's share: freed as it is sent or added into
        undo = 1.0 / (ranks * loss_scale)
        if not hand:
            sums = to_owners(self.peers, self._owner, model, raw if raw is not None else {}, order)
        own = finish_gradient(sums, undo)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        meta = {n: (tuple(p.shape), p.dtype if undo == 1.0 else torch.float64) for n, p in named}
        return self.remote(key, own, [n for n, _ in named], meta), none

    def per_parameter(self, op: str, mappings: tuple, names: list[str], u: float = 0.0) -> dict:
        """dpcompare.verify.judgement.tolerance.range_figures over `names`, each owner reducing its range of the sums it holds
        (`mappings`: this divider's Remotes; under "sums" the first may be rank 0's own, sent to each owner for its
        range) and rank 0 its own: the same figures, computed where the sums are."""
        if not self.serving:
            raise RuntimeError(f"divided sums were reduced ({op}) where the other ranks do not serve rank 0 (outside a "
                               "point of the step): they hold them, and would never answer")
        plan = self.owner
        keys = tuple(m.key if getattr(m, "divided_by", None) is self else None for m in mappings)
        shipped = {i: {n: _as_held(mappings[i], n).dtype for n in names if plan.ranks(n) != (0,)}
                   for i, k in enumerate(keys) if k is None}
        self.peers.broadcast(self._with_drops(Request("reduce", name=op, reduce=(keys, tuple(names), u, shipped))))
        for i in shipped:  # each holder's piece of rank 0's own values, in the names' order
            for n in shipped[i]:
                range_cuts.send(plan, n, _as_held(mappings[i], n), self.peers.group)
        whole = [n for n in names if plan.sole(n) == 0]
        cut = [n for n in names if plan.is_cut(n) and plan.holds(n, 0)]  # rank 0's pieces of them
        parts = [{**range_figures(op, tuple(m if k is None else m.own for m, k in zip(mappings, keys)), whole, u),
                  **range_figures(op, _pieces_of(plan, mappings, keys, cut), cut, u)}]
        for part in self.peers.gather(None)[1:]:
            if isinstance(part, str):
                raise RuntimeError(f"a rank reducing its range of the oracle's sums failed: {part}")
            parts.append(part)
        out = {n: range_cuts.merge_figures(op, fs) for n, fs in range_cuts.by_parameter(parts).items()}
        return {n: out[n] for n in names}

    def hold(self, tensors: Mapping[str, torch.Tensor], none: frozenset[str] = frozenset()) -> Remote:
        """`tensors` (rank 0's own values: the reduced gradient as read) held in ranges by their owners, as the divided
        sums are, each sent once to its owner: a Remote of them, read as Compact reads, with `none` read as None."""
        key, plan = self.new_key(), self.owner
        names = list(tensors)
        meta = {n: (tuple(t.shape), t.dtype) for n, t in tensors.items()}
        away = {n: meta[n][1] for n in names if plan.ranks(n) != (0,)}
        self.ask(Request("hold", key=key, reduce=(tuple(names), away)))
        for n in away:
            range_cuts.send(plan, n, tensors[n], self.peers.group)
        own = Compact({n: plan.take(n, 0, tensors[n]) for n in names if plan.holds(n, 0)})
        return self.remote(key, own, names, meta, none)

    def remote(self, key: int, own: Compact, names: list[str], meta: dict[str, tuple[tuple[int, ...], torch.dtype]],
               none: frozenset[str] = frozenset()) -> Remote:
        """Values of `names` held under number `key` by their owners (rank 0's range: `own`), each of (shape, dtype)
        `meta[name]`: a Remote, read as Compact reads; the owners let theirs go once it is let go. A parameter cut over
        several ranks is held here as rank 0's piece (where it has one) and read whole from every piece."""
        plan = self.owner
        return Remote(own, names, lambda name: self._fetch(key, name, *meta[name], own),
                      lambda: self._dropped.append(key), divided_by=self, key=key, none=none,
                      parts=frozenset(n for n in names if n in plan.sizes and plan.is_cut(n)))

    def ask(self, request: Any) -> None:
        """Every helper serves `request` (a dataclass with a `drop` field: the numbers let go since the last)."""
        self.peers.broadcast(self._with_drops(request))

    def new_key(self) -> int:
        """A number for values the owners are to hold."""
        self._key += 1
        return self._key

    @property
    def planned(self) -> Plan | None:
        """The plan of the parameters' owners, None before `own` ran."""
        return self._owner

    @property
    def owner(self) -> Plan:
        """Which rank holds which elements of each trainable parameter (known once `own` ran)."""
        if self._owner is None:
            raise RuntimeError("the parameters' owners are not known yet (Divider.own)")
        return self._owner

    def state_holder(self, names: list[str]) -> StateHolder:
        """An optimizer state to be held in ranges a parameter at a time, as it is computed
        (dpcompare.verify.ranks.verifier_group.StateHolder), by these owners (`hold`), each entry that is a tensor of its parameter's
        shape of a parameter of `names` (`hold_state`'s)."""
        chosen = set(names) & set(self._owner.sizes if self._owner is not None else ())
        # a sixteenth of one float32 entry of every parameter at most waits (64 MiB on a large model)
        waits = min(FLUSH_BYTES, 4 * sum(self._shapes[n].numel() for n in chosen) // 16)
        return StateHolder(self.hold, lambda n, v: self._ranged(chosen, n, v), chosen, flush_bytes=waits)

    def _ranged(self, chosen: set[str], name: str, value: Any) -> bool:
        """Whether an optimizer state entry of parameter `name` is held in ranges: a floating tensor of the
        parameter's shape (a momentum, a moment) of a parameter in `chosen`."""
        return name in chosen and of_its_shape(value, self._shapes[name])

    def hold_state(self, state: OptState, names: list[str]) -> RemoteState:
        """An optimizer state as rank 0 read it, held in ranges by the parameters' owners (`hold`, one entry key at a
        time): each entry of `names` that is a tensor of its parameter's shape (a momentum, a moment). The others stay
        here (step counts; a factored statistic of another shape); a parameter not in `names` keeps only its entries
        that are not tensors of elements (nothing reads those)."""
        chosen = set(names) & set(self._owner.sizes if self._owner is not None else ())
        ranged = lambda n, v: self._ranged(chosen, n, v)  # noqa: E731
        keys = sorted({k for n, entries in state.items() for k, v in entries.items() if ranged(n, v)})
        remotes, meta = {}, {}
        for key in keys:
            given = {n: entries[key] for n, entries in state.items() if ranged(n, entries.get(key))}
            meta[key] = {n: (tuple(t.shape), t.dtype) for n, t in given.items()}
            remotes[key] = self.hold(given)
        elements = lambda v: torch.is_tensor(v) and v.dim() > 0  # noqa: E731
        local = {n: {k: v for k, v in entries.items() if not (ranged(n, v) if n in chosen else elements(v))}
                 for n, entries in state.items()}
        return RemoteState(local, remotes, meta)

    def own(self, model: nn.Module, factory: Any = None) -> None:
        """The parameters' owners, from `model` (a copy of the template as the other ranks' copies are made), cut
        inside a parameter where the run's optimizer (`factory`; None: SGD, the default) steps element by element."""
        self._owner = owners(model, self.peers.world_size, uncut(model, factory))
        self._shapes = {n: p.shape for n, p in model.named_parameters()}

    def open(self) -> None:
        """The start of a point of the step: the helpers serve rank 0's requests until `done`."""
        self.serving = True

    def _fetch(self, key: int, name: str, shape: tuple[int, ...], dtype: torch.dtype,
               own: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Parameter `name` of gradient `key`, sent by its holders (put together with rank 0's piece in `own`, where
        it is cut and rank 0 holds one)."""
        if not self.serving:
            raise RuntimeError(f"the divided gradient of {name} was read where the other ranks do not serve rank 0 "
                               "(outside a point of the step): they hold it, and would never send it")
        self.peers.broadcast(self._with_drops(Request("fetch", key=key, name=name)))
        mine = _as_held(own, name) if self.owner.holds(name, 0) else None
        return range_cuts.receive_whole(self.owner, name, shape, dtype, mine, self.peers.group)

    def _with_drops(self, request: Request) -> Request:
        drop, self._dropped[:] = tuple(self._dropped), []
        return dataclasses.replace(request, drop=drop) if drop else request

    def let_go(self) -> None:
        """The owners let go now what rank 0 let go since its last request (not with the next: a step of the reference
        trajectory, whose copies are gathered whole, comes before it)."""
        if self._dropped:
            self.peers.broadcast(self._with_drops(Request("drop")))

    def done(self) -> None:
        """The end of a point of the step: every helper stops serving."""
        self.peers.broadcast(self._with_drops(Request(None)))
        self.serving = False


def _pieces_of(plan: Plan, mappings: tuple, keys: tuple, names: list[str]) -> tuple:
    """Rank 0's own part of each of `mappings` for `names` (parameters cut over the ranks): its piece of its own
    values (a mapping given twice, one Compact), the range held of a divided sum (`keys`: not None)."""
    taken: dict[int, Compact] = {}
    for m, k in zip(mappings, keys):
        if k is None and id(m) not in taken:
            taken[id(m)] = Compact({n: plan.take(n, 0, _as_held(m, n)) for n in names}, copy=False)
    return tuple(taken[id(m)] if k is None else m.own for m, k in zip(mappings, keys))


def _as_held(m, name: str) -> torch.Tensor:
    return m.held(name) if isinstance(m, Compact) else m[name]


class Helper:
    """A rank other than 0: serves rank 0's requests at every point of every step with copies of its own (float64,
    and the run's precision: its recipe's weights), computing its own forwards."""

    def __init__(self, peers: Peers, template: nn.Module, loss_fn: Callable, *, layout: Layout, dtype: torch.dtype,
                 device: torch.device, recipe: Recipe, trajectory: Any = None, factory: Any = None) -> None:
        """`trajectory`: this rank's dpcompare.verify.trajectory.reference_trajectory.Trajectory, built alike on every rank, whose range
        of the parameters this rank holds and steps (None: rank 0 asks for none of its steps); `factory`: the run's
        optimizer factory, for the update check of its range (None: rank 0 asks for none)."""
        self.peers, self.layout, self.loss_fn, self.device, self.recipe = peers, layout, loss_fn, device, recipe
        self.trajectory, self.factory = trajectory, factory
        # loaded at every request: they hold their parameters only while they compute
        self.models = {"64": releasable(verification_copy(template, device, torch.float64)),
                       "run": releasable(verification_copy(template, device, recipe.weights_dtype or dtype))}
        self.replayers = {k: MaskReplayer(m) for k, m in self.models.items()}
        self._owner = owners(self.models["64"], peers.world_size, uncut(self.models["64"], factory))
        self._held: dict[int, Grads] = {}
        """This rank's range of each divided gradient rank 0 still holds, by its number."""

    def serve(self, batch: tuple[torch.Tensor, torch.Tensor], masks: Callable[[], list | None]) -> None:
        """Until rank 0 says the point is over: each request's share, of this step's global `batch`, with the draws
        `masks()` unpacks (each forward's, in the layout's order; None: the forward draws nothing)."""
        with random_modules.isolated(self.device):
            while True:
                request = self.peers.broadcast(None)
                for key in getattr(request, "drop", ()):
                    self._held.pop(key, None)
                if request.slot is None:
                    break
                if request.slot == "drop":
                    continue
                if request.slot == "trajectory":
                    self.trajectory.serve(request, lambda r=request: self._own(r, batch, masks()))
                elif request.slot == "fetch":
                    self._send_held(request)
                elif request.slot == "reduce":
                    self._reduce(request)
                elif request.slot == "hold":
                    self._hold(request)
                elif request.slot == "update":
                    replay_ranges.serve(request, self.peers, self._owner, self._held,
                                        {n: p.shape for n, p in self.models["64"].named_parameters()}, self.device,
                                        self.factory)
                else:
                    self._answer(request, batch, masks)

    def _hold(self, request: Request) -> None:
        """Rank 0 holds its values in ranges (Divider.hold): this rank keeps its own range."""
        names, away = request.reduce
        shapes = {n: p.shape for n, p in self.models["64"].named_parameters()}
        got, me = {}, self.peers.rank
        for n in names:
            if n in away and self._owner.holds(n, me):
                t = torch.empty(self._owner.shape(n, me, shapes[n]), dtype=away[n])
                dist.recv(t, src=0, group=self.peers.group)
                got[n] = t
        self._held[request.key] = Compact(got, copy=False)

    def _reduce(self, request: Request) -> None:
        """Rank 0 reduces divided sums (Divider.per_parameter): this rank reduces its own range of them."""
        keys, names, u, shipped = request.reduce
        me = self.peers.rank
        shapes = {n: p.shape for n, p in self.models["64"].named_parameters()}
        received = {}
        for i, dtypes in shipped.items():
            got = {}
            for n in names:
                if n in dtypes and self._owner.holds(n, me):
                    t = torch.empty(self._owner.shape(n, me, shapes[n]), dtype=dtypes[n])
                    dist.recv(t, src=0, group=self.peers.group)
                    got[n] = t
            received[i] = Compact(got, copy=False)
        try:
            mappings = tuple(received[i] if k is None else self._held[k] for i, k in enumerate(keys))
            part: dict | str = range_figures(request.name, mappings, [n for n in names if self._owner.holds(n, me)], u)
        except Exception as exc:  # noqa: BLE001 - said by rank 0, with the ranks in step
            part = f"rank {me}: {type(exc).__name__}: {exc}"
        self.peers.gather(part)

    def _send_held(self, request: Request) -> None:
        """Rank 0 reads parameter `request.name` of gradient `request.key`: its owner sends it."""
        if not self._owner.holds(request.name, self.peers.rank):
            return
        held = self._held[request.key]
        t = held.held(request.name) if isinstance(held, Compact) else held[request.name]
        dist.send(t.detach().to("cpu").contiguous(), dst=0, group=self.peers.group)

    def _own(self, request: Any, batch, drawn: list | None) -> list[Piece]:
        """This rank's forwards among `request`'s positions, with their weights and draws."""
        positions = self.layout.positions(batches.rows(batch[0]))
        return [Piece(batches.take(batch[0], positions[i][3]), batches.take(batch[1], positions[i][3]), w,
                      drawn[i] if drawn else None, self.peers.rank, i)
                for i, w in zip(request.positions, request.weights) if positions[i][0] == self.peers.rank]

    def _answer(self, request: Request, batch, masks: Callable[[], list | None]) -> None:
        model, replayer = self.models[request.slot], self.replayers[request.slot]
        # loaded at every request, as rank 0 reloads its copy (a forward in training mode moves buffers); outside a
        # recipe the copy's parameters are made from the state as its ops use them: the state is held as it was sent
        # (4 bytes a float32 parameter) and the copy holds a module's at a time, where loaded whole a float64 copy holds
        # 8 bytes a parameter beside it (dpcompare.verify.oracle.weights_on_use)
        on_use = not request.recipe and weights_on_use.eligible(model)
        state: dict[str, torch.Tensor] = {}
        # rank 0 computing every forward alone sends no state: this rank computes nothing, and takes its ranges
        missing = [] if request.alone else receive_into(self.peers, request.state, model,
                                                        into=state if on_use else None)
        positions = self.layout.positions(batches.rows(batch[0]))
        order = [0] if request.alone else list(dict.fromkeys(positions[i][0] for i in request.positions))
        status, raw, sums, exchanged = Status(False), None, {}, False
        try:
            if missing:
                raise KeyError(f"the state rank 0 sent has {missing[0]!r}, which this rank's copy does not")
            own = [] if request.alone else self._own(request, batch, masks())
            with loaded(model, state) if on_use and not request.alone else nullcontext():
                if request.hand:
                    exchanged = True
                    none, loss, twice = hand_off(self.peers, self._owner, model, self.loss_fn, own, self.device,
                                                 replayer, order, sums)
                    status = Status(True, none, loss) if own else status
                    if twice:
                        status = Status(False, error=f"rank {self.peers.rank}: {twice[0]}'s gradient was completed "
                                                     "twice in one backward, after it was sent to its owner",
                                        twice=True)
                elif own:
                    raw, none, _, loss = accumulate_raw(model, self.loss_fn, own, self.device, replayer,
                                                        self.recipe if request.recipe else NO_RECIPE,
                                                        request.loss_scale, request.ranks)
                    status = Status(True, none, loss)
            del state
        except mk.MaskMismatch as exc:
            status = Status(False, mismatch=(exc.module, exc.reason))
        except Exception as exc:  # noqa: BLE001 - said by rank 0, in one line, with the others' ranks in step
            status = Status(False, error=f"rank {self.peers.rank}: {type(exc).__name__}: {exc}")
        finally:
            if request.hand and not exchanged:  # every rank settles every parameter, whatever happened here
                hand_off(self.peers, self._owner, model, self.loss_fn, [], self.device, None, order, sums)
        self.peers.gather(status)
        model.zero_grad(set_to_none=True)  # `raw` holds this rank's share: freed as it is sent or added into
        if self.peers.broadcast(None):  # every rank computed its own: the sums go to their owners
            if not request.hand:
                sums = to_owners(self.peers, self._owner, model, raw if raw is not None else {}, order)
            self._held[request.key] = finish_gradient(sums, 1.0 / (request.ranks * request.loss_scale))
        release(model)
