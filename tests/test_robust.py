"""Models nobody here wrote run to the end, or stop in one line, and every launch exits (issue 39, items 5-7).

Checks, on the models of tests/robust_models.py:
- the probe finds where a forward branches on the data (a tensor sized by its values, a value read in the model's own
  code) and parts of a batch that leave parameters out; a library helper's read and a plain MLP are not branches
  (twins);
- ddp's --opt find_unused_parameters: auto decided from those facts and said in a note, true/false obeyed, false
  refused in one line for a model seen leaving parameters out and stopped in one line at the step that leaves one
  out; a mixture of experts whose unused experts change with the data is `equivalent` under ddp through
  verification and measurement (the ablation included), and never meets torch's "please report a bug";
- fsdp and ZeRO-1/2/3 refuse such a model in one line; ZeRO-0 and Horovod run it;
- the model's own code raising in a step is told from the backend failing (twins: a hook of communication code
  deeper than the model, torch.distributed's own errors, running out of memory) and gets the build-time line with its
  traceback, exit 2 and no culprit, at 1 and 2 ranks, the other rank silent and gone;
- the heartbeat's mark of a rank that says why the run ends;
- a rank holding an object whose destructor never returns leaves at once (dpcompare.run.leave), and hangs without it
  (twin); runs of 2 ranks repeated under torchrun, the deepspeed launcher, horovodrun and mpirun all exit.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import robust_models
from conftest import REPO_ROOT, child_env, command, torchrun_rank_logs
from dpcompare.contract import ModelFacts, Settings
from dpcompare.contract.launch_env import LaunchEnv
from dpcompare.run import launchers, leave, raised
from dpcompare.run.watchdog import Watchdog
from dpcompare.verify.model_facts import data_dependence
from dpcompare.verify.model_facts.model_probe import probe
from tests.test_failures import in_process  # noqa: F401 - the fixture

ERROR = "dpcompare: error:"
SHORT = ["--warmup-steps", "1", "--measure-steps", "2"]
"""The defaults' 4 checked steps, then a short measurement with its ablation pairs."""


def _model(name: str):
    return getattr(robust_models, name)(0)


def _facts(name: str, global_batch: int = 24) -> ModelFacts:
    w = _model(name)
    return probe(w.model, w.loss_fn, w.make_batch(0, global_batch), torch.device("cpu"))


# -- where a forward branches on the data -------------------------------------------------------------------
def test_the_probe_finds_routing_and_a_branch_in_the_models_own_code_and_the_parts_that_leave_parameters_out():
    routed = _facts("routed")
    assert routed.branches_on_data and routed.data_reads == "Routed (nonzero)"
    assert routed.unused == () and {"experts.3.0.weight", "experts.2.0.weight"} & set(routed.left_out_by_parts)
    branch = _facts("per_sample_branch")
    assert branch.branches_on_data and "(__bool__)" in branch.data_reads
    assert set(branch.left_out_by_parts) == {"rare.weight", "rare.bias"}
    # the twins: every expert used by every part though the forward routes; an MLP reads nothing
    always = _facts("routed_always_used")
    assert always.branches_on_data and always.left_out_by_parts == ()
    from dpcompare.run.workloads import mlp

    w = mlp(0)
    plain = probe(w.model, w.loss_fn, w.make_batch(0, 24), torch.device("cpu"))
    assert (plain.data_reads, plain.branches_on_data, plain.left_out_by_parts) == (None, False, ())


def test_a_value_read_outside_the_models_own_code_is_no_branch():
    """A library helper that checks its input (`if mask.all():`, as transformers' causal-mask helpers do) reads the
    data but decides no parameter; the same read in the model's forward is a branch (the twin)."""
    namespace: dict = {}
    exec(compile("def check(t):\n    return bool(t.all())\n", "/library/helpers.py", "exec"), namespace)

    class Checked(torch.nn.Module):
        def __init__(self, own: bool) -> None:
            super().__init__()
            self.own, self.fc = own, torch.nn.Linear(4, 2)

        def forward(self, x):
            ok = bool((x == x).all()) if self.own else namespace["check"](x == x)
            return self.fc(x) if ok else self.fc(x) * 2

    for own in (False, True):
        model = Checked(own)
        with data_dependence.watch(model) as reads:
            model(torch.randn(3, 4))
        assert reads.read == "Checked (__bool__)"
        assert (reads.branch is not None) == own, (own, reads)


