"""compare: every installed backend at each world size, each under its native launcher, plus the
cross-backend gradient matrix.

Runs the reference and DataParallel (one process) and ddp / horovod / deepspeed at every world size asked
for, each as a subprocess of its real launcher (torchrun, horovodrun, the deepspeed launcher), with the
same model, seed, batch and steps. Every run checks itself against the float64 oracle and dumps its
checked-step gradients; this command then builds the backend x backend x oracle matrix from the dumps,
prints a table, and writes everything under OUT/<timestamp>/:

  runs/*.json      one result per run (schema: dpcompare/schema/result.schema.json)
  grads/*.npz      reduced, oracle and noise-floor gradients of every checked step
  logs/*.log       each launcher's output
  compare.json     the summary: runs, unavailable backends with the reason, the matrix
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dpcompare import registry, results


@dataclass(slots=True)
class Job:
    backend: str
    world_size: int
    command: list[str]
    label: str
    dump: Path
    log: Path
    status: str = "pending"
    result: dict[str, Any] | None = None
    wall_s: float | None = None
    error: str | None = None
    result_path: Path | None = None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backends", default=",".join(registry.NATIVE_LAUNCHER), help="comma-separated backends")
    p.add_argument("--world-sizes", default="1,2", help="comma-separated world sizes for multi-process backends")
    p.add_argument("--model", default="mlp")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--global-batch", type=int, default=24)
    p.add_argument("--out", default="results")
    p.add_argument("--timeout-s", type=float, default=600.0, help="per launch")
    p.add_argument("--run-arg", action="append", default=[], metavar="ARG",
                   help="extra argument passed to every run (repeat: --run-arg=--sync-bn)")


def _launcher_bin(name: str) -> str:
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise RuntimeError(f"launcher {name!r} not found next to {sys.executable} or on PATH: run bash scripts/setup.sh")
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def native_command(launcher: str, world_size: int, args: list[str]) -> list[str]:
    """The command a user would type to start `python -m dpcompare ARGS` under `launcher`."""
    py = [sys.executable, "-m", "dpcompare"]
    if launcher == "python":
        return py + args
    if launcher == "torchrun":
        return [_launcher_bin("torchrun"), "--standalone", f"--nproc_per_node={world_size}", "-m", "dpcompare", *args]
    if launcher == "horovodrun":
        return [_launcher_bin("horovodrun"), "--gloo", "-np", str(world_size), "-H", f"localhost:{world_size}", *py, *args]
    if launcher == "deepspeed":
        return [_launcher_bin("deepspeed"), "--num_gpus", str(world_size), "--master_port", str(_free_port()),
                "--module", "dpcompare", *args]
    if launcher == "mpirun":
        root = ["--allow-run-as-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []
        return [_launcher_bin("mpirun"), *root, "--oversubscribe", "-np", str(world_size), *py, *args]
    raise ValueError(f"unknown launcher {launcher!r}: use python, torchrun, horovodrun, deepspeed or mpirun")


def plan(ns: argparse.Namespace, run_dir: Path) -> tuple[list[Job], list[dict]]:
    backends = [b.strip() for b in ns.backends.split(",") if b.strip()]
    try:
        world_sizes = sorted({int(w) for w in ns.world_sizes.split(",") if w.strip()})
    except ValueError:
        raise ValueError(f"--world-sizes={ns.world_sizes!r} is invalid: use comma-separated whole numbers, e.g. 1,2") from None
    if not world_sizes or min(world_sizes) < 1:
        raise ValueError(f"--world-sizes={ns.world_sizes!r} is invalid: use positive whole numbers, e.g. 1,2")
    for ws in world_sizes:
        if ns.global_batch % ws:
            raise ValueError(f"--global-batch={ns.global_batch} is not divisible by world size {ws}: use a multiple of "
                             f"{np.lcm.reduce(world_sizes)}")
    unknown = [b for b in backends if b not in registry.NATIVE_LAUNCHER]
    if unknown:
        raise ValueError(f"--backends: unknown {', '.join(unknown)}; choose from {', '.join(registry.NATIVE_LAUNCHER)}")
    jobs, unavailable = [], []
    for backend in backends:
        ok, reason = registry.availability(backend)
        if not ok:
            unavailable.append({"backend": backend, "reason": reason})
            continue
        launcher = registry.NATIVE_LAUNCHER[backend]
        sizes = world_sizes if launcher != "python" else [1]
        for ws in sizes:
            label = f"{backend}/{ws}"
            dump = run_dir / "grads" / f"{backend}-ws{ws}.npz"
            args = ["--backend", backend, "--model", ns.model, "--steps", str(ns.steps),
                    "--global-batch", str(ns.global_batch), "--out", str(run_dir / "runs"),
                    "--dump-grads", str(dump), "--tag", label, *ns.run_arg]
            jobs.append(Job(backend, ws, native_command(launcher, ws, args), label, dump, run_dir / "logs" / f"{backend}-ws{ws}.log"))
    return jobs, unavailable


def execute(job: Job, timeout_s: float) -> None:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONUNBUFFERED="1")
    job.log.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with job.log.open("w") as log:
        log.write("$ " + " ".join(job.command) + "\n")
        log.flush()
        try:
            proc = subprocess.run(job.command, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout_s,
                                  start_new_session=True)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code = None
    job.wall_s = time.monotonic() - start
    for path in sorted((job.log.parent.parent / "runs").glob("*.json")):
        candidate = json.loads(path.read_text())
        if candidate.get("tag") == job.label:
            job.result, job.result_path = candidate, path
    if code is None:
        job.status, job.error = "timeout", f"no result within {timeout_s:g} s (log: {job.log})"
    elif code != 0 or job.result is None:
        lines = [ln for ln in job.log.read_text().splitlines() if "error" in ln.lower()]
        job.status = "failed"
        job.error = (lines[-1].strip() if lines else f"exit status {code}") + f" (log: {job.log})"
    else:
        job.status = job.result["equivalence"]["verdict"]


# -- the matrix ------------------------------------------------------------------------------------
def _load(dump: Path) -> dict[int, dict[str, np.ndarray]]:
    """step -> {'reduced' | 'oracle' | 'floor': flat float64 vector}, parameters in a fixed order."""
    by_step: dict[int, dict[str, dict[str, np.ndarray]]] = {}
    with np.load(dump) as z:
        for key in z.files:
            step, kind, name = key.split("/", 2)
            by_step.setdefault(int(step), {}).setdefault(kind, {})[name] = z[key]
    return {s: {k: np.concatenate([v[n].ravel() for n in sorted(v)]) for k, v in kinds.items()}
            for s, kinds in by_step.items()}


def build_matrix(jobs: list[Job]) -> dict[str, Any]:
    """Entry (a, b) at a step: ||g_a - g_b|| / ||oracle|| divided by the noise floor ||floor - oracle|| /
    ||oracle||, both from run a at that step. Column 'oracle': each run against its own oracle. At step 0
    every run starts from the same weights (verified by fingerprint), so step 0 compares one computation;
    later steps also carry each run's own trajectory."""
    loaded = {j.label: _load(j.dump) for j in jobs if j.result is not None and j.dump.exists()}
    labels = list(loaded)
    steps = sorted(set.intersection(*(set(v) for v in loaded.values()))) if loaded else []
    per_step = {}
    for step in steps:
        rows = {}
        for a in labels:
            ref = loaded[a][step]
            onorm = float(np.linalg.norm(ref["oracle"])) or 1.0
            floor = float(np.linalg.norm(ref["floor"] - ref["oracle"])) / onorm
            row = {"oracle": float(np.linalg.norm(ref["reduced"] - ref["oracle"])) / onorm}
            for b in labels:
                row[b] = float(np.linalg.norm(ref["reduced"] - loaded[b][step]["reduced"])) / onorm
            rows[a] = {"rel_err": row, "noise_floor": floor,
                       "in_noise_floors": {k: (v / floor if floor > 0 else None) for k, v in row.items()}}
        per_step[str(step)] = rows
    return {"labels": labels, "steps": steps, "per_step": per_step,
            "definition": build_matrix.__doc__.strip().replace("\n   ", "").replace("  ", " ")}


