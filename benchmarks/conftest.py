"""Launch helpers for the honesty benchmarks: real runs under torchrun, side by side, in alternation.

Every launch gets: OMP_NUM_THREADS=1 (two ranks on a two-core box), the repository root on PYTHONPATH
(so the ranks import `benchmarks.workloads`), no launcher variables inherited from the shell, its own
heartbeat directory, loopback rendezvous (`torchrun --standalone`), and a timeout after which its whole
process tree is killed by pid.

`alternate` runs the sides of a comparison in turn (A, B, A, B, ...; with three sides the order rotates
every round), so a change in the machine's load falls on every side alike. `spread` and `paired_ratios`
are the statistics the benchmarks report: medians, min-max and the per-round ratio of two sides.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from rich.console import Console
from rich.table import Table

from dpcompare.run import launchers

REPO_ROOT = Path(__file__).resolve().parents[1]
BIN_DIR = Path(sys.executable).parent
PLAIN_DDP = REPO_ROOT / "experiments" / "plain_ddp.py"

LAUNCH_TIMEOUT_S = 240.0
"""One launch (two ranks, imports, rendezvous, the run); the box is shared, so this is generous."""

_LAUNCHER_VAR_PREFIXES = ("OMPI_", "PMI_", "PMIX_", "SLURM_", "HOROVOD_", "TORCHELASTIC_", "MPI_LOCAL", "PRTE_")
_LAUNCHER_VARS = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "CROSS_RANK",
                  "CROSS_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR", "MASTER_PORT", "DPCOMPARE_HEARTBEAT_DIR"}


# -- processes -------------------------------------------------------------------------------------
def child_env(work_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in _LAUNCHER_VARS and not k.startswith(_LAUNCHER_VAR_PREFIXES)}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["PATH"] = os.pathsep.join([str(BIN_DIR), env.get("PATH", "")])
    env["PYTHONUNBUFFERED"] = "1"
    env["DPCOMPARE_HEARTBEAT_DIR"] = str(work_dir / "heartbeat")
    return env


def run_checked(cmd: Sequence[str], work_dir: Path, timeout_s: float = LAUNCH_TIMEOUT_S) -> str:
    """Run `cmd` in `work_dir` with the library's runner; fail the benchmark (with the output's tail) on
    timeout or non-zero exit."""
    work_dir.mkdir(parents=True, exist_ok=True)
    done = launchers.run_process(cmd, timeout_s=timeout_s, capture=True, env=child_env(work_dir), cwd=REPO_ROOT)
    output = done.stdout + done.stderr
    if done.timed_out:
        pytest.fail(f"timed out after {timeout_s:g} s: {' '.join(cmd)}\n{output[-4000:]}")
    if done.returncode != 0:
        pytest.fail(f"exit status {done.returncode}: {' '.join(cmd)}\n{output[-4000:]}")
    return output


def torchrun(target: Sequence[str], nproc: int = 2) -> list[str]:
    """`torchrun --standalone --nproc_per_node=N TARGET...` (TARGET: a script path or `-m module`)."""
    return [launchers.launcher_bin("torchrun"), "--standalone", f"--nproc_per_node={nproc}", *target]


@dataclass
class Runner:
    """Starts the two kinds of runs the benchmarks compare; each launch gets a fresh directory."""

    root: Path
    count: int = 0

    def launch_dir(self, label: str) -> Path:
        self.count += 1
        d = self.root / f"{self.count:03d}-{label}"
        d.mkdir(parents=True)
        return d

    def dpcompare(self, args: Sequence[str], label: str = "dpcompare") -> dict[str, Any]:
        """`torchrun ... -m dpcompare ARGS --out DIR`; returns the result's `metrics`."""
        d = self.launch_dir(label)
        out = d / "out"
        run_checked(torchrun(["-m", "dpcompare", *args, "--out", str(out)]), d)
        files = sorted(out.glob("*.json"))
        assert len(files) == 1, f"expected one result in {out}, found {[f.name for f in files]}"
        return json.loads(files[0].read_text())["metrics"]

    def plain_ddp(self, args: Sequence[str], label: str = "plain") -> dict[str, Any]:
        """`torchrun ... experiments/plain_ddp.py ARGS --out FILE`; returns its JSON."""
        d = self.launch_dir(label)
        out = d / "plain.json"
        run_checked(torchrun([str(PLAIN_DDP), *args, "--out", str(out)]), d)
        return json.loads(out.read_text())

    def command(self, cmd: Sequence[str], launch_dir: Path, timeout_s: float = LAUNCH_TIMEOUT_S) -> str:
        """Any other command (bench-collectives), run like the launches above in `launch_dir`."""
        return run_checked(cmd, launch_dir, timeout_s)


