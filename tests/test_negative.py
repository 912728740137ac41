"""The equivalence check can fail, and when it does it names the right step, parameter and cause.

Each test plants one known data-parallel fault into a 2-rank torchrun launch (through an adapter in
tests/faulty_adapters.py, loaded like a user's `package.module:Class`, or through the product's own
`--inject-fault`) and checks the JSON result against what that fault must produce: verdict `different`,
`first_divergence` at the step where the fault first acts, on the first parameter in the model's order,
with a reason that names the fault, and an error far above the noise floor (correct runs stay below
10x, test_equivalence_matrix.py). These are the negative twins of the matrix; the positive twin of the
adapter faults (the same command with the faultless parent adapter) is `test_faultless_parent_adapter_is_equivalent`.
"""

from __future__ import annotations

import pytest

from test_equivalence_matrix import assert_equivalent

STEPS = ["--steps", "2"]
WORLD_SIZE = 2
pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(240)]


def different(proc, result: dict | None) -> dict:
    """The run finished and came out `different`: return its first divergence."""
    assert proc.returncode == 0, proc.output[-6000:]
    assert result is not None
    e = result["equivalence"]
    assert e["verdict"] == "different", e
    assert e["first_divergence"] is not None
    assert "different" in proc.stdout and "first divergence at step" in proc.stdout, proc.stdout[-2000:]
    return e["first_divergence"]


def test_summed_gradients_are_named_at_step_0(launch):
    proc, result = launch("tests.faulty_adapters:SummingDDP", WORLD_SIZE, "mlp", STEPS)
    d = different(proc, result)
    assert (d["step"], d["parameter"]) == (0, "0.weight"), d
    assert "summed" in d["reason"], d["reason"]
    assert f"{WORLD_SIZE}x the oracle" in d["reason"], d["reason"]
    assert d["noise_ratio"] > 10, d
    # Every rank adds the same sum: the replicas stay identical, only the value is wrong.
    assert result["equivalence"]["replicas_identical"] is True


def test_skipped_synchronisation_is_named_at_step_1(launch):
    proc, result = launch("tests.faulty_adapters:SkipSyncOnceDDP", WORLD_SIZE, "mlp", STEPS)
    d = different(proc, result)
    assert (d["step"], d["parameter"]) == (1, "0.weight"), d
    assert "not synchronised" in d["reason"], d["reason"]
    assert "rank 0's local gradient" in d["reason"], d["reason"]
    assert d["noise_ratio"] > 10, d
    e = result["equivalence"]
    step0, step1 = e["per_step"]
    assert step0["noise_ratio"] < 10 and step0["grads_identical_across_ranks"], "step 0 was synchronised normally"
    assert step1["grads_identical_across_ranks"] is False
    assert e["replicas_identical"] is False, "local-only updates must leave the replicas apart"


def test_duplicated_shard_is_named_at_step_0(launch):
    proc, result = launch("ddp", WORLD_SIZE, "mlp", [*STEPS, "--inject-fault", "dupdata"])
    d = different(proc, result)
    assert (d["step"], d["parameter"]) == (0, "0.weight"), d
    assert "same shard" in d["reason"], d["reason"]
    assert "ranks 0 and 1" in d["reason"], d["reason"]
    assert d["noise_ratio"] > 10, d


def test_per_rank_batchnorm_without_sync_bn_is_named_at_step_0(launch):
    """Twin of the matrix's ddp-ws2-cnn run, which passes --sync-bn."""
    proc, result = launch("ddp", WORLD_SIZE, "cnn", STEPS)
    d = different(proc, result)
    assert (d["step"], d["parameter"]) == (0, "0.weight"), d
    assert "BatchNorm" in d["reason"] and "--sync-bn" in d["reason"], d["reason"]
    assert d["noise_ratio"] > 10, d


def test_replica_that_starts_from_other_weights_is_named(launch):
    """Twin of `initial_weights_identical` and `replicas_identical` in the matrix."""
    proc, result = launch("tests.faulty_adapters:DriftedInitDDP", WORLD_SIZE, "mlp", STEPS)
    d = different(proc, result)
    e = result["equivalence"]
    assert e["initial_weights_identical"] is False
    assert e["replicas_identical"] is False
    assert (d["step"], d["parameter"]) == (0, "4.bias"), d
    assert any("rank 1 started with different weights at parameter 4.bias" in n for n in e["notes"]), e["notes"]


def test_faultless_parent_adapter_is_equivalent(launch):
    """The faulty adapters' command with the fault taken out: their parent class, loaded by path too."""
    backend = "dpcompare.adapters.ddp:DDPAdapter"
    proc, result = launch(backend, WORLD_SIZE, "mlp", STEPS)
    assert_equivalent(proc, result, backend=backend, world_size=WORLD_SIZE, model="mlp", launcher="torchrun")
