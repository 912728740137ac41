"""Shared helpers for the dpcompare test suite: starting real runs under real launchers.

`launch` (a fixture) starts `python -m dpcompare` under the launcher a user would use for that backend
(python, torchrun, horovodrun, mpirun or deepspeed), in a pytest tmp dir, with results written into
tmp_path, and returns the finished process and the run's JSON result, validated against the published
schema (dpcompare/schema/result.schema.json). The `backend` fixture skips a test only when the
backend's package cannot be imported at all (a broken install fails instead of skipping).

Hygiene every spawned process gets: OMP_NUM_THREADS=1 (two cores here), the repository root on
PYTHONPATH (so `--backend tests.faulty_adapters:SummingDDP` imports), loopback-only rendezvous, no
launcher variables inherited from the shell that runs pytest, its own heartbeat directory, and a
timeout after which the whole process tree is killed by pid.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

import jsonschema
import pytest

from dpcompare.run import launchers, registry

REPO_ROOT = Path(__file__).resolve().parents[1]
BIN_DIR = Path(sys.executable).parent
SCHEMA_PATH = REPO_ROOT / "dpcompare" / "schema" / "result.schema.json"

# Every run starts under the launcher its adapter declares (Capabilities.native_launcher, the table compare
# uses too), except deepspeed, which the tests start under torchrun: its own launcher adds ~5-10 s per run.
# test_equivalence_matrix runs it under the deepspeed launcher once.
TEST_LAUNCHER_OVERRIDE = {"deepspeed": "torchrun"}


def native_launcher(backend: str) -> str:
    """The launcher a test starts `backend` under (a user's own adapter class: its declared launcher)."""
    if backend in TEST_LAUNCHER_OVERRIDE:
        return TEST_LAUNCHER_OVERRIDE[backend]
    try:
        return registry.load(backend, registry.BACKENDS, "backend").capabilities.native_launcher
    except (ValueError, ImportError, AttributeError):
        return "python"  # a bad --backend: the run itself must refuse it, with one line


# Python modules a backend needs; a test of that backend is skipped only when the module is absent.
BACKEND_MODULES = {"horovod": "horovod", "deepspeed": "deepspeed"}
INSTALL_HINT = "bash scripts/setup.sh"

# Seconds a launch may take before its process tree is killed. DeepSpeed's first init on a machine
# JIT-compiles a shared-memory op (~70 s) before it is cached under ~/.cache/torch_extensions.
LAUNCH_TIMEOUT_S = {"python": 120, "torchrun": 180, "mpirun": 240, "horovodrun": 240, "deepspeed": 300}

# Variables set by launchers and schedulers: a test run from inside a job (CI under Slurm, a shell under
# mpirun) must not leak them into the processes it starts, or launch detection sees the wrong launcher.
_LAUNCHER_VAR_PREFIXES = ("OMPI_", "PMI_", "PMIX_", "SLURM_", "HOROVOD_", "TORCHELASTIC_", "MPI_LOCAL", "PRTE_")
_LAUNCHER_VARS = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "CROSS_RANK",
                  "CROSS_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR", "MASTER_PORT", "DPCOMPARE_HEARTBEAT_DIR"}


# -- result schema -----------------------------------------------------------------------------------
def result_validator() -> jsonschema.protocols.Validator:
    schema = json.loads(SCHEMA_PATH.read_text())
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def validate_result(payload: dict) -> None:
    """Raise jsonschema.ValidationError unless `payload` follows the published result schema."""
    result_validator().validate(payload)


# -- synthetic results (for tests of what reads them: compare, report) -----------------------------------
SYNTHETIC_TOLERANCE = {"rule": "rel_fro_err <= factor * (...)", "factor": 4.0, "unit_roundoff": 2.0**-24,
                       "world_size": 2, "depth": 3}
UNVERIFIABLE_REASON = ("the forward draws random numbers (drop) and BatchNorm couples the samples of a batch, so the "
                       "ranks' forwards cannot be replayed shard by shard: rerun with --no-dropout")


