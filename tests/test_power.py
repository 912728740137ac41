"""The verdict has power on deep networks at every precision, states it, and refuses `equivalent` without it.

On a ResNet the float32 (and more so bf16) single process is far from float64: held against float64, a 10x-its-floor
tolerance passes a doubled update. The gradient check holds the backend against the run-precision reference split
as the ranks split it (its floor: the same function regrouped), and the update check replays the optimizer on the
backend's own parameters, gradient and state, so both keep their power there. Every check states its
`min_detectable_rel`; a run whose checks cannot catch a 10 % change is `unverifiable`, with the cause.

Default tier: a run without power, and one whose every checked step overflowed. Slow tier: ResNet-18 at bf16 and with
AdamW over eight steps, and the planted faults on it (lr x N named at step 0, local clipping). Deep tier
(`pytest -m deep`, about 6 minutes, not in CI): ResNet-50 at the defaults and at bf16, the figures of
docs/results/2026-11-26-deep-verdict-cpu.md.
"""

from __future__ import annotations

import pytest
import torch

from dpcompare.run.verification import checked_arithmetic
from test_negative import different, update_failed

RESNET_BF16 = ["--amp", "bf16", "--global-batch", "4", "--steps", "2", "--measure-steps", "0"]


def _equivalent(proc, result: dict | None, model: str) -> dict:
    assert proc.returncode == 0, proc.output[-6000:]
    assert result is not None and result["model"] == model
    e = result["equivalence"]
    assert e["verdict"] == "equivalent", (e["first_divergence"], e.get("unverifiable_reason"))
    assert e["replicas_identical"] and all(s["grads_identical_across_ranks"] for s in e["per_step"])
    assert all(e["checks"][name]["status"] == "pass" for name in ("gradient", "update", "trajectory")), e["checks"]
    assert e["checks"]["grad_norm"]["status"] == "off", e["checks"]["grad_norm"]  # no --clip-grad-norm here
    assert f"ws=2 {model} [{result['launcher']}]: equivalent" in proc.stdout, proc.stdout[-2000:]
    return _power(result)


def _power(result: dict) -> dict:
    e = result["equivalence"]
    for name in ("gradient", "update", "trajectory"):
        assert "min_detectable_rel" in e["checks"][name], e["checks"][name]
    assert e["min_detectable_rel"] is not None
    return e


@pytest.mark.multiproc
@pytest.mark.timeout(420)
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["ddp"], indirect=True)
def test_resnet_at_bf16_is_equivalent_with_power(launch, backend):
    proc, result = launch("ddp", 2, "resnet18-cifar", RESNET_BF16, timeout_s=400)
    e = _equivalent(proc, result, "resnet18-cifar")
    assert e["min_detectable_rel"] <= 0.1, e["checks"]
    # The precision's own distance from float64 is stated, and far larger than what the check resolves.
    assert e["checks"]["gradient"]["noise_floor_rel_fro"] > 10 * e["checks"]["gradient"]["min_detectable_rel"]
    assert "catches a change of" in proc.stdout


@pytest.mark.multiproc
@pytest.mark.timeout(420)
@pytest.mark.slow
def test_learning_rate_times_n_on_a_resnet_at_bf16_is_named_at_step_0(launch):
    proc, result = launch("tests.faulty_adapters:LinearScaledLRDDP", 2, "resnet18-cifar", RESNET_BF16, timeout_s=400)
    d = update_failed(proc, result)
    assert (d["step"], d["cause"]) == (0, "lr_scaled"), d
    assert "learning rate is scaled by the world size" in d["reason"], d["reason"]
    e = result["equivalence"]
    assert e["checks"]["update"]["norm_ratio"] == pytest.approx(2.0, rel=1e-3)
    # The gradient passed with power, though the bf16 reference is far from float64 on this network.
    assert e["checks"]["gradient"]["min_detectable_rel"] <= 1e-3 < e["checks"]["gradient"]["noise_floor_rel_fro"]


@pytest.mark.slow  # breadth: the default tier keeps this capability's other test
@pytest.mark.multiproc
@pytest.mark.timeout(420)
def test_a_run_without_power_is_unverifiable_and_says_why(launch):
    """bfloat16 weights end to end: the update is below what bf16 storage of the weights resolves."""
    proc, result = launch("ddp", 2, "mlp", ["--dtype", "bfloat16", "--steps", "2", "--measure-steps", "0"])
    assert proc.returncode == 0, proc.output[-4000:]
    e = result["equivalence"]
    assert e["verdict"] == "unverifiable", e["checks"]
    assert "cannot catch a 10% change" in e["unverifiable_reason"], e["unverifiable_reason"]
    assert e["min_detectable_rel"] > 0.1
    assert "unverifiable" in proc.stdout


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.timeout(420)
def test_a_run_whose_every_checked_step_overflowed_compared_nothing_and_is_unverifiable(launch):
    """Both steps overflow at 2^24 and are rightly skipped: no gradient was compared, so no `equivalent`."""
    proc, result = launch("ddp", 2, "mlp", ["--amp", "fp16", "--loss-scale", str(2**24), "--steps", "2",
                                            "--measure-steps", "0"])
    assert proc.returncode == 0, proc.output[-4000:]
    e = result["equivalence"]
    assert e["precision"]["skipped_steps"] == [0, 1], e["precision"]
    assert e["verdict"] == "unverifiable" and e["checked_steps"] == [], e["checks"]
    assert "no gradient or update was compared" in e["unverifiable_reason"], e["unverifiable_reason"]


