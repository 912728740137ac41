"""Checking state held as it was computed, read in float64: the reduced gradient, the run-precision references and the
step's parameters in their own dtype (`Compact`: a float32 gradient costs its 4 bytes an element while it is kept), an
update as the values it reached (`Difference`: the float64 difference computed where it is read, never held). Every
reader still computes in float64: the casts are exact. A copy of the model that is loaded before each use holds its
parameters' memory only while it computes (`releasable`, `release`); what a check allocates and frees parameter by
parameter is handed back to the system as it goes (`give_back_freed`). Imports nothing of the run.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import weakref
from typing import Any, Iterable, Mapping

import torch
from torch import nn


class Compact(Mapping[str, torch.Tensor]):
    """Gradients (or parameters) by name, held where they were computed (the model's device), in the dtype they were
    computed in, and read in float64: a
    float32 gradient costs its 4 bytes per element while it is kept, and every reader still computes in float64 (the
    cast is exact). Read-only: what is held is a snapshot, never the run's own tensors."""

    __slots__ = ("_held", "source")

    def __init__(self, tensors: Mapping[str, torch.Tensor | None], *, copy: bool = True) -> None:
        """`copy`: snapshot each tensor (the run may change its own in place); False: `tensors` are already private.
        A None (no gradient) is held and read as None."""
        self._held = {n: None if t is None else _snapshot(t, copy) for n, t in tensors.items()}
        self.source: tuple | None = None
        """A gradient's: what computed it (dpcompare.verify.oracle.gradient_oracle.Oracle: the copy, the state it was loaded
        from, its forwards, the names autograd left None), for a computation that would repeat it; None: unknown."""

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self._held[name]
        return None if t is None else t.double()

    def __iter__(self):
        return iter(self._held)

    def __len__(self) -> int:
        return len(self._held)

    def held(self, name: str) -> torch.Tensor:
        """The tensor as it is held (its own dtype), for a reader that needs no float64."""
        return self._held[name]

    def without(self, names: Iterable[str]) -> "Compact":
        """The same tensors, with `names` held as None (sharing, not copying, the rest)."""
        drop = set(names)
        return Compact({n: None if n in drop else t for n, t in self._held.items()}, copy=False)

    @property
    def none(self) -> frozenset[str]:
        """The names held as None."""
        return frozenset(n for n, t in self._held.items() if t is None)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._held.values() if t is not None)


class Difference(Mapping[str, torch.Tensor]):
    """`after` - `before` by name (`before`'s names), computed in float64 where `before` is held when read and never held: an update is kept as the
    values it led to (in their own dtype), not as a float64 copy of its own. `round_to`: `before` rounded to that
    dtype first (a replay that started from the parameters in its own dtype)."""

    __slots__ = ("_after", "_before", "_round_to")

    def __init__(self, after: Mapping[str, torch.Tensor], before: Mapping[str, torch.Tensor],
                 round_to: torch.dtype | None = None) -> None:
        self._after, self._before, self._round_to = after, before, round_to

    def __getitem__(self, name: str) -> torch.Tensor:
        after, before = self.sides(name)
        # in place on a float64 copy of `after`: the values of `after.double() - before`, without the promoted temporary
        return after.to(torch.float64, copy=True).sub_(before).reshape(self._after[name].shape)

    def sides(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(after, before) of `name`, flattened on `before`'s device as held (`before` rounded as asked): their float64
        difference is the update (one float64 copy and one subtraction: the other side is promoted in it, exactly)."""
        before = self._before_of(name)
        return self._after[name].detach().to(before.device).reshape(-1), before

    def pieces(self, name: str) -> tuple[object, torch.Tensor]:
        """(after, before) as `sides` gives them, except an `after` that is computed a slice at a time where it is read
        (an update replay's values: its mapping's `pieces`), given as that: indexed by a slice of the flattened
        parameter, never computed whole."""
        pieces = getattr(self._after, "pieces", None)
        return self.sides(name) if pieces is None else (pieces(name), self._before_of(name))

    def _before_of(self, name: str) -> torch.Tensor:
        before = (self._before.held(name) if isinstance(self._before, Compact) else self._before[name]).detach()
        if self._round_to is not None and torch.promote_types(before.dtype, self._round_to) != self._round_to:
            before = before.to(self._round_to)  # a narrower dtype rounds; a wider one holds it exactly as it is
        return before.reshape(-1)

    def __iter__(self):
        return iter(self._before)

    def __len__(self) -> int:
        return len(self._before)


def _snapshot(t: torch.Tensor, copy: bool) -> torch.Tensor:
    """`t` as held: on its own device, a copy of it (`copy`) or itself (already private)."""
    t = t.detach()
    return t.clone() if copy else t


def releasable(model: nn.Module) -> nn.Module:
    """`model`, a copy that is loaded before every use (load_state_dict), made to hold no parameter memory between
    uses, from now: `release` frees its parameters' storage, and its next load_state_dict allocates it again before it
    loads. A copy of the oracle's then costs its bytes only while it computes, not over the checks that follow."""
    model.register_load_state_dict_pre_hook(_restore)
    _RELEASABLE.add(model)
    release(model)
    return model


def is_releasable(model: nn.Module) -> bool:
    """Whether `model` was made `releasable`."""
    return model in _RELEASABLE


def release(model: nn.Module) -> None:
    """Free the storage of every parameter of `model` (made `releasable`): its values are gone until it is loaded.
    Refused for a model not made releasable: loading into freed storage would write past it."""
    if model not in _RELEASABLE:
        raise ValueError("release() of a model not made releasable(): nothing would allocate its parameters again")
    for p in model.parameters():
        storage = p.untyped_storage()
        if storage.nbytes():
            storage.resize_(0)


_RELEASABLE: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def _restore(model: nn.Module, state_dict: Mapping[str, Any], prefix: str, *_) -> None:
    """Before a load: the storage of every parameter `state_dict` has an entry for (one loaded for its buffers alone
    leaves the parameters released)."""
    for name, p in model.named_parameters(remove_duplicate=False):
        if prefix + name not in state_dict:
            continue
        storage = p.untyped_storage()
        need = (p.storage_offset() + p.numel()) * p.element_size()
        if storage.nbytes() < need:
            storage.resize_(need)


def _libc(name: str):
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):  # not glibc: its allocator returns memory as it does
        return None


