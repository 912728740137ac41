"""The user's own optimizer and learning-rate schedule, held against a reference built apart from the backend.

Checked against:
- the reference (dpcompare.verify.replay.optimizer_rebuild), against the user's optimizer and scheduler stepped on the whole
  model: each parameter's group and hyper-parameters at every step, the update check's replay per group
  (update_check.reference_step) and the trajectory's grouped optimizer (`over`, `schedule`) step to the same values;
- the adapter contract: the scheduler steps once after every training step whatever a backend's step() override does
  (contract.scheduling), and the state table names the optimizer's class and its groups;
- the refusals (dpcompare.run.optim.refusal, DeepSpeed's optimizer_refusal), one line each, and a refused run says it
  in one line, exit 2, with nothing written;
- under real launchers at 2 ranks, 4 checked steps: AdamW over parameter groups with warmup then cosine, Adam with
  betas (0.9, 0.95), Nesterov SGD, foreach AdamW with a --scheduler, and lion-pytorch's Lion are `equivalent` under
  ddp, fsdp, DeepSpeed ZeRO 0-3 and Horovod (one cell per kind in the default tier, the matrix in `slow`), the
  scale-invariant ones with the update check's power against a wrong divisor stated; and three twins
  (tests/faulty_optim.py) are `different`, their cause named: weight decay on every group, the scheduler stepped twice,
  a group's learning rate dropped.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

import optim_workloads as ow
from dpcompare.contract import Adapter, Settings
from dpcompare.contract.launch_env import LaunchEnv
from dpcompare.run import optim, state_table
from dpcompare.run.config import RunConfig
from dpcompare.run.workloads import lm
from dpcompare.verify.replay.optimizer_rebuild import OptimizerReference, over, schedule
from dpcompare.verify.replay.optimizer_replay import reference_step

WS = 2
QUICK = ["--steps", "4", "--measure-steps", "0"]
CELLS = {"ddp": ("ddp", []), "fsdp": ("fsdp", []), "horovod": ("horovod", []),
         **{f"zero{s}": ("deepspeed", ["--opt", f"zero_stage={s}"]) for s in range(4)}}
KINDS = {
    "adamw-groups-warmup-cosine": ("tests.optim_workloads:lm_grouped", [], "ddp"),
    "adam-betas": ("lm", ["--optimizer", "tests.optim_workloads:adam_095"], "fsdp"),
    "sgd-nesterov": ("lm", ["--optimizer", "tests.optim_workloads:sgd_nesterov"], "zero2"),
    "adamw-foreach": ("lm", ["--optimizer", "tests.optim_workloads:adamw_foreach",
                             "--scheduler", "tests.optim_workloads:warmup_cosine"], "horovod"),
    "lion": ("lm", ["--optimizer", "tests.optim_workloads:lion"], "zero3"),
}
"""Each kind's model and flags, and the cell it runs in the default tier."""
SCALE_INVARIANT = {"adamw-groups-warmup-cosine", "adam-betas", "adamw-foreach", "lion"}


def _model() -> torch.nn.Module:
    return lm(0).model


def _user_run(steps: int = 4):
    """The user's optimizer and scheduler stepped on the whole model, in float64, with fixed gradients: the values
    each parameter reaches after each step."""
    torch.manual_seed(1)
    model = _model().double()
    optimizer, grads = ow.adamw_groups(model), [{n: torch.randn_like(p) for n, p in model.named_parameters()}
                                                for _ in range(steps)]
    scheduler = ow.warmup_cosine(optimizer)
    before, after = [], []
    for k in range(steps):
        before.append({n: p.detach().clone() for n, p in model.named_parameters()})
        for n, p in model.named_parameters():
            p.grad = grads[k][n].clone()
        optimizer.step()
        scheduler.step()
        after.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return before, after, grads, optimizer


# -- the reference ----------------------------------------------------------------------------------------------------
def test_the_reference_knows_each_parameters_group_and_the_schedules_values_at_every_step():
    ref = OptimizerReference(ow.adamw_groups, ow.warmup_cosine, _model(), lr=0.05)
    assert ref.type is torch.optim.AdamW and len(ref.groups) == 2
    assert ref.group_of("blocks.0.mlp.0.weight") == 0 and ref.group_of("blocks.0.ln1.bias") == 1
    assert ref.group_of("tok.weight") == 0
    lrs = [ref.hparams(0, k)["lr"] for k in range(4)]
    assert lrs == pytest.approx([ow.LR * f for f in (0.5, 1.0, 1.0, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2)))])
    assert ref.hparams(1, 1)["lr"] == pytest.approx(ow.LR / 2) and ref.hparams(1, 1)["weight_decay"] == 0.0
    assert next(ref.model.parameters()).device.type == "meta"  # nothing of the model allocated for it
    assert "AdamW, 2 groups of 10 / 18 tensors (weight_decay 0.1 / 0; lr 0.002 / 0.001), scheduled by LambdaLR" == \
        ref.describe()


