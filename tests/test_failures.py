"""Failures end cleanly: bad input, a crashed rank, a hung rank, an interrupted result write.

Checks the CLI's error contract (docs/failures.md): bad input exits 2 with exactly one stderr line
`dpcompare: error: ...` that names the problem and the fix, never a Python traceback, and writes no result.
Every validation case runs in-process through dpcompare.cli.main (they fail before any backend starts); a few
run as real processes, under python and under each launcher. Under torchrun the launcher itself exits 1 and prints its own report;
what the child printed is read from torchrun's per-rank logs (`--log-dir D --redirects 3`), because
torchrun's ChildFailedError report contains a "Traceback" of torchrun's own frames
(torch/distributed/run.py -> launcher/api.py) that says nothing about dpcompare. A crashed rank ends the
launch quickly; a hung rank ends it within the --timeout-s watchdog and is named. Results on disk are
never half-written (dpcompare.json_files.write_atomic). The positive twin of every check here (a good run
exits 0, prints no error line and writes exactly one valid result) is asserted by the launch helper in
conftest.py for every equivalent run of test_equivalence_matrix.py.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest

from conftest import REPO_ROOT, torchrun_rank_logs, without_launcher_vars
from dpcompare import cli, json_files

ERROR_PREFIX = "dpcompare: error:"
_FRAME = re.compile(r'^\s*File "([^"]+)"', re.MULTILINE)


def assert_one_error_line(stderr: str, *expected: str) -> str:
    lines = stderr.splitlines()
    assert len(lines) == 1, f"expected exactly one stderr line, got {len(lines)}:\n{stderr}"
    line = lines[0]
    assert line.startswith(ERROR_PREFIX), line
    for text in expected:
        assert text in line, f"{text!r} not in {line!r}"
    return line


# -- bad input, one process ------------------------------------------------------------------------------
PYTHON_CASES = [
    pytest.param("nope", "mlp", [], ["unknown backend 'nope'", "ddp, deepspeed, dp, fsdp, horovod, reference"], id="unknown-backend"),
    pytest.param("reference", "nope", [], ["unknown model 'nope'", "cnn, gpt-mini", "lm, mlp", "resnet50"],
                 id="unknown-model"),
    pytest.param("reference", "mlp", ["--steps", "0"], ["--steps=0", "at least one step"], id="steps-0"),
    pytest.param("reference", "mlp", ["--lr", "-1"], ["--lr=-1.0", "positive learning rate"], id="lr-negative"),
    pytest.param("reference", "mlp", ["--opt", "foo"], ["--opt 'foo'", "KEY=VALUE"], id="opt-without-equals"),
    pytest.param("ddp", "mlp", ["--opt", "compression=fp16"], ["--opt compression=fp16 is a run setting",
                                                             "use --compression fp16"], id="opt-compression"),
    pytest.param("horovod", "mlp", ["--opt", "compression=bf16"], ["--opt compression=bf16 is a run setting",
                                                                 "use --compression bf16"], id="horovod-opt-bf16"),
    pytest.param("horovod", "mlp", ["--compression", "bf16"], ["--compression=bf16 is not available for --backend horovod",
                                                             "it supports fp16, none"], id="horovod-bf16"),
    pytest.param("ddp", "mlp", ["--opt", "bucket_cap_mb=25"], ["ddp's own name for --bucket-mb"], id="opt-bucket-cap-mb"),
    pytest.param("deepspeed", "mlp", ["--opt", "communication_data_type=fp16"],
                 ["deepspeed's own name for --compression"], id="opt-communication-data-type"),
    pytest.param("ddp", "mlp", ["--opt", "broadcast_buffers=perhaps"], ["--opt broadcast_buffers='perhaps' is invalid",
                                                                      "true/false"], id="opt-bad-value"),
    pytest.param("ddp", "mlp", ["--dp-devices", "2"], ["--dp-devices=2 does not apply to --backend ddp"], id="dp-devices-not-dp"),
    pytest.param("reference", "mlp", ["--timeout-s", "inf"], ["--timeout-s=inf is invalid", "finite"], id="timeout-inf"),
    pytest.param("reference", "mlp", ["--timeout-s", "1e12"], ["--timeout-s=1000000000000.0 is invalid", "at most"],
                 id="timeout-huge"),
    pytest.param("reference", "mlp", ["--seed", "99999999999999999999999"], ["--seed=99999999999999999999999 is invalid",
                                                                           "0 to 4294967295"], id="seed-huge"),
    pytest.param("reference", "mlp", ["--weight-decay", "nan"], ["--weight-decay=nan is invalid", "finite"],
                 id="weight-decay-nan"),
    pytest.param("reference", "mlp", ["--lr", "inf"], ["--lr=inf is invalid", "finite"], id="lr-inf"),
    pytest.param("reference", "mlp", ["--out", "/etc/passwd"], ["--out='/etc/passwd' is invalid", "is a file"],
                 id="out-is-a-file"),
    pytest.param("reference", "mlp", ["--out", "/proc/dpcompare-x"], ["--out='/proc/dpcompare-x' is invalid"],
                 id="out-unwritable"),
    pytest.param("reference", "mlp", ["--dump-grads", "/proc/dpcompare-x/g.npz"],
                 ["--dump-grads='/proc/dpcompare-x/g.npz' is invalid"], id="dump-grads-unwritable"),
    pytest.param("reference", "mlp", ["--collectives", "/nonexistent/c.json"],
                 ["--collectives='/nonexistent/c.json' cannot be read", "bench-collectives --out FILE"],
                 id="collectives-missing-at-ws1"),
    pytest.param("reference", "mlp", ["--collectives", "/etc/passwd"], ["--collectives='/etc/passwd' is not JSON"],
                 id="collectives-not-json"),
    pytest.param(":Adapter", "mlp", [], ["--backend ':Adapter' is invalid", "needs both parts"], id="backend-empty-module"),
    pytest.param("reference", "mlp", ["--sync-bn"], ["--sync-bn is invalid for --model mlp", "no BatchNorm"],
                 id="sync-bn-without-batchnorm"),
    pytest.param("ddp", "mlp", ["--opt", "dist_backend=nccl"], ["--opt dist_backend=nccl needs CUDA tensors"],
                 id="nccl-on-cpu"),
    pytest.param("reference", "mlp", ["--amp", "fp16", "--loss-scale", "1000"],
                 ["--loss-scale=1000.0 is invalid", "power of two"], id="loss-scale-not-a-power-of-two"),
    pytest.param("reference", "mlp", ["--loss-scale", "65536"], ["--loss-scale=65536.0 is invalid", "--amp fp16 only"],
                 id="loss-scale-without-fp16"),
    pytest.param("reference", "mlp", ["--amp", "bf16", "--dtype", "bfloat16"],
                 ["--dtype='bfloat16' is invalid", "keeps parameters and optimizer in float32"], id="amp-with-dtype"),
    pytest.param("deepspeed", "mlp", ["--opt", "amp_recipe=engine"], ["amp_recipe=engine", "add --amp bf16"],
                 id="engine-recipe-without-amp"),
    pytest.param("deepspeed", "mlp", ["--amp", "fp16", "--opt", "amp_recipe=engine"],
                 ["--amp fp16 --opt amp_recipe=engine", "does not support fp16 weights here", "use --amp bf16"],
                 id="deepspeed-fp16-engine-on-cpu"),
    pytest.param("tests.no_such_adapters:MyAdapter", "mlp", [],
                 ["cannot import module 'tests.no_such_adapters'", "PYTHONPATH"], id="adapter-module-missing"),
    pytest.param("tests.faulty_adapters:NoSuchAdapter", "mlp", [],
                 ["has no attribute 'NoSuchAdapter'"], id="adapter-class-missing"),
]


@pytest.fixture
def in_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    """Run `python -m dpcompare ARGS` in this process through dpcompare.cli.main, as a plain one-process launch
    would (no launcher variables, the working directory on sys.path, results under tmp_path/out): returns
    (exit status, stdout, stderr, the results written)."""
    saved = dict(os.environ)  # restored whole: a backend may set RANK, MASTER_PORT, ... for its world of one
    os.environ.clear()
    os.environ.update(without_launcher_vars(saved))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(REPO_ROOT))  # --backend tests.faulty_adapters:...

    def run(backend: str, model: str, extra: list[str]) -> tuple[int, str, str, list[Path]]:
        out = tmp_path / "out"
        status = cli.main(["--backend", backend, "--model", model, "--out", str(out), *extra])
        captured = capsys.readouterr()
        return status, captured.out, captured.err, sorted(out.glob("*.json")) if out.exists() else []

    yield run
    os.environ.clear()
    os.environ.update(saved)


@pytest.mark.parametrize(("backend", "model", "extra", "expected"), PYTHON_CASES)
def test_bad_input_is_one_line_and_exit_2(in_process, monkeypatch, backend, model, extra, expected):
    """In-process through cli.main: every case fails in validation, before any backend starts."""
    if "amp_recipe=engine" in extra and "fp16" in extra:
        # Refused where DeepSpeed's accelerator holds no fp16 weights: a CPU with AVX512-FP16 does (mkldnn's fp16),
        # and there the engine runs. The refusal is held here as it reads on a CPU without.
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

        monkeypatch.setattr(CPU_Accelerator, "is_fp16_supported", lambda self: False)
    status, out, err, written = in_process(backend, model, extra)
    assert status == 2, out + err
    assert written == []
    assert_one_error_line(err, *expected)
    assert "Traceback" not in out + err
    # DeepSpeed's import logs its accelerator choice on stdout (its own logger): not a line of ours
    ours = [line for line in out.splitlines() if "real_accelerator.py" not in line]
    assert ours == [], "no summary line for a run that did not happen"


UNDER_A_LAUNCHER = {"unknown-backend", "out-is-a-file"}


@pytest.mark.multiproc
@pytest.mark.timeout(150)
@pytest.mark.parametrize(("backend", "model", "extra", "expected"),
                         [c for c in PYTHON_CASES if c.id in UNDER_A_LAUNCHER])
def test_bad_input_from_the_command_line_is_one_line_and_exit_2(launch, backend, model, extra, expected):
    """The same contract for a real `python -m dpcompare` process: its exit status, its stderr, nothing written."""
    proc, result = launch(backend, 1, model, extra, "python")
    assert proc.returncode == 2, proc.output[-4000:]
    assert result is None
    assert_one_error_line(proc.stderr, *expected)
    assert "Traceback" not in proc.output
    assert proc.stdout == "", "no summary line for a run that did not happen"


# -- the user's own code raising -------------------------------------------------------------------------------
USER_CODE = {
    "syntax": ("broken_user_model", "def build(seed)\n    return None\n", "broken_user_model:build",
               ["importing your module 'broken_user_model' raised SyntaxError"], "broken_user_model.py"),
    "signature": ("user_model_signature", "def build():\n    return None\n", "user_model_signature:build",
                  ["--model user_model_signature:build: your function raised TypeError", "function(seed: int)"],
                  "TypeError: build() takes 0 positional arguments"),
    "raises": ("user_model_raises", "def build(seed):\n    raise KeyError('no such layer')\n", "user_model_raises:build",
               ["your function raised KeyError", "no such layer"], "user_model_raises.py"),
}


def _one_line_then_the_users_traceback(stderr: str, expected: list[str], in_traceback: str) -> None:
    first, *rest = stderr.splitlines()
    assert first.startswith(ERROR_PREFIX), stderr
    for text in expected:
        assert text in first, first
    # then the traceback of the user's code, naming their file
    assert rest and rest[0].startswith("Traceback") or any("SyntaxError" in line for line in rest), stderr
    assert in_traceback in "\n".join(rest), stderr


@pytest.mark.parametrize("case", sorted(USER_CODE))
def test_the_users_code_raising_is_one_line_then_its_traceback(in_process, tmp_path, case):
    module, source, spec, expected, in_traceback = USER_CODE[case]
    (tmp_path / f"{module}.py").write_text(source)  # python -m puts the working directory on sys.path
    status, out, err, written = in_process("reference", spec, [])
    assert status == 2, out + err
    assert written == []
    _one_line_then_the_users_traceback(err, expected, in_traceback)


@pytest.mark.multiproc
@pytest.mark.timeout(150)
def test_the_users_module_failing_to_import_under_python_m(launch):
    """A real `python -m dpcompare` process, which puts the working directory on sys.path."""
    module, source, spec, expected, in_traceback = USER_CODE["syntax"]
    (launch.cwd / f"{module}.py").write_text(source)
    proc, result = launch("reference", 1, spec, [], "python")
    assert proc.returncode == 2, proc.output[-4000:]
    assert result is None
    _one_line_then_the_users_traceback(proc.stderr, expected, in_traceback)


# -- bad input, several ranks under torchrun ---------------------------------------------------------------
TORCHRUN_CASES = [
    pytest.param("ddp", ["--global-batch", "25"], ["--global-batch=25", "not divisible by world size 2", "e.g. 24"],
                 id="global-batch-not-divisible"),
    pytest.param("horovod", [], ["cannot run under torchrun", "horovodrun -np N"], id="horovod-under-torchrun",
                 marks=pytest.mark.slow),
    pytest.param("dp", [], ["runs in one process", "torchrun started 2", "python -m dpcompare --backend dp"],
                 id="dp-under-torchrun", marks=pytest.mark.slow),
    pytest.param("ddp", ["--opt", "foo=1"], ["--opt foo=1 is not an option of --backend ddp", "gradient_as_bucket_view",
                                            "broadcast_buffers"], id="unknown-opt-key", marks=pytest.mark.slow),
]


@pytest.mark.multiproc
@pytest.mark.timeout(200)
@pytest.mark.parametrize(("backend", "extra", "expected"), TORCHRUN_CASES)
def test_bad_input_under_torchrun_is_said_once_by_rank_0(launch, tmp_path, backend, extra, expected):
    log_dir = tmp_path / "torchrun-logs"
    proc, result = launch(backend, 2, "mlp", extra, "torchrun", launcher_args=["--log-dir", str(log_dir), "--redirects", "3"])
    assert proc.returncode != 0
    assert result is None

    # What each rank printed: rank 0 says it once, the other rank stays quiet; nobody prints a traceback.
    logs = torchrun_rank_logs(log_dir)
    assert sorted(logs) == [0, 1], logs
    assert_one_error_line(logs[0]["stderr"], *expected)
    assert logs[1]["stderr"] == "", logs[1]["stderr"]
    for rank, streams in logs.items():
        for name, text in streams.items():
            assert "Traceback" not in text, f"rank {rank} {name}:\n{text}"

    # Every rank exited 2 (or was stopped by torchrun after the first one did).
    codes = [int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", proc.stderr)]
    assert 2 in codes and set(codes) <= {2, -15}, codes
    # torchrun's own report may carry a traceback: it must be torchrun's ChildFailedError, with no frame
    # in dpcompare's code.
    if "Traceback" in proc.stderr:
        assert "ChildFailedError" in proc.stderr
        frames = _FRAME.findall(proc.stderr)
        assert frames and all("/torch/" in f or f.endswith("/torchrun") for f in frames), frames


@pytest.mark.parametrize(("backend", "extra", "said_by_every_rank"), [
    pytest.param("ddp", ["--opt", "foo=1"], False, id="unknown-opt-key"),
    pytest.param("ddp", ["--opt", "foo"], False, id="opt-not-key-value"),
    pytest.param("ddp", ["--global-batch", "3"], False, id="global-batch-not-divisible"),
    pytest.param("tests.faulty_adapters:NoSuchAdapter", [], True, id="adapter-class-missing"),
])
def test_a_rank_other_than_0_leaves_quietly_when_the_command_line_alone_is_refused(
        in_process, monkeypatch, backend, extra, said_by_every_rank):
    """Rank 1 of two, in process: a setting refused for the command line alone is rank 0's to say (every rank refuses
    it alike), so rank 1 never says it, however late rank 0 gets there: it waits, silent, for the launcher to end it
    once rank 0 has said it and exited (leaving first would let the launcher end rank 0 before it says it). An error
    that could be this rank's alone (here its adapter failing to load) is said after the short quiet wait, with the
    rank."""
    waits: list[float] = []
    monkeypatch.setattr(cli.time, "sleep", waits.append)
    os.environ.update(RANK="1", LOCAL_RANK="1", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="29999", TORCHELASTIC_RUN_ID="quiet-rank")
    status, out, err, written = in_process(backend, "mlp", extra)
    assert status == 2 and written == [] and out == "", (status, out, written)
    if said_by_every_rank:
        assert waits == [cli.QUIET_RANK_EXIT_DELAY_S], waits
        assert_one_error_line(err, "[rank 1]")
    else:
        assert err == "" and waits == [cli.SAID_BY_RANK0_WAIT_S], (err, waits)


OTHER_LAUNCHERS = [pytest.param("horovod", "horovodrun", id="horovodrun"), pytest.param("ddp", "mpirun", id="mpirun"),
                   pytest.param("deepspeed", "deepspeed", id="deepspeed-launcher")]


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize(("backend", "launcher"), OTHER_LAUNCHERS, indirect=["backend"])
def test_bad_input_under_other_launchers_is_said_once(launch, backend, launcher):
    """An unknown --opt key under horovodrun, mpirun and the deepspeed launcher: the launch fails, writes nothing,
    and dpcompare's line appears once (rank 0's; the launchers prefix or interleave their ranks' output)."""
    proc, result = launch(backend, 2, "mlp", ["--opt", "foo=1"], launcher)
    assert proc.returncode != 0
    assert result is None
    ours = [line for line in proc.output.splitlines() if ERROR_PREFIX in line]
    assert len(ours) == 1, "\n".join(ours) or proc.output[-4000:]
    assert f"--opt foo=1 is not an option of --backend {backend}" in ours[0], ours[0]
    frames = _FRAME.findall(proc.output)
    assert not [f for f in frames if "/dpcompare/" in f], frames


