"""The buffer check names the semantics each module buffer follows, and fails only what a backend caused.

Each test plays two ranks in one process: float32 copies of a small BatchNorm model run their shard the way
a backend would (each rank from its own buffers, from rank 0's broadcast ones, or the global batch), and
dpcompare.verify.model_facts.buffer_semantics.BufferCheck is handed the snapshots a real run gathers. Every semantics has its
twin: buffers made one way must not be credited to another; a buffer updated twice fails, a buffer of the
model's own clock does not; the check never touches the run's buffers.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn import functional as F

from dpcompare.contract.workload import shard
from dpcompare.verify.model_facts import buffer_semantics as bf
from dpcompare.verify.oracle import gradient_oracle as eq
from faulty_workloads import _ClockBuffer

WS = 2


def _model(extra: nn.Module | None = None) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), *([extra] if extra is not None else []), nn.ReLU(),
                         nn.Linear(6, 3))


def _batch():
    torch.manual_seed(3)
    return torch.randn(8, 4), torch.randint(0, 3, (8,))


def _after(model: nn.Module, start: bf.Buffers, x: torch.Tensor, times: int = 1) -> bf.Buffers:
    """What a rank's float32 model holds after training-mode forwards of `x` from buffers `start`."""
    m = copy.deepcopy(model).train()
    with torch.no_grad():
        for name, b in m.named_buffers():
            b.copy_(start[name])
        for _ in range(times):
            m(x)
    return bf.snapshot(m)


def _check(model: nn.Module, make_after, before: list[bf.Buffers] | None = None):
    """BufferCheck of one step whose rank r ends with make_after(r, before, batch)."""
    batch = _batch()
    start = bf.snapshot(model)
    before = before or [start, start]
    evidence = [{"before": before[r], "after": make_after(r, before, batch)} for r in range(WS)]
    oracle = eq.Oracle(model, lambda out, t: F.cross_entropy(out, t), "float32", torch.device("cpu"))
    check = bf.BufferCheck(oracle, eq.depth_of(model), "float32")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    failure = check.check(0, state, batch, eq.Layout(WS), evidence, None)
    return {e["name"]: e for e in check.entries()}, failure, check


def _moved(start: bf.Buffers) -> bf.Buffers:
    """Rank 1's buffers after an earlier step of its own: not rank 0's."""
    return {k: (v + 0.25 if v.is_floating_point() else v) for k, v in start.items()}


def test_each_ranks_own_shard_is_named_and_the_ranks_differ():
    model = _model()
    start = bf.snapshot(model)
    entries, failure, check = _check(model, lambda r, before, b: _after(model, before[r], shard(b, r, WS)[0]),
                                     before=[start, _moved(start)])
    assert failure is None
    mean = entries["1.running_mean"]
    assert mean["semantics"] == ["own_shard"] and not mean["ranks_agree"] and mean["max_rel_diff_between_ranks"] > 0.1
    assert entries["1.num_batches_tracked"]["ranks_agree"] and entries["1.num_batches_tracked"]["updated_by_forward"]
    note = check.note()
    assert note is not None and "1.running_mean" in note and "own buffers and shard" in note


def test_rank_0s_broadcast_buffers_are_named():
    model = _model()
    start = bf.snapshot(model)
    entries, failure, _ = _check(model, lambda r, before, b: _after(model, before[0], shard(b, r, WS)[0]),
                                 before=[start, _moved(start)])
    assert failure is None
    assert entries["1.running_mean"]["semantics"] == ["rank0_broadcast"]
    assert entries["1.running_var"]["semantics"] == ["rank0_broadcast"]


def test_global_batch_statistics_are_named_and_the_ranks_agree():
    model = _model()
    entries, failure, check = _check(model, lambda r, before, b: _after(model, before[0], b[0]))
    assert failure is None
    assert entries["1.running_mean"]["semantics"] == ["global_batch"] and entries["1.running_mean"]["ranks_agree"]
    assert entries["1.running_mean"]["nearest"] == ["global_batch"]
    assert check.note() is None, "buffers that agree across ranks need no note"


