"""dpcompare.from_dataset against torch's own DistributedSampler and DataLoader.

Checks that rank r's strided shard (dpcompare.shard) of the global batch from_dataset makes for step s is, sample for
sample, the batch a DistributedSampler(num_replicas=N, rank=r, seed=seed, shuffle, drop_last=True) with set_epoch(e)
and a DataLoader(batch_size=global_batch // N, drop_last=True) hands rank r at that step, for N = 2 and 3, over three
epochs of a dataset the global batch and N do not divide (no process group: the sampler is given N and r). The
negative twins: another seed, or shuffle=False against a shuffling sampler, does not match. Also: the batch's shape
(a pair as a tuple, a dict as it is), the same batch on every call, no global generator drawn from, and one
DatasetError line for each refusal (an IterableDataset, no __len__, an empty dataset, a global batch larger than the
dataset, a collate_fn returning something else).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from dpcompare import from_dataset, shard
from dpcompare.data import DatasetError

SIZE = 23  # neither the global batch (6) nor N (2, 3) divides it: the sampler and the epoch both drop a tail
GLOBAL_BATCH = 6
EPOCHS = 3


def _dataset() -> TensorDataset:
    index = torch.arange(SIZE)
    return TensorDataset(index.float().unsqueeze(1) * 10, index)  # targets are the sample's index


def _sampler_batches(dataset: Dataset, world_size: int, rank: int, seed: int, shuffle: bool = True) -> list:
    """What a training loop over DistributedSampler and DataLoader gives `rank`, step after step, for EPOCHS epochs."""
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed,
                                 drop_last=True)
    loader = DataLoader(dataset, batch_size=GLOBAL_BATCH // world_size, sampler=sampler, drop_last=True)
    out = []
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        out += [tuple(batch) for batch in loader]
    return out


def _ours(make_batch, world_size: int, rank: int, steps: int) -> list:
    return [shard(make_batch(step, GLOBAL_BATCH), rank, world_size) for step in range(steps)]


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, u) and torch.equal(y, v) for (x, y), (u, v) in zip(a, b))


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("shuffle", [True, False])
def test_each_rank_gets_what_distributed_sampler_and_dataloader_give_it(world_size: int, shuffle: bool):
    dataset = _dataset()
    make_batch = from_dataset(dataset, seed=7, shuffle=shuffle)
    for rank in range(world_size):
        expected = _sampler_batches(dataset, world_size, rank, seed=7, shuffle=shuffle)
        assert len(expected) == EPOCHS * (SIZE // GLOBAL_BATCH)  # the loop's steps: 3 an epoch, the tail dropped
        assert _same(_ours(make_batch, world_size, rank, len(expected)), expected), (world_size, rank)


@pytest.mark.parametrize("world_size", [2, 3])
def test_another_seed_or_no_shuffle_does_not_match_the_sampler(world_size: int):
    dataset = _dataset()
    expected = _sampler_batches(dataset, world_size, 0, seed=7)
    steps = len(expected)
    assert not _same(_ours(from_dataset(dataset, seed=8), world_size, 0, steps), expected)
    assert not _same(_ours(from_dataset(dataset, seed=7, shuffle=False), world_size, 0, steps), expected)


def test_the_order_is_distributed_samplers_permutation_epoch_by_epoch():
    """Step s of epoch e is perm_e[s*gb:(s+1)*gb], perm_e = randperm(len) with a generator seeded seed + e; the
    len % gb samples at an epoch's end are left out of it."""
    make_batch = from_dataset(_dataset(), seed=3)
    per_epoch = SIZE // GLOBAL_BATCH
    for epoch in range(EPOCHS):
        perm = torch.randperm(SIZE, generator=torch.Generator().manual_seed(3 + epoch))
        taken = torch.cat([make_batch(epoch * per_epoch + s, GLOBAL_BATCH)[1] for s in range(per_epoch)])
        assert torch.equal(taken, perm[:per_epoch * GLOBAL_BATCH])


def test_every_call_builds_the_same_batch_and_draws_no_global_random_number():
    make_batch = from_dataset(_dataset(), seed=1)
    state = torch.get_rng_state()
    first = make_batch(5, GLOBAL_BATCH)
    torch.manual_seed(12345)  # what a rank's own seeding does to the global generator
    again = from_dataset(_dataset(), seed=1)(5, GLOBAL_BATCH)
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    torch.set_rng_state(state)
    make_batch(6, GLOBAL_BATCH)
    assert torch.equal(torch.get_rng_state(), state)


def test_the_batch_is_a_pair_as_a_tuple_or_a_dict_as_it_is():
    x, y = torch.randn(8, 3), torch.arange(8)
    pair = from_dataset(TensorDataset(x, y), shuffle=False)(0, 4)
    assert type(pair) is tuple and torch.equal(pair[0], x[:4]) and torch.equal(pair[1], y[:4])

    class Tokens(Dataset):
        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int) -> dict:
            return {"input_ids": torch.full((5,), i), "labels": torch.full((5,), i)}

    batch = from_dataset(Tokens(), shuffle=False)(1, 4)
    assert set(batch) == {"input_ids", "labels"} and batch["labels"][:, 0].tolist() == [4, 5, 6, 7]
    joined = from_dataset(TensorDataset(x, y), shuffle=False, collate_fn=lambda s: [torch.stack([a for a, _ in s]),
                                                                                     torch.stack([b for _, b in s])])
    assert torch.equal(joined(1, 4)[1], y[4:])


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(range(4))


class _NoLength(Dataset):
    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.zeros(1)


@pytest.mark.parametrize("dataset, said", [
    (_Stream(), "_Stream is an IterableDataset"),
    (_NoLength(), "_NoLength has no __len__"),
    (TensorDataset(torch.zeros(0, 2)), "TensorDataset is empty"),
])
def test_a_dataset_without_an_order_is_refused_in_one_line(dataset, said: str):
    with pytest.raises(DatasetError, match=said) as caught:
        from_dataset(dataset)
    assert "\n" not in str(caught.value) and isinstance(caught.value, ValueError)


def test_a_global_batch_larger_than_the_dataset_is_refused_in_one_line():
    make_batch = from_dataset(_dataset())
    assert len(make_batch(0, SIZE)[1]) == SIZE  # the whole dataset is still a global batch
    with pytest.raises(DatasetError, match=f"a global batch of {SIZE + 1} samples cannot be drawn from a dataset of "
                                           f"{SIZE}: give --global-batch from 1 to {SIZE}") as caught:
        make_batch(0, SIZE + 1)
    assert "\n" not in str(caught.value)


def test_a_collate_fn_returning_neither_a_pair_nor_a_dict_is_refused():
    dataset = TensorDataset(torch.zeros(4, 2), torch.zeros(4), torch.zeros(4))
    with pytest.raises(DatasetError, match="the collate function returned a list of 3: give a collate_fn that "
                                           r"returns \(inputs, targets\) or a dict"):
        from_dataset(dataset)(0, 2)