# -- crashed and hung ranks ----------------------------------------------------------------------------
@pytest.mark.multiproc
@pytest.mark.slow  # the default tier kills a rank in the fault campaign (kill-ddp-torchrun)
@pytest.mark.timeout(150)
def test_crashed_rank_ends_the_launch_quickly(launch):
    # The default --timeout-s is 120 s: ending well before it means the crash, not a timeout, ended the run.
    proc, result = launch("ddp", 2, "mlp", ["--steps", "3", "--inject-fault", "crash:1:1"])
    assert proc.returncode != 0
    assert result is None
    assert proc.wall_s < 60, f"took {proc.wall_s:.0f} s"
    assert re.search(r"exitcode\s*:\s*17\b", proc.stderr), "rank 1's injected crash (exit 17) is not reported"


# -- results are never half-written ------------------------------------------------------------------------
class _Unserialisable:
    def __str__(self) -> str:  # json.dump(default=str) calls this halfway through the file
        raise RuntimeError("cannot serialise")


def test_write_atomic_writes_complete_json(tmp_path: Path):
    path = tmp_path / "r.json"
    json_files.write_atomic(path, {"a": 1, "nan": float("nan"), "nested": [1.5, {"inf": float("inf")}]})
    assert json.loads(path.read_text()) == {"a": 1, "nan": None, "nested": [1.5, {"inf": None}]}
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_latest_moves_to_the_newest_compare_and_never_replaces_a_real_folder(tmp_path: Path):
    first, second = tmp_path / "20261125-100000", tmp_path / "20261125-110000"
    first.mkdir(), second.mkdir()
    (first / "compare.json").write_text("{}")
    assert json_files.point_latest(first) == tmp_path / "latest"
    assert (tmp_path / "latest" / "compare.json").exists() and os.readlink(tmp_path / "latest") == first.name
    json_files.point_latest(second)
    assert os.readlink(tmp_path / "latest") == second.name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["20261125-100000", "20261125-110000", "latest"]
    (tmp_path / "latest").unlink()
    (tmp_path / "latest").mkdir()  # a folder of the user's own named latest: left alone
    assert json_files.point_latest(second) is None and not (tmp_path / "latest").is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["20261125-100000", "20261125-110000", "latest"]