# -- output ----------------------------------------------------------------------------------------
def _fmt(x: float | None, spec: str = ".2e") -> str:
    return "-" if x is None else format(x, spec)


def render(console, jobs: list[Job], unavailable: list[dict], matrix: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(title="dpcompare: is it the same computation?", show_lines=False)
    for col in ("backend", "ws", "launcher", "verdict", "rel err", "floor", "x floor", "replicas", "s"):
        table.add_column(col, no_wrap=True)
    table.add_column("first divergence / note", overflow="fold")
    style = {"equivalent": "green", "different": "red", "failed": "red", "timeout": "red"}
    for j in jobs:
        r = j.result or {}
        e = r.get("equivalence", {})
        note = ""
        if e.get("first_divergence"):
            d = e["first_divergence"]
            note = f"step {d['step']} {d['parameter']}: {d['reason']}"
        elif j.error:
            note = j.error
        elif any("no parallelism" in n for n in e.get("notes", [])):
            note = "no parallelism on CPU (pass-through)"
        table.add_row(j.backend, str(j.world_size), r.get("launcher", registry.NATIVE_LAUNCHER[j.backend]),
                      f"[{style.get(j.status, 'white')}]{j.status}[/]", _fmt(e.get("max_rel_fro_err")),
                      _fmt(e.get("noise_floor_rel_fro")), _fmt(e.get("noise_ratio"), ".2f"),
                      {True: "identical", False: "DIFFER"}.get(e.get("replicas_identical"), "-"),
                      _fmt(j.wall_s, ".0f"), note)
    for u in unavailable:
        table.add_row(u["backend"], "-", registry.NATIVE_LAUNCHER[u["backend"]], "[yellow]unavailable[/]",
                      "-", "-", "-", "-", "-", u["reason"])
    console.print(table)

    if matrix["steps"]:
        step = str(matrix["steps"][0])
        m = Table(title=f"gradient matrix at step {step}, in noise floors (0 = bitwise equal)")
        m.add_column("run", no_wrap=True)
        for label in ["oracle", *matrix["labels"]]:
            m.add_column(label, justify="right", no_wrap=True)
        for a in matrix["labels"]:
            cells = matrix["per_step"][step][a]["in_noise_floors"]
            m.add_row(a, *[("0" if matrix["per_step"][step][a]["rel_err"][b] == 0 else _fmt(cells[b], ".2f"))
                           for b in ["oracle", *matrix["labels"]]])
        console.print(m)


def main(ns: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console()
    if not console.is_terminal:
        console = Console(width=160)  # logs and CI: wide enough for the matrix, no wrapped numbers
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir = Path(ns.out) / stamp
    jobs, unavailable = plan(ns, run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    for u in unavailable:
        console.print(f"[yellow]{u['backend']} unavailable:[/] {u['reason']}")

    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console, transient=False) as progress:
        task = progress.add_task("compare", total=len(jobs))
        for job in jobs:
            progress.update(task, description=f"{job.label} ({registry.NATIVE_LAUNCHER[job.backend]})")
            execute(job, ns.timeout_s)
            progress.advance(task)

    matrix = build_matrix(jobs)
    summary = results.base_payload(
        kind="compare",
        created_unix=time.time(),
        model=ns.model, steps=ns.steps, global_batch=ns.global_batch,
        runs=[{"label": j.label, "backend": j.backend, "world_size": j.world_size, "status": j.status,
               "wall_s": j.wall_s, "error": j.error, "command": j.command,
               "result_path": None if j.result_path is None else str(j.result_path),
               "verdict": (j.result or {}).get("equivalence", {}).get("verdict")} for j in jobs],
        unavailable=unavailable,
        matrix=matrix,
        env=results.environment(),
    )
    results.write_atomic(run_dir / "compare.json", summary)
    render(console, jobs, unavailable, matrix)
    console.print(f"results: {run_dir}")
    failed = [j for j in jobs if j.status in ("failed", "timeout")]
    return 1 if failed else 0
