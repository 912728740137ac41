"""The rank-aware pytest-benchmark bridge (pytest entry point `dpcompare`, loaded in any project where
dpcompare is installed).

pytest-benchmark times a callable in the test process; a distributed step runs in N launcher-started
processes and is as slow as its slowest rank. This plugin starts one real run under the backend's native
launcher (the same command `compare` uses), takes the run's measured steps on their slowest rank (warm-up
excluded, `metrics.step_ms`) and hands them to pytest-benchmark as its rounds through its public API: a
timer that only moves when told (`@pytest.mark.benchmark(timer=...)`) and `benchmark.pedantic(rounds=N,
iterations=1, warmup_rounds=0)`. min/median/IQR, --benchmark-autosave, --benchmark-compare,
--benchmark-compare-fail, histograms and `pytest-benchmark compare` then work on them unchanged.

Fixtures: `dpcompare_run(backend, world_size, *run_args)` -> the run's JSON result; `dpcompare_benchmark(
backend, world_size, *run_args)` -> the same, recorded as a benchmark (throughput, memory, communication,
busbw and the verdict in extra_info; a `different` verdict fails the test). Machine info gains the
devices and library versions, and a baseline saved on other hardware is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from dpcompare import verdict_words as words
from dpcompare.result_view import Metrics, ResultError, RunResult

DEFAULT_BACKENDS = "reference,ddp,horovod,deepspeed"
DEFAULT_WORLD_SIZES = "1,2"
DEFAULT_MODEL = "mlp-wide"
REGRESSION_GLOBAL_BATCH = 512
"""The global batch every run of the regression suite is given (--dpcompare-global-batch): a fixed value passed as
--global-batch, not the default-global-batch rule (dpcompare.run.config.default_global_batch)."""
DEFAULT_STEPS = 30
DEFAULT_WARMUP = 5
HARDWARE_KEYS = ("device_names", "cpu_count", "platform_machine")
"""Machine-info keys that name the hardware: a baseline that differs in one of them is refused."""
EXTRA_INFO = (Metrics.samples_per_s, Metrics.tokens_per_s, Metrics.step_ms_p50, Metrics.peak_mem_mib,
              Metrics.comm_exposed_ms, Metrics.comm_exposed_ci_ms, Metrics.comm_total_ms, Metrics.overlap_fraction,
              Metrics.busbw_gbps, Metrics.measured_steps)
"""The run's figures each benchmark keeps in its extra_info, under their names in the result."""


class ReplayClock:
    """A pytest-benchmark timer that moves only when told: each round advances it by one recorded step, so
    the round's duration is that step's time."""

    __name__ = "dpcompare_replay_clock"

    def __init__(self) -> None:
        self.now = 0.0
        self._samples: Iterator[float] = iter(())

    def __call__(self) -> float:
        return self.now

    def load(self, seconds: list[float]) -> None:
        self._samples = iter(seconds)

    def advance(self) -> None:
        self.now += next(self._samples)


REPLAY_CLOCK = ReplayClock()


