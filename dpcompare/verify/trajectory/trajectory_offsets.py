"""The float64 reference trajectory held between its steps as offsets from the run-precision trajectory.

The two copies of dpcompare.verify.trajectory.reference_trajectory train side by side from the same weights on the same batches, so after
each step the float64 copy's value of an element differs from the run-precision copy's only by what that dtype's
rounding has led to (for a float32 run, a few units in 2^-24 of it after a step of SGD, about 1e-5 of it after a few
steps of AdamW, which magnifies the rounding of small gradients). Held as `base + offset`, with the offset in float32,
each float64 value costs 4 bytes instead of 8 between steps (its parameters, and its optimizer state entry by entry where the other copy
holds the same entry: AdamW's two moments, SGD's momentum), and is given back in float64 before the copy is used.

Exact enough, and checked element by element. The trajectory's smallest allowed drift is depth * u per step (u: the
run dtype's unit roundoff; dpcompare.verify.trajectory.reference_trajectory): a value held here comes back within MARGIN * u of itself
(relative), 2^8 * depth times less. An offset in float32 is within 2^-24 of itself, so any value whose offset is at
most 2^-8 of it comes back within 2^-32 (a float32 run's bound). Every element is checked when it is held: one that
would come back further than its bound, or is not finite, is kept in float64 beside the offsets; a tensor with more
than SPARSE of its elements so kept stays whole in float64. A float64 run's copies are the same values, whose offsets
are zero and exact.

A tensor left whole is not tested again at every hold: one left whole at j holds running is left whole without a test at
the next 2^j - 1 holds, then tested again (`Offsets.hold`). AdamW's moments are so: on the 11 M Llama-style config
at 2 x 16 tokens, more than an eighth of each moment's elements would not come back within the bound at every hold of
the run, and the test found that anew at every step. A tensor left whole untested keeps its exact float64 values
where a test might have held it (then given back within the bound): the trajectory is the same within the bound,
not to the bit, and which elements later holds keep can differ. A test made again still holds a tensor that has come
near its twin.

While held, a parameter's `.data` is an empty float64 tensor and an optimizer state entry is one (the same parameter
and state objects: a reader that forgets to give them back reads nothing, never freed memory). A base that changes
while its offsets are held would give back wrong values: each base's version counter is kept and checked when the
values come back (a change is a bug here, and raises). Imports nothing of the run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dpcompare.contract.optim_state import per_element
from dpcompare.verify.judgement.held_values import give_back_freed

MARGIN = 2.0 ** -8
"""A held value comes back within MARGIN * u of itself (relative), u: the run dtype's unit roundoff."""
SPARSE = 1 / 8
"""Above this fraction of a tensor's elements kept in float64, the tensor stays whole in float64."""
CHUNK = 1 << 16
"""Elements converted at a time: the transients of holding a tensor are this many, not the tensor's."""
PART = 1 << 22
"""Elements of parameters stepped at a time by `step_in_parts`."""
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)
"""Optimizers whose step of a parameter reads nothing of the others: stepped a part at a time (`step_in_parts`)."""


Slot = tuple[object, str | None]
"""Where a held tensor lives: (a parameter, None) for its `.data`; (a dict, key) for an optimizer state entry."""


@dataclass(slots=True)
class _Held:
    slot: Slot
    shape: torch.Size
    base: torch.Tensor
    version: int
    offset: torch.Tensor
    """target - base, float32, flat."""
    index: torch.Tensor
    """The flat positions held in float64 (`values`)."""
    values: torch.Tensor