# -- ddp's find_unused_parameters -------------------------------------------------------------------------------
def _ddp(choice: str, facts: ModelFacts):
    from dpcompare.adapters.ddp import DDPAdapter

    env = LaunchEnv(rank=0, local_rank=0, world_size=2, local_world_size=2, launcher="torchrun", job_id="t")
    options = {o.name: o.default for o in DDPAdapter.OPTIONS} | {"find_unused_parameters": choice}
    adapter = DDPAdapter(env, torch.device("cpu"), Settings(options=options))
    adapter.model_facts = facts
    return adapter._find_unused()


def test_find_unused_parameters_auto_follows_the_probe_and_says_why():
    on, why = _ddp("auto", _facts("routed"))
    assert on and "parts of the first batch leave" in why and "Routed (nonzero)" in why
    on, why = _ddp("auto", ModelFacts(unused=("aux.weight",)))
    assert on and "aux.weight take no part in the loss" in why
    on, why = _ddp("auto", _facts("routed_always_used"))
    assert on and "branches on the data at Routed (nonzero)" in why
    # the twins: a library's read only, then nothing read at all
    on, why = _ddp("auto", ModelFacts(data_reads="model (LlamaModel) (__bool__)"))
    assert not on and "every part of the first batch used every parameter" in why
    assert _ddp("auto", ModelFacts()) == (False, "")
    assert _ddp("true", ModelFacts()) == (True, "(--opt find_unused_parameters)")
    assert _ddp("false", _facts("routed_always_used"))[0] is False


def test_find_unused_parameters_false_is_refused_for_a_model_seen_leaving_parameters_out():
    for facts, said in ((_facts("routed"), "parts of the first batch leave"),
                        (ModelFacts(unused=("aux.weight",)), "aux.weight take no part in the loss")):
        with pytest.raises(ValueError) as refused:
            _ddp("false", facts)
        assert said in str(refused.value) and "use --opt find_unused_parameters=true" in str(refused.value)


@pytest.mark.slow  # breadth: the default tier keeps this capability's other test
@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_data_dependent_unused_parameters_are_equivalent_under_ddp_through_measurement(launch):
    """Experts unused on one rank and used on the other, changing from step to step: verification and measurement,
    the ablation's unsynced arm included, run through (the ablation once built a second DDP over the module, which
    died with torch's "please report a bug")."""
    proc, result = launch("ddp", 2, "tests.robust_models:routed", SHORT, "torchrun")
    assert proc.returncode == 0 and result is not None, proc.output[-4000:]
    e = result["equivalence"]
    assert e["verdict"] == "equivalent", e
    note = next(n["text"] for n in e["notes"] if n["code"] == "ddp.find_unused_parameters")
    assert note.startswith("ddp: find_unused_parameters=True because parts of the first batch leave"), note
    assert result["metrics"]["step_unsynced_ms"] and result["metrics"]["comm_exposed_ms"] is not None
    assert "report a bug" not in proc.output


