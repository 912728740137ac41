"""The bench-collectives orchestrator: every transport at every world size, each under its own launcher.

Owns: checking which transports can run here, one launch per transport and world size (the worker
command under the transport's launcher, run with the shared subprocess runner), judging each launch
from its exit status, result file and log, the table printed at the end, and the collectives JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dpcompare import json_files
from dpcompare.commands.bench_collectives.sweep import Sweep, human_bytes
from dpcompare.commands.bench_collectives.transports import TRANSPORTS, Transport, availability, launcher
from dpcompare.run.launchers import native_command, run_process

DEFINITIONS = {
    "time_us_mean": "mean over timed iterations of the slowest rank (highest mean); each iteration is "
                    "refilled, then barrier, then one in-place all-reduce",
    "time_us_p50": "median over timed iterations of that rank",
    "algbw_gbps": "bytes / time_us_mean, 1 GB = 1e9 bytes",
    "busbw_gbps": "algbw * 2(n-1)/n (nccl-tests doc/PERFORMANCE.md)",
    "correct": "every rank holds exactly n(n+1)/2 * ((i mod 251) + 1) after the last iteration",
}
"""What each number in a size's record means, written into the JSON next to the numbers."""


@dataclass(slots=True)
class Launch:
    transport: Transport
    world_size: int
    command: list[str]
    status: str = "pending"
    """ok | incorrect | failed | timeout"""
    entry: dict[str, Any] | None = None
    wall_s: float | None = None
    error: str | None = None
    log_tail: list[str] = field(default_factory=list)