def checked_equivalence(verdict: str = "equivalent", *, stochastic: bool = False, **overrides) -> dict:
    """An `equivalence` object as a run writes it since the update and trajectory checks: gradient 1.25x its
    floor, update 3.5x with norm ratio 1.001, trajectory 2.25x; it catches a 3e-06 change."""
    e = {"verdict": verdict, "unverifiable_reason": None, "checked_steps": [0], "max_rel_err": 1e-7,
         "max_rel_fro_err": 2.5e-8, "noise_floor_rel_fro": 2e-8, "noise_ratio": 1.25, "min_detectable_rel": 3e-6,
         "first_divergence": None,
         "replicas_identical": True, "initial_weights_identical": True, "tolerance": SYNTHETIC_TOLERANCE, "notes": [],
         "drift": [{"step": 0, "rel_param_distance": 4.5e-8, "floor_rel_param_distance": 2e-8, "noise_ratio": 2.25,
                    "tolerance": 1e-6, "ok": True, "worst_parameter": "fc1.weight"}],
         "checks": {"gradient": {"status": "pass", "noise_ratio": 1.25, "max_rel_fro_err": 2.5e-8,
                                 "noise_floor_rel_fro": 2e-8},
                    "update": {"status": "pass", "noise_ratio": 3.5, "max_rel_fro_err": 7e-8,
                               "noise_floor_rel_fro": 2e-8, "norm_ratio": 1.001},
                    "trajectory": {"status": "pass", "noise_ratio": 2.25, "rel_param_distance": 4.5e-8,
                                   "floor_rel_param_distance": 2e-8, "step": 0}},
         "stochastic": {"stochastic": stochastic, "modules": ["drop"] if stochastic else [], "captured": stochastic,
                        "reason": None, "capture_bytes_per_step": 96 if stochastic else None},
         "parameters": {"unused": [], "frozen": [], "unused_grad": {}}}
    e.update(overrides)
    return e


# -- the tiers: a test marked deep is deep, whatever else it is marked -------------------------------------
DEEP_LIST = Path(__file__).with_name("deep_tier.txt")
"""Tests of the breadth tier (`slow`) run in the deep tier instead: CI's time (docs/testing.md). One pytest node ID
per line; '#' starts a comment."""


SLOW_LIST = Path(__file__).with_name("slow_tier.txt")
"""Tests written for the default tier run in the breadth tier (`slow`) instead: the default tier's ten minutes
(docs/testing.md). One pytest node ID per line; '#' starts a comment."""


def _listed(path: Path) -> set[str]:
    return {line.split("#", 1)[0].strip() for line in path.read_text().splitlines()} - {""}


def deep_listed() -> set[str]:
    return _listed(DEEP_LIST)


def slow_listed() -> set[str]:
    return _listed(SLOW_LIST)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items) -> None:
    """Before pytest selects by mark: each test listed in tests/slow_tier.txt is marked slow, each listed in
    tests/deep_tier.txt deep, and where the mark expression does not name deep (`-m slow`), a test marked deep is left
    out whatever else it is marked. A collection of the whole suite that misses a listed test is an error: a renamed test would silently return to its old tier."""
    listed, slow = deep_listed(), slow_listed()
    seen = set()
    for item in items:
        if item.nodeid in listed:
            item.add_marker(pytest.mark.deep)
            seen.add(item.nodeid)
        if item.nodeid in slow:
            item.add_marker(pytest.mark.slow)
            seen.add(item.nodeid)
    whole = set(config.args) <= {"tests", str(REPO_ROOT / "tests")}
    if whole and (listed | slow) - seen:
        raise pytest.UsageError(f"tests/deep_tier.txt or tests/slow_tier.txt lists tests that do not exist: "
                                f"{sorted((listed | slow) - seen)[:5]}")
    if "deep" in (config.getoption("markexpr") or ""):
        return
    dropped = [item for item in items if item.get_closest_marker("deep") is not None]
    if dropped:
        items[:] = [item for item in items if item.get_closest_marker("deep") is None]
        config.hook.pytest_deselected(items=dropped)


# -- noise ratios seen by the equivalence matrix, printed at the end of the session ------------------
NOISE_RATIOS: list[tuple[str, int, str, str, float, float | None, float | None]] = []