@pytest.fixture
def runner(tmp_path: Path) -> Runner:
    return Runner(tmp_path)


# -- alternation and statistics --------------------------------------------------------------------
def alternate(sides: dict[str, Callable[[], dict[str, Any]]], rounds: int, *,
              rotate: bool = True) -> dict[str, list[dict[str, Any]]]:
    """Run every side once per round. With `rotate` the order turns each round (A B, B A, ... for two
    sides), so no side always follows the same one; without it the order is fixed (for a side that uses
    the one before it). Returns each side's results in round order."""
    names = list(sides)
    results: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for r in range(rounds):
        k = r % len(names) if rotate else 0
        for name in names[k:] + names[:k]:
            started = time.monotonic()
            result = sides[name]()
            result["_wall_s"] = time.monotonic() - started
            result["_load1"] = os.getloadavg()[0]
            results[name].append(result)
            print(f"  round {r + 1}/{rounds} {name:<22} {describe(result)}  ({result['_wall_s']:.0f} s, "
                  f"load {result['_load1']:.1f})", flush=True)
    return results


def describe(result: dict[str, Any]) -> str:
    keys = ("loop_ms_per_step", "step_ms_p50", "comm_exposed_ms", "comm_total_ms", "comm_native_overlap_ms",
            "busbw_gbps", "microbench_busbw_gbps", "busbw_at_bucket_gbps")
    return " ".join(f"{k}={result[k]:.2f}" for k in keys if isinstance(result.get(k), (int, float)))


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, min, max, IQR and a 90 % bootstrap interval of the median (how well n values pin it down)."""
    a = np.asarray(values, dtype=float)
    boot = np.median(a[np.random.default_rng(0).integers(0, a.size, (10_000, a.size))], axis=1)
    return {"median": float(np.median(a)), "min": float(a.min()), "max": float(a.max()),
            "iqr": float(np.percentile(a, 75) - np.percentile(a, 25)), "n": int(a.size),
            "median_ci90": [float(np.percentile(boot, 5)), float(np.percentile(boot, 95))]}


def paired_ratios(numerator: Sequence[float], denominator: Sequence[float]) -> list[float]:
    """Per-round ratio of two sides measured next to each other (the load drifts less within a round)."""
    return [float(a) / float(b) for a, b in zip(numerator, denominator, strict=True)]


def print_table(title: str, rows: list[tuple[str, dict[str, float] | float | str, str]]) -> None:
    """One row per figure: name, value (a `spread` dict or a number), what it is."""
    table = Table(title=title, title_justify="left")
    numeric = ("median", "median 90% CI", "min", "max", "n")
    for col in ("figure", *numeric, "note"):
        table.add_column(col, justify="right" if col in numeric else "left")
    for name, value, note in rows:
        if isinstance(value, dict):
            lo, hi = value["median_ci90"]
            table.add_row(name, f"{value['median']:.4g}", f"{lo:.4g} - {hi:.4g}", f"{value['min']:.4g}",
                          f"{value['max']:.4g}", str(value["n"]), note)
        elif isinstance(value, float):
            table.add_row(name, f"{value:.4g}", "", "", "", "", note)
        else:
            table.add_row(name, str(value), "", "", "", "", note)
    Console(width=160, force_terminal=False).print(table)