def test_the_update_checks_replay_steps_each_group_as_the_users_optimizer_does_at_each_step():
    before, after, grads, _ = _user_run()
    ref = OptimizerReference(ow.adamw_groups, ow.warmup_cosine, _model())
    state: dict = {}
    for k in range(4):
        result = reference_step(ref.at(k), before[k], grads[k], state, torch.float64, torch.device("cpu"))
        for n in before[k]:
            assert torch.allclose(before[k][n] + result.delta[n], after[k][n], rtol=0, atol=1e-12), (k, n)
        state = result.state
    # the schedule is part of it: the step-0 values replayed at step 1 miss
    wrong = reference_step(ref.at(0), before[1], grads[1], state, torch.float64, torch.device("cpu"))
    assert not torch.allclose(before[1]["tok.weight"] + wrong.delta["tok.weight"], after[1]["tok.weight"])


def test_the_trajectorys_optimizer_is_grouped_as_the_run_and_scheduled_step_by_step():
    before, after, grads, _ = _user_run()
    ref = OptimizerReference(ow.adamw_groups, ow.warmup_cosine, _model())
    copy = _model().double()
    with torch.no_grad():
        for n, p in copy.named_parameters():
            p.copy_(before[0][n])
    opt = over(ref, list(copy.named_parameters()))
    assert [len(g["params"]) for g in opt.param_groups] == [10, 18]
    for k in range(4):
        schedule(ref, [opt], k)
        for n, p in copy.named_parameters():
            p.grad = grads[k][n].clone()
        opt.step()
    for n, p in copy.named_parameters():
        assert torch.allclose(p, after[-1][n], rtol=0, atol=1e-12), n


def test_a_plain_factory_passes_through_unchanged():
    factory = optim.optimizer_factory(RunConfig(optimizer="adamw"), _model(), lm(0))
    assert not isinstance(factory, OptimizerReference)
    assert type(factory([torch.nn.Parameter(torch.zeros(1))])) is torch.optim.AdamW
    chosen = optim.optimizer_factory(RunConfig(), _model(), ow.lm_grouped(0))
    assert isinstance(chosen, OptimizerReference) and chosen.scheduled


# -- the adapter contract ---------------------------------------------------------------------------------------------
class _Counted(Adapter):
    def step(self) -> None:  # an override that steps twice, as a double-step fault does
        super().step()
        super().step()


def _adapter(cls=Adapter):
    adapter = cls(LaunchEnv(launcher="python", rank=0, local_rank=0, world_size=1, local_world_size=1, job_id="t"),
                  torch.device("cpu"))
    model = torch.nn.Linear(2, 2)
    adapter.scheduler_factory = lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    adapter.wrap(model, torch.optim.SGD(model.parameters(), lr=1.0), 1, 1)
    adapter.start_scheduler()
    return adapter


def test_the_scheduler_steps_once_per_training_step_whatever_the_backends_step_does():
    for cls in (Adapter, _Counted):
        adapter = _adapter(cls)
        for _ in range(3):
            adapter.step()
        assert adapter.scheduler.last_epoch == 3, cls
        assert adapter.wrapped.optimizer.param_groups[0]["lr"] == pytest.approx(0.125)
    adapter = _adapter()
    adapter.scheduler_steps_in_step = True  # DeepSpeed's engine steps it in its own step()
    adapter.step()
    assert adapter.scheduler.last_epoch == 0


