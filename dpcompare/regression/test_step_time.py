"""One benchmark per installed backend x world size: the run's measured steps are its rounds.

Run it with `pytest --pyargs dpcompare.regression` (options: `pytest --pyargs dpcompare.regression --help`,
group "dpcompare"). Backends that are not installed are skipped with the install command; single-process
backends (reference, dp) run at world size 1 only. A `different` verdict fails its test. Under pytest-xdist, or
with --benchmark-disable, pytest-benchmark records no rounds: each run still runs and its verdict is still judged.
"""

from __future__ import annotations

import pytest

from dpcompare.commands.pytest_plugin import run_args, selected
from dpcompare.result_view import RunResult
from dpcompare.run import registry


def _cases(config: pytest.Config) -> list:
    backends, sizes = selected(config)
    unknown = [b for b in backends if b not in registry.BACKENDS]
    if unknown:
        raise pytest.UsageError(f"--dpcompare-backends: unknown {', '.join(unknown)}; choose from "
                                f"{', '.join(registry.BACKENDS)}")
    cases = []
    for backend in backends:
        ok, reason = registry.availability(backend)
        marks = [] if ok else [pytest.mark.skip(reason=f"{backend} unavailable: {reason}")]
        multi = ok and registry.load(backend, registry.BACKENDS, "backend").capabilities.multi_process
        for ws in (sizes if multi else [1]):
            cases.append(pytest.param(backend, ws, id=f"{backend}-ws{ws}", marks=marks))
    return cases


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if {"backend", "world_size"} <= set(metafunc.fixturenames):
        metafunc.parametrize(("backend", "world_size"), _cases(metafunc.config))


def test_step_time(backend, world_size, dpcompare_benchmark, benchmark, pytestconfig):
    benchmark.group = f"model={pytestconfig.getoption('--dpcompare-model')}"
    result = RunResult(dpcompare_benchmark(backend, world_size, *run_args(pytestconfig)))
    if benchmark.enabled:  # pytest-benchmark disables itself under xdist and with --benchmark-disable: no rounds kept
        assert len(benchmark.stats.stats.data) == result.metrics.measured_steps.value
