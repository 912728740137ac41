"""The forward the step's oracle holds the ranks' shards to where they stand for the global batch
(dpcompare.verify.instruments.run_instruments.Bench.joined_pair, the join itself dpcompare.verify.model_facts.replica_forwards.Forwards.join): two ranks'
forwards joined into one, the next pair in turn, with those ranks' own losses; the global batch where there are two
ranks. And the first checked step's split measured on two ranks' forwards joined against their shards at three ranks
or more (Bench.split_on_a_pair). Glue, on a stand-in for the bench (its layout, its forwards, the divider's per-rank
losses; a float64 copy computing the shards in one process); the runs that rely on it are tests/test_divided.py's."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

import semantics_workloads as sw
from dpcompare.run import workloads
from dpcompare.verify.oracle import gradient_oracle as eq
from dpcompare.verify.randomness import draw_recording as mk
from dpcompare.verify.instruments.run_instruments import Bench
from dpcompare.verify.oracle.gradient_oracle import Layout
from dpcompare.verify.model_facts.replica_forwards import Forwards
from dpcompare.verify.model_facts import batch_split as split_module
from dpcompare.verify.model_facts.batch_split import SplitCheck

KEY = "drop (Dropout) aten.bernoulli_"


def _bench(world: int, grad_accum: int = 1) -> SimpleNamespace:
    layout = Layout(world, grad_accum)
    joins = SimpleNamespace(layout=layout)
    joins.whole = lambda batch, masks: Forwards.whole(joins, batch, masks)
    forwards = SimpleNamespace(join=lambda batch, masks, ranks: Forwards.join(joins, batch, masks, ranks))
    losses = {r: 10.0 ** r for r in range(world)}  # each rank's own: a sum names which ranks it added
    return SimpleNamespace(layout=layout, forwards=forwards, divider=SimpleNamespace(last_losses=losses), joined=[])


def _batch(n: int = 12):
    x = torch.arange(n, dtype=torch.float64).unsqueeze(1).repeat(1, 3)  # row i holds i
    return x, torch.arange(n)


def _masks(layout: Layout, n: int) -> list[dict[str, list[torch.Tensor]]]:
    """Each forward's draw: its samples' positions, so a joined draw shows which row came from where."""
    return [{KEY: [p[3].to(torch.float64).unsqueeze(1).repeat(1, 5)]} for p in layout.positions(n)]


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_two_ranks_forwards_are_joined_in_turn_with_their_draws_and_losses(grad_accum):
    bench, (x, y) = _bench(4, grad_accum), _batch()
    masks = _masks(bench.layout, 12)
    seen = []
    for _ in range(5):
        (piece,), loss = Bench.joined_pair(bench, (x, y), masks)
        seen.append((sorted(int(v) for v in piece.y), loss, piece.weight))
        # each row's draw is the one its own forward drew for that sample
        assert torch.equal(piece.masks[KEY][0][:, 0], piece.x[:, 0]) and torch.equal(piece.x[:, 0], piece.y.double())
    # rank r holds samples r, r + 4, r + 8: ranks 0 and 1, then 1 and 2, 2 and 3, 3 and 0, then 0 and 1 again
    expected = [([0, 1, 4, 5, 8, 9], 11.0), ([1, 2, 5, 6, 9, 10], 110.0), ([2, 3, 6, 7, 10, 11], 1100.0),
                ([0, 3, 4, 7, 8, 11], 1001.0), ([0, 1, 4, 5, 8, 9], 11.0)]
    assert [(s, loss) for s, loss, _ in seen] == expected
    assert all(w == 0.5 for _, _, w in seen)  # six of twelve samples: their loss is weighted as the shards' are
    assert [j["ranks"] for j in bench.joined] == [[0, 1], [1, 2], [2, 3], [0, 3], [0, 1]]
    assert all(j["samples"] == 6 for j in bench.joined)


def test_with_two_ranks_the_joined_forward_is_the_global_batch():
    bench, (x, y) = _bench(2), _batch()
    (piece,), loss = Bench.joined_pair(bench, (x, y), None)
    assert torch.equal(piece.x, x) and piece.weight == 1.0 and loss == 11.0
    assert bench.joined == [{"ranks": [0, 1], "samples": 12}]


def test_draws_that_are_not_batch_first_cannot_be_joined():
    bench, (x, y) = _bench(4), _batch()
    masks = [{KEY: [torch.zeros(7)]} for _ in bench.layout.positions(12)]
    with pytest.raises(mk.MaskMismatch):
        Bench.joined_pair(bench, (x, y), masks)


# -- the first checked step's split, measured on two ranks' forwards ----------------------------------------------
def _pair_bench(workload, world: int, monkeypatch):
    """A stand-in for rank 0's bench at `world` ranks sharing the oracle (its divider stands in: the float64 copy
    computes the shards here, in one process, as the ranks would), the split not yet measured; every float64 backward
    the measurement runs records its samples (`sizes`)."""
    layout = eq.Layout(world)
    verdict = eq.Verdict()
    oracle = eq.Oracle(workload.model, workload.loss_fn, "float32", torch.device("cpu"))
    forwards = Forwards(layout, oracle, batchnorms=[], per_replica=False, stochastic=False, dtype="float32",
                        depth=eq.depth_of(workload.model), verdict=verdict)
    check = SplitCheck(oracle, forwards, depth=eq.depth_of(workload.model), applies=True, verdict=verdict)
    sizes, oracle_of = [], oracle.oracle_of
    oracle.oracle_of = lambda state, pieces: (sizes.append(sum(p.x.shape[0] for p in pieces)),
                                              oracle_of(state, pieces))[1]
    distance_of = split_module.distance_of
    monkeypatch.setattr(split_module, "distance_of", lambda oracle, state, pieces, against: (
        sizes.append(sum(p.x.shape[0] for p in pieces)), distance_of(oracle, state, pieces, against))[1])
    bench = SimpleNamespace(divider=object(), layout=layout, split=check, forwards=forwards, reads_data=False)
    batch = workload.make_batch(0, 24)
    return bench, batch, forwards.pieces(batch, None), workload.model.state_dict(), sizes


@pytest.mark.parametrize("world", [2, 3, 4])
def test_at_two_ranks_or_more_the_first_split_is_measured_on_two_ranks_forwards(world, monkeypatch):
    bench, batch, pieces, state, sizes = _pair_bench(workloads.mlp(1234), world, monkeypatch)
    shards = Bench.split_on_a_pair(bench, 0, state, batch, None, pieces)
    f = bench.split.finding
    assert f.semantics == "global" and f.ranks == [0, 1] and f.distance_rel_fro < 1e-14, f
    assert bench.split.verdict.split["ranks"] == [0, 1]
    # two ranks' samples, joined and as their shards: below the global batch's 24 from three ranks; at two the pair
    # is the global batch, compared as its backward completes it (the distance_of call), never held whole
    assert sizes == [48 // world, 48 // world], sizes
    assert [p.rank for p in shards] == list(range(world)) and sum(p.weight for p in shards) == pytest.approx(1.0)


def test_a_split_dependent_forward_is_left_to_the_global_batch_after_the_pair(monkeypatch):
    bench, batch, pieces, state, sizes = _pair_bench(sw.split_by_size_mlp(1234), 3, monkeypatch)
    assert Bench.split_on_a_pair(bench, 0, state, batch, None, pieces) is None
    assert bench.split.finding is None  # measured on the global batch next, as before: it finds per_replica there
    bench.split.settle(0, state, batch, None, None, pieces, bench.split.oracle.oracle_of(state, pieces))
    assert bench.split.finding.semantics == "per_replica" and bench.split.finding.ranks is None
    bench, batch, pieces, state, sizes = _pair_bench(sw.split_by_size_mlp(1234), 2, monkeypatch)
    assert Bench.split_on_a_pair(bench, 0, state, batch, None, pieces) is None and bench.split.finding is None
    assert sizes == [24, 24], sizes  # at two ranks the pair is measured, found apart, and left to the global batch
    bench, batch, pieces, state, sizes = _pair_bench(workloads.mlp(1234), 1, monkeypatch)
    assert Bench.split_on_a_pair(bench, 0, state, batch, None, pieces) is None and sizes == []


@pytest.mark.parametrize(("items", "global_count", "paired"), [
    (lambda y: y.shape[0] ** 2, False, False),  # each rank's own count, out of proportion to its samples
    (lambda y: 3 * y.shape[0], False, True),     # items in proportion to the samples: weighted by them already
    (lambda y: y.shape[0] ** 2, True, True),     # --loss-normalisation global
], ids=["own-count-apart", "own-count-in-proportion", "global-count"])
def test_a_loss_normalised_by_each_ranks_own_count_is_not_paired(items, global_count, paired, monkeypatch):
    """A loss over items normalised by each rank's own count, the ranks' items out of proportion to their samples: the
    pair would part from its shards by the normalisation and be measured again on the global batch, so it is not
    computed (no float64 backward); in proportion, or under a global count, the pair is measured."""
    bench, batch, pieces, state, sizes = _pair_bench(workloads.mlp(1234), 2, monkeypatch)
    bench.layout = dataclasses.replace(bench.layout, items=items, global_count=global_count)
    bench.split.layout = bench.layout
    out = Bench.split_on_a_pair(bench, 0, state, (batch[0][:23], batch[1][:23]), None, pieces)
    assert (sizes != []) == paired, sizes
    f = bench.split.finding
    assert (out is not None) == (paired and f is not None and f.semantics == "global"), f


@pytest.mark.parametrize("world", [2, 3])
def test_at_two_ranks_the_pairs_shards_are_the_steps_split_to_the_bit(world, monkeypatch):
    """The pair's shards, measured at two ranks, are every rank's forwards: kept once for the step's oracle, the same
    gradient its own computation gives, to the bit (the step then computes them once, not twice). At three ranks the
    pair is two of them, and nothing is kept."""
    bench, batch, pieces, state, _ = _pair_bench(workloads.mlp(1234), world, monkeypatch)
    shared = Bench.split_on_a_pair(bench, 0, state, batch, None, pieces)
    kept = bench.split.pair_shards(0)
    if world != 2:
        assert kept is None
        return
    grads, none = kept
    own = bench.split.oracle.oracle_of(state, shared)
    names = bench.split.oracle.names
    assert all(torch.equal(grads[n], own[n]) for n in names) and none == bench.split.oracle.none
    assert bench.split.pair_shards(0) is None  # given once