def test_the_state_table_names_the_optimizer_class_and_its_groups():
    model = _model()
    optimizer = ow.adamw_groups(model)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    adapter = SimpleNamespace(wrapped=SimpleNamespace(optimizer=optimizer),
                              model_state_tensors=lambda: {"params": list(model.parameters()), "grads": [],
                                                           "master_params": []},
                              gradient_wire=lambda: "none", gradient_wire_parameters=lambda: None,
                              scaler_state=lambda: None)
    reading = state_table.read(adapter, None)
    assert reading["optimizer_class"] == "AdamW"
    assert reading["optimizer_groups"] == {"count": 2, "differing": {"weight_decay": [0.1, 0.0], "lr": [0.002, 0.001]}}
    assert state_table.cell("optimizer", [reading]) == \
        "AdamW, 2 groups (weight_decay 0.1 / 0; lr 0.002 / 0.001): exp_avg float32, exp_avg_sq float32"


# -- refusals ---------------------------------------------------------------------------------------------------------
def _refusal(cfg: RunConfig, workload=None, adapter_cls=Adapter, settings=None) -> str | None:
    workload = workload or lm(0)
    adapter = SimpleNamespace(settings=settings or Settings(), optimizer_refusal=adapter_cls.optimizer_refusal)
    return optim.refusal(cfg, optim.choose(cfg, workload), workload.model, adapter)


@pytest.mark.parametrize(("flags", "said"), [
    ({"optimizer": "tests.optim_workloads:raising"},
     "--optimizer tests.optim_workloads:raising: your function raised KeyError: 'no_such_group' (it is called as "
     "function(model) and must return a torch.optim.Optimizer)"),
    ({"optimizer": "tests.optim_workloads:leaves_out"},
     "--optimizer tests.optim_workloads:leaves_out: the optimizer leaves out trainable parameter(s) pos: give them to "
     "it, or set requires_grad=False on them"),
    ({"scheduler": "tests.optim_workloads:raising_scheduler"},
     "--scheduler tests.optim_workloads:raising_scheduler: your function raised ValueError: warmup must be positive"),
    ({"scheduler": "tests.optim_workloads:steps_the_optimizer"},
     "its step() calls optimizer.step() itself, so every training step would take two optimizer steps"),
    ({"scheduler": "tests.optim_workloads:plateau"},
     "its step() raised TypeError"),
    ({"scheduler": "tests.optim_workloads:warmup_cosine", "save_checkpoint": "ckpt"},
     "a learning-rate schedule is not part of the checkpoints dpcompare saves and loads"),
])
def test_each_refusal_is_one_line_saying_what_to_change(flags, said):
    refused = _refusal(RunConfig(**flags))
    assert refused is not None and said in refused and "\n" not in refused, refused


def test_two_choices_of_the_optimizer_or_the_schedule_are_refused_and_a_good_one_is_not():
    with pytest.raises(ValueError, match="both choose the run's optimizer"):
        optim.choose(RunConfig(optimizer="adamw"), ow.lm_grouped(0))
    with pytest.raises(ValueError, match="both choose the run's schedule"):
        optim.choose(RunConfig(scheduler="tests.optim_workloads:warmup_cosine"), ow.lm_grouped(0))
    assert _refusal(RunConfig(), ow.lm_grouped(0)) is None


def test_deepspeed_refuses_a_schedule_its_engine_would_leave_behind_and_a_zero_buffer_typed_by_an_integer():
    from dpcompare.adapters.deepspeed import DeepSpeedAdapter

    settings = Settings(amp="fp16", options={"zero_stage": 1, "amp_recipe": "autocast"})
    refused = _refusal(RunConfig(backend="deepspeed", scheduler="tests.optim_workloads:warmup_cosine"),
                       adapter_cls=DeepSpeedAdapter, settings=settings)
    assert refused.startswith("--backend deepspeed cannot take --optimizer sgd with --scheduler "), refused
    assert "leaves the scheduler unstepped on a step its loss scaler skips" in refused and "--amp bf16" in refused
    assert _refusal(RunConfig(backend="deepspeed", scheduler="tests.optim_workloads:warmup_cosine"),
                    adapter_cls=DeepSpeedAdapter, settings=Settings(amp="bf16", options={"zero_stage": 1})) is None
    ids = torch.nn.Parameter(torch.arange(3), requires_grad=False)
    weight = torch.nn.Parameter(torch.zeros(3))
    integer_first = torch.optim.SGD([ids, weight], lr=0.1)
    refused = DeepSpeedAdapter.optimizer_refusal(Settings(options={"zero_stage": 2}), integer_first, False)
    assert "ZeRO-2 types its flat buffers by the first parameter of the first group, here a torch.int64" in refused
    assert DeepSpeedAdapter.optimizer_refusal(Settings(options={"zero_stage": 3}), integer_first, False) is None