def test_buffers_updated_twice_fail_with_that_cause():
    model = _model()
    entries, failure, _ = _check(model, lambda r, before, b: _after(model, before[r], shard(b, r, WS)[0], times=2))
    assert failure is not None and failure.check == "buffers" and failure.cause == "buffer_updated_twice", failure
    assert failure.parameter == "1.running_mean" and "updated it twice" in failure.reason
    assert entries["1.running_mean"]["semantics"] == [] and entries["1.running_mean"]["unexplained"]["reproducible"]


def test_buffers_left_unchanged_fail_with_that_cause():
    """A forward in eval mode: BatchNorm's statistics do not move where every semantics moves them."""
    model = _model()
    entries, failure, _ = _check(model, lambda r, before, b: dict(before[r]))
    assert failure is not None and failure.cause == "buffer_not_updated", failure
    assert "eval mode" in failure.reason


def test_the_models_own_clock_buffer_is_reported_not_failed():
    """Twin of the two failures above: a buffer the forward's replay cannot predict is the model's own business."""
    model = _model(_ClockBuffer())
    entries, failure, _ = _check(model, lambda r, before, b: _after(model, before[r], shard(b, r, WS)[0]))
    assert failure is None
    clock = entries["2.last_seen"]
    assert clock["semantics"] == [] and clock["unexplained"]["reproducible"] is False, clock
    # Both ranks started from the same buffers: broadcasting rank 0's changes nothing, both predictions coincide.
    assert entries["1.running_mean"]["semantics"] == entries["1.running_mean"]["nearest"] == ["rank0_broadcast",
                                                                                              "own_shard"]


def test_checking_never_changes_the_runs_buffers():
    """The check predicts on the oracle's own models from snapshots; the run's module keeps its buffers bit for bit.
    Negative twin: the same predictions do move the buffers of the model they run on."""
    model = _model()
    run = copy.deepcopy(model)
    mine = bf.snapshot(run)
    _check(run, lambda r, before, b: _after(run, before[r], shard(b, r, WS)[0]))
    assert all(torch.equal(b, mine[n]) for n, b in run.named_buffers())
    snap = bf.snapshot(run)
    snap["1.running_mean"].add_(1.0)
    assert torch.equal(dict(run.named_buffers())["1.running_mean"], mine["1.running_mean"]), "a snapshot is a copy"
    oracle = eq.Oracle(run, lambda out, t: F.cross_entropy(out, t), "float32", torch.device("cpu"))
    check = bf.BufferCheck(oracle, eq.depth_of(run), "float32")
    moved = check._f64({k: v.clone() for k, v in run.state_dict().items()}, mine, eq.global_pieces(_batch()))
    assert not torch.equal(moved["1.running_mean"].float(), mine["1.running_mean"])


def test_ddp_broadcast_under_accumulation_is_rank_0s_buffers_at_the_steps_first_forward():
    """With --grad-accum, DDP broadcasts before the forward that follows a synchronised one (the first micro-batch)
    and not under no_sync; each rank then runs all its micro-batches. Twin: broadcasting at the last micro-batch
    instead matches no semantics."""
    model = _model()
    batch = _batch()
    start = bf.snapshot(model)
    before = [start, _moved(start)]
    micro = [shard(batch, r, WS)[0].chunk(2) for r in range(WS)]

    def check(after):
        oracle = eq.Oracle(model, lambda out, t: F.cross_entropy(out, t), "float32", torch.device("cpu"))
        c = bf.BufferCheck(oracle, eq.depth_of(model), "float32")
        state = {key: v.clone() for key, v in model.state_dict().items()}
        failure = c.check(0, state, batch, eq.Layout(WS, 2), [{"before": before[r], "after": after[r]}
                                                                 for r in range(WS)], None)
        return {e["name"]: e for e in c.entries()}["1.running_mean"], failure

    first = [_after(model, _after(model, before[0], micro[r][0]), micro[r][1]) for r in range(WS)]
    entry, failure = check(first)
    assert failure is None and entry["semantics"] == ["rank0_broadcast"], entry
    rank0_after_first = _after(model, before[0], micro[0][0])
    last = [_after(model, rank0_after_first, micro[r][1]) for r in range(WS)]
    entry, failure = check(last)
    assert entry["semantics"] == [] and failure is not None and failure.cause == "buffer_semantics", entry
