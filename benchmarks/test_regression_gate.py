"""Regression gate benchmark: does `dpcompare regress` catch a planted 20 % compute slowdown every time without
crying wolf, on this noisy shared machine, where plain `--benchmark-compare-fail=median:10%` is a coin toss?

Run it with (about 40 minutes on two cores; nothing else should run meanwhile):

    cd /work/main && OMP_NUM_THREADS=1 .venv/bin/python -m pytest benchmarks/test_regression_gate.py -s -p no:cacheprovider

Design. ddp at world size 2 on mlp-wide at global batch 2048 (compute-bound: ~45 ms compute, ~5 ms of
communication per step). COMPARISONS rounds; in each, RUNS_PER_SIDE repeats of three sides, interleaved
(B S U, B S U, ...): B a baseline build, S the same build with DPCOMPARE_INJECT_SLOWDOWN=0.2, U the unchanged
build again. Every run is the real user path: `pytest --pyargs dpcompare.regression --benchmark-json`.
Comparison k of the planted kind is `dpcompare regress --baseline B_k --current S_k` (exit 1 = caught);
of the unchanged kind `--baseline B_k --current U_k` (exit 1 = false alarm). The runs interleave, so the gate
pairs them (Wilcoxon signed-rank over the rounds; a run's neighbour shares its machine state). The plain rule is
pytest-benchmark's own `median:10%` check on one saved run against one new run (the first of each side):
flagged when current median > 1.10 x baseline median. Targets: caught >= 10/10, false alarms <= 1/10.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


from benchmarks.conftest import print_table, run_checked

REPO_ROOT = Path(__file__).resolve().parents[1]
COMPARISONS = 10
RUNS_PER_SIDE = 6
SLOWDOWN = 0.2
PLAIN_THRESHOLD = 0.10
SUITE = ["--pyargs", "dpcompare.regression", "--dpcompare-backends", "ddp", "--dpcompare-world-sizes", "2",
         "--dpcompare-global-batch", "2048", "--dpcompare-steps", "20", "--dpcompare-warmup", "3"]


def _suite_run(out: Path, work: Path, slowdown: float) -> float:
    """One run of the regression suite writing `out`; returns its benchmark's median step (s)."""
    os.environ["DPCOMPARE_INJECT_SLOWDOWN"] = str(slowdown)
    try:
        run_checked([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *SUITE, "--benchmark-json",
                     str(out)], work)
    finally:
        del os.environ["DPCOMPARE_INJECT_SLOWDOWN"]
    (bench,) = json.loads(out.read_text())["benchmarks"]
    return float(bench["stats"]["median"])


def _gate(baseline: Path, current: Path) -> tuple[bool, str]:
    """`dpcompare regress`: (flagged, its summary line)."""
    proc = subprocess.run([sys.executable, "-m", "dpcompare", "regress", "--baseline", str(baseline), "--current",
                           str(current)], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert proc.returncode in (0, 1), proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.returncode == 1, (proc.stdout.strip().splitlines() or [""])[-1]


def test_gate_catches_a_planted_20_percent_slowdown_without_false_alarms(tmp_path):
    sides = {"base": 0.0, "slow": SLOWDOWN, "same": 0.0}
    medians: dict[tuple[int, str], list[float]] = {}
    for k in range(COMPARISONS):
        for r in range(RUNS_PER_SIDE):
            for side, slowdown in sides.items():
                out = tmp_path / f"{side}-{k}" / f"run-{r}.json"
                out.parent.mkdir(exist_ok=True)
                medians.setdefault((k, side), []).append(_suite_run(out, tmp_path / "work", slowdown))
        line = " ".join(f"{s}=" + ",".join(f"{m * 1e3:.1f}" for m in medians[(k, s)]) for s in sides)
        print(f"  comparison {k + 1}/{COMPARISONS} medians ms: {line}", flush=True)

    gate = {"caught": 0, "false": 0}
    plain = {"caught": 0, "false": 0}
    for k in range(COMPARISONS):
        caught, said = _gate(tmp_path / f"base-{k}", tmp_path / f"slow-{k}")
        alarm, said_same = _gate(tmp_path / f"base-{k}", tmp_path / f"same-{k}")
        gate["caught"] += caught
        gate["false"] += alarm
        base0 = medians[(k, "base")][0]
        plain["caught"] += medians[(k, "slow")][0] > base0 * (1 + PLAIN_THRESHOLD)
        plain["false"] += medians[(k, "same")][0] > base0 * (1 + PLAIN_THRESHOLD)
        print(f"  {k + 1}: planted -> {said}\n     unchanged -> {said_same}", flush=True)

    ratios = [sorted(medians[(k, "slow")])[RUNS_PER_SIDE // 2] / sorted(medians[(k, "base")])[RUNS_PER_SIDE // 2]
              for k in range(COMPARISONS)]
    print_table(f"regression gate, ddp ws=2 mlp-wide, {COMPARISONS} comparisons of each kind, "
                f"{RUNS_PER_SIDE} interleaved runs per side", [
        ("dpcompare regress: planted 20 % caught", f"{gate['caught']}/{COMPARISONS}", "target >= 10/10"),
        ("dpcompare regress: false alarms", f"{gate['false']}/{COMPARISONS}", "target <= 1/10"),
        ("median:10% (one run each): planted caught", f"{plain['caught']}/{COMPARISONS}", "pytest-benchmark's rule"),
        ("median:10% (one run each): false alarms", f"{plain['false']}/{COMPARISONS}", "pytest-benchmark's rule"),
        ("step slowdown the plant causes (median ratio)", f"{min(ratios):.3f} - {max(ratios):.3f}",
         "20 % of compute; the step also holds communication"),
    ])
    assert gate["caught"] == COMPARISONS, gate
    assert gate["false"] <= 1, gate