@pytest.mark.multiproc
@pytest.mark.timeout(180)
def test_a_refused_run_says_one_line_exits_2_and_writes_nothing(launch, tmp_path):
    proc, result = launch("reference", 1, "lm", [*QUICK, "--scheduler", "tests.optim_workloads:steps_the_optimizer"])
    assert proc.returncode == 2 and result is None, proc.output[-3000:]
    said = [line for line in proc.output.splitlines() if "dpcompare: error:" in line]
    assert len(said) == 1 and "calls optimizer.step() itself" in said[0], proc.output[-3000:]
    assert "Traceback" not in proc.output
    assert not list(tmp_path.glob("out-*/*.json"))


# -- under real launchers ---------------------------------------------------------------------------------------------
def _launched(launch, cell: str, model: str, flags: list[str], backend: str | None = None):
    name, extra = CELLS[cell]
    return launch(backend or name, WS, model, [*QUICK, *extra, *flags], "horovodrun" if name == "horovod" else
                  "torchrun")


def _notes(result: dict) -> dict[str, str]:
    return {n["code"]: n["text"] for n in result["equivalence"]["notes"]}


def _assert_equivalent(proc, result, kind: str, cell: str) -> None:
    assert proc.returncode == 0 and result is not None, proc.output[-4000:]
    e = result["equivalence"]
    assert e["verdict"] == "equivalent", (kind, cell, e["first_divergence"], e["notes"], e.get("unverifiable_reason"))
    assert e["checked_steps"] == [0, 1, 2, 3]
    for check in ("gradient", "update", "trajectory"):
        assert e["checks"][check]["status"] == "pass", (kind, cell, check, e["checks"][check])
    optimizer = result["state"]["cells"]["optimizer"]
    assert optimizer.split(",")[0].split(":")[0] in ("AdamW", "Adam", "SGD", "Lion"), optimizer
    if kind in SCALE_INVARIANT:
        assert "is scale-invariant" in _notes(result)["scale_invariant_update"], e["notes"]
    print(f"{kind} {cell}: update {e['checks']['update']['noise_ratio']:.3g}x, trajectory "
          f"{e['checks']['trajectory']['noise_ratio']:.3g}x its floor; {optimizer}")


def _matrix():
    for kind, (_, _, default) in KINDS.items():
        for cell in CELLS:
            marks = [] if cell == default else [pytest.mark.slow]
            yield pytest.param(kind, cell, marks=marks, id=f"{kind}-{cell}")


@pytest.mark.multiproc
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("kind", "cell"), list(_matrix()))
def test_the_users_optimizer_and_schedule_are_equivalent_under_every_backend(launch, kind, cell):
    if CELLS[cell][0] in ("horovod", "deepspeed"):
        pytest.importorskip(CELLS[cell][0])
    model, flags, _ = KINDS[kind]
    proc, result = _launched(launch, cell, model, flags)
    _assert_equivalent(proc, result, kind, cell)


TWINS = {
    "DecayEveryGroupDDP": (0, "group_hparams", "parameter group 1 took a step with group 0's weight_decay (0.1) where "
                                               "their own group's is 0"),
    # the schedule's steps 1 and 2 are the same (warmup's end, cosine's start): step 2 is where twice shows
    "DoubleScheduleDDP": (2, "schedule", "the update took the schedule's learning rate of step 4"),
    "DroppedGroupLrDDP": (0, "group_hparams", "took a step with group 0's lr"),
}


@pytest.mark.multiproc
@pytest.mark.timeout(240)
@pytest.mark.parametrize("twin", list(TWINS))
def test_a_backend_that_gets_a_group_or_the_schedule_wrong_is_different_and_named(launch, twin):
    step, cause, said = TWINS[twin]
    proc, result = _launched(launch, "ddp", "tests.optim_workloads:lm_grouped", [],
                             backend=f"tests.faulty_optim:{twin}")
    assert proc.returncode == 0 and result is not None, proc.output[-4000:]
    e = result["equivalence"]
    d = e["first_divergence"]
    assert e["verdict"] == "different" and d is not None, e
    assert (d["check"], d["step"], d["cause"]) == ("update", step, cause), d
    assert said in d["reason"], d["reason"]
    assert e["checks"]["gradient"]["status"] == "pass"
    print(f"{twin}: {d['cause']} at step {d['step']}, {d['noise_ratio']:.3g}x its floor: {d['reason']}")
