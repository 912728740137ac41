"""A copy's parameters made from the state it is loaded from as its ops use them, and let go once used.

Owns: `made_from(model, state)`, which holds a releasable copy (dpcompare.verify.judgement.held_values) loaded from
`state` without holding its parameters whole: a parameter's storage is allocated and filled from its entry of `state`
(cast to the copy's dtype, as load_state_dict copies it: the same values, to the bit) when an op first uses it, and
freed again once its module's forward has returned and, in backward, once autograd has accumulated its gradient. What
a forward saves for backward of a parameter (the weight itself, or a view of it such as the transposed weight a linear
layer saves) is held as a reference to the parameter and made again when backward reads it. The copy then holds a
module's weights at a time, not the model's: a float64 copy of a model trained in float32 costs 8 bytes a parameter
whole; made from the run's own parameters (rank 0's state is the backend's own tensors), it costs one module's.

Where a parameter is used: every op taking it (or a view of it) as an argument on the main thread makes it (a torch
function mode, so a weight used outside its module's forward, a tied head multiplying by the embedding's weight, is
made too); a module's forward makes its own parameters before it runs (what recomputation in backward sees where the
mode is not on the thread backward runs on); what backward reads of a saved parameter makes it (saved-tensor hooks).
A parameter is let go only where no tensor that reads its storage later is alive but unsaved: after its own module's
forward (not in a backward: a recomputed block's saved tensors hold its storage until its gradient is accumulated)
and after its gradient is accumulated. A parameter no gradient reaches stays made until the copy is let go.

Not used (the copy is loaded whole, as before) for a model whose parameters share storage, whose modules load their
state with their own code (`_load_from_state_dict` overridden, a load hook of their own), or that is compiled.
Imports no adapter.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterator, Mapping

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from dpcompare.verify.judgement.held_values import is_releasable, release

__all__ = ["eligible", "made_from"]


class _Saved:
    """What a forward saved of a parameter: the parameter, and the view of it saved (None: itself)."""

    __slots__ = ("param", "view")

    def __init__(self, param: nn.Parameter, view: tuple | None) -> None:
        self.param, self.view = param, view


class _Maker:
    """The hooks and the bookkeeping of one copy (made once, active inside `made_from`)."""

    def __init__(self, model: nn.Module) -> None:
        self.by_id: dict[int, tuple[str, nn.Parameter]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            self.by_id.setdefault(id(p), (name, p))
        self.by_storage = {p.untyped_storage()._cdata: p for _, p in self.by_id.values()}
        """Each parameter by its storage (the same object through a resize): what finds a view or an alias of it."""
        self.source: Mapping[str, torch.Tensor] | None = None
        self.made: dict[int, nn.Parameter] = {}
        self.peak_bytes = 0
        """The most parameter bytes made at once inside the last `made_from`."""
        self._bytes = 0
        for module in model.modules():
            own = [p for p in module._parameters.values() if p is not None]
            if own:
                module.register_forward_pre_hook(lambda m, _a, own=own: self._make_all(own))
                module.register_forward_hook(lambda m, _a, _o, own=own: self._after_forward(own))
        for _, p in self.by_id.values():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._accumulated)

    # -- making and letting go ----------------------------------------------------------------------------------------
    def make(self, p: nn.Parameter) -> None:
        if self.source is None or id(p) in self.made:
            return
        with torch._C.DisableTorchFunction():  # what it calls is not a use
            self._make(p)

    def _make(self, p: nn.Parameter) -> None:
        name = self.by_id[id(p)][0]
        storage = p.untyped_storage()
        need = (p.storage_offset() + p.numel()) * p.element_size()
        if storage.nbytes() < need:
            storage.resize_(need)
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(p):
            p.copy_(self.source[name])
        self.made[id(p)] = p
        self._bytes += need
        self.peak_bytes = max(self.peak_bytes, self._bytes)

    def drop(self, p: nn.Parameter) -> None:
        if self.made.pop(id(p), None) is None:
            return
        with torch._C.DisableTorchFunction():
            storage = p.untyped_storage()
            self._bytes -= storage.nbytes()
            storage.resize_(0)

    def _make_all(self, own: list[nn.Parameter]) -> None:
        for p in own:
            self.make(p)

    def _after_forward(self, own: list[nn.Parameter]) -> None:
        if self.source is None or torch._C._current_autograd_node() is not None:
            return  # in a backward (a block recomputed): its saved tensors read the storage until its gradient is in
        for p in own:
            self.drop(p)

    def _accumulated(self, p: torch.Tensor) -> None:
        if self.source is not None:
            self.drop(p)  # type: ignore[arg-type]

    def param_of(self, t: torch.Tensor) -> nn.Parameter | None:
        """The copy's parameter whose storage `t` reads (the parameter, a view, a detached alias), None for any other
        tensor."""
        with torch._C.DisableTorchFunction():
            return self.by_storage.get(t.untyped_storage()._cdata)

    # -- the hooks -----------------------------------------------------------------------------------------------------
    def pack(self, t: torch.Tensor) -> Any:
        p = self.param_of(t)
        if p is None:
            return t
        whole = t is p
        return _Saved(p, None if whole else (tuple(t.shape), t.stride(), t.storage_offset()))

    def unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _Saved):
            return saved
        self.make(saved.param)
        if saved.view is None:
            return saved.param
        with torch._C.DisableTorchFunction():
            return saved.param.detach().as_strided(*saved.view)

    def used(self, value: Any) -> None:
        if torch.is_tensor(value):
            p = self.param_of(value)
            if p is not None:
                self.make(p)
        elif isinstance(value, (list, tuple)):
            for v in value:
                if torch.is_tensor(v):
                    self.used(v)


class _OnUse(TorchFunctionMode):
    """Makes every parameter of the copy an op is given (or a view of which it is given) before the op runs."""

    def __init__(self, maker: _Maker) -> None:
        super().__init__()
        self.maker = maker

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # every parameter made already (a count, not a comparison of the sets: this runs at every op of the copy)
        if len(self.maker.made) < len(self.maker.by_id) and getattr(func, "__name__", None) not in _METADATA:
            for a in args:
                self.maker.used(a)
            for a in kwargs.values():
                self.maker.used(a)
        return func(*args, **kwargs)


_METADATA = frozenset({
    "__get__", "__set__", "__hash__", "size", "dim", "ndimension", "numel", "nelement", "stride", "storage_offset",
    "untyped_storage", "data_ptr", "element_size", "is_floating_point", "is_complex", "is_contiguous", "get_device",
    "register_hook", "register_post_accumulate_grad_hook", "requires_grad_", "zeros_like", "empty_like", "ones_like",
    "full_like", "new_zeros", "new_empty", "new_ones", "new_full"})
"""What reads no element of a tensor (its attributes, its shape, a tensor of its shape): no use that makes it."""

_MAKERS: "weakref.WeakKeyDictionary[nn.Module, _Maker]" = weakref.WeakKeyDictionary()
_OWN_LOADING = (nn.Module._load_from_state_dict,)


def eligible(model: nn.Module) -> bool:
    """Whether `model`'s parameters can be made on use: a releasable copy (held_values.releasable), each parameter its
    own storage, from its start; every module loading its state as nn.Module does (no `_load_from_state_dict` of its
    own, no load hook but the copy's own); not compiled."""
    if not is_releasable(model) or hasattr(model, "_orig_mod"):
        return False
    if getattr(model.forward, "__wrapped__", None) is not None:
        return False
    seen: set[int] = set()
    for p in {id(p): p for p in model.parameters()}.values():
        key = p.untyped_storage()._cdata
        if p.storage_offset() != 0 or key in seen:
            return False
        seen.add(key)
    for m in model.modules():
        if type(m)._load_from_state_dict not in _OWN_LOADING:
            return False
        if m is not model and (m._load_state_dict_pre_hooks or m._load_state_dict_post_hooks):
            return False
    return True


@contextlib.contextmanager
def made_from(model: nn.Module, state: Mapping[str, torch.Tensor]) -> Iterator[_Maker]:
    """`model` (made releasable) loaded from `state` for the duration: its buffers copied in now (load_state_dict's
    own checks: every key of `state` the model's, every key of the model's in `state`), its parameters made from their
    entries of `state` as they are used (see the module docstring), every parameter let go after. The gradients
    backward leaves are the model's as they would be after a whole load."""
    maker = _MAKERS.get(model)
    if maker is None:
        maker = _MAKERS[model] = _Maker(model)
    params = dict(model.named_parameters(remove_duplicate=False))
    missing = [k for k in params if k not in state]
    buffers = {k: v for k, v in state.items() if k not in params}
    known = set(model.state_dict(keep_vars=True))
    unexpected = [k for k in buffers if k not in known]
    if missing or unexpected:
        try:
            model.load_state_dict(state)  # its own message
        finally:
            release(model)  # what it allocated before it refused
    release(model)
    if buffers:
        model.load_state_dict(buffers, strict=False)
    maker.source, maker.made, maker._bytes, maker.peak_bytes = state, {}, 0, 0
    try:
        with _OnUse(maker), torch.autograd.graph.saved_tensors_hooks(maker.pack, maker.unpack):
            yield maker
    finally:
        maker.source = None
        maker.made.clear()
        release(model)