_TRIM = _libc("malloc_trim")
_MALLOPT = _libc("mallopt")
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
_GLIBC_DEFAULTS = {_M_MMAP_MAX: 65536, _M_TRIM_THRESHOLD: 128 * 1024}
_KEPT = [0]


@contextlib.contextmanager
def pages_kept():
    """Within a check, glibc serves every allocation from its heap and trims the heap only when told
    (`give_back_freed`, and once on leaving): a copy freed and allocated again (an oracle copy loaded before each use,
    its gradients, a replay's buffers) takes the pages the last one left instead of mapping fresh ones, whose page
    faults cost several times the arithmetic on them on the CPU. Measured on the 22 M Llama-style config at one rank:
    the oracle's part of a checked step 790 -> 630 ms, and the peak resident memory about 4 B/param lower (trimmed on
    leaving, where glibc's own thresholds kept more). Leaving sets glibc's defaults back (its dynamic mmap threshold
    stays off once set): the run's own step allocates between the checks as glibc does. A no-op where the C library
    is not glibc."""
    if _MALLOPT is None or _KEPT[0]:  # not glibc, or within a use already: the outer one sets and restores
        yield
        return
    _KEPT[0] = 1
    _MALLOPT(_M_MMAP_MAX, 0)
    _MALLOPT(_M_TRIM_THRESHOLD, 1 << 30)
    try:
        yield
    finally:
        _KEPT[0] = 0
        for option, value in _GLIBC_DEFAULTS.items():
            _MALLOPT(option, value)
        give_back_freed()


_FREED = [0]
TRIM_EVERY = 256 << 20
"""Bytes freed between two trims within a check (each trim costs about a millisecond)."""


def give_back_freed(freed: int | None = None) -> None:
    """Hand the host memory a check freed back to the system (glibc's malloc_trim), where the allocator kept it: the
    update replay allocates and frees each parameter's copies in turn, and glibc kept much of it resident (on an 11 M
    model, 8 B/param with SGD and 14 with AdamW at the verification's peak, measured without it and with it). `freed`:
    bytes just freed, counted until `TRIM_EVERY` of them call for a trim (None: trim now; each costs a few
    milliseconds, which is why the checks' parts are not trimmed one by one: that cost a fifth of their time for no
    measured saving). A no-op where the C library is not glibc."""
    if _TRIM is None:
        return
    if freed is not None:
        _FREED[0] += freed
        if _FREED[0] < TRIM_EVERY:
            return
    _FREED[0] = 0
    _TRIM(0)