def _launch_logs(launch, tmp_path: Path, backend: str, model: str, extra: list[str]) -> tuple[int, dict, str]:
    log_dir = tmp_path / f"logs-{len(list(tmp_path.glob('logs-*')))}"
    proc, result = launch(backend, 2, model, extra, "torchrun",
                          launcher_args=["--log-dir", str(log_dir), "--redirects", "3"])
    assert result is None, "a run that stopped wrote a result"
    codes = [int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", proc.stderr)]
    return proc.returncode, torchrun_rank_logs(log_dir), str(codes)


def _said_once(logs: dict, by: int, *expected: str) -> list[str]:
    """Rank `by` said one error line (then, maybe, a traceback); every other rank said nothing at all. Returns rank
    `by`'s stderr from that line on."""
    lines = logs[by]["stderr"].splitlines()
    ours = [line for line in lines if line.startswith(ERROR)]
    assert len(ours) == 1, logs[by]["stderr"][-3000:]
    for text in expected:
        assert text in ours[0], ours[0]
    assert "culprit" not in ours[0]
    for rank, streams in logs.items():  # torch's own warnings aside (DDP's on find_unused_parameters)
        if rank != by:
            text = streams["stderr"]
            assert ERROR not in text and "Traceback" not in text, (rank, text[-3000:])
    return lines[lines.index(ours[0]):]


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_find_unused_parameters_false_stops_in_one_line(launch, tmp_path):
    """Refused before the run where the probe saw parts of the batch leave experts out; where only the run can see it
    (the extra head skipped for the batch holding step 2's planted sample, rank 1's), the rank that left it out says
    which parameters and what to set, before DDP's reducer waits for them."""
    status, logs, codes = _launch_logs(launch, tmp_path, "ddp", "tests.robust_models:routed",
                                       ["--opt", "find_unused_parameters=false"])
    _said_once(logs, 0, "--opt find_unused_parameters=false is invalid for this model",
               "parts of the first batch leave", "use --opt find_unused_parameters=true")
    assert "2" in codes, codes
    status, logs, codes = _launch_logs(launch, tmp_path, "ddp", "tests.robust_models:extra_head_until_planted",
                                       ["--opt", "find_unused_parameters=false"])
    _said_once(logs, 1, "[rank 1] --backend ddp: this step's forward on rank 1 left extra.weight, extra.bias out",
               "use --opt find_unused_parameters=true")
    for streams in logs.values():
        assert "Traceback" not in streams["stderr"] and "report a bug" not in streams["stderr"]


@pytest.mark.multiproc
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("backend", "extra", "said"), [  # ZeRO-3's launch (DeepSpeed's start) in the deep tier
    pytest.param("fsdp", [], "--backend fsdp cannot run this model", id="fsdp", marks=pytest.mark.slow),
    pytest.param("deepspeed", ["--opt", "zero_stage=3"], "--backend deepspeed --opt zero_stage=3 cannot run this model",
                 id="zero3", marks=pytest.mark.deep),
], indirect=["backend"])
def test_sharding_backends_refuse_data_dependent_unused_parameters_in_one_line(launch, tmp_path, backend, extra, said):
    _, logs, codes = _launch_logs(launch, tmp_path, backend, "tests.robust_models:routed", extra)
    _said_once(logs, 0, said, "parts of the first batch leave", "--backend ddp")


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("backend", "launcher", "extra"), [
    pytest.param("deepspeed", "torchrun", [], id="zero0"),
    pytest.param("horovod", "horovodrun", [], id="horovod"),
], indirect=["backend"])
def test_data_dependent_unused_parameters_run_through_the_ablation_elsewhere(launch, backend, launcher, extra):
    proc, result = launch(backend, 2, "tests.robust_models:routed", [*SHORT, *extra], launcher)
    assert proc.returncode == 0 and result is not None, proc.output[-4000:]
    assert result["equivalence"]["verdict"] == "equivalent"
    assert result["metrics"]["comm_exposed_ms"] is not None


# -- the model raising inside the run -------------------------------------------------------------------------
class _Communication:
    """Stands for communication code (its file: this test module) around or inside the model."""

    @staticmethod
    def forward(model, x):
        return model(x)

    @staticmethod
    def hook(module, args):
        raise RuntimeError("Connection closed by peer")


def test_the_models_own_code_raising_is_told_from_communication_failing():
    w = _model("torch_raises_at_step2")
    x, y = w.make_batch(2, 8)
    code = raised.model_files(w.model, w.loss_fn)
    here = frozenset({str(Path(__file__).resolve())})

    def caught(call) -> BaseException:
        with pytest.raises(BaseException) as info:
            call()
        return info.value

    assert raised.model_raised(caught(lambda: w.model(x)), code, here)
    assert raised.model_raised(caught(lambda: _Communication.forward(w.model, x)), code, here)  # called by it
    # the twins: communication deeper than the model (a hook of FSDP's kind), torch.distributed's own error, memory
    w.model.body.register_forward_pre_hook(_Communication.hook)
    assert not raised.model_raised(caught(lambda: w.model(w.make_batch(0, 8)[0])), code, here)
    assert not raised.model_raised(torch.distributed.DistBackendError("lost a peer"), code, here)
    assert not raised.model_raised(torch.OutOfMemoryError("out of memory"), code, here)


