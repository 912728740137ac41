"""The verifier's own process group, and the parameters cut into ranges over it: what each rank holds.

Owns: `Peers` (the verifier's own process group: gloo, CPU tensors, made by the run layer on every rank beside the
backend's, so nothing the checks send passes through the backend's wrapper, buckets or hooks), `owners` (which rank
holds which elements of each trainable parameter: dpcompare.verify.ranks.range_plan's ranges, cut inside a parameter where the
ranks' shares cross it), `to_owners` (the ranks' summed gradients of their own forwards sent to each parameter's
holders, each its piece, who add them in a fixed order), `Remote` (on rank 0, a gradient summed at its holders: rank
0's own range held, every other parameter sent by its holders when read and put together), `RemoteState` (an
optimizer state held so) and `StateHolder` (one held so as it is computed, a parameter at a time). Used by
dpcompare.verify.memory.divider (the oracle's and the references' sums, the update check's optimizer states) and
dpcompare.verify.trajectory.trajectory_ranges (the reference trajectory). Imports no adapter.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch
import torch.distributed as dist
from torch import nn

from dpcompare.verify.ranks.range_plan import Plan, of_model


@dataclass(frozen=True, slots=True)
class Peers:
    """This rank, the world, and the verifier's process group (gloo: CPU tensors)."""

    rank: int
    world_size: int
    group: Any

    @classmethod
    def make(cls) -> "Peers | None":
        """On every rank, at the same point: the verifier's group beside the backend's; None where there is no
        torch.distributed process group (one process; Horovod) or one rank."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return None
        return cls(dist.get_rank(), dist.get_world_size(), dist.new_group(backend="gloo"))

    def broadcast(self, obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def gather(self, obj: Any) -> list[Any] | None:
        out = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.group)
        return out


def of_its_shape(value: Any, shape: torch.Size) -> bool:
    """Whether an optimizer state entry is held in ranges: a floating tensor of its parameter's `shape` (a momentum, a
    moment), not a step count or a statistic of another shape."""
    return torch.is_tensor(value) and value.is_floating_point() and value.dim() > 0 and value.shape == shape


def owners(model: nn.Module, world_size: int, whole: Iterable[str] = ()) -> Plan:
    """Which rank holds which elements of `model`'s trainable parameters (dpcompare.verify.ranks.range_plan: contiguous ranges
    of as many elements each, cut inside a parameter where that balances the ranks; `whole`: never cut)."""
    return of_model(model, world_size, whole)


def to_owners(peers: Peers, owner: Plan, model: nn.Module, raw: dict[str, torch.Tensor],
              order: tuple[int, ...] | list[int]) -> dict[str, torch.Tensor]:
    """Each trainable parameter's sum over the ranks in `order` of their `raw` gradients of `model` (this rank's,
    popped as they are sent or added), at its holders (each its piece: `owner.take`), added in `order` in the copy's
    dtype as autograd accumulates on one process: this rank's own pieces' sums. Every rank calls it at once, with the
    same `owner` and `order` (a rank not in `order` sends nothing and still receives what it holds); each piece is
    settled before the next, so no rank waits on one that waits on it."""
    out: dict[str, torch.Tensor] = {}
    me = peers.rank
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        settle(peers, owner, n, p, raw.pop(n) if me in order else None, order, out)
    return out


def settle(peers: Peers, owner: Plan, n: str, p: torch.Tensor, given: torch.Tensor | None,
           order: tuple[int, ...] | list[int], out: dict[str, torch.Tensor]) -> None:
    """`to_owners` for one parameter `n` (`p`: the copy's, for its shape and dtype): this rank's gradient `given`
    (None where this rank is not in `order`) sent to each piece's holder, or, at a holder, the ranks' pieces received
    and added in `order` into `out[n]`. Every rank settles the same parameters in the same order."""
    me, group = peers.rank, peers.group
    for piece in owner.holders(n):
        mine, acc = piece.rank == me, None
        for r in order:
            if r == me:
                part = owner.take(n, piece.rank, given)
                if not mine:
                    dist.send(part.detach().to("cpu").contiguous(), dst=piece.rank, group=group)
                    continue
                part = part.clone() if part is not given and acc is None else part  # a piece: its own storage
            elif mine:
                part = torch.empty(owner.shape(n, me, p.shape), dtype=p.dtype)
                dist.recv(part, src=r, group=group)
                part = part.to(p.device)
            else:
                continue
            acc = part if acc is None else acc.add_(part)  # in place: the rounding of acc + part
        if mine:
            out[n] = acc


class Remote(Mapping[str, torch.Tensor]):
    """On rank 0, a gradient summed at its parameters' owners (`to_owners`): rank 0's own range held here (`own`),
    every other parameter sent by its owner when read, one at a time, the last kept (`fetch(name)`), read in float64
    on the CPU as a Compact is. `on_drop` is called once this mapping is let go, so that the owners let theirs go."""

    __slots__ = ("_own", "_names", "_known", "_fetch", "_life", "_last", "divided_by", "key", "none", "parts")

    def __init__(self, own: Mapping[str, torch.Tensor], names: list[str], fetch: Callable[[str], torch.Tensor],
                 on_drop: Callable[[], None] | None, *, divided_by: Any = None, key: int = 0,
                 none: frozenset[str] = frozenset(), life: "_Life | None" = None,
                 parts: frozenset[str] = frozenset()) -> None:
        """`divided_by`: what holds the other ranges (its `per_parameter` reduces them where they are held: see
        dpcompare.verify.judgement.tolerance.per_parameter), and this sum's number there (`key`). `none`: the names read as
        None (no gradient). `parts`: the names of which `own` holds rank 0's piece alone (a parameter cut over several
        ranks, dpcompare.verify.ranks.range_plan): read whole, they are put together from their holders. `on_drop` is called once
        this mapping and every view of it (`without`) are let go."""
        self._own, self._names, self._known, self._fetch = own, list(names), frozenset(names), fetch
        self.divided_by, self.key, self.none, self.parts = divided_by, key, frozenset(none), frozenset(parts)
        self._life = life if life is not None else _Life(on_drop)
        self._last: tuple[str, torch.Tensor] | None = None
        """The last parameter sent, kept for a second read of it (the update check's two replays read each in turn)."""

    def without(self, names) -> "Remote":
        """The same values with `names` read as None, sharing (not copying) the rest and its lifetime."""
        return Remote(self._own, self._names, self._fetch, None, divided_by=self.divided_by, key=self.key,
                      none=self.none | frozenset(names), life=self._life, parts=self.parts)

    def key_of(self, name: str) -> int:
        return self.key

    def held(self, name: str) -> torch.Tensor | None:
        """`name` as it is held (its own dtype), for a reader that needs no float64."""
        if name in self.none:
            return None
        own = self._own
        if name in own and name not in self.parts:
            return own.held(name) if hasattr(own, "held") else own[name]
        if name not in self._known:
            raise KeyError(name)
        return self._sent(name)

    def part(self, name: str) -> torch.Tensor | None:
        """Rank 0's own part of `name` as held: the whole value where rank 0 holds it whole, else its piece (None: no
        gradient)."""
        if name in self.none:
            return None
        own = self._own
        return own.held(name) if hasattr(own, "held") else own[name]

    def _sent(self, name: str) -> torch.Tensor:
        """`name` from its owner, or the last one sent again within the same point of the step (outside one, a read
        is refused as `fetch` refuses it: the owners may have let it go)."""
        if not getattr(self.divided_by, "serving", True) or self._last is None or self._last[0] != name:
            self._last = None  # the last one let go before the next is sent
            self._last = (name, self._fetch(name))
        return self._last[1]

    @property
    def own(self) -> Mapping[str, torch.Tensor]:
        """Rank 0's own range, as held."""
        return self._own

    def forget(self) -> None:
        """Let go of the last parameter sent (kept for a second read of it within one point of the step): a reader
        that is done with this point, so that a parameter-sized copy is not held into the next (the oracle's peak)."""
        self._last = None

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.none:
            return None
        if name in self._own and name not in self.parts:
            return self._own[name]
        if name not in self._known:
            raise KeyError(name)
        return self._sent(name).double()

    def __contains__(self, name: object) -> bool:
        return name in self._known

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


class _Life:
    """What a Remote and its views share: when the last of them is let go, `on_drop` (the owners let theirs go)."""

    __slots__ = ("__weakref__",)

    def __init__(self, on_drop: Callable[[], None] | None) -> None:
        if on_drop is not None:
            weakref.finalize(self, on_drop)


class RemoteState(Mapping[str, dict]):
    """On rank 0, an optimizer state held in ranges by the parameters' owners (Divider.hold_state): the entries that are
    tensors of their parameter's elements (momentum, moments) in one `Remote` per entry key, every other entry (a step
    count) here. A parameter's entries are sent by their owners when read; the last parameter read is kept for a second
    read of it (a replay reads a parameter's state more than once)."""

    __slots__ = ("_local", "_remotes", "_meta", "_last")

    def __init__(self, local: dict[str, dict], remotes: dict[str, Remote],
                 meta: dict[str, dict[str, tuple[tuple[int, ...], torch.dtype]]]) -> None:
        """`local`: every parameter's entries not held in ranges; `remotes`: by entry key, the held ones; `meta`: by
        entry key, each held parameter's (shape, dtype)."""
        self._local, self._remotes, self._meta = local, remotes, meta
        self._last: tuple[str, dict] | None = None

    def __getitem__(self, name: str) -> dict:
        if self._last is not None and self._last[0] == name:
            return self._last[1]
        entries = dict(self._local[name])
        for key, remote in self._remotes.items():
            if name in remote:
                entries[key] = remote.held(name)
        self._last = (name, entries)
        return entries

    def forget(self) -> None:
        """Let go of the last parameter's entries read, and each Remote's last one sent (`Remote.forget`)."""
        self._last = None
        for remote in self._remotes.values():
            remote.forget()

    def part(self, name: str) -> dict:
        """Parameter `name`'s entries with each held one as rank 0's own part of it (`Remote.part`): what rank 0
        replays its piece of the update from, nothing sent."""
        entries = dict(self._local[name])
        for key, remote in self._remotes.items():
            if name in remote:
                entries[key] = remote.part(name)
        return entries

    def where(self, name: str) -> tuple[dict, dict[str, int]]:
        """Parameter `name`'s entries held here, and by entry key the number its held ones are held under by their
        owner (what an owner reads its own range of this state by: dpcompare.verify.replay.replay_ranges)."""
        return self._local[name], {key: remote.key_of(name) for key, remote in self._remotes.items()
                                   if name in remote}

    def like(self) -> dict[str, dict]:
        """Each parameter's entries with every held one as a meta tensor of its shape and dtype (nothing sent): for a
        reader that needs only what the entries are (dpcompare.verify.replay.optimizer_replay's `state_like`)."""
        out = {n: dict(entries) for n, entries in self._local.items()}
        for key, held in self._meta.items():
            for n, (shape, dtype) in held.items():
                out[n][key] = torch.empty(shape, dtype=dtype, device="meta")
        return out

    def __contains__(self, name: object) -> bool:
        return name in self._local

    def __iter__(self) -> Iterator[str]:
        return iter(self._local)

    def __len__(self) -> int:
        return len(self._local)


FLUSH_BYTES = 64 * 2**20
"""The most a StateHolder lets wait before it sends it (a request per entry key; Divider.state_holder waits at most a
sixteenth of one entry of the whole model): the state is never held whole on rank 0, and a model of many small
parameters is not a request each."""


class StateHolder:
    """An optimizer state held in ranges by the parameters' owners as it is computed (the update check's replay, a
    parameter at a time): each parameter's entries of its shape are sent to its owner once that parameter's state is
    complete and about FLUSH_BYTES of them wait (`add`), so rank 0 never holds the whole state; `result` is the state
    held (a RemoteState, as Divider.hold_state gives). Entries that are not tensors of the parameter's elements stay
    here."""

    def __init__(self, hold: Callable[[Mapping[str, torch.Tensor]], Remote], ranged: Callable[[str, Any], bool],
                 chosen: set[str], flush_bytes: int = FLUSH_BYTES) -> None:
        """`hold`: tensors by parameter held by their owners (dpcompare.verify.memory.divider.Divider.hold); `ranged`: whether
        an entry of a parameter is held so; `chosen`: the parameters whose other entries are kept here."""
        self.hold, self.ranged, self.flush_bytes, self.chosen = hold, ranged, flush_bytes, chosen
        self._local: dict[str, dict] = {}
        self._parts: dict[str, dict[str, Remote]] = {}
        """By entry key, by parameter: the Remote holding it."""
        self._meta: dict[str, dict[str, tuple[tuple[int, ...], torch.dtype]]] = {}
        self._waiting: dict[str, dict[str, torch.Tensor]] = {}
        """By entry key, the entries complete and not sent yet (at most about `flush_bytes`)."""
        self._bytes = 0

    def add(self, name: str, entries: Mapping[str, Any]) -> None:
        """Parameter `name`'s state, complete: its ranged entries sent to their owner once about `flush_bytes` of them
        are waiting (a request per entry key then, not per parameter)."""
        local = {}
        for key, value in entries.items():
            if self.ranged(name, value):
                self._waiting.setdefault(key, {})[name] = value
                self._meta.setdefault(key, {})[name] = (tuple(value.shape), value.dtype)
                self._bytes += value.numel() * value.element_size()
            elif name in self.chosen or not (torch.is_tensor(value) and value.dim() > 0):
                local[key] = value  # as hold_state keeps them: nothing reads another parameter's elements
        self._local[name] = local
        if self._bytes >= self.flush_bytes:
            self._flush()

    def _flush(self) -> None:
        for key, waiting in self._waiting.items():
            remote = self.hold(waiting)
            self._parts.setdefault(key, {}).update({n: remote for n in waiting})
        self._waiting, self._bytes = {}, 0

    def __contains__(self, name: object) -> bool:
        return name in self._local

    def result(self) -> RemoteState:
        self._flush()
        return RemoteState(dict(self._local), {k: _ByName(parts) for k, parts in self._parts.items()}, self._meta)


class _ByName(Mapping[str, torch.Tensor]):
    """Remotes of some parameters each read as one mapping: each parameter from the Remote holding it (RemoteState's
    entry)."""

    __slots__ = ("_parts",)

    def __init__(self, parts: dict[str, Remote]) -> None:
        self._parts = parts

    def held(self, name: str) -> torch.Tensor:
        return self._parts[name].held(name)

    def part(self, name: str) -> torch.Tensor:
        return self._parts[name].part(name)

    def key_of(self, name: str) -> int:
        return self._parts[name].key

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._parts[name][name]

    def __contains__(self, name: object) -> bool:
        return name in self._parts

    def __iter__(self):
        return iter(self._parts)

    def __len__(self) -> int:
        return len(self._parts)