def test_failed_serialisation_leaves_no_file_and_no_temp_file(tmp_path: Path):
    path = tmp_path / "out" / "r.json"
    payload = {"first": "x" * 100_000, "bad": _Unserialisable()}  # enough text that some is written first
    with pytest.raises(RuntimeError, match="cannot serialise"):
        json_files.write_atomic(path, payload)
    assert list(path.parent.iterdir()) == []


def test_failed_serialisation_leaves_an_existing_result_untouched(tmp_path: Path):
    path = tmp_path / "r.json"
    json_files.write_atomic(path, {"run": "earlier"})
    before = path.read_bytes()
    with pytest.raises(RuntimeError):
        json_files.write_atomic(path, {"run": "later", "bad": _Unserialisable()})
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_a_fenced_write_finds_its_fence_and_writes_nothing(tmp_path: Path):
    fence = tmp_path / "job.closed"
    path = tmp_path / "runs" / "r.json"
    json_files.write_atomic(path, {"run": "on time"}, unless=fence)  # no fence yet: written
    assert json.loads(path.read_text()) == {"run": "on time"}
    fence.touch()
    with pytest.raises(json_files.Closed, match="job.closed exists"):
        json_files.write_atomic(path, {"run": "late"}, unless=fence)
    assert json.loads(path.read_text()) == {"run": "on time"}
    assert [p.name for p in path.parent.iterdir()] == ["r.json"], "no temporary file left behind"


