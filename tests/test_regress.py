"""`python -m dpcompare regress`: the noise-aware regression gate, against synthetic pytest-benchmark runs.

Each test writes one pytest-benchmark JSON file per run into tmp dirs and runs the command through
dpcompare.cli.main, as a user would. The gate must flag a clear 20% slowdown over 5+5 runs with 3% noise
(exit 1) and leave an unchanged build alone (exit 0); call a 20% speed-up an improvement (exit 0); not
flag one outlier run (significance) nor a consistent 2% slowdown under a 5% minimum effect (effect size),
while flagging their larger twins; and test each run's chosen statistic, not its rounds. It refuses, with
one line and exit 2, fewer than 3 runs per side, an alpha the run count can never reach, runs from another
machine (unless --allow-other-machine), a missing directory, an empty one, files that are not
pytest-benchmark JSON, and sides with no benchmark in common. A benchmark on one side only is listed as not
compared. --json writes every decision. The statistics themselves (dpcompare.measure.gate) are checked
against the exact Mann-Whitney floor 1/C(2n, n) and for a reproducible bootstrap interval.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dpcompare import cli
from dpcompare.measure import gate

BENCH = "tests/bench_step.py::test_step[ddp-2]"
OTHER = "tests/bench_step.py::test_step[dp-1]"
BASE_S = 0.100
# Interleaved 3% noise: fixed so every verdict below is the same on every machine.
NOISE_A = [1.00, 0.97, 1.03, 0.99, 1.02]
NOISE_B = [1.01, 0.98, 1.02, 1.00, 0.97]
MACHINE = {"node": "box", "machine": "x86_64", "cpu": {"brand_raw": "Some CPU"},
           "dpcompare": {"host": "box", "device_names": ["cpu"], "cpu_count": 2, "platform_machine": "x86_64",
                         "world_sizes": "2", "torch": "2.5.0"}}


def _benchmark(name: str, median_s: float, min_s: float | None = None) -> dict[str, Any]:
    rounds = [median_s * f for f in (0.99, 1.0, 1.0, 1.01, 1.05)]
    return {"name": name.split("::")[-1], "fullname": name, "group": None, "extra_info": {},
            "stats": {"min": min_s if min_s is not None else min(rounds), "max": max(rounds),
                      "mean": float(np.mean(rounds)), "median": median_s, "stddev": float(np.std(rounds)),
                      "iqr": 0.0, "rounds": len(rounds), "data": rounds}}


def write_runs(directory: Path, times_s: dict[str, list[float]], machine: dict[str, Any] | None = None,
               min_s: dict[str, list[float]] | None = None, started: list[str] | None = None) -> Path:
    """One pytest-benchmark JSON file per run: run k holds times_s[name][k] as each benchmark's median."""
    directory.mkdir(parents=True, exist_ok=True)
    runs = max(len(v) for v in times_s.values())
    for k in range(runs):
        benchmarks = [_benchmark(name, figures[k], (min_s or {}).get(name, [None] * runs)[k])
                      for name, figures in times_s.items() if k < len(figures)]
        payload = {"machine_info": machine if machine is not None else MACHINE, "commit_info": {},
                   "benchmarks": benchmarks, "datetime": started[k] if started else "2025-01-01T00:00:00",
                   "version": "5.2.3"}
        (directory / f"run-{k}.json").write_text(json.dumps(payload))
    return directory


def regress(tmp_path: Path, baseline: dict[str, list[float]], current: dict[str, list[float]], *extra: str,
            capsys: pytest.CaptureFixture[str], machine_current: dict[str, Any] | None = None
            ) -> tuple[int, str, str, dict[str, Any]]:
    """Run the gate; returns exit status, stdout, stderr and the --json payload ({} when none was written)."""
    write_runs(tmp_path / "baseline", baseline)
    write_runs(tmp_path / "current", current, machine=machine_current)
    out_json = tmp_path / "regress.json"
    status = cli.main(["regress", "--baseline", str(tmp_path / "baseline"), "--current", str(tmp_path / "current"),
                       "--json", str(out_json), *extra])
    captured = capsys.readouterr()
    payload = json.loads(out_json.read_text()) if out_json.exists() else {}
    return status, captured.out, captured.err, payload