class Offsets:
    """Float64 tensors held as float32 offsets from their bases between uses (`hold`), given back whole (`restore`)
    or read a chunk at a time while held (`read`)."""

    def __init__(self, u: float, sparse: float = SPARSE) -> None:
        """`u`: the run dtype's unit roundoff."""
        self.bound, self.sparse = MARGIN * u, sparse
        self._held: dict[tuple[int, str | None], _Held] = {}
        """By slot (its owner's id, its key): the owner is kept alive by its entry."""
        self._left: dict[tuple[int, str | None], tuple[object, int, int]] = {}
        """By slot, a tensor the last holds left whole: (its owner, kept alive; how many holds running; the hold at
        which it is tested again)."""
        self.holds = 0
        """The holds made so far."""
        self.elements = self.kept = self.whole = self.untested = 0
        """Of the elements last held: how many, how many of them kept in float64, how many in tensors left whole, and
        how many of those left whole without a test (the module docstring)."""

    def __len__(self) -> int:
        return len(self._held)

    @property
    def nbytes(self) -> int:
        return sum(h.offset.nbytes + h.index.nbytes + h.values.nbytes for h in self._held.values())

    def hold(self, entries: list[tuple[Slot, torch.Tensor]]) -> None:
        """Hold each float64 tensor in a slot of `entries` as its offset from `base` (a floating tensor of the same
        shape, on the same device), letting the tensor go; where it cannot be (see the module docstring), leave it."""
        self.elements = self.kept = self.whole = self.untested = 0
        self.holds += 1
        freed = 0
        # a slot this hold is not given is no longer followed (a state dict an optimizer's load replaced: its owner,
        # and the tensors it holds, are let go)
        entries = list(entries)
        given = {_key(slot) for slot, _ in entries}
        self._left = {k: v for k, v in self._left.items() if k in given}
        for slot, base in entries:
            target = _get(slot)
            if _key(slot) in self._held or not _eligible(target, base):
                continue
            self.elements += target.numel()
            left = self._left.get(_key(slot))
            if left is not None and self.holds < left[2]:  # left whole lately: not tested at this hold
                self.whole += target.numel()
                self.untested += target.numel()
                continue
            held = self._offset(slot, target, base)
            if held is None:
                self.whole += target.numel()
                running = 1 if left is None else left[1] + 1
                self._left[_key(slot)] = (slot[0], running, self.holds + 2 ** running)
                continue
            self._left.pop(_key(slot), None)
            self.kept += held.index.numel()
            freed += target.untyped_storage().nbytes()
            empty = torch.empty(0, dtype=torch.float64, device=target.device)
            _set(slot, empty)
            self._held[_key(slot)] = held
        give_back_freed(freed)

    def restore(self, slots: list[Slot] | None = None) -> None:
        """Every held tensor (or those of `slots`) given back in float64, in its slot (the same parameter or state
        dict), each offset let go as its tensor comes back (not all at the end: they would sit beside the whole float64
        copy)."""
        for held in self._take_all() if slots is None else self._take(slots):
            self._check(held)
            value = torch.empty(held.shape, dtype=torch.float64, device=held.offset.device)
            flat = value.view(-1)
            for start in range(0, flat.numel(), CHUNK):
                self._into(held, flat[start:start + CHUNK], start)
            flat[held.index] = held.values
            _set(held.slot, value)

    def _take_all(self):
        while self._held:
            yield self._held.pop(next(iter(self._held)))

    def _take(self, slots: list[Slot]):
        for slot in slots:
            held = self._held.pop(_key(slot), None)
            if held is not None:
                yield held

    def read(self, slot: Slot, part: slice) -> torch.Tensor:
        """The flat elements `part` of the tensor in `slot`, whether held or not."""
        held = self._held.get(_key(slot))
        if held is None:
            return _get(slot).detach().reshape(-1)[part]
        self._check(held)
        start, stop, _ = part.indices(held.offset.numel())
        out = self._into(held, torch.empty(max(stop - start, 0), dtype=torch.float64, device=held.offset.device), start)
        inside = (held.index >= start) & (held.index < stop)
        out[held.index[inside] - start] = held.values[inside]
        return out

    def _offset(self, slot: Slot, target: torch.Tensor, base: torch.Tensor) -> _Held | None:
        x, b = target.detach().view(-1), base.detach().reshape(-1)
        offset = torch.empty(x.numel(), dtype=torch.float32, device=x.device)
        size = min(CHUNK, x.numel())
        magnitude, diff = (torch.empty(size, dtype=torch.float64, device=x.device) for _ in range(2))
        scaled = torch.empty(size, dtype=torch.float32, device=x.device)
        near = _near(self.bound)
        bad: list[torch.Tensor] = []
        kept, most = 0, self.sparse * x.numel()
        with torch.no_grad():  # in place, a chunk at a time: the check is most of holding's time
            for start in range(0, x.numel(), CHUNK):
                value, base_part = x[start:start + CHUNK], b[start:start + CHUNK]
                n = value.numel()
                off = offset[start:start + n]
                off.copy_(torch.sub(value, base_part, out=diff[:n]))
                if near is not None:
                    # The elements whose offset is small against them come back within the bound (`_near`): a chunk
                    # of such elements alone passes here. The margin |value| - |offset| / T in float64, its least
                    # read in one reduction: no mask is made (on the CPU a comparison and a test of its mask cost
                    # several times the arithmetic).
                    margin = torch.abs(value, out=magnitude[:n])
                    margin.sub_(torch.abs(off, out=scaled[:n]), alpha=near.inverse)
                    if float(torch.amin(margin)) > near.tiny:
                        continue
                # The exact test, on the whole chunk: picking out the elements the cheap test does not pass (a mask
                # and its nonzero) costs most of it already, and more once a few per cent of the chunk fail (AdamW's
                # moments and parameters; zeros beside zeros, which the cheap test never passes).
                failing = _failing(value, base_part, off, self.bound)
                if failing is not None:
                    far = torch.nonzero(failing).view(-1)
                    bad.append(far + start)
                    kept += far.numel()
                    if kept > most:
                        return None
        index = torch.cat(bad) if bad else torch.empty(0, dtype=torch.long, device=x.device)
        return _Held(slot, target.shape, base, base._version, offset, index, x[index])

    @staticmethod
    def _into(held: _Held, out: torch.Tensor, start: int) -> torch.Tensor:
        """Base + offset of the flat elements from `start`, as many as `out` holds, written into `out` (float64): the
        base copied in, the offset added in float64, no other temporary."""
        out.copy_(held.base.detach().reshape(-1)[start:start + out.numel()])
        return out.add_(held.offset[start:start + out.numel()])

    @staticmethod
    def _check(held: _Held) -> None:
        if held.base._version != held.version:
            raise RuntimeError("a float64 value held as an offset lost its base: the base changed while it was held")


