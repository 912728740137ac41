"""The verdict on the configurations GPU users train with: BatchNorm without SyncBN, module buffers, dropout.

Real 2-rank launches under the backends' own launchers. Without --sync-bn each replica normalises its own
shard: the oracle computes exactly that, so a correct backend is `equivalent`, and the distance from the
single-process global batch is stated (`per_replica_batchnorm`, with a number); the BatchNorm running
statistics differ across ranks and the result names the semantics each backend gives them (DDP: rank 0's
buffers broadcast at the forward; Horovod: each rank's own) with a `buffers_per_rank` note. Dropout masks
are captured during the ranks' forward, also where BatchNorm couples the samples.

With --sync-bn the statistics are the global batch's on every rank: the matrix's cnn runs check that
(test_equivalence_matrix.py). Negative twins: a backend that synchronises BatchNorm behind the user's back, one that updates the running
statistics twice per step, and a model whose randomness cannot be replayed (NumPy noise in its own forward) --
`different` with the cause, or `unverifiable` naming the module. The unit-level twins of the buffer check are
in test_buffers.py, of the mask capture in test_masks.py.
"""

from __future__ import annotations

import pytest

from test_equivalence_matrix import assert_equivalent
from test_negative import different

STEPS = ["--steps", "2"]
WS = 2
pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(240)]


def _note(e: dict, code: str) -> str:
    texts = [n["text"] for n in e["notes"] if n["code"] == code]
    assert texts, f"no {code} note in {[n['code'] for n in e['notes']]}"
    return texts[0]


def _per_replica(proc, result: dict, backend: str, semantics: str) -> dict:
    """`equivalent`, judged per replica with the distance stated, and BatchNorm's statistics per rank."""
    assert_equivalent(proc, result, backend=backend, world_size=WS, model="cnn", launcher=result["launcher"])
    e = result["equivalence"]
    bn = e["batchnorm"]
    assert bn["semantics"] == "per_replica" and bn["modules"] == ["1", "4"] and bn["forwards"] == WS, bn
    assert bn["local_batch"] == result["local_batch"] and bn["floors"] > 100, bn  # far from the global batch
    text = _note(e, "per_replica_batchnorm")
    assert f"{bn['floors']:.3g}x the float32 noise floor" in text and "--sync-bn makes it one computation" in text
    buffers = {b["name"]: b for b in e["buffers"]}
    for name in ("1.running_mean", "1.running_var", "4.running_mean", "4.running_var"):
        assert buffers[name]["ranks_agree"] is False and buffers[name]["semantics"] == [semantics], buffers[name]
    assert buffers["1.num_batches_tracked"]["ranks_agree"] is True
    assert "1.running_mean" in _note(e, "buffers_per_rank")
    assert "per-replica BatchNorm" in proc.stdout and "buffer(s) differ across ranks" in proc.stdout
    return e


@pytest.mark.slow  # breadth: the default tier keeps this capability's other test
def test_ddp_without_sync_bn_is_judged_per_replica(shared_launch):
    proc, result = shared_launch("ddp", WS, "cnn", STEPS)
    _per_replica(proc, result, "ddp", "rank0_broadcast")


@pytest.mark.slow  # ddp keeps the per-replica judgement in the default tier
@pytest.mark.parametrize("backend", ["horovod"], indirect=True)
def test_horovod_without_sync_bn_keeps_each_ranks_statistics(backend, shared_launch):
    proc, result = shared_launch(backend, WS, "cnn", STEPS)
    _per_replica(proc, result, backend, "own_shard")


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["deepspeed"], indirect=True)
def test_deepspeed_without_sync_bn_keeps_each_ranks_statistics(backend, shared_launch):
    proc, result = shared_launch(backend, WS, "cnn", STEPS)
    _per_replica(proc, result, backend, "own_shard")


@pytest.mark.slow
def test_batchnorm_per_micro_batch_is_judged_as_its_own_replica(launch):
    """--grad-accum 2 without --sync-bn: each rank normalises each micro-batch on its own, 4 forwards per step."""
    proc, result = launch("ddp", WS, "cnn", [*STEPS, "--grad-accum", "2"])
    assert_equivalent(proc, result, backend="ddp", world_size=WS, model="cnn", launcher="torchrun")
    assert result["equivalence"]["batchnorm"]["forwards"] == 2 * WS
    buffers = {b["name"]: b for b in result["equivalence"]["buffers"]}
    assert buffers["1.running_mean"]["semantics"] == ["rank0_broadcast"], buffers["1.running_mean"]