def scaled(factor: float, noise: list[float] = NOISE_B) -> list[float]:
    return [BASE_S * factor * f for f in noise]


def only_decision(payload: dict[str, Any]) -> dict[str, Any]:
    (decision,) = payload["decisions"]
    return decision


def assert_one_line_error(status: int, err: str, *fragments: str) -> None:
    assert status == 2
    assert err.startswith("dpcompare: error: ") and err.count("\n") == 1, err
    for fragment in fragments:
        assert fragment in err, err


# -- verdicts ---------------------------------------------------------------------------------------------
def test_clear_slowdown_is_a_regression_and_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err, payload = regress(tmp_path, {BENCH: scaled(1.0, NOISE_A)}, {BENCH: scaled(1.2)}, capsys=capsys)
    assert status == 1, out + err
    d = only_decision(payload)
    assert d["verdict"] == "regression"
    assert (d["n_baseline"], d["n_current"]) == (5, 5)
    assert d["p_value"] == pytest.approx(1 / math.comb(10, 5))
    assert 1.15 < d["ratio"] < 1.25 and d["ci90"][0] > 1.05
    assert "slower" in d["reason"] and d["reason"].endswith(": regression")
    assert "regression" in out and "1 regression(s)" in out and "FAIL" in out


def test_unchanged_build_is_the_same_and_exits_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _, payload = regress(tmp_path, {BENCH: scaled(1.0, NOISE_A)}, {BENCH: scaled(1.0)}, capsys=capsys)
    assert status == 0
    d = only_decision(payload)
    assert d["verdict"] == "same" and d["p_value"] >= 0.05
    assert d["ci90"][0] <= 1.0 <= d["ci90"][1]
    assert "0 regression(s)" in out and "pass" in out


def test_faster_build_is_an_improvement_and_exits_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, _, _, payload = regress(tmp_path, {BENCH: scaled(1.0, NOISE_A)}, {BENCH: scaled(0.8)}, capsys=capsys)
    assert status == 0
    d = only_decision(payload)
    assert d["verdict"] == "improvement" and d["ratio"] < 0.85
    assert "faster" in d["reason"] and d["reason"].endswith(": improvement")


@pytest.mark.parametrize("min_effect", ["0.05", "0"])
def test_one_slow_run_is_not_significant(tmp_path: Path, capsys: pytest.CaptureFixture[str], min_effect: str) -> None:
    outlier = scaled(1.0)
    outlier[2] *= 1.3
    assert np.mean(outlier) / np.mean(scaled(1.0, NOISE_A)) >= 1.05  # a mean over runs would cry wolf
    status, _, _, payload = regress(tmp_path, {BENCH: scaled(1.0, NOISE_A)}, {BENCH: outlier},
                                    "--min-effect", min_effect, capsys=capsys)
    assert status == 0
    d = only_decision(payload)
    assert d["verdict"] == "same" and d["p_value"] >= 0.05 and "not significant" in d["reason"]
    if min_effect == "0":
        assert d["ratio"] >= 1.0  # no effect size to hide behind: the test's significance alone decides


def test_every_run_slower_by_the_outliers_30_percent_is_a_regression(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    status, _, _, payload = regress(tmp_path, {BENCH: scaled(1.0, NOISE_A)}, {BENCH: scaled(1.3)}, capsys=capsys)
    assert status == 1 and only_decision(payload)["verdict"] == "regression"


@pytest.mark.parametrize(("min_effect", "verdict", "status"), [("0.05", "same", 0), ("0.01", "regression", 1)])
def test_small_consistent_slowdown_is_judged_by_the_minimum_effect(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], min_effect: str, verdict: str, status: int) -> None:
    quiet_a, quiet_b = [1.000, 0.998, 1.002, 0.999, 1.001], [1.001, 0.999, 1.002, 1.000, 0.998]
    got, _, _, payload = regress(tmp_path, {BENCH: scaled(1.0, quiet_a)}, {BENCH: scaled(1.02, quiet_b)},
                                 "--min-effect", min_effect, capsys=capsys)
    d = only_decision(payload)
    assert d["p_value"] < 0.05  # significant either way: only the effect size decides
    assert (got, d["verdict"]) == (status, verdict)
    if verdict == "same":
        assert "within the 5% minimum effect" in d["reason"]