@dataclass(frozen=True, slots=True)
class _Near:
    """A test that needs no value given back: an element passes where fl64(|value| - |offset| / T) > TINY."""
    inverse: float
    """1 / T, a power of two."""
    tiny: float
    """TINY: a value below it never passes, so an offset's subnormal rounding (2^-150) stays far inside the bound."""


def _near(bound: float) -> _Near | None:
    """The cheap test for `bound` (None: the exact test for every element, a bound below 2^-40, as a float64 run's).

    An element that passes it has |offset| <= T |value| and |value| >= TINY = 2^-100, with T = min(bound 2^22, 1/2). Its
    value comes back within the bound, and the exact test (`_comes_back`) passes it. With d = fl64(value - base), the
    offset fl32(d) within 2^-24 |d| + 2^-150 of d, and the value given back fl64(base + offset) within 2^-53 of the sum,
    what comes back differs from the value by at most 2^-24 T |v| + 2^-150 + 2^-53 (|v - base| + |base + offset|) <=
    bound/4 |v| + bound/4 |v| + 2^-53 x 2.6 |v| (|v - base| <= (1 + 2^-23) T |v|, T <= 1/2), under 0.75 bound |v| for a
    bound of at least 2^-40: inside the bound after the test's own rounding. That rounding is one: |offset| / T is
    exact (a power of two times a float32), and fl64(|v| - |offset| / T) > TINY means |v| - |offset| / T > TINY (1 -
    2^-53), so |offset| < T |v| and |v| > 2^-100 (1 - 2^-53), which the bounds above allow. An infinite value fails
    it (its offset is infinite or NaN too: the margin is NaN or minus infinity), as a NaN does: both go to the exact
    test."""
    if bound < 2.0 ** -40:
        return None
    return _Near(inverse=1.0 / min(bound * 2.0 ** 22, 0.5), tiny=2.0 ** -100)


def _failing(value: torch.Tensor, base: torch.Tensor, offset: torch.Tensor, bound: float) -> torch.Tensor | None:
    """The exact test (`_comes_back`), its mask made only where an element fails it: where the largest of
    |given back - value| - bound |value| is at most zero (fl64 of a difference keeps its sign; a NaN reads as a
    failure), every element passes, told in one reduction. Else the elements that fail, as `_comes_back` tells them."""
    back = torch.empty(value.shape, dtype=torch.float64, device=value.device).copy_(base)
    back.add_(offset).sub_(value).abs_()
    limit = torch.abs(value).mul_(bound)
    if float(torch.amax(torch.sub(back, limit))) <= 0:
        return None
    return torch.logical_not(back <= limit)