# -- inputs -------------------------------------------------------------------------------------------
def _parse_list(text: str, option: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise ValueError(f"{option}={text!r} is empty: give a comma-separated list")
    return list(dict.fromkeys(items))


def _transports(text: str) -> list[str]:
    requested = _parse_list(text, "--transports")
    unknown = [t for t in requested if t not in TRANSPORTS]
    if unknown:
        raise ValueError(f"--transports: unknown {', '.join(unknown)}; choose from {', '.join(TRANSPORTS)}")
    return requested


def _world_sizes(text: str) -> list[int]:
    try:
        sizes = sorted({int(w) for w in _parse_list(text, "--world-sizes")})
    except ValueError:
        raise ValueError(f"--world-sizes={text!r} is invalid: use comma-separated whole numbers, e.g. 2,4") from None
    if sizes[0] < 1:
        raise ValueError(f"--world-sizes={text!r} is invalid: use positive whole numbers, e.g. 2,4")
    return sizes


def _out_path(out: str | None) -> Path:
    name = f"collectives-{time.strftime('%Y%m%d-%H%M%S')}.json"
    if out is None:
        return Path("results") / name
    path = Path(out)
    return path if path.suffix == ".json" else path / name


def _worker_args(ns: argparse.Namespace, transport: Transport, result_file: Path) -> list[str]:
    args = ["bench-collectives", "--worker", "--transport", transport, "--min-bytes", ns.min_bytes,
            "--max-bytes", ns.max_bytes, "--factor", str(ns.factor), "--iters", str(ns.iters),
            "--warmup", str(ns.warmup), "--target-s", str(ns.target_s), "--device", ns.device,
            "--timeout-s", str(ns.timeout_s), "--result-file", str(result_file)]
    return args + (["--corrupt"] if ns.corrupt else [])


def worker_command(ns: argparse.Namespace, transport: Transport, world_size: int, result_file: Path) -> list[str]:
    """The command that starts `world_size` worker ranks of `transport` under its launcher."""
    return native_command(launcher(transport), world_size, _worker_args(ns, transport, result_file))


# -- one launch ---------------------------------------------------------------------------------------
def execute(job: Launch, result_file: Path, log: Path, timeout_s: float) -> None:
    """Run one launch to completion (or past `timeout_s`, when its whole process tree is killed) and
    record its status, error, wall time, log tail and, when rank 0 wrote one, its result entry."""
    finished = run_process(job.command, timeout_s=timeout_s, log=log)
    code = finished.returncode
    job.wall_s = finished.wall_s
    job.log_tail = log.read_text(errors="replace").splitlines()[-15:]
    if result_file.exists():
        job.entry = json.loads(result_file.read_text())
    if code is None:
        job.status, job.error = "timeout", f"no result within {timeout_s:g} s"
    elif job.entry is not None and not all(s["correct"] for s in job.entry["sizes"]):
        job.status = "incorrect"
        wrong = [human_bytes(s["bytes"]) for s in job.entry["sizes"] if not s["correct"]]
        job.error = f"wrong all-reduce result at {', '.join(wrong)}"
    elif code != 0 or job.entry is None:
        # Our own one-line errors first; launchers' [ERROR] lines mostly repeat the command line.
        ours = [ln for ln in job.log_tail if ln.startswith("dpcompare: error")]
        errors = ours or [ln for ln in job.log_tail if "error" in ln.lower()]
        job.status = "failed"
        job.error = (errors[-1].strip()[:300] if errors else "") + f" (exit status {code})"
    else:
        job.status = "ok"


def _run_all(console, ns: argparse.Namespace, transports: list[Transport], world_sizes: list[int]) -> list[Launch]:
    """Every transport at every world size, one after the other, each reported as it ends."""
    jobs: list[Launch] = []
    with tempfile.TemporaryDirectory(prefix="dpcompare-collectives-") as tmp:
        for transport in transports:
            for ws in world_sizes:
                result_file = Path(tmp) / f"{transport}-ws{ws}.json"
                job = Launch(transport, ws, worker_command(ns, transport, ws, result_file))
                jobs.append(job)
                with console.status(f"{transport} at N={ws} ({launcher(transport)}) ..."):
                    execute(job, result_file, Path(tmp) / f"{transport}-ws{ws}.log", ns.timeout_s)
                style = {"ok": "green", "incorrect": "red"}.get(job.status, "red")
                console.print(f"{transport} N={ws}: [{style}]{job.status}[/] in {job.wall_s:.1f} s"
                              + (f" - {job.error}" if job.error else ""))
                if job.status in ("failed", "timeout"):
                    console.print("\n".join("  | " + ln for ln in job.log_tail), markup=False, highlight=False)
    return jobs


# -- output -------------------------------------------------------------------------------------------
def render(console, jobs: list[Launch], unavailable: list[dict[str, str]]) -> None:
    from rich.table import Table

    table = Table(title="all-reduce, float32 sum (busbw = algbw x 2(n-1)/n; GB/s = 1e9 B/s)")
    for col, justify in (("transport", "left"), ("backend", "left"), ("N", "right"), ("size", "right"),
                         ("time_us", "right"), ("p50_us", "right"), ("algbw GB/s", "right"),
                         ("busbw GB/s", "right"), ("correct", "left")):
        table.add_column(col, justify=justify, no_wrap=True)
    for job in jobs:
        if job.entry is None:
            table.add_row(job.transport, "-", str(job.world_size), "-", "-", "-", "-", "-",
                          f"[red]{job.status}[/] (see above)", end_section=True)
            continue
        for i, s in enumerate(job.entry["sizes"]):
            first = i == 0
            table.add_row(job.transport if first else "", job.entry["backend"] if first else "",
                          str(job.world_size) if first else "", human_bytes(s["bytes"]),
                          f"{s['time_us_mean']:.1f}", f"{s['time_us_p50']:.1f}", f"{s['algbw_gbps']:.3f}",
                          f"{s['busbw_gbps']:.3f}", "[green]yes[/]" if s["correct"] else "[red]NO[/]",
                          end_section=i == len(job.entry["sizes"]) - 1)
    for u in unavailable:
        table.add_row(u["transport"], "-", "-", "-", "-", "-", "-", "-", "[yellow]unavailable[/] (see above)")
    console.print(table)


def _loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:  # not available on this platform
        return None


def _entry(job: Launch) -> dict[str, Any]:
    """A launch's JSON entry: rank 0's result (or an empty one) with how the launch went."""
    entry = job.entry or {"transport": job.transport, "backend": None, "world_size": job.world_size,
                          "device": None, "sizes": []}
    return {**entry, "status": job.status, "error": job.error, "wall_s": job.wall_s, "command": job.command,
            **({"log_tail": job.log_tail} if job.status in ("failed", "timeout") else {})}


def _payload(sweep: Sweep, jobs: list[Launch], unavailable: list[dict[str, str]], started: float,
             load_before: float | None) -> dict[str, Any]:
    return json_files.base_payload(
        kind="collectives",
        created_unix=time.time(),
        wall_s=time.monotonic() - started,
        host_load_avg_1m={"before": load_before, "after": _loadavg()},
        sweep=asdict(sweep),
        definitions=DEFINITIONS,
        env=json_files.environment(),
        entries=[_entry(j) for j in jobs],
        unavailable=unavailable,
    )


def _note_load(console, load: dict[str, float | None]) -> None:
    """Say so when other work on the host competed with the ranks."""
    if load["before"] is not None and max(load["before"], load["after"]) > 0.5 * (os.cpu_count() or 1):
        console.print(f"[yellow]note:[/] host load average {load['before']:.1f} -> {load['after']:.1f} on "
                      f"{os.cpu_count()} CPUs: other work competed with the ranks; expect outliers (mean >> p50)")


# -- the command --------------------------------------------------------------------------------------
def _available(console, requested: list[str]) -> tuple[list[Transport], list[dict[str, str]]]:
    """The requested transports that can run here, and the others with the reason (printed as found)."""
    transports: list[Transport] = []
    unavailable: list[dict[str, str]] = []
    for t in requested:
        ok, reason = availability(t)
        if ok:
            transports.append(t)
        else:
            unavailable.append({"transport": t, "reason": reason})
            console.print(f"[yellow]{t} unavailable:[/] {reason}")
    return transports, unavailable


def run_orchestrator(ns: argparse.Namespace, sweep: Sweep) -> int:
    from rich.console import Console

    requested = _transports(ns.transports)
    world_sizes = _world_sizes(ns.world_sizes)
    out_path = _out_path(ns.out)
    console = Console()
    if not console.is_terminal:
        console = Console(width=140)
    transports, unavailable = _available(console, requested)

    started = time.monotonic()
    # Other work on the host shows up as latency outliers (mean >> p50): keep the evidence with the figures.
    load_before = _loadavg()
    jobs = _run_all(console, ns, transports, world_sizes)
    payload = _payload(sweep, jobs, unavailable, started, load_before)
    json_files.write_atomic(out_path, payload)
    render(console, jobs, unavailable)
    _note_load(console, payload["host_load_avg_1m"])
    console.print(f"results: {out_path}  ({payload['wall_s']:.0f} s)")
    return 0 if all(j.status == "ok" for j in jobs) else 1
