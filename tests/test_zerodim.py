"""0-dim (shape []) parameters and buffers (issue 62): CLIP's `logit_scale = nn.Parameter(torch.ones([]) * ...)` and
0-dim buffers, on the workload of tests/zerodim_models.py.

- The update check's replay (dpcompare.verify.replay.optimizer_replay) tells a state entry's role by its key, not its shape: a
  0-dim parameter's momentum (SGD) and moments (AdamW) are per-element entries, stepped, cast to the replay's dtype and
  cut into pieces like the parameter (a piece of a 0-dim parameter is the whole: one element); AdamW's `step`, 0-dim
  too, stays a count in its own dtype. The replay read whole and read in pieces is torch's own step.
- A wrong update of the 0-dim parameter (doubled; stepped from a state that lost its momentum) is caught, on it alone;
  a fitted weight decay, which fits any one value, is not named as its cause.
- Backends: reference, dp, ddp, horovod judge the model `equivalent` with momentum SGD and with AdamW over 4 steps at
  2 ranks. DeepSpeed (0.19.8, every ZeRO stage) views each parameter as bytes while it builds the engine, which torch
  refuses for a 0-dim tensor: the run is refused before DeepSpeed starts, in one line naming the parameter and what to
  do (exit 2); FSDP2's fully_shard refuses scalar parameters itself, in one line. The same model with a 1-element
  logit_scale, what both lines advise, is `equivalent` under ZeRO 0-3 and FSDP2.

Tiers: the default tier runs the unit tests, two in-process negative runs of the reference (about 5 s) and DDP at 2
ranks (about 13 s); every other backend, and the refusals, are the slow tier's (about 6 minutes on two cores).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import torchrun_rank_logs
from dpcompare.contract.optim_state import per_element, read_state
from dpcompare.verify.judgement.held_values import Compact, Difference
from dpcompare.verify.diagnosis.state_comparison import _same_state, state_difference
from dpcompare.verify.judgement.tolerance import UNIT_ROUNDOFF, judge_figures, range_figures
from dpcompare.verify.replay.optimizer_replay import held_as, reference_step
from test_equivalence_matrix import assert_equivalent
from tests.test_failures import in_process  # noqa: F401 - the fixture

CPU = torch.device("cpu")
U = UNIT_ROUNDOFF["float32"]
MODEL = "tests.zerodim_models:clip_towers"
ONE_ELEMENT = "tests.zerodim_models:clip_towers_one_element"
ERROR = "dpcompare: error:"


def _factory(optimizer: str):
    def make(params, **o):
        if optimizer == "sgd":
            return torch.optim.SGD(params, **{"lr": 0.05, "momentum": 0.9, **o})
        return torch.optim.AdamW(params, **{"lr": 0.01, "weight_decay": 0.1, **o})
    return make


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.weight = nn.Parameter(torch.randn(3, 4))
        self.logit_scale = nn.Parameter(torch.ones([]) * 2.6593)


def _backend(optimizer: str, wrong: str | None = None):
    """A backend's second float32 step of `_Scaled` (its state one step old): (params before, gradient, state before,
    values after). `wrong`: "doubled", logit_scale's update doubled; "state_lost", logit_scale stepped from no state."""
    model = _Scaled()
    opt = _factory(optimizer)(model.parameters())
    g = torch.Generator().manual_seed(1)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()
    grads = {n: torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = read_state(opt, model)
    if wrong == "state_lost":
        opt.state[model.logit_scale].clear()
    for n, p in model.named_parameters():
        p.grad = grads[n].clone()
    opt.step()
    with torch.no_grad():
        if wrong == "doubled":
            model.logit_scale.add_(model.logit_scale - before["logit_scale"])
    return before, grads, state, {n: p.detach().clone() for n, p in model.named_parameters()}


def _torch_step(optimizer: str, before, grads, state):
    """torch's own float64 step of logit_scale alone from (before, grads, state): its value and state after."""
    p = nn.Parameter(before["logit_scale"].double().clone())
    opt = _factory(optimizer)([p])
    opt.state[p] = {k: (v.double().clone() if per_element(k, v) else v.clone())
                    for k, v in state["logit_scale"].items()}
    p.grad = grads["logit_scale"].double().clone()
    opt.step()
    return p.detach(), opt.state[p]


# -- the replay -----------------------------------------------------------------------------------------------
def test_a_state_entry_is_per_element_by_its_key_not_its_shape():
    assert per_element("momentum_buffer", torch.zeros([])) and per_element("exp_avg", torch.zeros([]))
    assert per_element("exp_avg_sq", torch.zeros(3, 4))
    assert not per_element("step", torch.tensor(1.0)) and not per_element("step", 1)  # a count, 0-dim or a number
    assert not per_element("momentum_buffer", None)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_the_replay_steps_a_0dim_parameter_and_its_state_as_torch_does(optimizer):
    """The float64 replay from the backend's float32 state, read whole and read in pieces (the comparison's way, a
    piece of one element), is torch's own float64 step to the bit; the state it leaves holds the 0-dim momentum or
    moments in float64 (held in the backend's float32 where asked) and AdamW's step as the count it is."""
    before, grads, state, _ = _backend(optimizer)
    assert all(v.dim() == 0 for v in state["logit_scale"].values() if torch.is_tensor(v))  # step and moments alike
    want, want_state = _torch_step(optimizer, before, grads, state)
    whole = reference_step(_factory(optimizer), Compact(before), Compact(grads), state, torch.float64, CPU)
    assert torch.equal(whole.delta["logit_scale"], want - before["logit_scale"].double())
    pieces, _ = reference_step(_factory(optimizer), Compact(before), Compact(grads), state, torch.float64, CPU,
                               state_like=state).delta.pieces("logit_scale")
    assert pieces.numel() == 1 and torch.equal(pieces[0:1], want.reshape(1))
    for after, dtype in ((whole.state, torch.float64), (held_as(whole.state, state), torch.float32)):
        after = after["logit_scale"]
        assert after.keys() == want_state.keys()
        for k, v in want_state.items():
            if per_element(k, v):
                assert after[k].shape == torch.Size([]) and after[k].dtype == dtype, (k, after[k])
                assert torch.allclose(after[k].double(), v, rtol=1e-6), (k, after[k], v)
            else:
                assert torch.equal(after[k], v) and after[k].dtype == state["logit_scale"][k].dtype, (k, after[k])


def _failing(optimizer: str, wrong: str | None) -> list[str]:
    """The parameters the update check's comparison fails, as one process judges it."""
    before, grads, state, after = _backend(optimizer, wrong)
    params, names = Compact(before), list(before)
    ref = reference_step(_factory(optimizer), params, Compact(grads), state, torch.float64, CPU, state_like=state)
    floor = reference_step(_factory(optimizer), params, Compact(grads), state, torch.float32, CPU, keep_state=False)
    figures = range_figures("sums", (Difference(after, params), ref.delta, ref.delta, floor.delta, floor.delta), names,
                            U)
    judged, _ = judge_figures(figures, names, dtype="float32", world_size=1, depth=3)
    return [p.parameter for p in judged if not p.ok]


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_a_wrong_update_of_the_0dim_parameter_is_caught_on_it_alone(optimizer):
    assert _failing(optimizer, None) == []
    assert _failing(optimizer, "doubled") == ["logit_scale"]
    assert _failing(optimizer, "state_lost") == ["logit_scale"]


def test_a_zero_0dim_momentum_steps_like_none_and_a_wrong_one_is_named():
    assert _same_state({"logit_scale": {"momentum_buffer": torch.zeros([])}}, {})
    assert not _same_state({"logit_scale": {"step": torch.tensor(0.0)}}, {})  # a count is no buffer
    wrong, text = state_difference({"logit_scale": {"momentum_buffer": torch.tensor(0.5)}},
                                   {"logit_scale": {"momentum_buffer": torch.tensor(4.0)}}, ["logit_scale"])
    assert wrong == ["logit_scale"] and "logit_scale's momentum_buffer differs from it" in text, text
    assert "is 0.5 where 4 was expected" in text, text


def test_deepspeed_refuses_a_0dim_parameter_before_it_builds_the_engine():
    pytest.importorskip("deepspeed")
    from dpcompare.adapters.deepspeed_config import check_scalar_parameters

    for stage in range(4):
        with pytest.raises(ValueError) as refused:
            check_scalar_parameters(_Scaled(), stage)
        line = str(refused.value)
        assert "\n" not in line and f"--backend deepspeed --opt zero_stage={stage} cannot run this model" in line
        assert "logit_scale is a 0-dim parameter (shape [])" in line and "DeepSpeedEngine._broadcast_model" in line
        assert ("zero.Init._zero_init_param" in line) == (stage == 3), line
        assert "hold it as a 1-element tensor (torch.ones(1), not torch.ones([]))" in line
    one = _Scaled()
    one.logit_scale = nn.Parameter(torch.ones(1))
    check_scalar_parameters(one, 3)  # a 1-element parameter is let through


# -- whole runs -----------------------------------------------------------------------------------------------
def _different(in_process, backend: str, optimizer: str) -> dict:
    """The first divergence of an in-process run of a backend of tests/zerodim_models.py that gets logit_scale wrong."""
    status, out, err, files = in_process(f"tests.zerodim_models:{backend}", MODEL,
                                         ["--steps", "4", "--optimizer", optimizer, "--measure-steps", "0"])
    assert status == 0 and len(files) == 1, err[-3000:]
    e = json.loads(files[0].read_text())["equivalence"]
    assert e["verdict"] == "different", e["first_divergence"]
    assert e["checks"]["gradient"]["status"] == "pass"
    return e["first_divergence"]


def test_a_doubled_update_of_logit_scale_is_different_and_not_blamed_on_weight_decay(in_process):
    """SGD momentum from a fresh state: the doubled update of one element fits a weight decay of some value exactly, and
    a fitted weight decay is no evidence there; the ratio the update measured is what is said."""
    d = _different(in_process, "ScalarUpdateDoubledReference", "sgd")
    assert (d["step"], d["check"], d["parameters"]) == (0, "update", ["logit_scale"]), d
    assert d["cause"] == "scaled" and "the update is 2x the reference" in d["reason"], d


def test_a_lost_0dim_momentum_is_different_at_the_next_step(in_process):
    d = _different(in_process, "ScalarStateDroppedReference", "sgd")
    assert (d["step"], d["check"], d["parameters"]) == (1, "update", ["logit_scale"]), d
    assert "logit_scale holds no momentum_buffer where one of norm" in d["reason"], d


def _assert_judged(proc, result, backend: str, world_size: int, launcher: str, model: str = "clip-towers") -> None:
    """`equivalent`, every check passed at each of the 4 steps, and the 0-dim buffers judged."""
    assert_equivalent(proc, result, backend=backend, world_size=world_size, model=model, launcher=launcher, steps=4)
    buffers = {b["name"]: b for b in result["equivalence"]["buffers"]}
    for name in ("logit_scale_max", "similarity_ema", "steps_seen"):  # the 0-dim buffers, judged
        assert buffers[name]["nearest"], buffers[name]


@pytest.mark.multiproc
@pytest.mark.timeout(200)
def test_ddp_judges_the_clip_model_equivalent_at_two_ranks(launch):
    proc, result = launch("ddp", 2, MODEL, ["--steps", "4", "--measure-steps", "0"], "torchrun")
    _assert_judged(proc, result, "ddp", 2, "torchrun")


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("backend", "world_size", "launcher", "optimizer"), [
    ("reference", 1, "python", "sgd"), ("reference", 1, "python", "adamw"),
    ("dp", 1, "python", "sgd"), ("dp", 1, "python", "adamw"),
    ("ddp", 2, "torchrun", "adamw"), ("ddp", 3, "torchrun", "adamw"),
    ("horovod", 2, "horovodrun", "sgd"), ("horovod", 2, "horovodrun", "adamw"),
], indirect=["backend"])
def test_every_replicating_backend_judges_the_clip_model_equivalent(launch, backend, world_size, launcher, optimizer):
    """dp on the CPU is one process (a pass-through); ddp at 3 ranks cuts the checks' ranges inside parameters, the
    0-dim one never cut."""
    args = ["--steps", "4", "--measure-steps", "0", "--optimizer", optimizer]
    proc, result = launch(backend, world_size, MODEL, args, launcher)
    _assert_judged(proc, result, backend, world_size, launcher)


