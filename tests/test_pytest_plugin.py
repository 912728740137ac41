"""The pytest-benchmark bridge: real runs become benchmark rounds, and pytest-benchmark's own comparison
catches a planted slowdown.

Each test starts pytest in a subprocess the way a user's CI does (`pytest --pyargs dpcompare.regression`, or a
test file of their own using the fixtures), with real launchers. Negative twins: a planted slowdown fails
`--benchmark-compare-fail`, a `different` verdict fails the test, a baseline from other hardware is refused.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dpcompare.commands import pytest_plugin

REPO = Path(__file__).resolve().parents[1]


def pytest_in(tmp_path: Path, *args: str, slowdown: float | None = None, timeout_s: float = 400) -> subprocess.CompletedProcess:
    # A fresh pytest, as a user's CI starts it: none of this pytest's variables (an xdist worker's PYTEST_XDIST_WORKER
    # would make pytest-benchmark disable itself there).
    env = {k: v for k, v in os.environ.items() if k != "DPCOMPARE_INJECT_SLOWDOWN" and not k.startswith("PYTEST_")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    if slowdown is not None:
        env["DPCOMPARE_INJECT_SLOWDOWN"] = str(slowdown)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=timeout_s)


SUITE = ["--pyargs", "dpcompare.regression", "--dpcompare-steps", "12", "--dpcompare-warmup", "2"]


@pytest.mark.slow  # the default tier keeps this capability in a sibling test
@pytest.mark.multiproc
@pytest.mark.timeout(900)
def test_measured_steps_become_the_rounds_and_a_planted_slowdown_fails_the_compare(tmp_path):
    base = tmp_path / "base.json"
    # One process here; a multi-process run through the fixture: test_a_different_verdict_fails_the_benchmark_test.
    proc = pytest_in(tmp_path, *SUITE, "--dpcompare-backends", "reference", "--benchmark-json", str(base))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    data = json.loads(base.read_text())
    by_name = {b["name"]: b for b in data["benchmarks"]}
    assert set(by_name) == {"test_step_time[reference-ws1]"}
    for bench in by_name.values():
        info, stats = bench["extra_info"], bench["stats"]
        assert stats["rounds"] == info["measured_steps"] == 12 == len(stats["data"])
        # The rounds are the run's steps: their median is the run's own step_ms_p50.
        assert stats["median"] * 1e3 == pytest.approx(info["step_ms_p50"], rel=1e-9)
        assert info["verdict"] == "equivalent" and bench["group"] == "model=mlp-wide"
    assert data["machine_info"]["dpcompare"]["device_names"]

    compare = ["--dpcompare-backends", "reference", "--benchmark-compare", str(base)]
    slowed = pytest_in(tmp_path, *SUITE, *compare, "--benchmark-compare-fail=median:20%", slowdown=1.0)
    assert slowed.returncode != 0, slowed.stdout[-4000:]
    assert "Performance has regressed" in slowed.stdout + slowed.stderr
    # Positive twin: the same build against its baseline passes a threshold wider than this machine's noise.
    same = pytest_in(tmp_path, *SUITE, *compare, "--benchmark-compare-fail=median:60%")
    assert same.returncode == 0, same.stdout[-4000:] + same.stderr[-2000:]


@pytest.mark.multiproc
@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", [["--benchmark-disable"], ["-p", "xdist", "-n", "1"]], ids=["disabled", "xdist"])
def test_the_suite_runs_and_judges_where_pytest_benchmark_keeps_no_rounds(tmp_path, how):
    """Under xdist pytest-benchmark disables itself and records no rounds: the run still runs and its verdict is
    judged (negative twin: a backend that sums is still failed there)."""
    proc = pytest_in(tmp_path, "--pyargs", "dpcompare.regression", "--dpcompare-steps", "3", "--dpcompare-warmup", "1",
                     "--dpcompare-backends", "reference", *how, "-rA")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "PASSED" in proc.stdout and "test_step_time[reference-ws1]" in proc.stdout, proc.stdout[-4000:]
    (tmp_path / "test_user.py").write_text(USER_TEST)
    summing = pytest_in(tmp_path, "test_user.py", *how)
    assert summing.returncode == 1 and "verdict different" in summing.stdout, summing.stdout[-4000:]


USER_TEST = '''
def test_summing_ddp(dpcompare_benchmark):
    dpcompare_benchmark("tests.faulty_adapters:SummingDDP", 2, "--model", "mlp", "--steps", "1", "--measure-steps", "3")
'''


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_different_verdict_fails_the_benchmark_test(tmp_path):
    """A user's own test file with the fixture: a backend that sums instead of averaging fails its test."""
    (tmp_path / "test_user.py").write_text(USER_TEST)
    proc = pytest_in(tmp_path, "test_user.py")
    assert proc.returncode == 1, proc.stdout[-4000:]
    assert "verdict different" in proc.stdout and "summed" in proc.stdout, proc.stdout[-4000:]


def test_a_different_verdict_is_refused_before_any_round_is_recorded():
    class Untouchable:
        extra_info: dict = {}

        def pedantic(self, *args, **kwargs):
            raise AssertionError("a wrong run must not be recorded")

    result = {"backend": "ddp", "world_size": 2, "equivalence": {"verdict": "different", "first_divergence": {
        "step": 0, "parameter": "0.weight", "reason": "summed"}}, "metrics": {"step_ms": [1.0]}}
    with pytest.raises(pytest.fail.Exception, match="verdict different"):
        pytest_plugin.record(Untouchable(), result)
    ok = dict(result, equivalence={"verdict": "equivalent"}, metrics={"step_ms": []})
    with pytest.raises(pytest.fail.Exception, match="measured no steps"):
        pytest_plugin.record(Untouchable(), ok)


def test_replay_clock_turns_each_round_into_one_recorded_step():
    clock = pytest_plugin.ReplayClock()
    clock.load([0.5, 0.25])
    durations = []
    for _ in range(2):
        start = clock()
        clock.advance()
        durations.append(clock() - start)
    assert durations == [0.5, 0.25]
    with pytest.raises(StopIteration):
        clock.advance()


def test_a_baseline_from_other_hardware_is_refused():
    here = {"dpcompare": {"device_names": ["NVIDIA H100 80GB HBM3"], "cpu_count": 16, "platform_machine": "x86_64",
                          "torch": "2.13.0"}}
    upgraded = {"machine_info": {"dpcompare": {**here["dpcompare"], "torch": "2.14.0"}}}
    pytest_plugin.pytest_benchmark_compare_machine_info(None, None, here, upgraded)  # software may differ
    other = {"machine_info": {"dpcompare": {**here["dpcompare"], "device_names": ["NVIDIA A100-SXM4-80GB"]}}}
    with pytest.raises(pytest.UsageError, match="other hardware.*device_names"):
        pytest_plugin.pytest_benchmark_compare_machine_info(None, None, here, other)