@pytest.mark.slow  # the default tier keeps this capability in a sibling test
def test_batchnorm_synchronised_behind_the_users_back_is_named(launch):
    """Negative twin: per-replica judging fails a backend that computes the global batch where it should not."""
    proc, result = launch("tests.faulty_adapters:SelfSyncingBatchNormDDP", WS, "cnn", STEPS)
    d = different(proc, result)
    assert (d["step"], d["cause"]) == (0, "batchnorm"), d
    assert "synchronises BatchNorm statistics on its own" in d["reason"], d["reason"]
    assert d["noise_ratio"] > 10, d


@pytest.mark.slow  # the default tier keeps this capability in a sibling test
def test_running_statistics_updated_twice_are_named(launch):
    """Negative twin of the buffer semantics: gradients right, buffers moved twice per step."""
    proc, result = launch("tests.faulty_adapters:TwiceForwardBatchNormDDP", WS, "cnn", STEPS)
    d = different(proc, result, "buffers")
    e = result["equivalence"]
    assert e["checks"]["gradient"]["status"] == "pass", e["checks"]
    assert (d["step"], d["cause"]) == (0, "buffer_updated_twice") and d["parameter"].endswith("running_mean"), d
    assert "updated it twice" in d["reason"], d["reason"]


@pytest.mark.slow
def test_the_models_own_clock_buffer_does_not_fail_the_verdict(launch):
    """A buffer no replay can predict (the wall clock) differs across ranks: reported and noted, never blamed."""
    proc, result = launch("ddp", WS, "tests.faulty_workloads:clock_buffer_mlp", STEPS)
    assert_equivalent(proc, result, backend="ddp", world_size=WS, model="clock-buffer-mlp", launcher="torchrun")
    clock = {b["name"]: b for b in result["equivalence"]["buffers"]}["2.last_seen"]
    assert clock["semantics"] == [] and clock["unexplained"]["reproducible"] is False, clock


@pytest.mark.slow  # breadth: the default tier keeps this capability's other test
def test_dropout_with_batchnorm_is_checked_on_the_captured_masks(shared_launch):
    """The masks each rank drew are joined into one forward of the global batch (--sync-bn)."""
    proc, result = shared_launch("ddp", WS, "tests.faulty_workloads:dropout_cnn", [*STEPS, "--sync-bn"])
    assert_equivalent(proc, result, backend="ddp", world_size=WS, model="dropout-cnn", launcher="torchrun")
    probe = result["equivalence"]["stochastic"]
    assert probe["stochastic"] and probe["captured"] and probe["capture_bytes_per_step"] > 0, probe


@pytest.mark.slow
def test_dropout_per_replica_is_checked_on_the_captured_masks(launch):
    proc, result = launch("ddp", WS, "tests.faulty_workloads:dropout_cnn", STEPS)
    assert_equivalent(proc, result, backend="ddp", world_size=WS, model="dropout-cnn", launcher="torchrun")
    assert result["equivalence"]["stochastic"]["captured"] and result["equivalence"]["batchnorm"]["floors"] > 100


@pytest.mark.slow  # the default tier keeps this capability in a sibling test
def test_randomness_that_cannot_be_replayed_is_unverifiable_and_named(launch):
    """Noise from NumPy's generator inside a module's forward: no torch random op draws it, so no replay reaches it,
    no `equivalent`, and the module is named (its neighbour's drop path, a torch.rand, is replayable)."""
    proc, result = launch("ddp", WS, "tests.random_models:numpy_noise", STEPS)
    assert proc.returncode == 0, proc.output[-4000:]
    e = result["equivalence"]
    assert e["verdict"] == "unverifiable", e
    assert "blocks.1 (NumpyNoiseBlock) draws random numbers outside torch's random operations" in \
        e["unverifiable_reason"] and "--no-dropout" in e["unverifiable_reason"], e
    assert e["checked_steps"] == [] and e["noise_ratio"] is None, "no figure measured against randomness"
    assert e["stochastic"]["stochastic"] is True and e["stochastic"]["captured"] is False
    assert "unverifiable" in proc.stdout