@pytest.mark.multiproc
@pytest.mark.timeout(420)
@pytest.mark.deep  # the slow tier keeps ResNet-18 at bf16 equivalent and its lr x N twin named
def test_local_clipping_on_a_resnet_at_bf16_is_different_and_named(launch):
    proc, result = launch("tests.faulty_adapters:LocalClipDDP", 2, "resnet18-cifar", RESNET_BF16, timeout_s=400)
    d = different(proc, result)
    assert (d["step"], d["cause"]) == (0, "local_clip"), d
    assert "clipped its own local gradient" in d["reason"], d["reason"]


@pytest.mark.deep
@pytest.mark.parametrize("backend", ["ddp"], indirect=True)
@pytest.mark.parametrize("args", [
    pytest.param([], id="resnet50-defaults"),
    pytest.param(["--amp", "bf16", "--global-batch", "8", "--steps", "3"], id="resnet50-bf16"),
])
@pytest.mark.multiproc
@pytest.mark.timeout(900)
def test_resnet50_at_the_defaults_is_equivalent(launch, backend, args):
    """About 2.5 minutes each on two quiet cores: the float64 oracle of a 23.5 M-parameter network, every step."""
    proc, result = launch("ddp", 2, "resnet50-cifar", [*args, "--measure-steps", "0"], timeout_s=800)
    assert _equivalent(proc, result, "resnet50-cifar")["min_detectable_rel"] <= 0.1


@pytest.mark.multiproc
@pytest.mark.timeout(420)
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["ddp"], indirect=True)
def test_resnet18_with_adamw_over_eight_steps_is_equivalent(launch, backend):
    proc, result = launch("ddp", 2, "resnet18-cifar", ["--optimizer", "adamw", "--steps", "8", "--measure-steps", "0"],
                          timeout_s=400)
    _equivalent(proc, result, "resnet18-cifar")


@pytest.mark.multiproc
@pytest.mark.timeout(420)
@pytest.mark.deep
@pytest.mark.parametrize("backend", ["deepspeed"], indirect=True)
def test_deepspeed_bf16_engine_with_adamw_is_equivalent_and_states_its_prestep(launch, backend):
    """DeepSpeed's FP16_UnfusedOptimizer steps AdamW once on zero gradients when it is built (by design): the state
    before step 0 is held to that, the first update's ratio to a fresh optimizer's is stated."""
    proc, result = launch("deepspeed", 2, "mlp", ["--amp", "bf16", "--opt", "amp_recipe=engine", "--optimizer", "adamw",
                                                  "--measure-steps", "0"])
    _equivalent(proc, result, "mlp")
    note = next(n for n in result["equivalence"]["notes"] if n["code"] == "optimizer_prestep")
    assert "initialize_optimizer_states" in note["text"] and "the first update is 0.74" in note["text"], note


@pytest.mark.multiproc
@pytest.mark.timeout(420)
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["deepspeed"], indirect=True)
def test_a_bf16_wire_is_measured_so_four_ranks_accumulating_keep_their_power(launch, backend):
    """The bf16 engine all-reduces in bf16: bounded as world_size x its unit roundoff, four ranks could never catch
    10 %; measured (the reference sends the ranks' shares through the wire, its floor regroups them micro-batch by
    micro-batch), they do, with gradient accumulation."""
    proc, result = launch("deepspeed", 4, "mlp", ["--amp", "bf16", "--opt", "amp_recipe=engine", "--grad-accum", "2",
                                                  "--steps", "2", "--measure-steps", "0"])
    assert proc.returncode == 0, proc.output[-6000:]
    e = result["equivalence"]
    assert e["verdict"] == "equivalent", (e["first_divergence"], e.get("unverifiable_reason"))
    assert e["tolerance"]["wire_rounding"] == "measured" and e["precision"]["wire"] == "bf16", e["tolerance"]
    assert e["checks"]["gradient"]["min_detectable_rel"] < 0.1, e["checks"]["gradient"]
    assert "its rounding measured in the data-parallel floor" in proc.stdout