def _comes_back(value: torch.Tensor, base: torch.Tensor, offset: torch.Tensor, bound: float) -> torch.Tensor:
    """Where the value given back, fl64(base + offset), is within `bound` of the value, relatively (False where not
    finite): the exact test, as restoring computes the value given back."""
    back = torch.empty(value.shape, dtype=torch.float64, device=value.device).copy_(base)
    back.add_(offset).sub_(value).abs_()
    return back <= torch.abs(value).mul_(bound)


def step_in_parts(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], offsets: Offsets,
                  part: int = PART) -> None:
    """`optimizer.step()` over `params` (those with a gradient), its held state given back a part of about `part`
    elements at a time: each part's state comes back, the part steps, its gradients are let go. So the whole float64
    state and the whole float64 gradient are never held at once. Only for an optimizer that steps each parameter on
    its own (ELEMENTWISE, in its loop or its fused kernel: the same values as one step, to the bit, since a part holds
    whole parameters); any other steps once, its state given back first."""
    if type(optimizer) not in ELEMENTWISE:
        offsets.restore()
        optimizer.step()
        return
    grads = [(p, p.grad) for p in params if p.grad is not None]
    for p, _ in grads:
        p.grad = None
    start = 0
    while start < len(grads):
        end, size = start + 1, grads[start][0].numel()
        while end < len(grads) and size + grads[end][0].numel() <= part:
            size += grads[end][0].numel()
            end += 1
        chunk = grads[start:end]
        offsets.restore([(optimizer.state[p], k) for p, _ in chunk for k in list(optimizer.state[p])])
        for p, g in chunk:
            p.grad = g
        optimizer.step()
        for i, (p, _) in enumerate(chunk, start):
            p.grad = None
            grads[i] = (p, None)  # its gradient let go with the part
        start = end


def paired(model: nn.Module, optimizer: torch.optim.Optimizer, base: nn.Module, base_optimizer: torch.optim.Optimizer,
           names: list[str], pieces: list[tuple[torch.Tensor, torch.Tensor]] = ()) -> list[tuple[Slot, torch.Tensor]]:
    """What `Offsets.hold` takes for a float64 copy `model` beside its run-precision twin `base`: each parameter of
    `names` with the twin's of the same name, and each of its optimizer state entries with the twin's entry of the
    same key where both are tensors of the parameter's shape and of its elements (a momentum, a moment: told by the
    entry's key, not its shape, since a 0-dim parameter's step count is of its shape too); and each of `pieces` (a
    float64 tensor the optimizer steps beside its twin's: a piece of a parameter cut over the ranks,
    dpcompare.verify.trajectory.trajectory_ranges) so too."""
    theirs = dict(base.named_parameters())
    chosen = set(names)
    pairs = [(p, theirs[n]) for n, p in model.named_parameters() if n in chosen] + list(pieces)
    entries: list[tuple[Slot, torch.Tensor]] = []
    for p, twin in pairs:
        entries.append(((p, None), twin))
        mine, other = optimizer.state.get(p, {}), base_optimizer.state.get(twin, {})
        entries += [((mine, k), other[k]) for k, v in mine.items()
                    if per_element(k, v) and torch.is_tensor(other.get(k)) and v.shape == p.shape]
    return entries


def _key(slot: Slot) -> tuple[int, str | None]:
    return id(slot[0]), slot[1]


def _get(slot: Slot) -> torch.Tensor:
    owner, key = slot
    return owner.data if key is None else owner[key]


def _set(slot: Slot, value: torch.Tensor) -> None:
    owner, key = slot
    if key is None:
        owner.data = value
    else:
        owner[key] = value


def _eligible(target: torch.Tensor, base: torch.Tensor) -> bool:
    """A float64 tensor that owns its storage alone, whole and contiguous, beside a floating base of its shape and
    device (a view or a shared storage would keep what it shares)."""
    storage = target.untyped_storage()
    return (target.dtype == torch.float64 and target.is_contiguous() and target.storage_offset() == 0
            and target.numel() > 0 and storage.nbytes() == target.numel() * target.element_size()
            and base.is_floating_point() and base.shape == target.shape and base.device == target.device
            and base.untyped_storage().nbytes() > 0)
