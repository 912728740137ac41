"""Whether a model's forward can change with the batch's content which of its parameters take part.

Owns: `watch(model)`, a context that records, during one forward, the first place the forward reads a tensor's value
into Python (`.item()`, `if tensor:`, `int(t)`, `.tolist()`, `.numpy()`) and the first place it sizes a tensor by its
values (`nonzero`, `x[mask]`, `masked_select`, `unique`): the only ways Python code can branch on the data, and so
use a parameter on one batch and leave it out on another (a mixture of experts skipping an expert no token chose);
and `left_out_by_parts`, which looks for that on parts of a batch. DDP needs to know (find_unused_parameters). Calls
inside torch's own Python functions are not seen (a torch function mode sees the outermost call only): what is
recorded is the model's code. Imports no adapter.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

_READS = frozenset({"item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__", "__complex__"})
"""Tensor methods that bring a tensor's value into Python."""
_SIZED_BY_VALUES = frozenset({"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive"})
"""Functions whose result's shape depends on the values."""
_INDEXING = frozenset({"__getitem__", "index_select"})


def _boolean_index(args: tuple) -> bool:
    """An index made of boolean tensors (x[mask]): the result's size is the mask's count."""
    index = args[1] if len(args) > 1 else None
    parts = index if isinstance(index, (tuple, list)) else (index,)
    return any(torch.is_tensor(p) and p.dtype == torch.bool for p in parts)


def _data_dependent(func, args: tuple, kwargs: dict) -> str | None:
    name = getattr(func, "__name__", "")
    if name in _READS or name in _SIZED_BY_VALUES:
        return name
    if name == "where" and len(args) + len(kwargs) == 1:  # torch.where(cond): nonzero
        return "where"
    if name in _INDEXING and _boolean_index(args):
        return "a boolean mask index"
    return None


@dataclass(slots=True)
class DataReads:
    read: str | None = None
    """Where the forward first read a tensor's value into Python: 'module path (Class) (call)', None when it never did."""
    sized: str | None = None
    """Where the forward first made a tensor whose size its values decide (routing: nonzero, x[mask]), or None."""

    @property
    def first(self) -> str | None:
        return self.sized or self.read


class _Watch(TorchFunctionMode):
    def __init__(self, found: DataReads, stack: list[str]) -> None:
        super().__init__()
        self.found, self.stack = found, stack

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.found.read is None or self.found.sized is None:
            what = _data_dependent(func, args, kwargs)
            if what is not None:
                where = f"{self.stack[-1] if self.stack else 'the forward'} ({what})"
                if what in _READS:
                    self.found.read = self.found.read or where
                else:
                    self.found.sized = self.found.sized or where
        return func(*args, **kwargs)


@contextlib.contextmanager
def watch(model: nn.Module) -> Iterator[DataReads]:
    """Around one forward of `model`: the first read of a tensor's value and the first tensor sized by its values in it
    (`DataReads`), each named by the innermost module running at the time."""
    found, stack = DataReads(), []
    handles = []

    def leave(*_) -> None:  # returns None: a forward hook's return value would replace the module's output
        if stack:
            stack.pop()

    for name, module in model.named_modules():
        label = f"{name} ({type(module).__name__})" if name else type(module).__name__
        handles.append(module.register_forward_pre_hook(lambda *_, label=label: stack.append(label)))
        handles.append(module.register_forward_hook(leave, always_call=True))
    try:
        with _Watch(found, stack):
            yield found
    finally:
        for handle in handles:
            handle.remove()


MAX_PARTS = 8
"""`left_out_by_parts` splits a batch into at most this many parts."""


def left_out_by_parts(model: nn.Module, loss_fn: Callable, x: torch.Tensor, y: torch.Tensor) -> tuple[str, ...]:
    """The trainable parameters of `model` that some part of the batch (x, y) leaves without a gradient, though the
    whole batch uses them: up to MAX_PARTS strided parts of at least two samples each (as ranks take their shards;
    two, so that BatchNorm still trains). A part whose forward fails (a model that refuses small batches) is passed
    over: this looks for evidence, it does not judge. `model`'s gradients are left cleared."""
    parts = min(MAX_PARTS, x.shape[0] // 2)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    left_out: dict[str, None] = {}
    for k in range(parts if parts >= 2 else 0):
        for _, p in named:
            p.grad = None
        try:
            loss_fn(model(x[k::parts]), y[k::parts]).backward()
        except Exception:  # noqa: BLE001 - evidence only; the run itself meets what this part met
            continue
        left_out.update((n, None) for n, p in named if p.grad is None)
    for _, p in named:
        p.grad = None
    return tuple(left_out)