def _refused(launch, tmp_path: Path, backend: str, extra: list[str]) -> str:
    """A 2-rank run refused before it starts: rank 0 says one line (returned), rank 1 nothing, exit status 2."""
    log_dir = tmp_path / f"logs-{len(list(tmp_path.glob('logs-*')))}"
    proc, result = launch(backend, 2, MODEL, ["--steps", "4", *extra], "torchrun",
                          launcher_args=["--log-dir", str(log_dir), "--redirects", "3"])
    assert result is None and proc.returncode != 0, proc.output[-3000:]
    assert "2" in re.findall(r"exitcode\s*:\s*(-?\d+)", proc.stderr), proc.stderr[-3000:]
    logs = torchrun_rank_logs(log_dir)
    ours = [line for line in logs[0]["stderr"].splitlines() if line.startswith(ERROR)]
    assert len(ours) == 1, logs[0]["stderr"][-3000:]
    for rank, streams in logs.items():
        assert "Traceback" not in streams["stderr"], (rank, streams["stderr"][-3000:])
        if rank:
            assert ERROR not in streams["stderr"], (rank, streams["stderr"][-3000:])
    assert "logit_scale" in ours[0] and "culprit" not in ours[0], ours[0]
    return ours[0]


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["deepspeed"], indirect=True)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_deepspeed_refuses_the_0dim_parameter_in_one_line_at_every_stage(launch, tmp_path, backend, stage):
    line = _refused(launch, tmp_path, "deepspeed", ["--opt", f"zero_stage={stage}"])
    assert f"--backend deepspeed --opt zero_stage={stage} cannot run this model: logit_scale is a 0-dim" in line
    assert "hold it as a 1-element tensor" in line and "--backend ddp or horovod" in line


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fsdp_refuses_the_0dim_parameter_in_one_line(launch, tmp_path):
    line = _refused(launch, tmp_path, "fsdp", [])
    assert "fully_shard doesn't support scalar parameters. Change logit_scale to a 1D tensor" in line, line


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("backend", "stage", "optimizer"), [
    ("deepspeed", 0, "sgd"), ("deepspeed", 1, "adamw"), ("deepspeed", 2, "sgd"), ("deepspeed", 3, "adamw"),
    ("deepspeed", 3, "sgd"), ("fsdp", None, "sgd"), ("fsdp", None, "adamw"),
], indirect=["backend"])
def test_what_the_refusals_advise_runs_equivalent(launch, backend, stage, optimizer):
    """logit_scale of shape [1] (the 0-dim buffers kept) under ZeRO 0-3 and FSDP2."""
    extra = [] if stage is None else ["--opt", f"zero_stage={stage}"]
    proc, result = launch(backend, 2, ONE_ELEMENT,
                          ["--steps", "4", "--measure-steps", "0", "--optimizer", optimizer, *extra], "torchrun")
    _assert_judged(proc, result, backend, 2, "torchrun", model="clip-towers-1")