def test_a_model_raising_at_step_2_gets_the_build_time_line_at_one_rank(in_process):
    status, out, err, written = in_process("reference", "tests.robust_models:torch_raises_at_step2", [])
    assert status == 2 and written == [] and out == "", (status, out, err)
    first, *rest = err.splitlines()
    assert first == ("dpcompare: error: --model tests.robust_models:torch_raises_at_step2: your model raised "
                     "RuntimeError in its forward at step 2 (verify): mat1 and mat2 shapes cannot be multiplied (24x8 "
                     "and 16x32) (its traceback follows)"), first
    assert rest[0].startswith("Traceback") and "robust_models.py" in err and "culprit" not in err


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_model_raising_at_step_2_gets_the_build_time_line_at_one_rank_under_torchrun(launch, tmp_path):
    """ddp at one rank under torchrun: a backend of one process per replica, leaving through dpcompare.run.leave."""
    log_dir = tmp_path / "logs"
    proc, result = launch("ddp", 1, "tests.robust_models:torch_raises_at_step2", [], "torchrun",
                          launcher_args=["--log-dir", str(log_dir), "--redirects", "3"])
    assert result is None and re.search(r"exitcode\s*:\s*2\b", proc.stderr), proc.output[-3000:]
    lines = _said_once(torchrun_rank_logs(log_dir), 0,
                       "your model raised RuntimeError in its forward at step 2 (verify): mat1 and mat2 shapes")
    assert lines[1].startswith("Traceback") and "on rank" not in lines[0]


@pytest.mark.slow  # breadth: the default tier keeps this capability's other test
@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_a_model_raising_on_one_rank_gets_the_build_time_line_and_the_other_rank_leaves_silent(launch, tmp_path):
    """Rank 1's shard holds step 2's planted sample: rank 1 says the line with its traceback and exits 2; rank 0,
    waiting for it in the all-reduce, loses it and leaves without a word (no culprit, no hang)."""
    _, logs, codes = _launch_logs(launch, tmp_path, "ddp", "tests.robust_models:raises_at_step2_rank1", [])
    lines = _said_once(logs, 1, "[rank 1] --model tests.robust_models:raises_at_step2_rank1: your model raised "
                                "ValueError in its forward at step 2 (verify): a planted sample reached the forward")
    assert lines[1].startswith("Traceback") and "robust_models.py" in logs[1]["stderr"]
    # rank 0 ends by the launcher's SIGTERM: killed by it (-15), or leaving at once in its handler (143: 128 +
    # SIGTERM, silent where the peer has said why), whichever the signal finds it doing
    assert set(codes.strip("[]").split(", ")) <= {"2", "-15", "143"} and "2" in codes, codes


@pytest.mark.multiproc
@pytest.mark.timeout(400)
@pytest.mark.parametrize(("backend", "extra"), [  # ZeRO-3's launch (DeepSpeed's start) in the deep tier
    pytest.param("fsdp", [], id="fsdp", marks=pytest.mark.slow),
    pytest.param("deepspeed", ["--opt", "zero_stage=3"], id="zero3", marks=pytest.mark.deep)],
                         indirect=["backend"])
def test_a_model_raising_on_one_rank_under_a_sharding_backend(launch, tmp_path, backend, extra):
    """The same under FSDP2 and ZeRO-3, whose hooks gather parameters inside the model's forward: the model's frame is
    the deepest, and rank 0, waiting in a collective, leaves silent."""
    _, logs, codes = _launch_logs(launch, tmp_path, backend, "tests.robust_models:raises_at_step2_rank1", extra)
    lines = _said_once(logs, 1, "[rank 1] --model tests.robust_models:raises_at_step2_rank1: your model raised "
                                "ValueError in its forward at step 2 (verify)")
    assert lines[1].startswith("Traceback")


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_model_raising_on_every_rank_is_said_once_by_rank_0(launch, tmp_path):
    _, logs, codes = _launch_logs(launch, tmp_path, "ddp", "tests.robust_models:torch_raises_at_step2", [])
    lines = _said_once(logs, 0, "--model tests.robust_models:torch_raises_at_step2: your model raised RuntimeError in "
                                "its forward at step 2 (verify) on rank 0: mat1 and mat2 shapes cannot be multiplied")
    assert lines[1].startswith("Traceback")


# -- the heartbeat's mark --------------------------------------------------------------------------------------
def test_a_rank_that_says_why_the_run_ends_is_seen_by_its_peers(tmp_path, monkeypatch):
    monkeypatch.setenv("DPCOMPARE_HEARTBEAT_DIR", str(tmp_path))
    ranks = [Watchdog(rank=r, world_size=2, job_id="said", timeout_s=60) for r in (0, 1)]
    for w in ranks:
        w._write()
    assert ranks[0].peer_said() is None and not ranks[1].wait_for_said(0, within_s=0.1)  # the twin: nobody said
    ranks[1].say_leaving()
    assert ranks[0].peer_said() == 1 and ranks[1].peer_said() is None
    assert ranks[0].wait_for_said(1, within_s=0.1)


