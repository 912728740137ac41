"""The verdict can fail, and when it does it names the right step, check, parameter and cause.

Each test plants one known data-parallel fault into a 2-rank launch under a real launcher (through an
adapter in tests/faulty_adapters.py or a workload in tests/faulty_workloads.py, loaded like a user's
`package.module:Class` / `package.module:function`, or through the product's own `--inject-fault` and
`--opt`) and checks the JSON result against what that fault must produce: verdict `different` (or
`unverifiable` where the run cannot be checked), `first_divergence` at the step and in the check where the
fault first acts (gradient, update, trajectory, generators), on the parameter it first hits, with a reason
that names the fault, and an error far above the noise floor (correct runs stay below 10x,
test_equivalence_matrix.py). These are the negative twins of the matrix; the positive twin of the adapter
faults (the same command with the faultless parent adapter) is `test_faultless_parent_adapter_is_equivalent`,
and the positive twins of the update faults are the matrix's runs plus the benign Horovod trap below.

Tiers: the default tier plants one fault per check (gradient, replicas, update, generators) and per verdict
path (a diverged run); the `slow` tier plants the rest. The BatchNorm, buffer and dropout-capture faults are
in test_semantics.py.
"""

from __future__ import annotations

import pytest

from test_equivalence_matrix import assert_equivalent

STEPS = ["--steps", "2"]
WORLD_SIZE = 2
pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(240)]


def different(proc, result: dict | None, check: str = "gradient") -> dict:
    """The run finished and came out `different` in `check`: return its first divergence."""
    assert proc.returncode == 0, proc.output[-6000:]
    assert result is not None
    e = result["equivalence"]
    assert e["verdict"] == "different", e
    assert e["first_divergence"] is not None
    assert e["first_divergence"]["check"] == check, e["first_divergence"]
    assert e["checks"].get(check, {"status": "fail"})["status"] == "fail", e["checks"]
    assert "different" in proc.stdout and "first divergence at step" in proc.stdout, proc.stdout[-2000:]
    return e["first_divergence"]


def update_failed(proc, result: dict | None) -> dict:
    """The gradient passed at every checked step, the update did not."""
    d = different(proc, result, "update")
    e = result["equivalence"]
    assert e["checks"]["gradient"]["status"] == "pass" and e["noise_ratio"] < 10, e["checks"]
    assert d["reason"].startswith("the gradient passed but the update did not"), d["reason"]
    assert d["noise_ratio"] > 10, d
    return d


@pytest.mark.slow  # breadth: the default tier keeps this capability's other test
def test_summed_gradients_are_named_at_step_0(launch):
    proc, result = launch("tests.faulty_adapters:SummingDDP", WORLD_SIZE, "mlp", STEPS)
    d = different(proc, result)
    assert (d["step"], d["parameter"]) == (0, "0.weight"), d
    assert "summed" in d["reason"], d["reason"]
    assert f"{WORLD_SIZE}x the oracle" in d["reason"], d["reason"]
    assert d["noise_ratio"] > 10, d
    # Every rank adds the same sum: the replicas stay identical, only the value is wrong.
    assert result["equivalence"]["replicas_identical"] is True


@pytest.mark.slow
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


@pytest.mark.slow
def test_duplicated_shard_is_named_at_step_0(launch):
    proc, result = launch("ddp", WORLD_SIZE, "mlp", [*STEPS, "--inject-fault", "dupdata"])
    d = different(proc, result)
    assert (d["step"], d["parameter"]) == (0, "0.weight"), d
    assert "same shard" in d["reason"], d["reason"]
    assert "ranks 0 and 1" in d["reason"], d["reason"]
    assert d["noise_ratio"] > 10, d


@pytest.mark.slow  # the default tier keeps this capability in a sibling test
def test_replica_that_starts_from_other_weights_is_named(launch):
    """Twin of `initial_weights_identical` and `replicas_identical` in the matrix."""
    proc, result = launch("tests.faulty_adapters:DriftedInitDDP", WORLD_SIZE, "mlp", STEPS)
    d = different(proc, result, "replicas")
    e = result["equivalence"]
    assert e["initial_weights_identical"] is False
    assert e["replicas_identical"] is False
    assert (d["step"], d["parameter"]) == (0, "4.bias"), d
    assert any(n["code"] == "initial_weights" and "rank 1 started with different weights at parameter 4.bias" in n["text"]
               for n in e["notes"]), e["notes"]


@pytest.mark.slow  # breadth: the default tier keeps this capability's other test
def test_faultless_parent_adapter_is_equivalent(shared_launch):
    """The faulty adapters' command with the fault taken out: their parent class, ddp, in the same launch as the
    equivalence matrix's ddp run (shared, not repeated). The faulty adapters themselves are loaded by path."""
    proc, result = shared_launch("ddp", WORLD_SIZE, "mlp", STEPS)
    assert_equivalent(proc, result, backend="ddp", world_size=WORLD_SIZE, model="mlp", launcher="torchrun")


