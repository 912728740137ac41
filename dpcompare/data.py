"""A torch Dataset as the source of a workload's batches: `from_dataset(dataset)` is a `make_batch(step, global_batch)`.

The order is DistributedSampler's (torch.utils.data.distributed), so a rank's shard of a step's global batch is the
batch a DistributedSampler and a DataLoader would hand that rank: epoch e's order is `torch.randperm(len(dataset),
generator=g)` with `g.manual_seed(seed + e)` (its `set_epoch(e)`), or the dataset's own order with shuffle=False; step s
of an epoch takes the samples `order[s * global_batch:(s + 1) * global_batch]`, and a rank of N takes every N-th of
them (DistributedSampler's `rank::num_replicas`: dpcompare.contract.batches.stride), which is what
`DistributedSampler(dataset, N, rank, shuffle=shuffle, seed=seed, drop_last=True)` with a `DataLoader(batch_size=
global_batch // N, drop_last=True)` gives rank r (tests/test_data.py compares the two).

An epoch holds `len(dataset) // global_batch` steps: a global batch never runs into the next epoch, and the
`len(dataset) % global_batch` samples at the end of an epoch's order are left out of that epoch (DataLoader's
drop_last=True); the next epoch's order is a fresh permutation, so they are other samples each epoch.

Owns: `from_dataset` and its refusal (`DatasetError`). Imports nothing of dpcompare's; the run layer is above it.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache
from typing import Any, Callable

import torch
from torch.utils.data import Dataset, IterableDataset, default_collate


class DatasetError(ValueError):
    """A dataset from_dataset cannot order, or a global batch it cannot fill (said as the run's one line)."""


def from_dataset(dataset: Dataset, *, seed: int = 0, shuffle: bool = True,
                 collate_fn: Callable[[list[Any]], Any] | None = None) -> Callable[[int, int], Any]:
    """`make_batch(step, global_batch)` over a map-style dataset (one with `__len__` and `__getitem__`), in
    DistributedSampler's order for `seed` (see the module's docstring), the samples put together by `collate_fn`
    (torch's default_collate when None). Every rank builds the same global batch: the order depends on (seed, epoch)
    alone and no global generator is drawn from, so the dataset's `__getitem__` must not draw from one either.

    The batch is what `collate_fn` returns: a pair (a tuple or list of two: default_collate's `[inputs, targets]`)
    as the tuple `(inputs, targets)`, or a mapping as it is (the whole batch: a transformers batch with its `labels`).
    Raises DatasetError for an IterableDataset or a dataset without `__len__` or `__getitem__`, an empty one, a global
    batch larger than the dataset, and a collate_fn that returns anything else."""
    size = _size(dataset)
    collate = default_collate if collate_fn is None else collate_fn

    @lru_cache(maxsize=2)  # the current epoch's order, and the last one's (8 bytes a sample)
    def permutation(epoch: int) -> torch.Tensor:
        g = torch.Generator()
        g.manual_seed(seed + epoch)  # DistributedSampler.__iter__ after set_epoch(epoch)
        return torch.randperm(size, generator=g)

    def make_batch(step: int, global_batch: int) -> Any:
        if not 1 <= global_batch <= size:
            raise DatasetError(f"from_dataset: a global batch of {global_batch} samples cannot be drawn from a dataset "
                               f"of {size}: give --global-batch from 1 to {size}, or a larger dataset")
        steps_per_epoch = size // global_batch
        epoch, position = divmod(step, steps_per_epoch)
        start = position * global_batch
        indices = (permutation(epoch)[start:start + global_batch].tolist() if shuffle
                   else list(range(start, start + global_batch)))
        return _pair(collate(_fetch(dataset, indices)))

    return make_batch


def _size(dataset: Any) -> int:
    if isinstance(dataset, IterableDataset):
        raise DatasetError(f"from_dataset: {type(dataset).__name__} is an IterableDataset, which has no order to draw "
                           "samples from by index: give a map-style Dataset (with __len__ and __getitem__), e.g. a "
                           "TensorDataset of its samples")
    try:
        size = len(dataset)
    except TypeError:
        raise DatasetError(f"from_dataset: {type(dataset).__name__} has no __len__, so its order cannot be drawn: give "
                           "a map-style Dataset with __len__ and __getitem__") from None
    if not hasattr(dataset, "__getitem__"):
        raise DatasetError(f"from_dataset: {type(dataset).__name__} has no __getitem__: give a map-style Dataset with "
                           "__len__ and __getitem__")
    if size < 1:
        raise DatasetError(f"from_dataset: {type(dataset).__name__} is empty: give a dataset with samples")
    return size


def _fetch(dataset: Any, indices: list[int]) -> list[Any]:
    """The samples at `indices`, as DataLoader's fetcher reads them: `__getitems__` where the dataset has one (a
    batched read: Hugging Face datasets), else one `__getitem__` a sample."""
    getitems = getattr(dataset, "__getitems__", None)
    return getitems(indices) if callable(getitems) else [dataset[i] for i in indices]


def _pair(batch: Any) -> Any:
    if isinstance(batch, Mapping):
        return batch
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return tuple(batch)  # a named tuple too: its two fields are the inputs and the targets
    said = f"{type(batch).__name__} of {len(batch)}" if isinstance(batch, (tuple, list)) else type(batch).__name__
    raise DatasetError(f"from_dataset: the collate function returned a {said}: give a collate_fn that returns "
                       "(inputs, targets) or a dict (the whole batch, which the loss receives)")
