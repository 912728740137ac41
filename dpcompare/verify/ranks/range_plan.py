"""Which rank holds which elements of the trainable parameters while the checks are divided: the range planner.

Owns: `plan` (a pure function of the parameters' names, element counts and the world size: contiguous ranges of the
parameters' elements laid end to end in the model's order, one range a rank, cut inside a parameter where that
balances the ranks, as FSDP's flat parameter and ZeRO's partitions are cut), `Plan` (what a rank asks of it: whether
it holds a parameter, which slice, who holds the rest, and the pieces put back together) and `problems` (what is wrong
with a plan: an element held twice or by no rank, a rank holding more than its share). Used by
dpcompare.verify.ranks.verifier_group, dpcompare.verify.memory.divider, dpcompare.verify.replay.replay_ranges and dpcompare.verify.trajectory.trajectory_ranges.
Imports nothing of dpcompare's.

The cut: rank r's range is the elements [r*T/N, (r+1)*T/N) of the T trainable elements laid end to end (rounded to
whole elements), so no rank holds more than ceil(T/N) of them. A parameter is held whole by one rank where its
elements fall in one range; else each rank whose range it crosses holds a contiguous slice of its flattened elements
(a "piece"; a rank holds at most one piece of a parameter, so a rank's values stay keyed by the parameter's name).
A parameter that may not be cut (`whole`: one the optimizer steps as a whole tensor, not element by element) goes
whole to the rank its middle element falls in, and the cut moves to its edges: that rank then holds at most that
parameter's elements beyond its share. Ranks left with nothing (more ranks than elements, or than uncuttable
parameters) are normal ranks: they take part in every collective and hold nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch


@dataclass(frozen=True, slots=True)
class Piece:
    """Elements [start, stop) of parameter `name`'s flattened elements, held by `rank`."""

    name: str
    rank: int
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Plan:
    """The pieces of every trainable parameter, in the model's order (see the module docstring)."""

    world_size: int
    sizes: dict[str, int]
    """Trainable parameter -> its number of elements, in the model's order."""
    pieces: dict[str, tuple[Piece, ...]]
    """Trainable parameter -> its pieces in the order of their elements (so in rank order)."""
    _by_rank: dict[tuple[str, int], Piece] = field(default_factory=dict, repr=False, compare=False)

    _counts: dict[int, int] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        for n, ps in self.pieces.items():
            for p in ps:
                self._by_rank[(n, p.rank)] = p
                self._counts[p.rank] = self._counts.get(p.rank, 0) + p.numel

    # -- who holds what -----------------------------------------------------------------------------------------------
    def holds(self, name: str, rank: int) -> bool:
        """Whether `rank` holds some of trainable parameter `name` (a parameter not trained is no rank's here)."""
        return (name, rank) in self._by_rank

    def holders(self, name: str) -> tuple[Piece, ...]:
        return self.pieces[name]

    def ranks(self, name: str) -> tuple[int, ...]:
        return tuple(p.rank for p in self.pieces[name])

    def is_cut(self, name: str) -> bool:
        """Whether `name` is held in more than one piece."""
        return len(self.pieces[name]) > 1

    def sole(self, name: str) -> int | None:
        """The rank that holds `name` whole, None where it is cut (or not trained)."""
        ps = self.pieces.get(name, ())
        return ps[0].rank if len(ps) == 1 else None

    def piece(self, name: str, rank: int) -> Piece | None:
        return self._by_rank.get((name, rank))

    def names(self, rank: int) -> list[str]:
        """The trainable parameters `rank` holds some of, in the model's order."""
        return [n for n in self.pieces if (n, rank) in self._by_rank]

    def elements(self, rank: int) -> int:
        """How many elements `rank` holds."""
        return self._counts.get(rank, 0)

    def share(self) -> int:
        """The most elements an even cut gives a rank: ceil(T / N)."""
        return -(-sum(self.sizes.values()) // self.world_size) if self.world_size else 0

    # -- tensors ------------------------------------------------------------------------------------------------------
    def take(self, name: str, rank: int, tensor: torch.Tensor) -> torch.Tensor:
        """`rank`'s part of `tensor` (a value of parameter `name`: a gradient, a weight, a moment): the tensor itself
        where `rank` holds `name` whole, else its piece of the flattened elements (a view where `tensor` is
        contiguous)."""
        p = self._by_rank[(name, rank)]
        if len(self.pieces[name]) == 1:
            return tensor
        return tensor.reshape(-1)[p.start:p.stop]

    def shape(self, name: str, rank: int, shape: Sequence[int]) -> tuple[int, ...]:
        """The shape of `rank`'s part of a value of `name` whose whole shape is `shape`."""
        p = self._by_rank[(name, rank)]
        return tuple(shape) if len(self.pieces[name]) == 1 else (p.numel,)

    def join(self, name: str, parts: Sequence[torch.Tensor], shape: Sequence[int]) -> torch.Tensor:
        """The whole value of `name` from its holders' `parts` (in `holders` order), of `shape`."""
        if len(parts) == 1:
            return parts[0].reshape(shape)
        return torch.cat([t.reshape(-1) for t in parts]).reshape(shape)

    def describe(self) -> str:
        """One line: how the elements were cut (for notes and errors)."""
        counts = [self.elements(r) for r in range(self.world_size)]
        empty = sum(1 for c in counts if c == 0)
        cut = sum(1 for ps in self.pieces.values() if len(ps) > 1)
        return (f"{sum(self.sizes.values())} elements of {len(self.sizes)} parameters over {self.world_size} ranks: "
                f"at most {max(counts, default=0)} a rank (an even share is {self.share()}), {cut} parameter(s) cut, "
                f"{empty} rank(s) holding none")


def plan(sizes: Iterable[tuple[str, int]], world_size: int, whole: Iterable[str] = ()) -> Plan:
    """The ranges of `sizes` (trainable parameter name, elements; in the model's order) over `world_size` ranks (see
    the module docstring); the parameters in `whole` are never cut."""
    if world_size < 1:
        raise ValueError(f"a plan needs at least one rank, got world_size={world_size}")
    sizes = list(sizes)
    keep = set(whole)
    total = sum(n for _, n in sizes)
    bounds = [(r * total) // world_size for r in range(world_size + 1)]
    """Rank r's range is [bounds[r], bounds[r + 1]) of the elements laid end to end."""
    pieces: dict[str, tuple[Piece, ...]] = {}
    seen = 0
    for name, n in sizes:
        if n == 0 or name in keep:
            # whole: the rank whose range its middle element falls in (an empty one: the range its place is in)
            middle = seen + (n - 1) / 2 if n else seen
            r = _rank_of(bounds, middle, world_size)
            pieces[name] = (Piece(name, r, 0, n),)
        else:
            out = []
            r = _rank_of(bounds, seen, world_size)
            start = seen
            while start < seen + n:
                stop = min(bounds[r + 1], seen + n)
                if stop > start:
                    out.append(Piece(name, r, start - seen, stop - seen))
                start = stop
                r += 1
            pieces[name] = tuple(out)
        seen += n
    return Plan(world_size, dict(sizes), pieces)


def _rank_of(bounds: list[int], element: float, world_size: int) -> int:
    """The rank whose range holds `element` (the last one past the end; the first range that is not empty at it)."""
    lo, hi = 0, world_size - 1
    while lo < hi:  # the first r with bounds[r + 1] > element
        mid = (lo + hi) // 2
        if bounds[mid + 1] > element:
            hi = mid
        else:
            lo = mid + 1
    return lo


def of_model(model: torch.nn.Module, world_size: int, whole: Iterable[str] = ()) -> Plan:
    """`plan` of `model`'s trainable parameters (a model on the meta device works: only shapes are read)."""
    return plan([(n, p.numel()) for n, p in model.named_parameters() if p.requires_grad], world_size, whole)


def problems(p: Plan, whole: Iterable[str] = ()) -> list[str]:
    """What is wrong with `p` (nothing: a plan every check may rely on): an element of a parameter held twice or by no
    rank, a piece out of its parameter or on a rank outside the world, a rank holding two pieces of one parameter, a
    parameter of `whole` cut, or a rank holding more than an even share by more than the largest uncut parameter
    (the most one piece can add: `plan` moves a cut only to an uncuttable parameter's edges)."""
    out: list[str] = []
    keep = set(whole)
    for name, n in p.sizes.items():
        ps = sorted(p.pieces.get(name, ()), key=lambda q: q.start)
        if not ps:
            out.append(f"{name}: held by no rank")
            continue
        at = 0
        for q in ps:
            if not 0 <= q.rank < p.world_size:
                out.append(f"{name}: a piece on rank {q.rank}, outside the {p.world_size} ranks")
            if q.start < at:
                out.append(f"{name}: elements [{q.start}, {min(at, q.stop)}) held twice")
            elif q.start > at:
                out.append(f"{name}: elements [{at}, {q.start}) held by no rank")
            at = max(at, q.stop)
        if at != n:
            out.append(f"{name}: elements [{min(at, n)}, {max(at, n)}) " + ("held by no rank" if at < n else
                                                                              "past its end"))
        ranks = [q.rank for q in ps]
        if len(set(ranks)) != len(ranks):
            out.append(f"{name}: a rank holds two pieces")
        if name in keep and len(ps) > 1:
            out.append(f"{name}: cut, though it may not be")
    slack = max((n for name, n in p.sizes.items() if name in keep), default=0)
    for r in range(p.world_size):
        held = p.elements(r)
        if held > p.share() + slack:
            out.append(f"rank {r} holds {held} elements, more than its share {p.share()} by {held - p.share()}"
                       + (f" (the largest uncut parameter has {slack})" if slack else ""))
    return out