@pytest.mark.parametrize(("statistic", "status"), [("median", 1), ("min", 0)])
def test_each_run_contributes_the_chosen_statistic(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   statistic: str, status: int) -> None:
    write_runs(tmp_path / "baseline", {BENCH: scaled(1.0, NOISE_A)}, min_s={BENCH: scaled(0.9, NOISE_A)})
    write_runs(tmp_path / "current", {BENCH: scaled(1.2)}, min_s={BENCH: scaled(0.9)})
    got = cli.main(["regress", "--baseline", str(tmp_path / "baseline"), "--current", str(tmp_path / "current"),
                    "--statistic", statistic])
    assert got == status, capsys.readouterr()


# -- refusals ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("runs", "status"), [(2, 2), (4, 1)])
def test_fewer_than_three_runs_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                          runs: int, status: int) -> None:
    got, _, err, _ = regress(tmp_path, {BENCH: scaled(1.0, NOISE_A)[:runs]}, {BENCH: scaled(1.2)}, capsys=capsys)
    if status == 2:
        assert_one_line_error(got, err, "at least 3 runs per side", f"{BENCH} has 2 in --baseline",
                              "at least 4 runs")
    else:
        assert (got, err) == (1, "")


@pytest.mark.parametrize(("alpha", "status"), [("0.01", 2), ("0.05", 2), ("0.1", 1)])
def test_an_alpha_three_runs_cannot_reach_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                     alpha: str, status: int) -> None:
    got, _, err, _ = regress(tmp_path, {BENCH: scaled(1.0, NOISE_A)[:3]}, {BENCH: scaled(1.2)[:3]},
                             "--alpha", alpha, capsys=capsys)
    if status == 2:
        assert_one_line_error(got, err, f"alpha {alpha} cannot be reached", "1/C(6,3) = 0.05",
                              f"at least {gate.runs_needed(float(alpha))} runs per side")
    else:
        assert (got, err) == (1, "")


@pytest.mark.parametrize("allow", [False, True])
def test_runs_from_another_machine_are_refused_unless_allowed(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                               allow: bool) -> None:
    other = {**MACHINE, "dpcompare": {**MACHINE["dpcompare"], "device_names": ["NVIDIA H100"], "cpu_count": 16}}
    extra = ["--allow-other-machine"] if allow else []
    got, _, err, payload = regress(tmp_path, {BENCH: scaled(1.0, NOISE_A)}, {BENCH: scaled(1.2)}, *extra,
                                   capsys=capsys, machine_current=other)
    if allow:
        assert got == 1 and payload["machine_check"].startswith("skipped")
    else:
        assert_one_line_error(got, err, "dpcompare.cpu_count, dpcompare.device_names", "--allow-other-machine")