# -- every launch exits ------------------------------------------------------------------------------------------
STUCK = """
import sys, threading
sys.path.insert(0, {root!r})
from dpcompare.run import leave


class Stuck:
    def __del__(self):  # a destructor that never returns, as a gloo process group's did
        threading.Event().wait()


kept = Stuck()
if sys.argv[1] == "hold":
    leave.hold(kept)
print("written", flush=True)
leave.exit_if_held(0)
"""


def test_a_rank_holding_a_destructor_that_never_returns_leaves_at_once(tmp_path):
    script = tmp_path / "stuck.py"
    script.write_text(STUCK.format(root=str(REPO_ROOT)))
    held = subprocess.run([sys.executable, str(script), "hold"], capture_output=True, text=True, timeout=60)
    assert (held.returncode, held.stdout) == (0, "written\n"), held.stderr
    with pytest.raises(subprocess.TimeoutExpired):  # the twin: the interpreter's own exit runs the destructor
        subprocess.run([sys.executable, str(script), "free"], capture_output=True, text=True, timeout=3)
    leave.exit_if_held(0)  # nothing held in this process: it returns


REPEAT_ARGS = ["--steps", "1", "--check-every", "0", "--measure-steps", "0", "--timeout-s", "60"]
REPEAT_MODEL = "tests.robust_models:routed"
"""A small model whose unused experts change with the data (the launches that hung were ddp runs of such models and
of transformers configs), one step, no check, no measurement: the shortest run that builds DDP's reducer with
find_unused_parameters, gathers objects (the all-gathers whose tensors a gloo worker freed in the hang), writes its
result and leaves."""


def _repeat(tmp_path: Path, backend: str, launcher: str, runs: int, per_run_s: float = 180.0) -> None:
    """`runs` consecutive 2-rank launches, each under a timeout that kills its process tree: all must exit 0 and
    write their result; those that hung are counted and named."""
    hung, failed = [], []
    for i in range(runs):
        out = tmp_path / f"out-{i}"
        args = ["--backend", backend, "--model", REPEAT_MODEL, "--out", str(out), *REPEAT_ARGS]
        done = launchers.run_process(command(launcher, 2, args), timeout_s=per_run_s, capture=True,
                                     env=child_env(tmp_path), cwd=REPO_ROOT)
        if done.returncode is None:
            hung.append(i)
        elif done.returncode != 0 or len(list(out.glob("*.json"))) != 1:
            failed.append((i, done.returncode, (done.stdout + done.stderr)[-1500:]))
    assert not hung and not failed, f"{len(hung)} of {runs} launches hung (runs {hung}); failed: {failed}"


@pytest.mark.slow  # breadth: the default tier keeps this capability's other test
@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_three_consecutive_runs_all_exit(tmp_path):
    _repeat(tmp_path, "ddp", "torchrun", 3)


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_fifty_consecutive_runs_all_exit_under_torchrun(tmp_path):
    """The hang was seen in 3 of 49 such launches, 1 of 40 of a transformers config here: 50 in a row exit."""
    _repeat(tmp_path, "ddp", "torchrun", 50)


@pytest.mark.multiproc
@pytest.mark.timeout(2400)
@pytest.mark.parametrize(("backend", "launcher", "runs"), [
    # Fewer: each launch costs the launcher's own start (the deepspeed launcher ~10 s, horovodrun and mpirun ~5 s
    # more than torchrun) and they share the exit path torchrun's fifty exercise; what differs is how each launcher
    # waits for its ranks and what a rank must do before it leaves (Horovod's MPI_Finalize, DeepSpeed's shm file).
    # CI's slow tier keeps three of each launcher that is not torchrun's; ten of each run in the deep tier.
    pytest.param("deepspeed", "deepspeed", 3, id="deepspeed-launcher-3", marks=pytest.mark.slow),
    pytest.param("horovod", "horovodrun", 3, id="horovodrun-3", marks=pytest.mark.slow),
    pytest.param("deepspeed", "deepspeed", 10, id="deepspeed-launcher-10", marks=pytest.mark.deep),
    pytest.param("horovod", "horovodrun", 10, id="horovodrun-10", marks=pytest.mark.deep),
    pytest.param("ddp", "mpirun", 10, id="mpirun-10", marks=pytest.mark.deep),
], indirect=["backend"])
def test_consecutive_runs_all_exit_under_the_other_launchers(tmp_path, backend, launcher, runs):
    _repeat(tmp_path, backend, launcher, runs)
