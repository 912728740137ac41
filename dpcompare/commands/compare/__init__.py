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
  compare.json     the summary: runs, unavailable backends with the reason, the matrix, and how each
                   backend left the gradients of unused parameters (unused_parameter_grads)
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

from dpcompare import results
from dpcompare.run import registry


@dataclass(slots=True)
class Job:
    backend: str
    world_size: int
    command: list[str]
    label: str
    dump: Path
    log: Path
    variant: str = "baseline"
    """'baseline', or 'knob=value' for a --sweep run."""
    status: str = "pending"
    result: dict[str, Any] | None = None
    wall_s: float | None = None
    error: str | None = None
    result_path: Path | None = None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backends", default=",".join(registry.NATIVE_LAUNCHER), help="comma-separated backends")
    p.add_argument("--world-sizes", default="1,2", help="comma-separated world sizes for multi-process backends")
    p.add_argument("--model", default="mlp")
    p.add_argument("--steps", type=int, default=3, help="verification steps (each checked against the oracle)")
    p.add_argument("--measure-steps", type=int, default=20, help="timed steps per run (0: verdicts only)")
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--global-batch", type=int, default=24)
    p.add_argument("--scaling", choices=("strong", "weak"), default="strong",
                   help="strong: fixed global batch; weak: fixed per-rank batch (global batch / largest world size)")
    p.add_argument("--collectives", default="auto",
                   help="bench-collectives JSON to quote busbw from; 'auto' runs a short one first; 'none' skips")
    p.add_argument("--sweep", action="store_true",
                   help="also vary one knob at a time at the largest world size: bucket size, accumulation, compression")
    p.add_argument("--sweep-bucket-mb", default="0.01,25", help="bucket sizes (MiB) for --sweep")
    p.add_argument("--sweep-accum", default="4", help="gradient accumulation steps for --sweep")
    p.add_argument("--sweep-compression", default="fp16", help="compressions for --sweep")
    p.add_argument("--no-report", dest="report", action="store_false", help="skip report.md and the plots")
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
        # --bind-to none: Open MPI pins each rank to a core when there are <= 2 ranks, which on a small
        # shared machine puts the ranks' helper threads on one core.
        return [_launcher_bin("mpirun"), *root, "--oversubscribe", "--bind-to", "none", "-np", str(world_size), *py, *args]
    raise ValueError(f"unknown launcher {launcher!r}: use python, torchrun, horovodrun, deepspeed or mpirun")