def pytest_sessionfinish(session) -> None:
    """Under pytest-xdist (`-n 2`), a worker hands the ratios its tests saw to the controller, which prints them."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["dpcompare_noise_ratios"] = list(NOISE_RATIOS)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:  # noqa: D103 (pytest-xdist's hook, on the controller)
    NOISE_RATIOS.extend(tuple(r) for r in getattr(node, "workeroutput", {}).get("dpcompare_noise_ratios", []))


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:  # noqa: D103
    if not NOISE_RATIOS:
        return
    terminalreporter.section("dpcompare noise ratios (error / its float32 noise floor)")
    terminalreporter.write_line(f"{'backend':<10} {'ws':>2} {'model':<11} {'launcher':<10} {'gradient':>9} {'update':>9} "
                                f"{'trajectory':>10}")

    def f(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    for backend, ws, model, launcher, grad, update, trajectory in sorted(NOISE_RATIOS):
        terminalreporter.write_line(f"{backend:<10} {ws:>2} {model:<11} {launcher:<10} {f(grad):>9} {f(update):>9} "
                                    f"{f(trajectory):>10}")


# -- processes -----------------------------------------------------------------------------------------
def command(launcher: str, world_size: int, dpcompare_args: Sequence[str], launcher_args: Sequence[str] = ()) -> list[str]:
    """The command line that starts `python -m dpcompare ARGS` with `world_size` ranks under `launcher`."""
    return launchers.native_command(launcher, world_size, dpcompare_args, launcher_args)


def one_rank_script(module: str, cls: str, model: str, body: str) -> str:
    """A Python script (for `python -c`) that builds adapter `cls` of dpcompare.adapters.`module` at world size 1 on
    the CPU with its default options, wraps workloads.`model`(0) with SGD, then runs `body` (adapter, w, wrapped)."""
    return f"""