@pytest.mark.multiproc
@pytest.mark.timeout(150)
@pytest.mark.parametrize("closed", [pytest.param(False, marks=pytest.mark.slow), True], ids=["open", "closed"])  # the control in the breadth tier
def test_a_run_whose_fence_is_closed_writes_no_result_and_no_dump(launch, tmp_path, closed):
    """A rank that outlived its compare (the fence exists) fails in one line and leaves the folder as it was."""
    fence, dump = tmp_path / "job.closed", tmp_path / "grads" / "g.npz"
    if closed:
        fence.touch()
    proc, result = launch("reference", 1, "mlp", ["--steps", "1", "--measure-steps", "0", "--closed-if", str(fence),
                                                  "--dump-grads", str(dump)], "python")
    if not closed:
        assert proc.returncode == 0 and result is not None and dump.exists(), proc.output[-3000:]
        return
    assert proc.returncode == 4, proc.output[-3000:]
    assert result is None and not dump.exists()
    assert_one_error_line(proc.stderr, "not writing", "job.closed exists")
    assert "Traceback" not in proc.output


# -- the fault campaign: a rank killed, suspended or hung, under every launcher ----------------------------------
FAULT_TIMEOUT_S = 20
# torchrun + ddp starts fastest: its watchdog can be tighter, which keeps the default tier's hang short.
FAULT_TIMEOUT_S_FAST = 10
FAULT_LAUNCHES = [("ddp", "torchrun"), ("deepspeed", "torchrun"), ("horovod", "horovodrun"), ("ddp", "mpirun"),
                  ("deepspeed", "deepspeed")]
