"""Whether a model's forward can change with the batch's content which of its parameters take part.

Owns: `watch(model)`, a context that records, during one forward, where the forward reads a tensor's value into
Python (`.item()`, `if tensor:`, `int(t)`, `.tolist()`, `.numpy()`) and where it sizes a tensor by its values
(`nonzero`, `x[mask]`, `masked_select`, `unique`): the only ways Python code can branch on the data, and so use a
parameter on one batch and leave it out on another (a mixture of experts skipping an expert no token chose); and
`left_out_by_parts`, which looks for that on parts of a batch. DDP needs to know (find_unused_parameters).

A value read counts as branching only in the model's own code (the files of its modules' classes): a library
helper's read (transformers' causal-mask helpers check their inputs with `if tensor.all():` in every causal LM)
decides no parameter. A tensor sized by its values counts wherever it is made. Calls inside torch's own Python
functions are not seen (a torch function mode sees the outermost call only). Imports no adapter.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from dpcompare.contract import batches

_READS = frozenset({"item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__", "__complex__"})
"""Tensor methods that bring a tensor's value into Python."""
_SIZED_BY_VALUES = frozenset({"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive"})
"""Functions whose result's shape depends on the values."""
_INDEXING = frozenset({"__getitem__", "index_select"})
_TORCH_DIR = str(Path(torch.__file__).resolve().parent)


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
    """Where the forward first read a tensor's value into Python, in any code: 'module path (Class) (call)', or None."""
    own_read: str | None = None
    """Where the model's own code first read a tensor's value into Python, or None."""
    sized: str | None = None
    """Where the forward first made a tensor whose size its values decide (routing: nonzero, x[mask]), or None."""

    @property
    def branch(self) -> str | None:
        """Where the forward can branch on the data (a tensor sized by it, or a value read in the model's code)."""
        return self.sized or self.own_read

    @property
    def first(self) -> str | None:
        return self.branch or self.read


def _caller_file() -> str:
    """The file of the innermost frame outside torch, this module and any other mode's handler (the float64 copies'
    own TorchFunctionMode sits between a model's call and this one): the code that made the call."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if (name != __file__ and not name.startswith(_TORCH_DIR)
                and frame.f_code.co_name not in ("__torch_function__", "__torch_dispatch__")):
            return name
        frame = frame.f_back
    return ""


class _Watch(TorchFunctionMode):
    def __init__(self, found: DataReads, stack: list[str], own_files: frozenset[str]) -> None:
        super().__init__()
        self.found, self.stack, self.own_files = found, stack, own_files

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.found.own_read is None or self.found.sized is None:
            what = _data_dependent(func, args, kwargs)
            if what is not None:
                self._record(what)
        return func(*args, **kwargs)

    def _record(self, what: str) -> None:
        where = f"{self.stack[-1] if self.stack else 'the forward'} ({what})"
        if what not in _READS:
            self.found.sized = self.found.sized or where
            return
        self.found.read = self.found.read or where
        if self.found.own_read is None and _resolved(_caller_file()) in self.own_files:
            self.found.own_read = where


def _resolved(name: str) -> str:
    return str(Path(name).resolve()) if name and not name.startswith("<") else name


def _own_files(model: nn.Module) -> frozenset[str]:
    """The files of the model's modules' classes, torch's own layers aside."""
    files = set()
    for m in model.modules():
        if type(m).__module__.startswith("torch."):
            continue
        with contextlib.suppress(TypeError, OSError):
            files.add(_resolved(inspect.getsourcefile(type(m)) or ""))
    return frozenset(files - {""})


@contextlib.contextmanager
def watch(model: nn.Module) -> Iterator[DataReads]:
    """Around one forward of `model`: where it reads the data (`DataReads`), each place named by the innermost module
    running at the time."""
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
        with _Watch(found, stack, _own_files(model)):
            yield found
    finally:
        for handle in handles:
            handle.remove()


MAX_PARTS = 8
"""`left_out_by_parts` splits a batch into at most this many parts."""


def left_out_by_parts(model: nn.Module, loss_fn: Callable, x: Any, y: Any) -> tuple[str, ...]:
    """The trainable parameters of `model` that some part of the batch (x, y) leaves without a gradient: up to
    MAX_PARTS strided parts of at least two samples each (as ranks take their shards; two, so that BatchNorm still
    trains). A part whose forward fails (a model that refuses small batches) is passed over: this looks for evidence,
    it does not judge. `model`'s gradients are left cleared."""
    parts = min(MAX_PARTS, batches.rows(x) // 2)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    left_out: dict[str, None] = {}
    for k in range(parts if parts >= 2 else 0):
        for _, p in named:
            p.grad = None
        try:
            loss_fn(batches.call(model, batches.stride(x, k, parts)), batches.stride(y, k, parts)).backward()
        except Exception:  # noqa: BLE001 - evidence only; the run itself meets what this part met
            continue
        left_out.update((n, None) for n, p in named if p.grad is None)
    for _, p in named:
        p.grad = None
    return tuple(left_out)