import os, sys, torch
from dpcompare.adapters.{module} import {cls}
from dpcompare.contract import Settings
from dpcompare.run import workloads
from dpcompare.contract.launch_env import LaunchEnv
env = LaunchEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, launcher="python", job_id="t")
adapter = {cls}(env, torch.device("cpu"), Settings(options={{o.name: o.default for o in {cls}.OPTIONS}}))
adapter.setup(60)
w = workloads.{model}(0)
wrapped = adapter.wrap(w.model, torch.optim.SGD(w.model.parameters(), lr=0.1), 8, 8)
{body}"""


def without_launcher_vars(env: Mapping[str, str]) -> dict[str, str]:
    """`env` less every variable a launcher or scheduler sets (a test run inside a job must not leak them)."""
    return {k: v for k, v in env.items() if k not in _LAUNCHER_VARS and not k.startswith(_LAUNCHER_VAR_PREFIXES)}


def child_env(tmp_path: Path) -> dict[str, str]:
    env = without_launcher_vars(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["PATH"] = os.pathsep.join([str(BIN_DIR), env.get("PATH", "")])
    env["PYTHONUNBUFFERED"] = "1"
    env["DPCOMPARE_HEARTBEAT_DIR"] = str(tmp_path / "heartbeat")
    return env


@dataclass
class Finished:
    """A finished launch: its exit status, captured output and wall time."""

    args: list[str]
    returncode: int
    stdout: str
    stderr: str
    wall_s: float

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def run_command(cmd: Sequence[str], *, cwd: Path, env: dict[str, str], timeout_s: float) -> Finished:
    """Run `cmd` to completion with the library's runner (dpcompare.run.launchers.run_process); on timeout its
    whole tree is killed and the test fails with its output."""
    done = launchers.run_process(cmd, timeout_s=timeout_s, capture=True, env=env, cwd=cwd)
    if done.timed_out:
        pytest.fail(f"timed out after {timeout_s:g} s: {' '.join(done.command)}\n--- stdout\n{done.stdout[-4000:]}\n"
                    f"--- stderr\n{done.stderr[-4000:]}")
    return Finished(done.command, done.returncode, done.stdout, done.stderr, done.wall_s)


def _read_result(out_dir: Path, finished: Finished) -> dict | None:
    leftovers = [p.name for p in out_dir.glob(".*")] if out_dir.exists() else []
    assert not leftovers, f"temporary files left in the results directory: {leftovers}"
    files = sorted(out_dir.glob("*.json")) if out_dir.exists() else []
    if finished.returncode != 0:
        assert not files, f"a failed run (exit {finished.returncode}) wrote a result: {files}"
        return None
    assert len(files) == 1, f"expected exactly one result in {out_dir}, found {[f.name for f in files]}\n{finished.output[-4000:]}"
    payload = json.loads(files[0].read_text())
    validate_result(payload)
    assert "dpcompare: error" not in finished.stderr, finished.stderr[-4000:]
    return payload


@dataclass
class Launcher:
    """Starts dpcompare runs for one test; each launch gets its own results directory under tmp_path."""

    tmp_path: Path
    count: int = 0
    cwd: Path = field(init=False)

    def __post_init__(self) -> None:
        self.cwd = self.tmp_path / "cwd"
        self.cwd.mkdir(parents=True, exist_ok=True)

    def __call__(
        self,
        backend: str,
        world_size: int,
        model: str,
        extra_args: Sequence[str] = (),
        launcher: str | None = None,
        *,
        launcher_args: Sequence[str] = (),
        timeout_s: float | None = None,
    ) -> tuple[Finished, dict | None]:
        """Run `backend` with `world_size` ranks on `model` under its native launcher (or `launcher`).

        Returns the finished process and the validated JSON result (None when the run failed)."""
        launcher = launcher or native_launcher(backend)
        self.count += 1
        out_dir = self.tmp_path / f"out-{self.count}"
        args = ["--backend", backend, "--model", model, "--out", str(out_dir), *extra_args]
        finished = run_command(command(launcher, world_size, args, launcher_args), cwd=self.cwd,
                               env=child_env(self.tmp_path), timeout_s=timeout_s or LAUNCH_TIMEOUT_S[launcher])
        return finished, _read_result(out_dir, finished)


@pytest.fixture
def launch(tmp_path: Path) -> Callable[..., tuple[Finished, dict | None]]:
    return Launcher(tmp_path)


@pytest.fixture(scope="session")
def shared_launch(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., tuple[Finished, dict | None]]:
    """`launch` for runs that several tests read: the same launch (backend, world size, model, arguments,
    launcher) starts once per session, and every test that asks for it reads that one finished run."""
    launcher = Launcher(tmp_path_factory.mktemp("shared"))
    done: dict[tuple, tuple[Finished, dict | None]] = {}

    def run(backend: str, world_size: int, model: str, extra_args: Sequence[str] = (),
            launcher_name: str | None = None) -> tuple[Finished, dict | None]:
        key = (backend, world_size, model, tuple(extra_args), launcher_name or native_launcher(backend))
        if key not in done:
            done[key] = launcher(backend, world_size, model, extra_args, key[-1])
        return done[key]

    return run


def finished(done: launchers.Finished) -> Finished:
    """A launch started with dpcompare.run.launchers.run_process (multi-node shapes), as the tests' Finished."""
    assert not done.timed_out, f"timed out: {' '.join(done.command)}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return Finished(done.command, done.returncode, done.stdout, done.stderr, done.wall_s)


@pytest.fixture
def record_noise_ratio(record_property) -> Callable[[dict], None]:
    """Keep a result's noise ratio for the end-of-session table (and the junit XML)."""

    def record(result: dict) -> None:
        e = result["equivalence"]
        ratio = e["noise_ratio"]
        checks = e.get("checks") or {}
        NOISE_RATIOS.append((result["backend"], result["world_size"], result["model"], result["launcher"], ratio,
                             (checks.get("update") or {}).get("noise_ratio"),
                             (checks.get("trajectory") or {}).get("noise_ratio")))
        record_property("noise_ratio", ratio)

    return record


@pytest.fixture
def backend(request: pytest.FixtureRequest) -> str:
    """The backend under test (parametrize with indirect=True); skips only when its package is absent."""
    name = request.param
    module = BACKEND_MODULES.get(name)
    if module is not None and importlib.util.find_spec(module) is None:
        pytest.skip(f"{name} not installed: {INSTALL_HINT}")
    return name


def torchrun_rank_logs(log_dir: Path) -> dict[int, dict[str, str]]:
    """Per-rank stdout/stderr that `torchrun --log-dir D --redirects 3` captured, by local rank."""
    logs: dict[int, dict[str, str]] = {}
    for path in log_dir.glob("*/attempt_*/*/std*.log"):
        logs.setdefault(int(path.parent.name), {})[path.stem] = path.read_text()
    return logs