FAULT_NAMING = {"kill": "rank 1 died", "stop": "rank 1 is stopped", "hang": "culprit: rank(s) 1 (stuck at"}
# The default tier kills a ddp rank under torchrun; the `slow` tier runs every fault under every launcher but
# DeepSpeed's stop and hang (its ranks take the longest to start), which the `deep` tier runs. The hung rank's
# culprit naming stays in the default tier through the watchdog's unit tests (tests/test_units.py, test_hardening.py).
FAULT_DEFAULT = {("kill", "torchrun", "ddp")}


def _fault_tier(fault: str, launcher: str, backend: str):
    if (fault, launcher, backend) in FAULT_DEFAULT:
        return ()
    # A stopped rank under ddp and horovod and a hung one under mpirun: the deep tier (the slow tier keeps every
    # launcher's killed rank, and a hung rank under torchrun and horovodrun).
    if (backend == "deepspeed" and fault != "kill") or fault == "stop" or (fault, launcher) == ("hang", "mpirun"):
        return pytest.mark.deep
    return pytest.mark.slow


FAULT_CASES = [pytest.param(b, launcher, fault, id=f"{fault}-{b}-{launcher}", marks=_fault_tier(fault, launcher, b))
               for fault in ("kill", "stop", "hang") for b, launcher in FAULT_LAUNCHES]