# -- the update check ----------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["horovod"], indirect=True)
def test_learning_rate_scaled_by_the_world_size_is_named_at_step_0(backend, launch):
    """Horovod with the linear-scaling rule (lr x hvd.size()), which the other backends do not apply."""
    proc, result = launch("tests.faulty_adapters:LinearScaledLRHorovod", WORLD_SIZE, "mlp", STEPS, "horovodrun")
    d = update_failed(proc, result)
    assert (d["step"], d["parameter"], d["cause"]) == (0, "0.weight", "lr_scaled"), d
    assert "2x the reference" in d["reason"] and "lr 0.1, --lr is 0.05" in d["reason"], d["reason"]
    step0 = result["equivalence"]["per_step"][0]["update"]
    assert abs(step0["norm_ratio"] - 2.0) < 1e-3, step0


@pytest.mark.slow  # breadth: the default tier keeps this capability's other test
def test_double_step_is_named_at_step_0(launch):
    proc, result = launch("tests.faulty_adapters:DoubleStepDDP", WORLD_SIZE, "mlp", STEPS)
    d = update_failed(proc, result)
    assert (d["step"], d["parameter"], d["cause"]) == (0, "0.weight", "double_step"), d
    assert "applied twice" in d["reason"], d["reason"]


@pytest.mark.slow
def test_clipping_in_one_backend_is_named_at_step_0(launch):
    proc, result = launch("tests.faulty_adapters:ClippingDDP", WORLD_SIZE, "mlp", STEPS)
    d = update_failed(proc, result)
    assert (d["step"], d["cause"]) == (0, "clipped"), d
    assert "capped at 0.001" in d["reason"], d["reason"]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["horovod"], indirect=True)
def test_horovod_broadcast_optimizer_state_trap_is_named_at_step_0(backend, launch):
    """horovod/horovod#3743: broadcast_optimizer_state on a fresh AdamW steps it once on zero gradients."""
    proc, result = launch("horovod", WORLD_SIZE, "mlp", [*STEPS, "--optimizer", "adamw", "--opt",
                                                          "broadcast_optimizer_state=1"], "horovodrun")
    d = update_failed(proc, result)
    assert (d["step"], d["parameter"], d["cause"]) == (0, "0.weight", "optimizer_state"), d
    assert "not a fresh optimizer's" in d["reason"] and "step count 1" in d["reason"], d["reason"]
    assert "horovod/horovod#3743" in d["reason"]
    assert result["equivalence"]["replicas_identical"] is True, "every rank took the same wrong step"


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["horovod"], indirect=True)
def test_horovod_trap_with_weight_decay_moves_the_weights_before_step_0(backend, launch):
    proc, result = launch("horovod", WORLD_SIZE, "mlp", [*STEPS, "--optimizer", "adamw", "--weight-decay", "0.01",
                                                          "--opt", "broadcast_optimizer_state=1"], "horovodrun")
    d = different(proc, result, "initial")
    assert (d["step"], d["cause"]) == (0, "initial_weights"), d
    assert "not the workload's initial weights" in d["reason"] and "broadcast_optimizer_state" in d["reason"]
    assert result["equivalence"]["initial_weights_identical"] is False


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["horovod"], indirect=True)
def test_horovod_trap_is_benign_for_sgd_without_weight_decay(backend, launch):
    """Positive twin: the trap leaves SGD a zero momentum buffer, which steps exactly like a fresh one."""
    proc, result = launch("horovod", WORLD_SIZE, "mlp", [*STEPS, "--opt", "broadcast_optimizer_state=1"], "horovodrun")
    assert_equivalent(proc, result, backend="horovod", world_size=WORLD_SIZE, model="mlp", launcher="horovodrun")
    assert any(n["code"] == "horovod.broadcast_optimizer_state" for n in result["equivalence"]["notes"])


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["horovod"], indirect=True)
def test_weight_decay_on_zero_filled_unused_parameters_is_named(backend, launch):
    """Horovod gives parameters outside the loss a zero gradient (DDP leaves None): with weight decay its
    optimizer decays them where a single process skips them."""
    proc, result = launch("horovod", WORLD_SIZE, "mlp-unused", [*STEPS, "--weight-decay", "0.01"], "horovodrun")
    d = update_failed(proc, result)
    assert (d["step"], d["cause"]) == (0, "unused_zero_grad"), d
    assert set(d["parameters"]) == {"aux_head.weight", "aux_head.bias"}, d
    assert result["equivalence"]["parameters"]["unused_grad"] == {"aux_head.weight": "zero", "aux_head.bias": "zero"}


