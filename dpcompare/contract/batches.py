"""A batch as a workload gives it, and everything the run and the checks do to one.

A workload's `make_batch(step, global_batch)` returns `(inputs, targets)`, each any structure of tensors (a tensor, a
dict or other mapping, a tuple, a list, a named tuple, a dataclass; leaves that are no tensor are passed through as
they are), or one mapping alone (a transformers batch: `input_ids`, `attention_mask`, `labels`), which is then both
the inputs and what the loss receives. Every tensor holds one row a sample along the sample dimension (0, or the
workload's `sample_dim`), 0-dim tensors excepted (a scalar the whole batch shares, passed through).

Owns: the structure's walk (`leaves`, `apply`), the sample count and its refusal (`rows`, BatchError), a rank's or a
forward's rows of every tensor (`take`, `stride`, `chunk`), their concatenation (`cat`), the move to a device with
floating tensors cast (`to`), the comparison of two batches (`equal`), and the model's call with the inputs as their
type says (`call`): `model(**inputs)` for a mapping, `model(*inputs)` for a tuple or list, `model(inputs)` otherwise,
or the workload's own `forward(model, inputs)`. The workload's convention (its `forward`, its `sample_dim`) is the
process's while its run lasts (`convention`), so that every copy of the model the checks run is called as the run
calls it. Imports nothing of dpcompare's.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch


class BatchError(ValueError):
    """A batch whose structure cannot be split by samples (said as the run's one line)."""


@dataclass(frozen=True, slots=True)
class Convention:
    forward: Callable[[Any, Any], Any] | None = None
    """`forward(model, inputs)`: how the workload calls its model (None: by the inputs' type)."""
    sample_dim: int = 0
    """The dimension of every tensor that counts samples."""


_CURRENT = [Convention()]


@contextlib.contextmanager
def convention(forward: Callable[[Any, Any], Any] | None = None, sample_dim: int = 0) -> Iterator[None]:
    """The workload's way of calling its model and counting samples, for the run that lasts inside."""
    _CURRENT.append(Convention(forward, sample_dim))
    try:
        yield
    finally:
        _CURRENT.pop()


def current() -> Convention:
    return _CURRENT[-1]


def pair(batch: Any) -> tuple[Any, Any]:
    """(inputs, targets) of what make_batch returned: a pair as it is; a mapping alone is both."""
    if isinstance(batch, Mapping):
        return batch, batch
    if isinstance(batch, (tuple, list)) and len(batch) == 2 and not hasattr(batch, "_fields"):
        return batch[0], batch[1]  # a list too: torch's default_collate returns [inputs, targets]
    raise BatchError(f"make_batch returned {type(batch).__name__}: return (inputs, targets), each a tensor or any "
                     "structure of tensors, or a dict of tensors (the whole batch, which the loss receives)")


# -- the walk ----------------------------------------------------------------------------------------------
def apply(fn: Callable[[torch.Tensor], Any], tree: Any) -> Any:
    """`tree` rebuilt with `fn` applied to each tensor leaf (other leaves as they are)."""
    if torch.is_tensor(tree):
        return fn(tree)
    if isinstance(tree, Mapping):
        items = {k: apply(fn, v) for k, v in tree.items()}
        try:
            return type(tree)(items)
        except Exception:  # a mapping whose constructor takes no dict
            out = copy.copy(tree)
            for k, v in items.items():
                out[k] = v
            return out
    if isinstance(tree, tuple):
        parts = [apply(fn, v) for v in tree]
        return type(tree)(*parts) if hasattr(tree, "_fields") else type(tree)(parts)
    if isinstance(tree, list):
        return type(tree)(apply(fn, v) for v in tree)
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        out = copy.copy(tree)
        for f in dataclasses.fields(tree):
            object.__setattr__(out, f.name, apply(fn, getattr(tree, f.name)))
        return out
    return tree


def named_leaves(tree: Any, path: str = "") -> list[tuple[str, torch.Tensor]]:
    """Every tensor leaf with its path (`["input_ids"]`, `[0]`, `.field`), in the structure's order."""
    if torch.is_tensor(tree):
        return [(path or "the batch", tree)]
    if isinstance(tree, Mapping):
        return [leaf for k, v in tree.items() for leaf in named_leaves(v, f"{path}[{k!r}]")]
    if isinstance(tree, (tuple, list)):
        return [leaf for i, v in enumerate(tree) for leaf in named_leaves(v, f"{path}[{i}]")]
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        return [leaf for f in dataclasses.fields(tree) for leaf in named_leaves(getattr(tree, f.name), f"{path}.{f.name}")]
    return []


def leaves(tree: Any) -> list[torch.Tensor]:
    return [t for _, t in named_leaves(tree)]


def _per_sample(t: torch.Tensor) -> bool:
    return t.dim() > 0


# -- samples -----------------------------------------------------------------------------------------------
def rows(*trees: Any) -> int:
    """The number of samples the trees hold: every tensor's size along the sample dimension (0-dim tensors left
    out), which must agree (else BatchError naming the tensors)."""
    dim = current().sample_dim
    sizes: dict[int, list[str]] = {}
    for i, tree in enumerate(trees):
        for path, t in named_leaves(tree, "inputs" if i == 0 and len(trees) > 1 else "targets" if i == 1 else ""):
            if _per_sample(t):
                if t.dim() <= dim:
                    raise BatchError(f"the batch's tensor {path} of shape {tuple(t.shape)} has no dimension {dim}, the "
                                     "sample dimension: every tensor holds one row a sample (a 0-dim tensor excepted)")
                sizes.setdefault(int(t.shape[dim]), []).append(path)
    if not sizes:
        raise BatchError("the batch holds no tensor with a sample dimension: make_batch returns tensors with one row "
                         "a sample")
    if len(sizes) > 1:
        said = "; ".join(f"{', '.join(paths[:3])}{' ...' if len(paths) > 3 else ''}: {n}"
                         for n, paths in sorted(sizes.items()))
        raise BatchError(f"the batch's tensors disagree on the number of samples along dimension {dim} ({said}): "
                         "every tensor of a batch holds one row a sample (declare Workload.sample_dim where it is "
                         "not dimension 0)")
    return next(iter(sizes))


def take(tree: Any, index: torch.Tensor | slice) -> Any:
    """The samples `index` (positions, or a slice) of every tensor with a sample dimension, each contiguous."""
    dim = current().sample_dim

    def one(t: torch.Tensor) -> torch.Tensor:
        if not _per_sample(t):
            return t
        if isinstance(index, slice):  # contiguous, as a DataLoader's batch is (a model may .view() it)
            return t[(slice(None),) * dim + (index,)].contiguous()
        return t.index_select(dim, index.to(t.device)) if dim else t[index.to(t.device)]

    return apply(one, tree)


def stride(tree: Any, start: int, step: int) -> Any:
    """Samples start, start + step, ... (DistributedSampler's rule for rank `start` of `step`)."""
    return take(tree, slice(start, None, step))


def chunk(tree: Any, k: int) -> list[Any]:
    """The tree cut into at most `k` contiguous parts of its samples, as torch.chunk cuts one tensor."""
    n = rows(tree)
    return [take(tree, part) for part in torch.arange(n).chunk(k)] if k > 1 else [tree]


def cat(trees: list[Any]) -> Any:
    """The samples of `trees` (of one structure) one after another."""
    if len(trees) == 1:
        return trees[0]
    dim = current().sample_dim
    flat = [leaves(t) for t in trees]
    joined = iter([torch.cat(parts, dim=dim) if _per_sample(parts[0]) else parts[0] for parts in zip(*flat)])
    return apply(lambda _: next(joined), trees[0])


def to(tree: Any, device: torch.device | str, float_dtype: torch.dtype | None = None) -> Any:
    """Every tensor on `device`; floating ones in `float_dtype` where given (integer ones, token ids, as they are)."""
    def one(t: torch.Tensor) -> torch.Tensor:
        t = t.to(device)
        return t.to(float_dtype) if float_dtype is not None and t.is_floating_point() else t

    return apply(one, tree)


def equal(a: Any, b: Any) -> bool:
    """Whether two batches hold the same tensors, to the bit."""
    la, lb = leaves(a), leaves(b)
    return len(la) == len(lb) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(la, lb))


def first(tree: Any) -> torch.Tensor | None:
    """The first tensor leaf (a single-tensor batch's tensor)."""
    found = leaves(tree)
    return found[0] if found else None


# -- the call ----------------------------------------------------------------------------------------------
def call(model: Any, inputs: Any) -> Any:
    """The model's forward of `inputs`, as the workload calls it (`convention`), else by the inputs' type."""
    forward = current().forward
    if forward is not None:
        return forward(model, inputs)
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)) and not hasattr(inputs, "_fields"):
        return model(*inputs)
    return model(inputs)


__all__ = ["BatchError", "Convention", "apply", "call", "cat", "chunk", "convention", "current", "equal", "first",
           "leaves", "named_leaves", "pair", "rows", "stride", "take", "to"]