def _processes_mentioning(text: str) -> list:
    import psutil

    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if text in " ".join(p.info["cmdline"] or []) and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.Error:
            continue
    return found


@pytest.mark.multiproc
@pytest.mark.timeout(FAULT_TIMEOUT_S + 150)
@pytest.mark.parametrize(("backend", "launcher", "fault"), FAULT_CASES, indirect=["backend"])
def test_fault_campaign(launch, tmp_path, backend, launcher, fault):
    """Rank 1 is SIGKILLed, SIGSTOPped or hangs at step 1 of 4 (--inject-fault KIND:1:1, --timeout-s 20, 10 for
    torchrun + ddp): the launch ends within the timeout plus startup and teardown, writes no result, leaves no
    process behind, and dpcompare's own output names rank 1 and what became of it."""
    timeout_s = FAULT_TIMEOUT_S_FAST if (backend, launcher) == ("ddp", "torchrun") else FAULT_TIMEOUT_S
    proc, result = launch(backend, 2, "mlp", ["--steps", "4", "--measure-steps", "0", "--inject-fault",
                                              f"{fault}:1:1", "--timeout-s", str(timeout_s)], launcher,
                          timeout_s=timeout_s + 120)
    assert proc.returncode != 0 and result is None
    bound = timeout_s + 25 if fault != "kill" else 40  # startup and teardown included
    assert proc.wall_s < bound, f"{launcher}: {proc.wall_s:.0f} s for a {timeout_s} s timeout"
    ours = [line for line in proc.output.splitlines() if "dpcompare: error" in line]
    assert any(FAULT_NAMING[fault] in line for line in ours), "\n".join(ours) or proc.output[-3000:]
    time.sleep(1)
    left = _processes_mentioning(str(tmp_path))
    assert not left, f"left behind: {[(p.pid, p.cmdline()[:5]) for p in left]}"
    print(f"FAULT {fault} {backend} {launcher}: exit {proc.returncode} in {proc.wall_s:.1f} s")


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.timeout(200)
def test_a_hung_rank_leaves_each_ranks_collectives_from_the_flight_recorder(launch, tmp_path):
    """Rank 1 hangs after its first checked step: every rank's watchdog writes its Flight Recorder entries beside the
    results and names the last collective it entered; rank 0 went on to a collective rank 1 never reached."""
    proc, result = launch("ddp", 2, "mlp", ["--steps", "4", "--measure-steps", "0", "--inject-fault", "hang:1:1",
                                            "--timeout-s", "10"], "torchrun", timeout_s=150)
    assert proc.returncode != 0 and result is None
    dumps = sorted(tmp_path.rglob("flight-recorder/*/rank*.json"))
    assert [d.name for d in dumps] == ["rank0.json", "rank1.json"], proc.output[-3000:]
    last = {d.name: json.loads(d.read_text())["entries"][-1] for d in dumps}
    assert last["rank0.json"]["collective_seq_id"] > last["rank1.json"]["collective_seq_id"], last
    assert "gloo:" in last["rank0.json"]["profiling_name"]
    said = [line for line in proc.output.splitlines() if "Its collectives (Flight Recorder)" in line]
    assert said, proc.output[-3000:]


