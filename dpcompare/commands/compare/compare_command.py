"""The `compare` command: its flags (the run flags it forwards come from RunConfig's declarations; a --suite preset
fills those not given), parsed once into a CompareSpec, and one compare from the plan to the printed tables: every
job run under one progress bar after the microbenchmark, the cross-run figures, compare.json, and report.md with its
plots unless --no-report."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from dpcompare import json_files
from dpcompare.commands.checkpoint import checkpoint_command as checkpoint
from dpcompare.commands.compare import compare_json, compare_output, execute, matrix, plan, questions, suites
from dpcompare.commands.compare.spec import CompareSpec, parse
from dpcompare.run import flags, registry
from dpcompare.run.config import COMPARE_GLOBAL_BATCH_TARGET, RunConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    suites.record_given(p)  # a flag given beside --suite wins over the preset, even at its default value
    p.add_argument("--suite", choices=tuple(suites.SUITES), default=None, help=suites.help_text())
    p.add_argument("--backends", default=",".join(registry.BACKENDS),
                   help="comma-separated backends; BACKEND:VARIANT runs a variant its adapter declares (its VARIANTS, "
                        "e.g. deepspeed:zero2 for --opt zero_stage=2) as a backend of its own; package.module:Class a "
                        "backend of your own")
    p.add_argument("--world-sizes", default="1,2", help="comma-separated world sizes for multi-process backends")
    flags.add_arguments(p, RunConfig, for_compare=True)  # the run flags compare forwards to every run
    # compare's own flags; --collectives, --out and --timeout-s say what they say for compare, not for one run.
    p.add_argument("--collectives", default="auto",
                   help="bench-collectives JSON to quote busbw from; 'auto' runs a short one first; 'none' skips")
    p.add_argument("--sweep", action="store_true",
                   help="also vary one knob at a time at the largest world size: bucket size, accumulation, compression")
    p.add_argument("--sweep-bucket-mb", default="0.01,25", help="bucket sizes (MiB) for --sweep")
    p.add_argument("--sweep-accum", default="4", help="gradient accumulation steps for --sweep")
    p.add_argument("--sweep-compression", default="fp16", help="compressions for --sweep")
    p.add_argument("--both-normalisations", action="store_true",
                   help="run every cell twice, side by side: --loss-normalisation local and global (a loss over items: "
                        "each rank's own count, and the step's count all-reduced first)")
    p.add_argument("--no-report", dest="report", action="store_false", help="skip report.md and the plots")
    p.add_argument("--out", default="results", help="directory; each compare writes OUT/<timestamp>/")
    p.add_argument("--timeout-s", type=float, default=600.0,
                   help="seconds per launch before its whole process tree is killed")
    p.add_argument("--run-arg", action="append", default=[], metavar="ARG",
                   help="extra argument passed to every run (repeat: --run-arg=--sync-bn)")


def main(ns: argparse.Namespace) -> int:
    if ns.suite is not None and suites.SUITES[ns.suite].checkpoint:
        try:
            moved = checkpoint.from_compare(ns, suites.given(ns))
        except ValueError as exc:
            print(f"dpcompare compare: error: {exc}", file=sys.stderr)
            return 2
        return checkpoint.main(moved)
    spec = parse(ns)
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)  # logs and CI: wide enough for the matrix, no wrapped numbers
    run_dir = Path(spec.out) / time.strftime("%Y%m%d-%H%M%S")
    if spec.questions:
        return _answer_questions(console, spec, run_dir)
    planned = plan.plan(spec, run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if spec.picked_global_batch and spec.global_batch != COMPARE_GLOBAL_BATCH_TARGET:
        console.print(f"global batch {spec.global_batch}: the smallest multiple of every world size at least "
                      f"{COMPARE_GLOBAL_BATCH_TARGET} (--global-batch sets it)")
    if spec.suite:
        console.print(f"suite {spec.suite}: {', '.join(j.label for j in planned.jobs)} (--model {spec.run.model} "
                      f"--optimizer {spec.run.optimizer} --global-batch {spec.global_batch})", highlight=False)
    for u in planned.unavailable:
        console.print(f"[yellow]{u['backend']} unavailable:[/] {u['reason']}")
    _run_all(console, spec, run_dir, planned.jobs)

    baseline = [j for j in planned.jobs if j.knob == "baseline"]
    # The same config: the baseline runs and other precision recipes (deepspeed's engine), not the sweep's knobs.
    same_config = [j.result for j in planned.jobs
                   if j.result and (j.knob == "baseline" or plan.is_amp_recipe(j.knob))]
    figures = {"matrix": matrix.build_matrix(baseline), "unused_parameter_grads": matrix.unused_parameter_grads(baseline),
               "scaling": matrix.scaling_rows(planned.jobs, spec.run.scaling),
               "skipped_steps": matrix.skipped_steps(same_config)}
    json_files.write_atomic(run_dir / "compare.json", compare_json.payload(spec, run_dir, planned, figures))
    json_files.point_latest(run_dir)
    compare_output.render(console, baseline, planned.unavailable, figures["matrix"], figures["unused_parameter_grads"],
                  figures["skipped_steps"])
    compare_output.render_cost(console, baseline, figures["scaling"])
    compare_output.render_state(console, [j for j in planned.jobs if j.knob == "baseline" or plan.is_amp_recipe(j.knob)])
    knobs = [j for j in planned.jobs if j.knob != "baseline"]
    if knobs or planned.sweep_skipped:
        compare_output.render_sweep(console, knobs, planned.sweep_skipped)
    return _finish(console, spec, run_dir, planned.jobs)


def _answer_questions(console: Console, spec: CompareSpec, run_dir: Path) -> int:
    """--suite questions: each question's rows run in turn, then one table per question and compare.json's
    `questions`, with report.md unless --no-report."""
    planned = questions.plan(spec, run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    console.print(f"suite questions: {len(planned.jobs)} runs", highlight=False)
    for u in planned.unavailable:
        console.print(f"[yellow]{u['backend']} unavailable:[/] {u['reason']}")
    _run_all(console, spec, run_dir, planned.jobs)
    answered = questions.answers(planned.jobs)
    figures = {"matrix": matrix.build_matrix([]), "unused_parameter_grads": [], "scaling": [], "skipped_steps": []}
    json_files.write_atomic(run_dir / "compare.json", compare_json.payload(spec, run_dir, planned, figures, answered))
    json_files.point_latest(run_dir)
    compare_output.render_questions(console, answered, planned.unavailable)
    return _finish(console, spec, run_dir, planned.jobs)


def _finish(console: Console, spec: CompareSpec, run_dir: Path, jobs: list[plan.Job]) -> int:
    """report.md unless --no-report, where the results are, and the exit status: 1 when a launch failed."""
    if spec.report:
        from dpcompare.commands import report

        console.print(f"report: {report.build_report(run_dir)}")
    console.print(f"results: {run_dir}")
    return 1 if any(j.status in ("failed", "timeout") for j in jobs) else 0


def _run_all(console: Console, spec: CompareSpec, run_dir: Path, jobs: list[plan.Job]) -> None:
    """The microbenchmark, then every job in order, under one progress bar."""
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console, transient=False) as progress:
        task = progress.add_task("compare", total=len(jobs) + 1)
        progress.update(task, description="bench-collectives (microbenchmark)")
        bench_error = execute.run_microbenchmark(spec, run_dir, jobs, spec.timeout_s)
        if bench_error:
            console.print(f"[yellow]{bench_error}[/]")
            execute.drop_collectives(jobs)
        progress.advance(task)
        for job in jobs:
            progress.update(task, description=f"{job.label} ({job.launcher})")
            execute.execute(job, spec.timeout_s)
            progress.advance(task)