def test_newer_software_on_the_same_hardware_is_compared(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A candidate built on another torch, run on another host of the same hardware: what a gate is for."""
    upgraded = {**MACHINE, "dpcompare": {**MACHINE["dpcompare"], "torch": "2.6.0", "host": "runner-2"}}
    got, _, err, payload = regress(tmp_path, {BENCH: scaled(1.0, NOISE_A)}, {BENCH: scaled(1.2)},
                                   capsys=capsys, machine_current=upgraded)
    assert (got, err) == (1, "") and payload["machine_check"] == "same machine"


def test_a_side_without_the_plugin_fingerprint_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plain = {k: v for k, v in MACHINE.items() if k != "dpcompare"}
    got, _, err, _ = regress(tmp_path, {BENCH: scaled(1.0, NOISE_A)}, {BENCH: scaled(1.2)}, capsys=capsys,
                             machine_current=plain)
    assert_one_line_error(got, err, "current", "has no machine_info.dpcompare")


@pytest.mark.parametrize(("node", "status"), [("elsewhere", 2), ("box", 1)])
def test_without_the_plugin_node_machine_and_cpu_are_compared(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                              node: str, status: int) -> None:
    plain = {k: v for k, v in MACHINE.items() if k != "dpcompare"}
    write_runs(tmp_path / "baseline", {BENCH: scaled(1.0, NOISE_A)}, machine=plain)
    write_runs(tmp_path / "current", {BENCH: scaled(1.2)}, machine={**plain, "node": node})
    got = cli.main(["regress", "--baseline", str(tmp_path / "baseline"), "--current", str(tmp_path / "current")])
    err = capsys.readouterr().err
    if status == 2:
        assert_one_line_error(got, err, "differs in: node")
    else:
        assert (got, err) == (1, "")


def test_missing_and_empty_directories_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_runs(tmp_path / "current", {BENCH: scaled(1.2)})
    (tmp_path / "empty").mkdir()
    for baseline, fragment in (("missing", "does not exist"), ("empty", "holds no .json file")):
        got = cli.main(["regress", "--baseline", str(tmp_path / baseline), "--current", str(tmp_path / "current")])
        assert_one_line_error(got, capsys.readouterr().err, f"--baseline {tmp_path / baseline}", fragment)


@pytest.mark.parametrize(("text", "fragment"), [
    ("not json {", "is not readable JSON"),
    (json.dumps({"results": []}), "is not pytest-benchmark JSON"),
    (json.dumps({"machine_info": {}, "benchmarks": [{"fullname": BENCH, "stats": {}}]}), "numeric stats.min"),
])
def test_files_that_are_not_pytest_benchmark_json_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                              text: str, fragment: str) -> None:
    write_runs(tmp_path / "baseline", {BENCH: scaled(1.0, NOISE_A)})
    write_runs(tmp_path / "current", {BENCH: scaled(1.2)})
    (tmp_path / "current" / "run-9.json").write_text(text)
    got = cli.main(["regress", "--baseline", str(tmp_path / "baseline"), "--current", str(tmp_path / "current")])
    assert_one_line_error(got, capsys.readouterr().err, "run-9.json", fragment)


def test_a_benchmark_on_one_side_is_listed_as_not_compared(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _, payload = regress(tmp_path, {BENCH: scaled(1.0, NOISE_A), OTHER: scaled(1.0, NOISE_A)},
                                      {BENCH: scaled(1.0)}, capsys=capsys)
    assert status == 0
    assert [d["name"] for d in payload["decisions"]] == [BENCH]
    assert payload["not_compared"] == [{"name": OTHER, "only_in": "baseline"}]
    assert f"not compared: {OTHER} (only in --baseline)" in out and "1 not compared" in out


def test_no_benchmark_in_common_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    got, _, err, _ = regress(tmp_path, {OTHER: scaled(1.0, NOISE_A)}, {BENCH: scaled(1.0)}, capsys=capsys)
    assert_one_line_error(got, err, "no benchmark appears in both")


# -- the JSON and the statistics --------------------------------------------------------------------------
def test_json_holds_every_decision(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, _, _, payload = regress(tmp_path, {BENCH: scaled(1.0, NOISE_A), OTHER: scaled(1.0, NOISE_A)},
                                    {BENCH: scaled(1.2), OTHER: scaled(1.0)}, capsys=capsys)
    assert status == 1
    assert payload["kind"] == "regress" and "schema_version" in payload
    assert (payload["statistic"], payload["alpha"], payload["min_effect"]) == ("min", 0.05, 0.05)
    assert len(payload["baseline_files"]) == len(payload["current_files"]) == 5
    verdicts = {d["name"]: d["verdict"] for d in payload["decisions"]}
    assert verdicts == {BENCH: "regression", OTHER: "same"}
    assert payload["regressions"] == [BENCH]
    fields = {"n_baseline", "n_current", "baseline_median_s", "current_median_s", "ratio", "ci90", "p_value",
              "verdict", "reason"}
    for d in payload["decisions"]:
        assert fields <= set(d) and len(d["ci90"]) == 2 and d["ci90"][0] <= d["ratio"] <= d["ci90"][1]
    bench = next(d for d in payload["decisions"] if d["name"] == BENCH)
    # the default figure is each run's fastest round, 0.99 x its median here
    assert bench["baseline_median_s"] == pytest.approx(float(np.median(scaled(1.0, NOISE_A))) * 0.99)
    assert bench["current_median_s"] == pytest.approx(float(np.median(scaled(1.2))) * 0.99)


def test_the_smallest_p_value_and_the_runs_an_alpha_needs() -> None:
    assert [gate.smallest_p(n, n) for n in (3, 4, 5)] == pytest.approx([1 / 20, 1 / 70, 1 / 252])
    assert (gate.runs_needed(0.1), gate.runs_needed(0.05), gate.runs_needed(0.01)) == (3, 4, 5)
    with pytest.raises(ValueError, match="alpha must lie between 0 and 1"):
        gate.runs_needed(1.5)


def test_the_bootstrap_interval_is_reproducible_and_brackets_the_ratio() -> None:
    noise = np.random.default_rng(7).normal(1.0, 0.03, size=(2, 20))
    baseline, current = list(BASE_S * noise[0]), list(BASE_S * 1.2 * noise[1])
    first = gate.decide(baseline, current, name=BENCH)
    assert first == gate.decide(baseline, current, name=BENCH)
    assert first.ci90[0] < first.ratio < first.ci90[1] and first.verdict == "regression"
    other_seed = gate.decide(baseline, current, name=BENCH, seed=1)
    assert other_seed.ci90 != first.ci90 and other_seed.ci90 == pytest.approx(first.ci90, abs=0.02)


# -- paired: interleaved runs ------------------------------------------------------------------------------
def _at(minute: int) -> str:
    return f"2025-01-01T00:{minute:02d}:00"


# The machine drifts from round to round (a neighbour comes and goes); within a round both sides see the same.
DRIFT = [1.00, 1.30, 0.85, 1.20, 0.90, 1.25]


def _paired(tmp_path: Path, capsys, factor: float, *extra: str, interleave: bool = True) -> tuple[int, dict]:
    base = [BASE_S * d for d in DRIFT]
    cur = [BASE_S * d * factor * n for d, n in zip(DRIFT, [1.01, 0.99, 1.02, 1.0, 0.98, 1.01])]
    b_times = [_at(2 * k) for k in range(6)]
    c_times = [_at(2 * k + 1) for k in range(6)] if interleave else [_at(30 + k) for k in range(6)]
    write_runs(tmp_path / "baseline", {BENCH: base}, started=b_times)
    write_runs(tmp_path / "current", {BENCH: cur}, started=c_times)
    out = tmp_path / "regress.json"
    status = cli.main(["regress", "--baseline", str(tmp_path / "baseline"), "--current", str(tmp_path / "current"),
                       "--json", str(out), *extra])
    capsys.readouterr()
    return status, (only_decision(json.loads(out.read_text())) if out.exists() else {})


def test_interleaved_runs_are_paired_and_a_slowdown_hidden_in_drift_is_caught(tmp_path, capsys):
    status, d = _paired(tmp_path, capsys, 1.12)
    assert status == 1 and d["design"] == "paired" and d["verdict"] == "regression", d
    assert d["ratio"] == pytest.approx(1.12, rel=0.02) and d["p_value"] == pytest.approx(1 / 64)


def test_the_same_drift_without_interleaving_is_tested_unpaired_and_not_caught(tmp_path, capsys):
    """Negative twin: the unpaired test counts the drift as noise (which is why interleaving and pairing matter)."""
    status, d = _paired(tmp_path, capsys, 1.12, interleave=False)
    assert status == 0 and d["design"] == "unpaired" and d["verdict"] == "same", d


def test_interleaved_unchanged_runs_are_the_same(tmp_path, capsys):
    status, d = _paired(tmp_path, capsys, 1.0)
    assert status == 0 and d["design"] == "paired" and d["verdict"] == "same", d


def test_pairing_runs_that_do_not_interleave_is_refused(tmp_path, capsys):
    base = [BASE_S] * 6
    write_runs(tmp_path / "baseline", {BENCH: base}, started=[_at(k) for k in range(6)])
    write_runs(tmp_path / "current", {BENCH: base}, started=[_at(10 + k) for k in range(6)])
    status = cli.main(["regress", "--baseline", str(tmp_path / "baseline"), "--current", str(tmp_path / "current"),
                       "--pairing", "paired"])
    _, err = capsys.readouterr()
    assert status == 2 and "do not alternate in time" in err and err.count("\n") == 1, err


def test_four_pairs_cannot_reach_alpha_005_and_are_refused():
    with pytest.raises(ValueError, match="1/2\\^4 = 0.0625"):
        gate.decide_paired([1.0, 1.1, 0.9, 1.0], [1.2, 1.3, 1.1, 1.2], alpha=0.05)
    assert gate.decide_paired([1.0, 1.1, 0.9, 1.0, 1.05], [1.2, 1.3, 1.1, 1.2, 1.25], alpha=0.05).verdict == "regression"