@pytest.mark.multiproc
@pytest.mark.timeout(420)
@pytest.mark.slow
def test_a_gradient_five_percent_off_under_a_bf16_wire_is_different(launch):
    proc, result = launch("tests.faulty_adapters:FivePercentGradientDeepSpeed", 2, "mlp",
                          ["--amp", "bf16", "--opt", "amp_recipe=engine", "--steps", "2", "--measure-steps", "0"])
    d = different(proc, result, "gradient")
    # 1.05 in bf16 is 1.046875: the factor the diagnosis fits, named on the weights
    assert d["step"] == 0 and d["cause"] == "scaled" and "is 1.049x the oracle" in d["reason"], d["reason"]


# -- the diagnosis of sharded and mixed-precision faults: one cause or none, never a wrong one ---------------------
@pytest.mark.multiproc
@pytest.mark.timeout(420)
@pytest.mark.slow
def test_clipping_part_by_part_is_named(launch):
    proc, result = launch("tests.faulty_adapters:ClipByPartsDDP", 2, "mlp", ["--steps", "2", "--measure-steps", "0"])
    d = update_failed(proc, result)
    assert (d["step"], d["cause"]) == (0, "clipped_in_parts"), d
    assert "clipped part by part, each part by its own norm" in d["reason"] and "capped at 0.001" in d["reason"]


@pytest.mark.multiproc
@pytest.mark.timeout(420)
@pytest.mark.slow
def test_a_rank_dependent_unscale_is_named_at_the_gradient_check(launch):
    proc, result = launch("tests.faulty_adapters:RankScaledUnscaleDDP", 2, "mlp",
                          ["--amp", "fp16", "--steps", "2", "--measure-steps", "0"])
    d = different(proc, result)
    assert (d["step"], d["cause"]) == (0, "rank_scale"), d
    assert "rank 1's gradient is 0.5x rank 0's" in d["reason"], d["reason"]


@pytest.mark.multiproc
@pytest.mark.timeout(420)
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["fsdp"], indirect=True)
def test_no_gradient_at_all_is_named_not_blamed_on_a_partition(launch, backend):
    proc, result = launch("tests.faulty_adapters:NeverSyncedFSDP", 2, "mlp", ["--steps", "2", "--measure-steps", "0"])
    d = different(proc, result)
    assert (d["step"], d["cause"]) == (0, "no_gradient"), d
    assert "no gradient at all" in d["reason"] and "partition" not in d["reason"], d["reason"]


# -- TF32: the checked steps run float32 as float32, the measured steps keep the user's settings --------------------
@pytest.fixture
def tf32_on():
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.get_float32_matmul_precision(),
             torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic)
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = True, True
    torch.set_float32_matmul_precision("high")
    torch.backends.cudnn.benchmark = True
    yield
    (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, precision, torch.backends.cudnn.benchmark,
     torch.backends.cudnn.deterministic) = saved
    torch.set_float32_matmul_precision(precision)


def _settings() -> tuple:
    return (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.get_float32_matmul_precision(),
            torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic)


def test_checked_steps_on_cuda_run_without_tf32_and_restore_the_users_settings(tf32_on):
    with checked_arithmetic(torch.device("cuda")) as recorded:
        assert _settings() == (False, False, "highest", False, True)
    assert _settings() == (True, True, "high", True, False), "the measured steps keep what the user set"
    assert recorded["matmul_allow_tf32"] and recorded["cudnn_allow_tf32"] and recorded["float32_matmul_precision"] == "high"
    assert recorded["checked_with"].startswith("TF32 off") and not recorded["checked_cudnn_allow_tf32"]


def test_checked_steps_on_the_cpu_leave_the_settings_alone(tf32_on):
    """The twin: TF32 is a CUDA setting; nothing is switched, and the record says so."""
    with checked_arithmetic(torch.device("cpu")) as recorded:
        assert _settings() == (True, True, "high", True, False)
    assert recorded["checked_with"].startswith("as set")


def test_the_runs_line_says_when_the_checks_ran_without_tf32():
    from dpcompare.result_view import Equivalence
    from dpcompare.run.line import _precision_facts

    tf32 = {"matmul_allow_tf32": False, "cudnn_allow_tf32": True, "checked_with": "TF32 off and deterministic cuDNN ..."}
    facts = _precision_facts(Equivalence({"precision": {"amp": "none", "tf32": tf32}}))
    assert facts == ["checked with TF32 off and deterministic cuDNN, measured with the settings as set (cudnn_allow_tf32)"]
    assert _precision_facts(Equivalence({"precision": {"amp": "none", "tf32": dict(
        tf32, checked_with="as set (TF32 is a CUDA setting)")}})) == []
