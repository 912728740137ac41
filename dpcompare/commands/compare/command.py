"""The `compare` command: its flags (a --suite preset fills those not given), and one compare from the plan to the
printed tables: every job run under one progress bar after the microbenchmark, the cross-run figures, compare.json,
and report.md with its plots unless --no-report."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import get_args

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from dpcompare import results
from dpcompare.commands.compare import execute, matrix, plan, questions, render, suites, summary
from dpcompare.run import registry
from dpcompare.run.config import Amp, Optimizer, RunConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    suites.record_given(p)  # a flag given beside --suite wins over the preset, even at its default value
    p.add_argument("--suite", choices=tuple(suites.SUITES), default=None, help=suites.help_text())
    p.add_argument("--backends", default=",".join(registry.BACKENDS),
                   help="comma-separated backends; BACKEND:VARIANT runs a variant its adapter declares (its VARIANTS, "
                        "e.g. deepspeed:zero2 for --opt zero_stage=2) as a backend of its own; package.module:Class a "
                        "backend of your own")
    p.add_argument("--world-sizes", default="1,2", help="comma-separated world sizes for multi-process backends")
    p.add_argument("--model", default="mlp-wide",
                   help="workload, a name, package.module:function or hf:NAME_OR_PATH (a transformers config); mlp-wide (0.8 M parameters) is compute-bound on "
                        "a CPU core at the default global batch, so the costs compare backends rather than Python "
                        "overhead")
    p.add_argument("--seq-len", type=int, default=None,
                   help="hf: causal language models: tokens per sample of every run (default: 128, at most the "
                        "config's context)")
    p.add_argument("--check-coverage", default="auto", metavar="auto|full|SHARE",
                   help="what each run's float64 oracle checks: auto (every parameter where its memory fits, else the "
                        "whole blocks that fit, stated), full, or a share of the parameters in (0, 1]")
    p.add_argument("--steps", type=int, default=2,
                   help="verification steps, each checked against the oracle; 2 check a fresh optimizer, then the "
                        "state the first step left")
    p.add_argument("--measure-steps", type=int, default=20, help="timed steps per run (0: verdicts only)")
    p.add_argument("--warmup-steps", type=int, default=3, help="untimed steps per run before the timed ones")
    p.add_argument("--global-batch", type=int, default=None,
                   help="samples per step over all ranks (default: 2048, or the smallest multiple of every world size "
                        "above it; at 2048, compute dominates a step of mlp-wide at world size 2 on a CPU core)")
    p.add_argument("--scaling", choices=("strong", "weak"), default="strong",
                   help="strong: fixed global batch; weak: fixed per-rank batch (global batch / largest world size)")
    p.add_argument("--optimizer", choices=get_args(Optimizer), default=RunConfig().optimizer,
                   help="every run's optimizer (adamw keeps two moments per parameter: the state ZeRO and FSDP shard)")
    p.add_argument("--clip-grad-norm", type=float, default=None, metavar="MAX_NORM",
                   help="every run clips the reduced gradient's global norm to MAX_NORM before each step, each backend "
                        "by its own mechanism (default: no clipping)")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="every run recomputes each block of the model in backward instead of keeping its activations "
                        "(the runs' peak memory then shows what it saves)")
    p.add_argument("--compile", action="store_true",
                   help="every run compiles its model with torch.compile (backends that declare no compiled path are "
                        "listed as unavailable); needs a C++ compiler")
    p.add_argument("--amp", choices=get_args(Amp), default="none",
                   help="mixed precision: run every backend under torch.autocast in this dtype (fp16 with each "
                        "backend's own dynamic loss scaling); deepspeed additionally runs its engine recipe "
                        "(--opt amp_recipe=engine: bf16/fp16 weights, fp32 master weights)")
    p.add_argument("--collectives", default="auto",
                   help="bench-collectives JSON to quote busbw from; 'auto' runs a short one first; 'none' skips")
    p.add_argument("--sweep", action="store_true",
                   help="also vary one knob at a time at the largest world size: bucket size, accumulation, compression")
    p.add_argument("--sweep-bucket-mb", default="0.01,25", help="bucket sizes (MiB) for --sweep")
    p.add_argument("--sweep-accum", default="4", help="gradient accumulation steps for --sweep")
    p.add_argument("--sweep-compression", default="fp16", help="compressions for --sweep")
    p.add_argument("--no-report", dest="report", action="store_false", help="skip report.md and the plots")
    p.add_argument("--out", default="results", help="directory; each compare writes OUT/<timestamp>/")
    p.add_argument("--timeout-s", type=float, default=600.0,
                   help="seconds per launch before its whole process tree is killed")
    p.add_argument("--run-arg", action="append", default=[], metavar="ARG",
                   help="extra argument passed to every run (repeat: --run-arg=--sync-bn)")


def main(ns: argparse.Namespace) -> int:
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)  # logs and CI: wide enough for the matrix, no wrapped numbers
    run_dir = Path(ns.out) / time.strftime("%Y%m%d-%H%M%S")
    suites.apply(ns)
    if suites.poses_questions(ns):
        return _answer_questions(console, ns, run_dir)
    given = ns.global_batch
    planned = plan.plan(ns, run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if given is None and ns.global_batch != plan.DEFAULT_GLOBAL_BATCH:
        console.print(f"global batch {ns.global_batch}: the smallest multiple of every world size at least "
                      f"{plan.DEFAULT_GLOBAL_BATCH} (--global-batch sets it)")
    if ns.suite:
        console.print(f"suite {ns.suite}: {', '.join(j.label for j in planned.jobs)} (--model {ns.model} "
                      f"--optimizer {ns.optimizer} --global-batch {ns.global_batch})", highlight=False)
    for u in planned.unavailable:
        console.print(f"[yellow]{u['backend']} unavailable:[/] {u['reason']}")
    _run_all(console, ns, run_dir, planned.jobs)

    baseline = [j for j in planned.jobs if j.knob == "baseline"]
    # The same config: the baseline runs and other precision recipes (deepspeed's engine), not the sweep's knobs.
    same_config = [j.result for j in planned.jobs
                   if j.result and (j.knob == "baseline" or plan.is_amp_recipe(j.knob))]
    figures = {"matrix": matrix.build_matrix(baseline), "unused_parameter_grads": matrix.unused_parameter_grads(baseline),
               "scaling": matrix.scaling_rows(planned.jobs, ns.scaling),
               "skipped_steps": matrix.skipped_steps(same_config)}
    results.write_atomic(run_dir / "compare.json", summary.payload(ns, run_dir, planned, figures))
    results.point_latest(run_dir)
    render.render(console, baseline, planned.unavailable, figures["matrix"], figures["unused_parameter_grads"],
                  figures["skipped_steps"])
    render.render_cost(console, baseline, figures["scaling"])
    knobs = [j for j in planned.jobs if j.knob != "baseline"]
    if knobs or planned.sweep_skipped:
        render.render_sweep(console, knobs, planned.sweep_skipped)
    if ns.report:
        from dpcompare.commands import report

        console.print(f"report: {report.build_report(run_dir)}")
    console.print(f"results: {run_dir}")
    return 1 if any(j.status in ("failed", "timeout") for j in planned.jobs) else 0


QUESTIONS_OWN = ("backends", "world_sizes", "model", "global_batch", "scaling", "optimizer", "clip_grad_norm", "amp",
                 "sweep")
"""compare's flags that each question of --suite questions sets for itself."""


