"""N default `dpcompare compare` runs in a row, and what their exposed communication looked like.

    OMP_NUM_THREADS=1 .venv/bin/python -m experiments.exposed_series --runs 10 --out /tmp/exposed-series

For every run of every compare with an exposed figure: the flags the report would show (exposed above its total:
(~) within the interval, (!) beyond it; (+) interference; compute + exposed above the step), the ablation's
difference, exposed, total and interference, and on DDP the ablation against DDP's own counter (communication minus
overlap) on rank 0, with the counter's figure for every rank. Prints a table per compare and a summary; writes
series.json beside the compares. Extra arguments after `--` go to every compare.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from dpcompare.measure import consistency


def inspect(compare_dir: Path) -> list[dict[str, Any]]:
    rows = []
    for path in sorted((compare_dir / "runs").glob("*.json")):
        run = json.loads(path.read_text())
        m = run.get("metrics") or {}
        if m.get("comm_ablation_ms") is None:
            continue
        exposed_flag = consistency.exposed_flag(m)
        native = m.get("comm_native_exposed_ms")
        rows.append({
            "run": f"{run.get('variant') or run['backend']}/{run['world_size']}",
            "exposed_flag": exposed_flag[0] if exposed_flag else None,
            "interference_flag": consistency.interference_flag(m) is not None,
            "breakdown_flag": consistency.breakdown_flag(m) is not None,
            "ablation_ms": m.get("comm_ablation_ms"), "exposed_ms": m.get("comm_exposed_ms"),
            "exposed_ci_ms": m.get("comm_exposed_ci_ms"), "total_ms": m.get("comm_total_ms"),
            "total_ms_per_rank": m.get("comm_total_ms_per_rank"), "interference_ms": m.get("comm_interference_ms"),
            "native_exposed_ms": native, "native_exposed_ms_per_rank": m.get("comm_native_exposed_ms_per_rank"),
            "ablation_over_native": (m["comm_exposed_ms"] / native) if native else None,
            "step_ms_p50": m.get("step_ms_p50"), "compute_ms_p50": m.get("compute_ms_p50"),
        })
    return rows


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.2f}"
    if isinstance(v, list):
        return "[" + ", ".join(_fmt(x) for x in v) + "]"
    return str(v)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("compare_args", nargs="*", help="after --: passed to every compare")
    args = parser.parse_args(argv)
    console = Console(width=160)
    series = []
    for k in range(args.runs):
        out = args.out / f"compare-{k:02d}"
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "dpcompare", "compare", "--out", str(out), *args.compare_args],
                              capture_output=True, text=True)
        if done.returncode != 0:
            console.print(f"compare {k} exited {done.returncode}:\n{done.stderr[-2000:]}")
            return 1
        folder = max(p for p in out.iterdir() if p.is_dir())
        rows = inspect(folder)
        series.append({"compare": k, "folder": str(folder), "wall_s": time.monotonic() - started, "runs": rows,
                       "flagged": any(r["exposed_flag"] for r in rows)})
        table = Table(title=f"compare {k + 1}/{args.runs} ({series[-1]['wall_s']:.0f} s): {folder}")
        for col in ("run", "flag", "(+)", "ablation", "exposed", "interval", "total", "total per rank",
                    "DDP counter", "counter per rank", "exposed / counter"):
            table.add_column(col)
        for r in rows:
            table.add_row(r["run"], _fmt(r["exposed_flag"]), "+" if r["interference_flag"] else "",
                          _fmt(r["ablation_ms"]), _fmt(r["exposed_ms"]), _fmt(r["exposed_ci_ms"]), _fmt(r["total_ms"]),
                          _fmt(r["total_ms_per_rank"]), _fmt(r["native_exposed_ms"]), _fmt(r["native_exposed_ms_per_rank"]),
                          _fmt(r["ablation_over_native"]))
        console.print(table)
        (args.out / "series.json").write_text(json.dumps(series, indent=1))
    flagged = [s["compare"] for s in series if s["flagged"]]
    ratios = [r["ablation_over_native"] for s in series for r in s["runs"] if r["ablation_over_native"] is not None]
    console.print(f"{len(series)} compares, {len(flagged)} with an exposed-above-total flag {flagged or ''}; "
                  f"(+) on {sum(r['interference_flag'] for s in series for r in s['runs'])} runs")
    if ratios:
        within = sum(abs(x - 1) <= 0.15 for x in ratios)
        console.print(f"ddp exposed / DDP's counter: median {np.median(ratios):.3f}, range {min(ratios):.3f}-"
                      f"{max(ratios):.3f}, {within}/{len(ratios)} within 15 %")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
