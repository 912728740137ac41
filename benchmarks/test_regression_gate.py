"""Regression gate benchmark: does `dpcompare regress` catch a planted 20 % compute slowdown every time without
crying wolf, on this noisy shared machine, where plain `--benchmark-compare-fail=median:10%` is a coin toss?

Run it with (about 70 minutes on two cores; nothing else should run meanwhile):

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest benchmarks/test_regression_gate.py -s -p no:cacheprovider

Every run's figures and every decision are also written as JSON to $DPCOMPARE_GATE_RECORD (default: the
test's tmp_path/gate-record.json), so a measurement can be kept and re-read.

Design. ddp at world size 2 on mlp-wide at global batch 2048 (compute-bound: ~45 ms compute, ~5 ms of
communication per step), 60 measured steps per run. COMPARISONS rounds; in each, RUNS_PER_SIDE repeats of three sides, interleaved
(B S U, B S U, ...): B a baseline build, S the same build with DPCOMPARE_INJECT_SLOWDOWN=0.2, U the unchanged
build again. Every run is the real user path: `pytest --pyargs dpcompare.regression --benchmark-json`.
Comparison k of the planted kind is `dpcompare regress --baseline B_k --current S_k` (exit 1 = caught);
of the unchanged kind `--baseline B_k --current U_k` (exit 1 = false alarm). The runs interleave, so the gate
pairs them (Wilcoxon signed-rank over the pairs of runs; a run's neighbour shares its machine state), and by
default it takes each run's fastest step as that run's figure; the same runs are also gated on each run's
median (`--statistic median`), side by side. The plain rule is
pytest-benchmark's own `median:10%` check on one saved run against one new run (the first of each side):
flagged when current median > 1.10 x baseline median. Targets: caught >= 10/10, false alarms <= 1/10.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from benchmarks.conftest import print_table, run_checked

REPO_ROOT = Path(__file__).resolve().parents[1]
COMPARISONS = 10
RUNS_PER_SIDE = 12
SLOWDOWN = 0.2
PLAIN_THRESHOLD = 0.10
SUITE = ["--pyargs", "dpcompare.regression", "--dpcompare-backends", "ddp", "--dpcompare-world-sizes", "2",
         "--dpcompare-global-batch", "2048", "--dpcompare-steps", "60", "--dpcompare-warmup", "3"]


def _suite_run(out: Path, work: Path, slowdown: float) -> tuple[float, float]:
    """One run of the regression suite writing `out`; returns its benchmark's (median, fastest) step (s)."""
    os.environ["DPCOMPARE_INJECT_SLOWDOWN"] = str(slowdown)
    try:
        run_checked([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *SUITE, "--benchmark-json",
                     str(out)], work)
    finally:
        del os.environ["DPCOMPARE_INJECT_SLOWDOWN"]
    (bench,) = json.loads(out.read_text())["benchmarks"]
    return float(bench["stats"]["median"]), float(bench["stats"]["min"])