def _csv(text: str, option: str, kind=str) -> list:
    try:
        return [kind(v.strip()) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{option}={text!r} is invalid: use a comma-separated list") from None


def plan(ns: argparse.Namespace, run_dir: Path) -> tuple[list[Job], list[dict]]:
    backends = _csv(ns.backends, "--backends")
    world_sizes = sorted(set(_csv(ns.world_sizes, "--world-sizes", int)))
    if not world_sizes or min(world_sizes) < 1:
        raise ValueError(f"--world-sizes={ns.world_sizes!r} is invalid: use positive whole numbers, e.g. 1,2")
    if ns.scaling == "strong":
        for ws in world_sizes:
            if ns.global_batch % ws:
                raise ValueError(f"--global-batch={ns.global_batch} is not divisible by world size {ws}: use a multiple of "
                                 f"{np.lcm.reduce(world_sizes)}")
    unknown = [b for b in backends if b not in registry.NATIVE_LAUNCHER]
    if unknown:
        raise ValueError(f"--backends: unknown {', '.join(unknown)}; choose from {', '.join(registry.NATIVE_LAUNCHER)}")
    if ns.measure_steps < 0 or ns.warmup_steps < 0 or ns.steps < 1:
        raise ValueError("--steps must be >= 1 and --measure-steps/--warmup-steps >= 0")
    collectives = _collectives_path(ns, run_dir)
    common = ["--collectives", str(collectives)] if collectives else []
    common += ["--model", ns.model, "--steps", str(ns.steps), "--measure-steps", str(ns.measure_steps),
              "--warmup-steps", str(ns.warmup_steps), "--out", str(run_dir / "runs")]
    if ns.scaling == "weak":
        common += ["--scaling", "weak", "--local-batch", str(max(ns.global_batch // max(world_sizes), 1))]
    else:
        common += ["--global-batch", str(ns.global_batch)]

    jobs, unavailable = [], []

    def add(backend: str, ws: int, variant: str, extra: list[str]) -> None:
        label = f"{backend}/{ws}" + ("" if variant == "baseline" else f" {variant}")
        stem = label.replace("/", "-ws").replace(" ", "-").replace("=", "")
        dump = run_dir / "grads" / f"{stem}.npz"
        args = ["--backend", backend, *common, "--dump-grads", str(dump), "--tag", label, *extra, *ns.run_arg]
        jobs.append(Job(backend, ws, native_command(registry.NATIVE_LAUNCHER[backend], ws, args), label, dump,
                        run_dir / "logs" / f"{stem}.log", variant))

    for backend in backends:
        ok, reason = registry.availability(backend)
        if not ok:
            unavailable.append({"backend": backend, "reason": reason})
            continue
        single = registry.NATIVE_LAUNCHER[backend] == "python"
        for ws in ([1] if single else world_sizes):
            add(backend, ws, "baseline", [])
    ns.sweep_skipped = sweep(ns, backends, max(world_sizes), add, unavailable) if ns.sweep else []
    return jobs, unavailable


def _collectives_path(ns: argparse.Namespace, run_dir: Path) -> Path | None:
    if ns.collectives == "none" or ns.measure_steps == 0:
        return None
    if ns.collectives == "auto":
        return run_dir / "collectives.json"
    path = Path(ns.collectives)
    if not path.is_file():
        raise ValueError(f"--collectives={ns.collectives!r} is not a file: pass a bench-collectives JSON, auto or none")
    return path


def run_microbenchmark(ns: argparse.Namespace, run_dir: Path, jobs: list[Job], timeout_s: float) -> str | None:
    """`compare --collectives auto`: a short all-reduce sweep over the transports the runs use, at the
    world sizes above 1, so each run can quote the link's busbw at its own message size. Returns an
    error line, or None."""
    sizes = sorted({j.world_size for j in jobs if j.world_size > 1})
    if ns.collectives != "auto" or not sizes or ns.measure_steps == 0:
        return None
    transports = sorted({registry.load(j.backend, registry.BACKENDS, "backend").capabilities.collective_transport
                         for j in jobs if j.world_size > 1})
    log = run_dir / "logs" / "bench-collectives.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "dpcompare", "bench-collectives", "--transports", ",".join(transports),
           "--world-sizes", ",".join(map(str, sizes)), "--max-bytes", "16MiB", "--out", str(run_dir / "collectives.json")]
    with log.open("w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        try:
            code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            code = None
    if code != 0 or not (run_dir / "collectives.json").exists():
        return f"bench-collectives failed (log: {log}); runs report no microbenchmark busbw"
    return None


def sweep(ns, backends, ws, add, unavailable) -> list[dict]:
    """Plan one knob at a time, at the largest world size, for the backends where the knob means
    something; return a line for each combination left out and why (data the adapters declare)."""
    skipped = []
    for backend in backends:
        if registry.NATIVE_LAUNCHER[backend] == "python" or any(u["backend"] == backend for u in unavailable):
            continue
        caps = registry.load(backend, registry.BACKENDS, "backend").capabilities
        for mb in _csv(ns.sweep_bucket_mb, "--sweep-bucket-mb", float):
            if caps.has_buckets:
                add(backend, ws, f"bucket_mb={mb:g}", ["--bucket-mb", str(mb)])
            else:
                skipped.append({"backend": backend, "knob": f"bucket_mb={mb:g}",
                                "reason": "no all-reduce bucket to size (ZeRO stage 0 reduces one flat buffer)"})
        for k in _csv(ns.sweep_accum, "--sweep-accum", int):
            add(backend, ws, f"grad_accum={k}", ["--grad-accum", str(k)])
        for c in _csv(ns.sweep_compression, "--sweep-compression"):
            if c in caps.compressions:
                add(backend, ws, f"compression={c}", ["--compression", c])
            else:
                skipped.append({"backend": backend, "knob": f"compression={c}",
                                "reason": f"{backend} offers {', '.join(sorted(caps.compressions))}"})
    return skipped
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


RANDOM_ACROSS_WORLD_SIZES = (
    "not comparable: the forward draws random numbers (dropout) and the two runs have different world sizes; each "
    "rank seeds its own generator from (seed, rank), so they drew different masks and their distance measures "
    "randomness, not rounding (each run's oracle column replays its own masks; compare with --run-arg=--no-dropout)")


def _stochastic(job: Job) -> bool:
    """Whether the run's forward draws random numbers (False for a result written before this was probed)."""
    probe = ((job.result or {}).get("equivalence") or {}).get("stochastic") or {}
    return bool(probe.get("stochastic"))


def _not_comparable(a: Job, b: Job) -> str | None:
    """Why the gradients of runs a and b cannot be compared, or None. Runs at the same world size seed their
    ranks alike and draw the same masks; at different world sizes a rank's shard and generator differ."""
    if a.world_size != b.world_size and (_stochastic(a) or _stochastic(b)):
        return RANDOM_ACROSS_WORLD_SIZES
    return None


def build_matrix(jobs: list[Job]) -> dict[str, Any]:
    """Entry (a, b) at a step: ||g_a - g_b|| / ||oracle|| divided by the noise floor ||floor - oracle|| /
    ||oracle||, both from run a at that step. Column 'oracle': each run against its own oracle. At step 0
    every run starts from the same weights (verified by fingerprint), so step 0 compares one computation;
    later steps also carry each run's own trajectory. Where the forward draws random numbers, runs at
    different world sizes drew different masks: their entry is null, with the reason under 'not_comparable'."""
    by_label = {j.label: j for j in jobs}
    loaded = {j.label: _load(j.dump) for j in jobs if j.result is not None and j.dump.exists()}
    # A run stopped before its first check (unverifiable) dumps an empty file: no row, or no common step at all.
    loaded = {label: steps for label, steps in loaded.items() if steps}
    labels = list(loaded)
    steps = sorted(set.intersection(*(set(v) for v in loaded.values()))) if loaded else []
    per_step = {}
    for step in steps:
        rows = {}
        for a in labels:
            ref = loaded[a][step]
            onorm = float(np.linalg.norm(ref["oracle"])) or 1.0
            floor = float(np.linalg.norm(ref["floor"] - ref["oracle"])) / onorm
            row: dict[str, float | None] = {"oracle": float(np.linalg.norm(ref["reduced"] - ref["oracle"])) / onorm}
            not_comparable = {}
            for b in labels:
                reason = _not_comparable(by_label[a], by_label[b])
                if reason is not None:
                    row[b], not_comparable[b] = None, reason
                else:
                    row[b] = float(np.linalg.norm(ref["reduced"] - loaded[b][step]["reduced"])) / onorm
            rows[a] = {"rel_err": row, "noise_floor": floor,
                       "in_noise_floors": {k: (v / floor if v is not None and floor > 0 else None) for k, v in row.items()},
                       "not_comparable": not_comparable}
        per_step[str(step)] = rows
    return {"labels": labels, "steps": steps, "per_step": per_step,
            "definition": " ".join(build_matrix.__doc__.split())}


def unused_parameter_grads(jobs: list[Job]) -> list[dict[str, Any]]:
    """How each run left the gradients of parameters that take no part in the loss, across backends: one entry
    per group of parameters every run treated alike, {'parameters', 'gradient': {form: [run labels]}, 'line'},
    form being none, zero, nonzero, mixed (across ranks) or 'not recorded'."""
    forms_by_name: dict[str, dict[str, str]] = {}  # parameter -> run label -> form
    for j in jobs:
        parameters = ((j.result or {}).get("equivalence") or {}).get("parameters") or {}
        recorded = parameters.get("unused_grad") or {}
        for name in parameters.get("unused") or []:
            forms_by_name.setdefault(name, {})[j.label] = recorded.get(name, "not recorded")
    groups: dict[tuple[tuple[str, str], ...], list[str]] = {}
    for name, by_run in forms_by_name.items():
        groups.setdefault(tuple(by_run.items()), []).append(name)
    shown = {j.label: f"{j.backend} ws={j.world_size}" for j in jobs}
    words = {"none": "None", "mixed": "mixed across ranks", "nonzero": "NONZERO"}
    entries = []
    for by_run, names in groups.items():
        gradient: dict[str, list[str]] = {}
        for label, form in by_run:
            gradient.setdefault(form, []).append(label)
        line = f"unused parameters {', '.join(names)}: gradient " + "; ".join(
            f"{words.get(form, form)} under {', '.join(shown[lb] for lb in labels)}" for form, labels in gradient.items())
        entries.append({"parameters": names, "gradient": gradient, "line": line})
    return entries


# -- output ----------------------------------------------------------------------------------------
def _fmt(x: float | None, spec: str = ".2e") -> str:
    return "-" if x is None else format(x, spec)


def _note(job: Job) -> str:
    """The last column of the verdict table: the first divergence, else why the run could not be checked,
    else the job's error, else a pass-through note."""
    e = (job.result or {}).get("equivalence") or {}
    d = e.get("first_divergence")
    if d:
        # Results written before the update and trajectory checks name no check: theirs was the gradient's.
        return f"step {d['step']} ({d.get('check', 'gradient')} check) {d['parameter']}: {d['reason']}"
    if e.get("unverifiable_reason"):
        return e["unverifiable_reason"]
    if job.error:
        return job.error
    if any("no parallelism" in n for n in e.get("notes", [])):
        return "no parallelism on CPU (pass-through)"
    return ""


def render(console, jobs: list[Job], unavailable: list[dict], matrix: dict[str, Any],
           unused: list[dict[str, Any]] | None = None) -> None:
    from rich.table import Table
    from rich.text import Text

    table = Table(title="dpcompare: is it the same computation?", show_lines=False)
    # Two-line headers keep the figures narrow enough for the note to have room at width 160.
    # x floor: the worst error in multiples of the run dtype's own noise floor; norm: ||update|| / ||reference update||.
    for col in ("backend", "ws", "launcher", "verdict", "grad\nrel err", "grad\nfloor", "grad\nx floor",
                "update\nx floor", "update\nnorm", "traj\nx floor", "replicas", "s"):
        table.add_column(col, no_wrap=True)
    table.add_column("first divergence / note", overflow="fold", min_width=24)
    style = {"equivalent": "green", "different": "red", "failed": "red", "timeout": "red", "unverifiable": "yellow"}
    for j in jobs:
        r = j.result or {}
        e = r.get("equivalence", {})
        checks = e.get("checks") or {}
        update, trajectory = checks.get("update") or {}, checks.get("trajectory") or {}
        table.add_row(j.backend, str(j.world_size), r.get("launcher", registry.NATIVE_LAUNCHER[j.backend]),
                      f"[{style.get(j.status, 'white')}]{j.status}[/]", _fmt(e.get("max_rel_fro_err")),
                      _fmt(e.get("noise_floor_rel_fro")), _fmt(e.get("noise_ratio"), ".2f"),
                      _fmt(update.get("noise_ratio"), ".2f"), _fmt(update.get("norm_ratio"), ".4f"),
                      _fmt(trajectory.get("noise_ratio"), ".2f"),
                      {True: "identical", False: "DIFFER"}.get(e.get("replicas_identical"), "-"),
                      _fmt(j.wall_s, ".0f"), Text(_note(j)))  # Text: a log line's [brackets] are not markup
    for u in unavailable:
        table.add_row(u["backend"], "-", registry.NATIVE_LAUNCHER[u["backend"]], "[yellow]unavailable[/]",
                      "-", "-", "-", "-", "-", "-", "-", "-", u["reason"])
    console.print(table)

    if matrix["steps"]:
        step = str(matrix["steps"][0])
        m = Table(title=f"gradient matrix at step {step}, in noise floors (0 = bitwise equal)")
        m.add_column("run", no_wrap=True)
        for label in ["oracle", *matrix["labels"]]:
            m.add_column(label, justify="right", no_wrap=True)
        reasons: list[str] = []
        for a in matrix["labels"]:
            row = matrix["per_step"][step][a]
            cells = []
            for b in ["oracle", *matrix["labels"]]:
                reason = (row.get("not_comparable") or {}).get(b)
                if reason is not None:
                    if reason not in reasons:
                        reasons.append(reason)
                    cells.append("n/a")
                else:
                    cells.append("0" if row["rel_err"][b] == 0 else _fmt(row["in_noise_floors"][b], ".2f"))
            m.add_row(a, *cells)
        console.print(m)
        for reason in reasons:
            console.print(f"n/a: {reason}", highlight=False)
    for entry in unused or []:
        console.print(entry["line"], highlight=False)


def render_cost(console, jobs: list[Job], scaling: list[dict[str, Any]]) -> None:
    from rich.table import Table

    eff = {row["label"]: row["efficiency"] for row in scaling}
    table = Table(title="what does it cost? (measured steps; a step is as slow as its slowest rank)")
    for col in ("run", "samples/s", "scaling eff", "step p50 ms", "compute ms", "exposed comm ms", "total comm ms",
                "overlap", "busbw GB/s", "vs microbench", "peak MiB"):
        table.add_column(col, justify="right", no_wrap=True)
    for j in jobs:
        m = (j.result or {}).get("metrics") or {}
        table.add_row(j.label, _fmt(m.get("samples_per_s"), ".0f"), _fmt(eff.get(j.label), ".2f"),
                      _fmt(m.get("step_ms_p50"), ".2f"), _fmt(m.get("compute_ms_p50"), ".2f"),
                      _fmt(m.get("comm_exposed_ms"), ".2f"), _fmt(m.get("comm_total_ms"), ".2f"),
                      _fmt(m.get("overlap_fraction"), ".2f"), _fmt(m.get("busbw_gbps"), ".3f"),
                      _fmt(m.get("busbw_vs_microbench"), ".2f"), _fmt(m.get("peak_mem_mib"), ".0f"))
    console.print(table)


def render_sweep(console, jobs: list[Job], skipped: list[dict]) -> None:
    from rich.table import Table

    table = Table(title="sweep: one knob at a time")
    for col in ("backend", "ws", "knob", "verdict", "rel err", "step p50 ms", "exposed comm ms", "busbw GB/s", "note"):
        table.add_column(col, no_wrap=col != "note", overflow="fold")
    for j in jobs:
        r = j.result or {}
        e, m = r.get("equivalence", {}), r.get("metrics") or {}
        note = j.error or "; ".join(n for n in e.get("notes", []) if "does not apply" in n)
        table.add_row(j.backend, str(j.world_size), j.variant, j.status, _fmt(e.get("max_rel_fro_err")),
                      _fmt(m.get("step_ms_p50"), ".2f"), _fmt(m.get("comm_exposed_ms"), ".2f"),
                      _fmt(m.get("busbw_gbps"), ".3f"), note)
    for k in skipped:
        table.add_row(k["backend"], "-", k["knob"], "n/a", "-", "-", "-", "-", k["reason"])
    console.print(table)


def scaling_rows(jobs: list[Job], scaling: str) -> list[dict[str, Any]]:
    """Scaling efficiency per baseline run (seed formula): throughput_N / (N * throughput_1), with
    throughput_1 the reference backend's at world size 1, measured in the same invocation."""
    from dpcompare.measure.scaling import scaling_efficiency

    base = [j for j in jobs if j.variant == "baseline" and j.result and j.result.get("metrics")]
    ref = next((j for j in base if j.backend == "reference" and j.world_size == 1), None)
    thr1 = ref.result["metrics"].get("samples_per_s") if ref else None
    rows = []
    for j in base:
        thr = j.result["metrics"].get("samples_per_s")
        rows.append({"label": j.label, "backend": j.backend, "world_size": j.world_size, "samples_per_s": thr,
                     "scaling": scaling, "efficiency": scaling_efficiency(thr, j.world_size, thr1),
                     "reason": None if thr1 else "no reference run at world size 1 with a measured throughput"})
    return rows


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
        task = progress.add_task("compare", total=len(jobs) + 1)
        progress.update(task, description="bench-collectives (microbenchmark)")
        bench_error = run_microbenchmark(ns, run_dir, jobs, ns.timeout_s)
        if bench_error:
            console.print(f"[yellow]{bench_error}[/]")
            for job in jobs:  # runs must not point at a file that is not there
                i = job.command.index("--collectives") if "--collectives" in job.command else None
                if i is not None:
                    del job.command[i:i + 2]
        progress.advance(task)
        for job in jobs:
            progress.update(task, description=f"{job.label} ({registry.NATIVE_LAUNCHER[job.backend]})")
            execute(job, ns.timeout_s)
            progress.advance(task)

    baseline = [j for j in jobs if j.variant == "baseline"]
    matrix = build_matrix(baseline)
    unused = unused_parameter_grads(baseline)
    scaling = scaling_rows(jobs, ns.scaling)
    summary = results.base_payload(
        kind="compare",
        created_unix=time.time(),
        model=ns.model, steps=ns.steps, measure_steps=ns.measure_steps, global_batch=ns.global_batch,
        scaling_mode=ns.scaling,
        runs=[{"label": j.label, "backend": j.backend, "world_size": j.world_size, "variant": j.variant,
               "status": j.status, "wall_s": j.wall_s, "error": j.error, "command": j.command,
               "result_path": None if j.result_path is None else str(j.result_path),
               "verdict": (j.result or {}).get("equivalence", {}).get("verdict")} for j in jobs],
        unavailable=unavailable,
        sweep_skipped=getattr(ns, "sweep_skipped", []),
        scaling=scaling,
        matrix=matrix,
        unused_parameter_grads=unused,
        collectives=str(run_dir / "collectives.json") if (run_dir / "collectives.json").exists() else None,
        env=results.environment(),
    )
    results.write_atomic(run_dir / "compare.json", summary)
    render(console, baseline, unavailable, matrix, unused)
    render_cost(console, baseline, scaling)
    if ns.sweep:
        render_sweep(console, [j for j in jobs if j.variant != "baseline"], summary["sweep_skipped"])
    if ns.report:
        from dpcompare.commands import report

        path = report.build_report(run_dir)
        console.print(f"report: {path}")
    console.print(f"results: {run_dir}")
    failed = [j for j in jobs if j.status in ("failed", "timeout")]
    return 1 if failed else 0