# -- gradient faults that used to match none ---------------------------------------------------------------
@pytest.mark.slow
def test_loss_reduced_with_sum_is_named_at_step_0(launch):
    proc, result = launch("ddp", WORLD_SIZE, "tests.faulty_workloads:sum_loss_mlp", STEPS)
    d = different(proc, result)
    assert (d["step"], d["parameter"], d["cause"]) == (0, "0.weight", "loss_sum"), d
    assert "1/2 of the oracle" in d["reason"] and "reduced with sum" in d["reason"], d["reason"]


@pytest.mark.slow
def test_biases_left_unsynchronised_are_named_at_step_0(launch):
    proc, result = launch("tests.faulty_adapters:UnsyncedBiasDDP", WORLD_SIZE, "mlp", STEPS)
    d = different(proc, result)
    assert (d["step"], d["parameter"], d["cause"]) == (0, "0.bias", "unsynchronised"), d
    assert d["parameters"] == ["0.bias", "2.bias", "4.bias"], d
    assert d["reason"].startswith("on 0.bias, 2.bias, 4.bias:") and "rank 0's local gradient" in d["reason"]
    assert d["noise_ratio"] > 10, d


@pytest.mark.slow
def test_undeclared_fp16_wire_is_named_at_step_0(launch):
    proc, result = launch("tests.faulty_adapters:Fp16WireDDP", WORLD_SIZE, "mlp", STEPS)
    d = different(proc, result)
    assert (d["step"], d["parameter"], d["cause"]) == (0, "0.weight", "wire_dtype"), d
    assert "float16 on the wire" in d["reason"] and "--compression fp16" in d["reason"], d["reason"]
    assert 10 < d["noise_ratio"] < 1e5, "of the size of fp16 rounding, far below a wrong gradient"


@pytest.mark.slow
def test_gradients_that_underflow_on_a_declared_fp16_wire_are_named(launch):
    """--compression fp16 is declared (its rounding is tolerated), but gradients of ~1e-21 flush to zero on it."""
    proc, result = launch("ddp", WORLD_SIZE, "tests.faulty_workloads:tiny_loss_mlp", [*STEPS, "--compression", "fp16"])
    d = different(proc, result)
    assert (d["step"], d["cause"]) == (0, "wire_underflow"), d
    assert "underflow to zero on the fp16 wire" in d["reason"] and "scale factor" not in d["reason"], d["reason"]


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, WORLD_SIZE])  # the digests held: rank 0's own, or every rank's
def test_stale_gradient_is_named_at_step_1(launch, world_size):
    proc, result = launch("tests.faulty_adapters:StaleGradDDP", world_size, "mlp", STEPS)
    d = different(proc, result)
    assert (d["step"], d["parameter"], d["cause"]) == (1, "0.weight", "stale"), d
    assert "step 0's" in d["reason"], d["reason"]
    assert result["equivalence"]["per_step"][0]["noise_ratio"] < 10, "step 0 was reduced normally"


@pytest.mark.slow  # the default tier keeps this capability in a sibling test
def test_diverged_training_is_named_not_blamed_on_the_backend(launch):
    proc, result = launch("ddp", WORLD_SIZE, "mlp", ["--steps", "5", "--lr", "999"])
    assert proc.returncode == 0, proc.output[-4000:]
    e = result["equivalence"]
    assert e["verdict"] == "unverifiable" and e["first_divergence"] is None, e
    assert "diverged numerically at step" in e["unverifiable_reason"] and "lower --lr" in e["unverifiable_reason"]


@pytest.mark.slow  # the default tier keeps this capability in a sibling test
# -- randomness ------------------------------------------------------------------------------------------
def test_ranks_seeded_the_same_are_named(launch):
    """With dropout, a script that seeds every rank the same draws the same masks on every rank."""
    proc, result = launch("tests.faulty_adapters:SameSeedDDP", WORLD_SIZE, "mlp-dropout", STEPS)
    d = different(proc, result, "rng")
    assert (d["step"], d["cause"]) == (0, "same_seed"), d
    assert "ranks 0 and 1 draw identical dropout masks" in d["reason"], d["reason"]


@pytest.mark.slow
def test_no_dropout_makes_the_same_model_checkable(launch):
    """The fix an unverifiable verdict names, on a model whose masks are captured anyway."""
    proc, result = launch("ddp", WORLD_SIZE, "tests.faulty_workloads:dropout_cnn", [*STEPS, "--sync-bn", "--no-dropout"])
    assert_equivalent(proc, result, backend="ddp", world_size=WORLD_SIZE, model="dropout-cnn", launcher="torchrun")
    assert result["equivalence"]["stochastic"]["stochastic"] is False