# -- options and markers ---------------------------------------------------------------------------------
def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("dpcompare", "dpcompare regression runs (pytest --pyargs dpcompare.regression)")
    group.addoption("--dpcompare-backends", default=DEFAULT_BACKENDS,
                    help=f"comma-separated backends (default {DEFAULT_BACKENDS}; uninstalled ones are skipped)")
    group.addoption("--dpcompare-world-sizes", default=DEFAULT_WORLD_SIZES,
                    help=f"comma-separated world sizes for multi-process backends (default {DEFAULT_WORLD_SIZES})")
    group.addoption("--dpcompare-model", default=DEFAULT_MODEL, help=f"workload (default {DEFAULT_MODEL}, compute-bound)")
    group.addoption("--dpcompare-global-batch", type=int, default=REGRESSION_GLOBAL_BATCH,
                    help=f"samples per step over all ranks (default {REGRESSION_GLOBAL_BATCH})")
    group.addoption("--dpcompare-steps", type=int, default=DEFAULT_STEPS,
                    help=f"measured steps per run = benchmark rounds (default {DEFAULT_STEPS})")
    group.addoption("--dpcompare-warmup", type=int, default=DEFAULT_WARMUP,
                    help=f"unmeasured warm-up steps per run (default {DEFAULT_WARMUP})")
    group.addoption("--dpcompare-run-arg", action="append", default=[], metavar="ARG",
                    help="extra argument for every run (repeat: --dpcompare-run-arg=--compression --dpcompare-run-arg=fp16)")
    group.addoption("--dpcompare-timeout", type=float, default=600.0, help="seconds per run before its tree is killed")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests using `dpcompare_benchmark` time with the replay clock (keeping their own benchmark options)."""
    for item in items:
        if "dpcompare_benchmark" not in getattr(item, "fixturenames", ()):
            continue
        marker = item.get_closest_marker("benchmark")
        options = dict(marker.kwargs) if marker else {}
        if options.get("timer") not in (None, REPLAY_CLOCK):
            raise pytest.UsageError(f"{item.nodeid}: dpcompare_benchmark records the run's steps with its own timer; "
                                    "remove timer= from its benchmark marker")
        item.add_marker(pytest.mark.benchmark(**{**options, "timer": REPLAY_CLOCK}))


# -- running -----------------------------------------------------------------------------------------------
def _last_error(text: str) -> str:
    ours = [ln for ln in text.splitlines() if ln.startswith("dpcompare: error")]
    lines = ours or [ln for ln in text.splitlines() if "error" in ln.lower()]
    return lines[-1].strip()[:500] if lines else text.strip()[-500:]


def start_run(backend: str, world_size: int, args: list[str], out: Path, timeout_s: float) -> dict[str, Any]:
    """One run of `backend` with `world_size` ranks under its native launcher; its JSON result. A run that
    fails or times out fails the test with the run's own error line."""
    from dpcompare.run import launchers, registry

    caps = registry.load(backend, registry.BACKENDS, "backend").capabilities
    launcher = caps.native_launcher if caps.multi_process else "python"
    command = launchers.native_command(launcher, world_size, ["--backend", backend, *args, "--out", str(out)])
    done = launchers.run_process(command, timeout_s=timeout_s, capture=True)
    if done.timed_out:
        pytest.fail(f"{backend}/{world_size}: no result within {timeout_s:g} s: {' '.join(command)}", pytrace=False)
    files = sorted(out.glob("*.json"))
    if done.returncode != 0 or len(files) != 1:
        pytest.fail(f"{backend}/{world_size} failed (exit {done.returncode}): {_last_error(done.stdout + done.stderr)}",
                    pytrace=False)
    try:
        return dict(RunResult.read(files[0]).raw)
    except ResultError as exc:
        pytest.fail(f"{backend}/{world_size}: {exc}", pytrace=False)


