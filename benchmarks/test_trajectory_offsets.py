"""What holding the float64 trajectory as offsets (dpcompare.verify.trajectory.trajectory_offsets) saves and costs, side by side: each size and
optimizer run with the offsets and with `Offsets.hold` made a no-op in the run's process, alternately, one rank:

    cd /work/main && OMP_NUM_THREADS=1 .venv/bin/python -m pytest benchmarks/test_trajectory_offsets.py -m deep \\
        -s -p no:cacheprovider

Marked `deep` (about 10 minutes on the 2-core box). The Llama-style sizes of benchmarks/test_verification_cost.py (11,
22 and 39 M), the world-size series' batch (2 sequences of 16 tokens, 2 checked steps), momentum SGD and AdamW, two
runs of each arm. Figures from each result: `verify_above_start_mib` per parameter, the trajectory's part of a checked
step (`verify_ms_by_part.trajectory`, divided by the checked steps), `verify_ms_per_step / step_ms_p50`, the verdict,
and `oracle_reuse.trajectory.held_as_offsets`. Record: docs/results/2026-11-29-trajectory-offsets-cpu.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console
from rich.table import Table

from benchmarks.conftest import REPO_ROOT, child_env
from benchmarks.test_verification_cost import ARGS, SIZES, MIB

pytestmark = [pytest.mark.deep, pytest.mark.timeout(3600)]

LABELS = tuple(os.environ.get("DPCOMPARE_OFFSETS_SIZES", "11M,22M,39M").split(","))
"""The sizes run (DPCOMPARE_OFFSETS_SIZES: a shorter list)."""
REPEATS = 2
WITHOUT = ("import runpy, sys\nfrom dpcompare.verify.trajectory import trajectory_offsets\n"
           "trajectory_offsets.Offsets.hold = lambda self, entries: None\n"
           "sys.argv = ['dpcompare', *sys.argv[1:]]\nrunpy.run_module('dpcompare', run_name='__main__')\n")
"""The run with nothing held as offsets: the same code, `hold` a no-op in the run's own process."""


def _run(folder: Path, optimizer: str, held: bool, out: Path) -> dict:
    head = [sys.executable, "-m", "dpcompare"] if held else [sys.executable, "-c", WITHOUT]
    cmd = [*head, *ARGS, "--model", f"hf:{folder}", "--optimizer", optimizer, "--out", str(out)]
    done = subprocess.run(cmd, cwd=REPO_ROOT, env=child_env(out.parent), capture_output=True, text=True, timeout=1800)
    results = sorted(out.glob("*.json"))
    assert done.returncode == 0 and results, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(results[-1].read_text())
    m = result["metrics"]
    return {"verdict": result["equivalence"]["verdict"],
            "bytes_per_param": None,
            "above_start_mib": m["verify_above_start_mib"],
            "trajectory_ms": m["verify_ms_by_part"]["trajectory"] / max(m["verify_checked_steps"], 1),
            "ratio": m["verify_ms_per_step"] / m["step_ms_p50"],
            "held": ((result["equivalence"].get("oracle_reuse") or {}).get("trajectory") or {}).get("held_as_offsets")}


def test_trajectory_offsets_side_by_side(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    rows = []
    for size in (s for s in SIZES if s.label in LABELS):
        folder = size.write(tmp_path)
        for optimizer in ("sgd", "adamw"):
            runs: dict[bool, list[dict]] = {True: [], False: []}
            for i in range(REPEATS):
                for held in (True, False) if i % 2 == 0 else (False, True):
                    point = _run(folder, optimizer, held, tmp_path / f"{size.label}-{optimizer}-{held}-{i}" / "out")
                    point["bytes_per_param"] = point["above_start_mib"] * MIB / size.parameters
                    runs[held].append(point)
                    print(f"  {size.label} {optimizer} offsets={held}: {point['verdict']}, "
                          f"{point['bytes_per_param']:.1f} B/param, trajectory {point['trajectory_ms']:.0f} ms, "
                          f"checks {point['ratio']:.1f}x the step; held {point['held']}", flush=True)
            assert all(p["verdict"] == "equivalent" for arm in runs.values() for p in arm)
            assert all(p["held"] and p["held"]["elements"] > 0 for p in runs[True])
            assert all(not p["held"] for p in runs[False])
            rows.append((size.label, optimizer, runs))
    table = Table(title="the float64 trajectory held as offsets, side by side (one rank, 2 x 16 tokens)")
    for col in ("size", "optimizer", "B/param above start: whole -> held", "trajectory ms/step: whole -> held",
                "checks / step: whole -> held", "kept in float64"):
        table.add_column(col)
    for label, optimizer, runs in rows:
        fmt = lambda key, spec: " -> ".join(  # noqa: E731
            "/".join(format(p[key], spec) for p in runs[arm]) for arm in (False, True))
        kept = "/".join(f"{p['held']['kept_float64'] / p['held']['elements']:.2%}" for p in runs[True])
        table.add_row(label, optimizer, fmt("bytes_per_param", ".1f"), fmt("trajectory_ms", ".0f"),
                      fmt("ratio", ".1f"), kept)
    Console(width=200, force_terminal=False).print(table)
    for _, _, runs in rows:  # what it is for: less memory above start, in every pair of runs
        assert min(p["above_start_mib"] for p in runs[False]) > max(p["above_start_mib"] for p in runs[True])
