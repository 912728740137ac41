"""Gradient clipping (--clip-grad-norm): every backend clips by the global norm its own way, and the checks hold it to
the oracle's clipping.

Checked against: torch.nn.utils.clip_grad_norm_ for the references' arithmetic (the reference optimizer step and the
coefficient min(1, X / (norm + 1e-6))); the float64 oracle's global norm for the norm each backend reports (the
grad_norm check); and planted faults (tests/faulty_clipping.py) for the verdict's power: each rank clipping its local
gradient before the all-reduce (the gradient check, cause local_clip), clipping in parts by the parts' own norms (the
update check, cause clipped_in_parts), no clipping at all (cause not_clipped), and a norm reported from one rank's
shards (the grad_norm check, cause grad_norm_partition). A correct run at --clip-grad-norm 0.05 clips at every checked
step (the mlp's unclipped norm is about 0.35), so the clip takes effect and is judged.

Tiers: the default tier runs the unit tests, DDP at world size 2 and the local-clip twin; the `slow` tier every other
backend, AdamW, and the other twins.
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from conftest import child_env
from dpcompare.contract import Settings
from dpcompare.contract.launch_env import LaunchEnv
from dpcompare.run.config import RunConfig
from dpcompare.verify.checks.grad_norm_check import expected, judge_norm
from dpcompare.verify.replay.clipping_rule import clip_, clip_coefficient
from dpcompare.verify.instruments.check_context import CheckContext, CheckSettings
from dpcompare.verify.judgement.tolerance import ParamError
from dpcompare.verify.replay.optimizer_replay import reference_step
from dpcompare.verify.judgement.verdict import StepCheck, Verdict

CLIP = 0.05
CLIPPED = ["--steps", "2", "--measure-steps", "0", "--clip-grad-norm", str(CLIP)]
WORLD_SIZE = 2


def _sgd(params, **overrides):
    return torch.optim.SGD(params, **{"lr": 0.05, "momentum": 0.9, **overrides})


def _grads(dtype=torch.float64, scale: float = 1.0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return {name: scale * torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype)
            for name, shape in (("0.weight", (6, 4)), ("0.bias", (6,)), ("2.weight", (3, 6)), ("2.bias", (3,)))}


# -- the references' arithmetic ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("scale", [1.0, 1e-3], ids=["clipped", "below-the-clip"])
def test_the_reference_step_clips_as_clip_grad_norm_does(dtype, scale):
    params, grads = _grads(), _grads(scale=scale)
    ours = reference_step(_sgd, params, grads, {}, dtype, torch.device("cpu"), clip=CLIP).delta
    live = [torch.nn.Parameter(params[n].to(dtype).clone()) for n in params]
    for p, n in zip(live, params):
        p.grad = grads[n].to(dtype).clone()
    norm = float(torch.nn.utils.clip_grad_norm_(live, CLIP))
    _sgd(live).step()
    for p, n in zip(live, params):
        assert torch.equal(ours[n], p.detach().double() - params[n].to(dtype).double()), n
    total = math.sqrt(sum(float(g.square().sum()) for g in grads.values()))
    assert norm == pytest.approx(total, rel=1e-6)
    assert clip_coefficient(total, CLIP) == (pytest.approx(CLIP / (total + 1e-6)) if scale == 1.0 else 1.0)


def test_clip_returns_the_norm_before_clipping_and_leaves_the_global_norm_at_the_clip():
    grads = list(_grads().values())
    before = clip_(grads, CLIP)
    assert before > CLIP
    assert float(torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads]))) == pytest.approx(CLIP, rel=1e-5)


# -- the flag ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [0.0, -1.0, math.nan, math.inf])
def test_a_clip_that_is_not_a_positive_number_is_refused(value):
    with pytest.raises(ValueError, match="--clip-grad-norm"):
        RunConfig(clip_grad_norm=value).validate()


def test_the_command_line_refuses_a_zero_clip_with_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "dpcompare", "--clip-grad-norm", "0", "--out", str(tmp_path)],
                          capture_output=True, text=True, env=child_env(tmp_path), timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--clip-grad-norm=0.0 is invalid: use a positive total norm" in lines[0], proc.stderr


def test_deepspeed_refuses_two_clippings():
    from dpcompare.adapters.deepspeed import DeepSpeedAdapter

    env = LaunchEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, launcher="python", job_id="t")
    options = {o.name: o.default for o in DeepSpeedAdapter.OPTIONS} | {"gradient_clipping": 1.0}
    with pytest.raises(ValueError, match="drop --opt gradient_clipping"):
        DeepSpeedAdapter(env, torch.device("cpu"), Settings(options=options, clip_grad_norm=CLIP))


# -- the grad_norm check and its diagnosis ----------------------------------------------------------------------
def _judged(reported_of, loss_scale: float | None = None) -> tuple[Verdict, float]:
    """A grad_norm check of step 0 on synthetic gradients: the reported norm is `reported_of(oracle, locals)`."""
    verdict = Verdict()
    verdict.checks.append(StepCheck(0, [], True, True))
    oracle = _grads()
    local = [_grads(scale=1.5), {n: 2 * g - _grads(scale=1.5)[n] for n, g in oracle.items()}]  # their mean: oracle
    names = list(oracle)
    ctx = CheckContext(settings=CheckSettings(dtype="float32", clip_grad_norm=CLIP), world_size=WORLD_SIZE, depth=2,
                       names=tuple(names), all_names=tuple(names), factory=_sgd)
    model = ParamError("(all parameters)", 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, True)
    norm = float(torch.linalg.vector_norm(torch.cat([oracle[n].reshape(-1) for n in names])))
    found = judge_norm(ctx, verdict.checks[0], expected(ctx, oracle, oracle, model, lambda: local, loss_scale),
                       reported_of(oracle, local, norm))
    if found is not None:
        found.record_in(verdict)
    return verdict, norm


def _norm(grads: dict[str, torch.Tensor]) -> float:
    return float(torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads.values()])))


def test_the_global_norm_passes_and_is_recorded_as_clipped():
    verdict, norm = _judged(lambda o, local, n: n * (1 + 1e-7))
    check = verdict.checks[0].grad_norm
    assert verdict.first_divergence is None and check.ok and check.clipped and check.oracle == norm
    assert check.coefficient == pytest.approx(CLIP / (norm + 1e-6))
    assert verdict.to_dict({})["checks"]["grad_norm"]["status"] == "pass"


@pytest.mark.parametrize(("reported", "cause", "words"), [
    (lambda o, local, n: _norm(local[0]), "grad_norm_local", "rank 0's local gradient's norm, taken before the all-reduce"),
    (lambda o, local, n: _norm({k: g.chunk(2)[1] for k, g in o.items()}), "grad_norm_partition", "rank 1's dim-0 shard"),
    (lambda o, local, n: float(torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in o.values()])[:26])),
     "grad_norm_partition", "rank 0's 1/2 partition of the flattened gradient"),
    (lambda o, local, n: CLIP, "grad_norm_after_clip", "the norm after clipping"),
    (lambda o, local, n: 1.37 * n, "grad_norm", "1.37x the oracle's"),
], ids=["local", "shard", "flat-partition", "after-clip", "unknown"])
def test_a_wrong_norm_is_different_and_named(reported, cause, words):
    verdict, _ = _judged(reported)
    d = verdict.first_divergence
    assert d is not None and (d.check, d.cause) == ("grad_norm", cause), d
    assert words in d.reason, d.reason
    assert verdict.to_dict({})["checks"]["grad_norm"]["status"] == "fail"


def test_the_loss_scaled_norm_is_named():
    verdict, _ = _judged(lambda o, local, n: 1024.0 * n, loss_scale=1024.0)
    assert verdict.first_divergence.cause == "grad_norm_scaled", verdict.first_divergence


def test_a_norm_never_reported_is_unverifiable():
    verdict, _ = _judged(lambda o, local, n: None)
    assert verdict.status() == "unverifiable" and "reported no total gradient norm" in verdict.unverifiable[0]


# -- real runs --------------------------------------------------------------------------------------------------
def assert_clipped_and_equivalent(proc, result: dict | None, backend: str) -> None:
    assert proc.returncode == 0, proc.output[-6000:]
    assert result is not None
    e = result["equivalence"]
    assert e["verdict"] == "equivalent", f"{e['first_divergence']} {e.get('unverifiable_reason')}"
    assert result["config"]["clip_grad_norm"] == CLIP
    for check in ("gradient", "grad_norm", "update", "trajectory"):
        assert e["checks"][check]["status"] == "pass", (check, e["checks"][check])
    assert e["checks"]["grad_norm"]["noise_ratio"] < 10, e["checks"]["grad_norm"]
    norms = [s["grad_norm"] for s in e["per_step"]]
    assert [n["step"] for n in norms] == e["checked_steps"] and all(n["clip"] == CLIP for n in norms)
    # The clip took effect at every checked step: the unclipped norm, reported and the oracle's, is above it.
    assert all(n["clipped"] and n["oracle"] > CLIP and n["reported"] > CLIP and n["ok"] for n in norms), norms
    assert "grad_norm: " in proc.stdout and f"clipped at {CLIP:g} at step(s) 0, 1" in proc.stdout, proc.stdout[-2000:]


def named(proc, result: dict | None, check: str, cause: str) -> dict:
    assert proc.returncode == 0, proc.output[-6000:]
    e = result["equivalence"]
    d = e["first_divergence"]
    assert e["verdict"] == "different" and d is not None, e
    assert (d["step"], d["check"], d["cause"]) == (0, check, cause), d
    return d


@pytest.mark.slow  # breadth: the default tier keeps this capability's other test
@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_ddp_clipped_by_the_global_norm_is_equivalent(launch):
    proc, result = launch("ddp", WORLD_SIZE, "mlp", CLIPPED)
    assert_clipped_and_equivalent(proc, result, "ddp")


@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_each_rank_clipping_its_local_gradient_before_the_reduce_is_named(launch):
    proc, result = launch("tests.faulty_clipping:ClipBeforeReduceDDP", WORLD_SIZE, "mlp", CLIPPED)
    d = named(proc, result, "gradient", "local_clip")
    assert f"clipped its own local gradient to norm {CLIP:g} before the all-reduce" in d["reason"], d["reason"]


@pytest.mark.multiproc
@pytest.mark.timeout(330)
@pytest.mark.parametrize(("backend", "world_size", "options"), [
    # reference, fsdp, horovod and ZeRO-2 are rows of `compare --suite questions` (slow tier), with these checks
    pytest.param("reference", 1, [], id="reference", marks=pytest.mark.deep),
    pytest.param("dp", 1, [], id="dp", marks=pytest.mark.slow),
    pytest.param("fsdp", 2, [], id="fsdp", marks=pytest.mark.deep),
    pytest.param("horovod", 2, [], id="horovod", marks=pytest.mark.deep),
    pytest.param("deepspeed", 2, [], id="zero0", marks=pytest.mark.slow),
    pytest.param("deepspeed", 2, ["--opt", "zero_stage=2"], id="zero2", marks=pytest.mark.deep),
    # the other stages and the bf16 recipes: the deep tier (outside CI's time)
    pytest.param("deepspeed", 2, ["--opt", "zero_stage=1"], id="zero1", marks=pytest.mark.deep),
    pytest.param("deepspeed", 2, ["--opt", "zero_stage=3"], id="zero3", marks=pytest.mark.deep),
    pytest.param("deepspeed", 2, ["--amp", "bf16"], id="zero0-bf16", marks=pytest.mark.deep),
    pytest.param("deepspeed", 2, ["--amp", "bf16", "--opt", "zero_stage=2"], id="zero2-bf16", marks=pytest.mark.deep),
], indirect=["backend"])
def test_every_backend_clipped_by_the_global_norm_is_equivalent(backend, world_size, options, launch):
    proc, result = launch(backend, world_size, "mlp", [*CLIPPED, *options])
    assert_clipped_and_equivalent(proc, result, backend)


@pytest.mark.multiproc
@pytest.mark.timeout(330)
@pytest.mark.parametrize("backend", [pytest.param("ddp", marks=pytest.mark.slow),
                                     pytest.param("fsdp", marks=pytest.mark.deep),
                                     pytest.param("deepspeed", marks=pytest.mark.deep)], indirect=True)
def test_adamw_clipped_by_the_global_norm_is_equivalent(backend, launch):
    proc, result = launch(backend, WORLD_SIZE, "mlp", [*CLIPPED, "--optimizer", "adamw"])
    assert_clipped_and_equivalent(proc, result, backend)


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_clipping_each_part_by_its_own_norm_is_named(launch):
    proc, result = launch("tests.faulty_clipping:ClipInPartsDDP", WORLD_SIZE, "mlp", CLIPPED)
    d = named(proc, result, "update", "clipped_in_parts")
    assert result["equivalence"]["checks"]["grad_norm"]["status"] == "pass"  # the norm it reports is the global one
    assert "clipped part by part, each part by its own norm" in d["reason"], d["reason"]


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_a_backend_that_ignores_the_clip_is_named(launch):
    proc, result = launch("tests.faulty_clipping:UnclippedDDP", WORLD_SIZE, "mlp", CLIPPED)
    d = named(proc, result, "update", "not_clipped")
    assert "the backend ignored the clipping" in d["reason"], d["reason"]


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_a_norm_reported_from_one_ranks_shards_is_named(launch):
    proc, result = launch("tests.faulty_clipping:ShardNormFSDP", WORLD_SIZE, "mlp", CLIPPED)
    d = named(proc, result, "grad_norm", "grad_norm_partition")
    assert "rank 0's dim-0 shard of every parameter" in d["reason"], d["reason"]
    assert result["equivalence"]["checks"]["update"]["status"] == "pass"  # its clipping is right


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.timeout(330)
@pytest.mark.parametrize("backend", ["deepspeed"], indirect=True)
def test_zero_under_autocast_fp16_clipping_by_the_scaled_norm_is_named(backend, launch):
    """DeepSpeed 0.19.8, ZeRO-2 under its torch_autocast section at fp16: the GradScaler scales the loss while the ZeRO
    optimizer's own loss scale stays 1, so the norm it reports and clips by is the loss scale times the true one."""
    proc, result = launch(backend, WORLD_SIZE, "mlp", [*CLIPPED, "--amp", "fp16", "--opt", "zero_stage=2"])
    d = named(proc, result, "grad_norm", "grad_norm_scaled")
    assert "x the loss scale 65536" in d["reason"], d["reason"]
    assert result["equivalence"]["checks"]["gradient"]["status"] == "pass"