@pytest.fixture
def dpcompare_run(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[..., dict[str, Any]]:
    """`dpcompare_run(backend, world_size, *run_args)`: one real run under the backend's native launcher;
    returns its JSON result (schema: dpcompare/schema/result.schema.json)."""
    timeout_s = request.config.getoption("--dpcompare-timeout")
    count = iter(range(1 << 30))

    def run(backend: str, world_size: int, *run_args: str) -> dict[str, Any]:
        return start_run(backend, world_size, list(run_args), tmp_path / f"run-{next(count)}", timeout_s)

    return run


def record(benchmark: Any, result: dict[str, Any]) -> None:
    """Hand a run's measured steps (slowest rank, warm-up excluded) to pytest-benchmark as its rounds, and its
    costs and verdict to extra_info. A `different` verdict fails the test: a wrong run's speed is no figure."""
    run = RunResult(result)
    e, metrics = run.equivalence, run.metrics
    if e.verdict == "different":
        said = words.note(e) or "no first divergence recorded"
        pytest.fail(f"{run.label}: verdict different ({said})", pytrace=False)
    steps_ms = metrics.step_ms.value or []
    if not steps_ms:
        pytest.fail(f"{run.label}: the run measured no steps (pass --measure-steps N)", pytrace=False)
    benchmark.extra_info.update({field.name: metrics.figure(field).value for field in EXTRA_INFO})
    benchmark.extra_info.update(verdict=e.verdict, backend=run.backend, world_size=run.world_size,
                                launcher=run.launcher, model=run.model, device=run.device,
                                inject_slowdown=run.config.inject_slowdown)
    REPLAY_CLOCK.load([ms / 1e3 for ms in steps_ms])
    benchmark.pedantic(REPLAY_CLOCK.advance, rounds=len(steps_ms), iterations=1, warmup_rounds=0)


@pytest.fixture
def dpcompare_benchmark(benchmark: Any, dpcompare_run: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    """`dpcompare_benchmark(backend, world_size, *run_args)`: `dpcompare_run`, then the run's measured steps
    become this test's benchmark rounds. Pass --measure-steps N (the rounds) among the run arguments."""

    def run(backend: str, world_size: int, *run_args: str) -> dict[str, Any]:
        result = dpcompare_run(backend, world_size, *run_args)
        record(benchmark, result)
        return result

    return run


# -- machine info --------------------------------------------------------------------------------------------
@pytest.hookimpl(optionalhook=True)
def pytest_benchmark_update_machine_info(config: pytest.Config, machine_info: dict[str, Any]) -> None:
    """Devices and the communication stack's versions, beside pytest-benchmark's CPU and Python."""
    import platform

    from dpcompare import json_files

    env = json_files.environment()
    machine_info["dpcompare"] = {
        **{k: env.get(k) for k in ("dpcompare", "torch", "cuda", "nccl", "gloo", "mpi", "mpi4py", "horovod",
                                   "deepspeed", "device_names", "cpu_count", "host")},
        "platform_machine": platform.machine(),
        "world_sizes": config.getoption("--dpcompare-world-sizes"),
    }


@pytest.hookimpl(optionalhook=True)
def pytest_benchmark_compare_machine_info(config: pytest.Config, benchmarksession: Any, machine_info: dict[str, Any],
                                          compared_benchmark: dict[str, Any]) -> None:
    """Refuse a baseline measured on other hardware: its timings say nothing about this machine's."""
    mine = machine_info.get("dpcompare") or {}
    theirs = (compared_benchmark.get("machine_info") or {}).get("dpcompare") or {}
    differ = [k for k in HARDWARE_KEYS if k in mine and k in theirs and mine[k] != theirs[k]]
    if differ:
        said = "; ".join(f"{k}: baseline {theirs[k]!r}, here {mine[k]!r}" for k in differ)
        raise pytest.UsageError(f"dpcompare: the benchmark baseline was measured on other hardware ({said}); "
                                "save a baseline on this machine (--benchmark-autosave) and compare against that")


def selected(config: pytest.Config) -> tuple[list[str], list[int]]:
    """The backends and world sizes the regression suite runs (options, with env DPCOMPARE_* overrides absent)."""
    backends = [b.strip() for b in config.getoption("--dpcompare-backends").split(",") if b.strip()]
    try:
        sizes = sorted({int(w) for w in config.getoption("--dpcompare-world-sizes").split(",") if w.strip()})
    except ValueError:
        raise pytest.UsageError("--dpcompare-world-sizes: use comma-separated whole numbers, e.g. 1,2") from None
    if not backends or not sizes or sizes[0] < 1:
        raise pytest.UsageError("--dpcompare-backends and --dpcompare-world-sizes must name at least one backend "
                                "and one positive world size")
    return backends, sizes


def run_args(config: pytest.Config) -> list[str]:
    """The run flags every benchmark of the regression suite uses."""
    return ["--model", config.getoption("--dpcompare-model"),
            "--global-batch", str(config.getoption("--dpcompare-global-batch")),
            "--steps", "1", "--measure-steps", str(config.getoption("--dpcompare-steps")),
            "--warmup-steps", str(config.getoption("--dpcompare-warmup")), "--ablation-steps", "0",
            *config.getoption("--dpcompare-run-arg")]