def _answer_questions(console: Console, ns: argparse.Namespace, run_dir: Path) -> int:
    """--suite questions: each question's rows run in turn, then one table per question and compare.json's
    `questions`, with report.md unless --no-report."""
    clashing = sorted(f"--{dest.replace('_', '-')}" for dest in QUESTIONS_OWN if dest in suites.given(ns))
    if clashing:
        raise ValueError(f"{', '.join(clashing)} cannot be given with --suite questions: each question runs the "
                         "backends, world sizes and workload that pose it; drop the flag (or run compare without the "
                         "suite)")
    planned = questions.plan(ns, run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    console.print(f"suite questions: {len(planned.jobs)} runs", highlight=False)
    for u in planned.unavailable:
        console.print(f"[yellow]{u['backend']} unavailable:[/] {u['reason']}")
    _run_all(console, ns, run_dir, planned.jobs)
    answered = questions.answers(planned.jobs)
    figures = {"matrix": matrix.build_matrix([]), "unused_parameter_grads": [], "scaling": [], "skipped_steps": []}
    results.write_atomic(run_dir / "compare.json", summary.payload(ns, run_dir, planned, figures, answered))
    results.point_latest(run_dir)
    render.render_questions(console, answered, planned.unavailable)
    if ns.report:
        from dpcompare.commands import report

        console.print(f"report: {report.build_report(run_dir)}")
    console.print(f"results: {run_dir}")
    return 1 if any(j.status in ("failed", "timeout") for j in planned.jobs) else 0


def _run_all(console: Console, ns: argparse.Namespace, run_dir: Path, jobs: list[plan.Job]) -> None:
    """The microbenchmark, then every job in order, under one progress bar."""
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console, transient=False) as progress:
        task = progress.add_task("compare", total=len(jobs) + 1)
        progress.update(task, description="bench-collectives (microbenchmark)")
        bench_error = execute.run_microbenchmark(ns, run_dir, jobs, ns.timeout_s)
        if bench_error:
            console.print(f"[yellow]{bench_error}[/]")
            execute.drop_collectives(jobs)
        progress.advance(task)
        for job in jobs:
            progress.update(task, description=f"{job.label} ({job.launcher})")
            execute.execute(job, ns.timeout_s)
            progress.advance(task)