def test_without_a_process_group_the_watchdog_says_why_there_is_no_dump(tmp_path, monkeypatch):
    import torch._C._distributed_c10d as c10d

    from dpcompare.run.watchdog import Watchdog

    # What the recorder holds in a process that ran no collective (a test run earlier in this process may have)
    monkeypatch.setattr(c10d, "_dump_fr_trace_json", lambda: '{"entries": []}')
    dog = Watchdog(rank=0, world_size=1, job_id=f"fr-{tmp_path.name}", timeout_s=60)
    assert dog.dump_collectives() == ""  # nowhere to write: nothing said
    dog.dump_to = tmp_path / "fr"
    said = dog.dump_collectives()
    assert said.startswith(" No Flight Recorder dump") and not (tmp_path / "fr").exists(), said


def test_a_half_way_dump_of_a_run_that_went_on_is_removed_when_it_finishes(tmp_path):
    from dpcompare.run.watchdog import Watchdog

    dog = Watchdog(rank=0, world_size=1, job_id=f"fr-{tmp_path.name}", timeout_s=60)
    dog.dump_to = tmp_path / "flight-recorder" / "job"
    dog.dump_to.mkdir(parents=True)
    (dog.dump_to / "rank0.json").write_text("{}")  # as a slow step's half-way dump leaves it
    dog._dumped_at = 3
    dog.stop(clean=True)
    assert not (tmp_path / "flight-recorder").exists()
