"""The `report` command: its flags, building the report from a directory's JSON (build_report, also what compare
calls), and the console summary of the reported runs."""

from __future__ import annotations

import argparse
from pathlib import Path

from dpcompare import verdict_words as words
from dpcompare.commands.report.build import write_report
from dpcompare.commands.report.derive import num


def build_report(in_dir: Path, out_dir: Path | None = None, *, link_peak_gbps: float | None = None) -> Path:
    """Write out_dir/report.md (default: in_dir) and its PNGs from the JSON under in_dir; return its path."""
    return write_report(Path(in_dir), None if out_dir is None else Path(out_dir), link_peak_gbps).path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", help="directory searched recursively for dpcompare JSON (run results, compare.json, "
                               "collectives benchmarks)")
    p.add_argument("--out", default=None, help="directory for report.md and the PNGs (default: DIR)")
    p.add_argument("--link-peak-gbps", type=float, default=None,
                   help="the link's nominal bus bandwidth in GB/s, drawn on the busbw plot "
                        "(default: the best busbw any microbenchmark reached)")


def main(ns: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    report = write_report(Path(ns.dir), None if ns.out is None else Path(ns.out), ns.link_peak_gbps)
    console = Console()
    if report.runs:
        table = Table(title="dpcompare report")
        for col in ("backend", "ws", "verdict", "samples/s", "scaling eff.", "step p50 (ms)"):
            table.add_column(col, justify="left" if col in ("backend", "verdict") else "right", no_wrap=True)
        for run, d in zip(report.runs, report.derived):
            verdict = run.equivalence.verdict or "n/a"
            samples, step = run.metrics.samples_per_s.value, run.metrics.step_ms_p50.value
            table.add_row(run.backend, str(run.world_size), f"[{words.STYLE.get(verdict, 'yellow')}]{verdict}[/]",
                          "n/a" if samples is None else num(samples),
                          "n/a" if d.efficiency is None else f"{d.efficiency:.2f}",
                          "n/a" if step is None else num(step))
        console.print(table)
    console.print(f"report: {report.path}", highlight=False, soft_wrap=True)
    return 0