def _gate(baseline: Path, current: Path, *flags: str) -> tuple[bool, str]:
    """`dpcompare regress` (its defaults unless `flags`): (flagged, its summary line)."""
    proc = subprocess.run([sys.executable, "-m", "dpcompare", "regress", "--baseline", str(baseline), "--current",
                           str(current), *flags], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert proc.returncode in (0, 1), proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.returncode == 1, (proc.stdout.strip().splitlines() or [""])[-1]


def _ratio(medians: dict[tuple[int, str], list[tuple[float, float]]], k: int, which: int) -> float:
    """Comparison k's slow/base ratio of the median over runs of each run's median (0) or fastest step (1)."""
    slow = sorted(m[which] for m in medians[(k, "slow")])
    base = sorted(m[which] for m in medians[(k, "base")])
    return float(np.median(slow) / np.median(base))


def test_gate_catches_a_planted_20_percent_slowdown_without_false_alarms(tmp_path):
    sides = {"base": 0.0, "slow": SLOWDOWN, "same": 0.0}
    medians: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for k in range(COMPARISONS):
        for r in range(RUNS_PER_SIDE):
            for side, slowdown in sides.items():
                out = tmp_path / f"{side}-{k}" / f"run-{r}.json"
                out.parent.mkdir(exist_ok=True)
                medians.setdefault((k, side), []).append(_suite_run(out, tmp_path / "work", slowdown))
        line = " ".join(f"{s}=" + ",".join(f"{m[0] * 1e3:.1f}/{m[1] * 1e3:.1f}" for m in medians[(k, s)])
                        for s in sides)
        print(f"  comparison {k + 1}/{COMPARISONS} median/min ms: {line}", flush=True)

    rules = {"default": (), "median": ("--statistic", "median")}
    gate = {rule: {"caught": 0, "false": 0} for rule in rules}
    plain = {"caught": 0, "false": 0}
    decided: list[dict] = []
    for k in range(COMPARISONS):
        for rule, flags in rules.items():
            caught, said = _gate(tmp_path / f"base-{k}", tmp_path / f"slow-{k}", *flags)
            alarm, said_same = _gate(tmp_path / f"base-{k}", tmp_path / f"same-{k}", *flags)
            gate[rule]["caught"] += caught
            gate[rule]["false"] += alarm
            decided.append({"comparison": k, "rule": rule, "planted_caught": caught, "planted_said": said,
                            "unchanged_flagged": alarm, "unchanged_said": said_same})
            print(f"  {k + 1} [{rule}]: planted -> {said}\n     unchanged -> {said_same}", flush=True)
        base0 = medians[(k, "base")][0][0]
        plain["caught"] += medians[(k, "slow")][0][0] > base0 * (1 + PLAIN_THRESHOLD)
        plain["false"] += medians[(k, "same")][0][0] > base0 * (1 + PLAIN_THRESHOLD)

    record = Path(os.environ.get("DPCOMPARE_GATE_RECORD") or tmp_path / "gate-record.json")
    record.write_text(json.dumps({
        "suite": SUITE, "comparisons": COMPARISONS, "runs_per_side": RUNS_PER_SIDE, "slowdown": SLOWDOWN,
        "runs_s": [{"comparison": k, "side": side, "median_min": medians[(k, side)]}
                   for k in range(COMPARISONS) for side in sides],
        "decisions": decided, "gate": gate, "plain_median_10pct": plain}, indent=1))
    print(f"  every run's figures and every decision: {record}", flush=True)
    by_median = [_ratio(medians, k, 0) for k in range(COMPARISONS)]
    by_min = [_ratio(medians, k, 1) for k in range(COMPARISONS)]
    print_table(f"regression gate, ddp ws=2 mlp-wide, {COMPARISONS} comparisons of each kind, "
                f"{RUNS_PER_SIDE} interleaved runs per side", [
        ("dpcompare regress (defaults): planted 20 % caught", f"{gate['default']['caught']}/{COMPARISONS}",
         "target >= 10/10"),
        ("dpcompare regress (defaults): false alarms", f"{gate['default']['false']}/{COMPARISONS}", "target <= 1/10"),
        ("regress --statistic median: planted caught", f"{gate['median']['caught']}/{COMPARISONS}", "same runs"),
        ("regress --statistic median: false alarms", f"{gate['median']['false']}/{COMPARISONS}", "same runs"),
        ("median:10% (one run each): planted caught", f"{plain['caught']}/{COMPARISONS}", "pytest-benchmark's rule"),
        ("median:10% (one run each): false alarms", f"{plain['false']}/{COMPARISONS}", "pytest-benchmark's rule"),
        ("step slowdown the plant causes, per-run medians", f"{min(by_median):.3f} - {max(by_median):.3f}",
         "20 % of compute; the step also holds communication"),
        ("step slowdown the plant causes, per-run fastest steps", f"{min(by_min):.3f} - {max(by_min):.3f}",
         "the default statistic"),
    ])
    assert gate["default"]["caught"] == COMPARISONS, gate
    assert gate["default"]["false"] <= 1, gate
