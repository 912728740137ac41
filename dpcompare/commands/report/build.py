"""Building one report: load the inputs, choose the runs to report and their scaling baseline, draw the
plots, assemble report.md from its sections in reading order and write it atomically."""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NamedTuple

from dpcompare.commands.report.derive import (Baseline, Derived, derive, newest_per_backend_world_size,
                                              scaling_baseline, scaling_mode)
from dpcompare.commands.report.load import Inputs, load_inputs
from dpcompare.commands.report.markdown import Footnotes, footnotes_section, plot_md
from dpcompare.commands.report.markdown_cost import cost_sections, microbench_section
from dpcompare.commands.report.markdown_sources import environment_section, inputs_not_used_section, unavailable_section
from dpcompare.commands.report.markdown_questions import questions_section
from dpcompare.commands.report.markdown_sweep import sweep_section
from dpcompare.commands.report.markdown_verdict import state_section, verdict_section
from dpcompare.commands.report.plots_cost import (MODEL_STATE_CAPTION, PLOT_MODEL_STATE, plot_busbw, plot_model_state,
                                                  plot_step_breakdown, plot_throughput)
from dpcompare.commands.report.plots_project import PLOT_PROJECTION, find_projection, plot_projection, projection_caption
from dpcompare.commands.report.plots_verify import plot_heatmap, plot_trajectory_drift, tolerance_floors
from dpcompare.commands.report.plots_trace import PLOT_TRACE, TRACE_CAPTION, plot_trace_timeline
from dpcompare.commands.report.style import (ALL_PLOTS, PLOT_BREAKDOWN, PLOT_BUSBW, PLOT_HEATMAP, PLOT_THROUGHPUT,
                                             PLOT_TRAJECTORY)
from dpcompare.result_view import RunResult
from dpcompare.json_files import write_text_atomic

BREAKDOWN_CAPTION = "Compute = the step with gradient sync switched off; exposed communication = synced - unsynced step."
HEATMAP_CAPTION = (
    "Rows: the run whose reduced gradient is measured; columns: the float64 oracle and every other run. "
    "Values: ||g_row - g_col|| / ||oracle|| in units of that run's float32 noise floor; 0 = bitwise "
    "equal; grey n/a = noise floor of 0, or two runs whose forward draws random numbers at different world "
    "sizes (they drew different dropout masks: the distance would measure randomness, not rounding).")
TRAJECTORY_CAPTION = (
    "Each run's parameter distance to a float64 single process after every verification step, "
    "against the floor (solid: a single process in the run dtype) and the pass tolerance (dashed), "
    "grey when all runs share them, else faint in each run's colour; red rings mark failed steps.")


@dataclass(slots=True)
class Report:
    path: Path
    runs: list[RunResult]
    derived: list[Derived]
    skipped: list[str]


class Plot(NamedTuple):
    name: str
    title: str
    why: str | None
    """Why it was skipped; None when drawn."""
    caption: str


@dataclass(slots=True)
class Selection:
    """What the report is about: the newest run per backend and world size among those that change no knob, the runs
    that change one from their backend's baseline as they recorded it (sweep knobs, other precision recipes, a named
    variant such as `deepspeed:zero2`: each its own row, never a backend's baseline), the scaling baseline, the
    scaling mode and each reported run's derived figures."""
    runs: list[RunResult]
    knob_runs: list[RunResult]
    baseline: Baseline
    scaling: str
    derived: list[Derived]


def _load(in_dir: Path) -> Inputs:
    inputs = load_inputs(in_dir)
    for item in inputs.skipped:
        print(f"dpcompare: warning: skipped {item}", file=sys.stderr, flush=True)
    if not inputs.runs and inputs.compare is None and not inputs.collectives:
        raise ValueError(
            f"{str(in_dir)!r} holds no dpcompare result JSON (searched recursively; {len(inputs.skipped)} file(s) "
            "skipped as malformed): expected run results (*.json with schema_version and backend, from python -m "
            "dpcompare --out DIR), a compare.json (python -m dpcompare compare) or a collectives benchmark")
    return inputs


def select(inputs: Inputs) -> Selection:
    # Runs that change no knob make the tables and plots; those that do (RunResult.knobs) get their own rows.
    runs = newest_per_backend_world_size(r for r in inputs.runs if not r.knobs)
    baseline = scaling_baseline(runs)
    return Selection(runs, [r for r in inputs.runs if r.knobs], baseline, scaling_mode(runs, inputs.compare),
                     [derive(r, baseline) for r in runs])


def _throughput_caption(baseline: Baseline) -> str:
    if baseline.throughput is None:
        return f"No ideal line: {baseline.reason}."
    return (f"Dashed: the scaling baseline's ({baseline.run.label}) samples/s at world size 1 times N; "
            "right: scaling efficiency.")


def _busbw_plot(inputs: Inputs, runs: list[RunResult], link_peak_gbps: float | None, out_dir: Path) -> Plot:
    why, sentence = plot_busbw(inputs.collectives, runs, link_peak_gbps, out_dir / PLOT_BUSBW)
    unplaced = [r.label for r in runs if r.metrics.busbw_gbps.value and not r.metrics.bucket_bytes.value]
    if unplaced:
        sentence += f" Not placed (busbw without bucket_bytes): {', '.join(unplaced)}."
    return Plot(PLOT_BUSBW, "Bus bandwidth vs message size", why, sentence)


def draw_plots(inputs: Inputs, sel: Selection, link_peak_gbps: float | None, out_dir: Path) -> tuple[list[Plot], Plot]:
    """(the plots for the Plots section, the trajectory drift plot shown beside the verdict)."""
    for name in (*ALL_PLOTS, PLOT_MODEL_STATE, PLOT_TRACE):
        (out_dir / name).unlink(missing_ok=True)  # a skipped plot must not leave a stale one behind
    runs = sel.runs
    plots = [
        Plot(PLOT_THROUGHPUT, "Throughput vs world size",
             plot_throughput(runs, sel.baseline.throughput, sel.scaling, out_dir / PLOT_THROUGHPUT),
             _throughput_caption(sel.baseline)),
        Plot(PLOT_BREAKDOWN, "Step time breakdown", plot_step_breakdown(runs, out_dir / PLOT_BREAKDOWN),
             BREAKDOWN_CAPTION),
        _busbw_plot(inputs, runs, link_peak_gbps, out_dir),
        Plot(PLOT_HEATMAP, "Gradient error matrix", plot_heatmap(inputs.compare, out_dir / PLOT_HEATMAP,
                                                                     tolerance_floors(runs)),
             HEATMAP_CAPTION),
        Plot(PLOT_MODEL_STATE, "Model state per component",
             plot_model_state([*runs, *sel.knob_runs], out_dir / PLOT_MODEL_STATE), MODEL_STATE_CAPTION),
        Plot(PLOT_TRACE, "Traced steps, rank by rank", plot_trace_timeline([*runs, *sel.knob_runs], out_dir / PLOT_TRACE),
             TRACE_CAPTION),
    ]
    drift = Plot(PLOT_TRAJECTORY, "Trajectory drift", plot_trajectory_drift(runs, out_dir / PLOT_TRAJECTORY),
                 TRAJECTORY_CAPTION)
    return plots, drift


def _header(in_dir: Path, inputs: Inputs, sel: Selection) -> list[str]:
    stamps = [r.created_unix for r in inputs.runs if r.created_unix > -math.inf]
    span = (f"; runs from {time.strftime('%Y-%m-%d %H:%M', time.localtime(min(stamps)))} to "
            f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(max(stamps)))}" if stamps else "")
    superseded = len(inputs.runs) - len(sel.runs) - len(sel.knob_runs)
    lines = ["# dpcompare report", "",
             f"Generated {time.strftime('%Y-%m-%d %H:%M:%S %Z')} from `{in_dir}`" + span + ".", "",
             f"{len(sel.runs)} run(s) reported ({superseded} older result(s) for the same "
             f"backend and world size superseded by newer ones, {len(sel.knob_runs)} run(s) with a knob changed: sweep "
             f"knobs, other precision recipes, backend variants such as ZeRO stages), scaling: "
             f"{sel.scaling}, {len(inputs.collectives)} microbenchmark curve(s), "
             f"{'a' if inputs.compare else 'no'} compare summary.", ""]
    batch: tuple[Callable[[RunResult], Any], str] = (
        ((lambda r: r.local_batch), "per-rank batches") if sel.scaling == "weak"
        else ((lambda r: r.global_batch), "global batches"))
    for read, what in (((lambda r: r.model), "models"), batch):
        seen = sorted({str(read(r)) for r in sel.runs})
        if len(seen) > 1:
            lines += [f"**Note:** the runs mix {what} ({', '.join(seen)}): their costs are not directly comparable.", ""]
    return lines


def compose(in_dir: Path, inputs: Inputs, sel: Selection, plots: list[Plot], drift: Plot | None) -> list[str]:
    """report.md line by line; the footnotes are numbered in the order the sections are built."""
    notes = Footnotes()
    lines = _header(in_dir, inputs, sel)
    if (inputs.compare or {}).get("questions"):
        # compare --suite questions: each run poses one question on its own workload; the tables of one
        # computation compared across backends do not apply.
        asked = inputs.compare["questions"]
        lines[4] = (f"{sum(len(q['rows']) for q in asked)} run(s) posing {len(asked)} question(s) "
                    "(compare --suite questions).")
        return [*lines[:6], *questions_section(inputs.compare), *unavailable_section(inputs.compare),
                *inputs_not_used_section(inputs.skipped, inputs.ignored)]
    if sel.runs:
        lines += ["## Environment", "", *environment_section(sel.runs)]
        lines += ["## Is it the same computation?", "", *verdict_section(sel.runs, inputs.compare, notes), ""]
        lines += plot_md(*drift)
        lines += state_section([*sel.runs, *sel.knob_runs])
    lines += unavailable_section(inputs.compare)
    lines += ["## What does it cost?", ""]
    lines += (cost_sections(sel.runs, sel.derived, notes, sel.knob_runs) if sel.runs
              else ["No run results: nothing to cost.", ""])
    lines += sweep_section(sel.knob_runs)
    lines += microbench_section(inputs.collectives, inputs.unavailable_transports)
    lines += ["## Plots", ""]
    for plot in plots:
        lines += plot_md(*plot)
    lines += inputs_not_used_section(inputs.skipped, inputs.ignored)
    lines += footnotes_section(notes)
    return lines


def write_report(in_dir: Path, out_dir: Path | None, link_peak_gbps: float | None) -> Report:
    if link_peak_gbps is not None and not link_peak_gbps > 0:
        raise ValueError(f"--link-peak-gbps must be a positive number of GB/s, got {link_peak_gbps}")
    inputs = _load(in_dir)
    out_dir = in_dir if out_dir is None else out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    sel = select(inputs)
    if (inputs.compare or {}).get("questions"):
        for name in (*ALL_PLOTS, PLOT_MODEL_STATE, PLOT_PROJECTION, PLOT_TRACE):
            (out_dir / name).unlink(missing_ok=True)  # the questions' report has no plots: none stale either
        path = write_text_atomic(out_dir / "report.md", "\n".join(compose(in_dir, inputs, sel, [], None)))
        return Report(path, sel.runs, sel.derived, inputs.skipped)
    plots, drift = draw_plots(inputs, sel, link_peak_gbps, out_dir)
    projection = find_projection(in_dir)  # python -m dpcompare project wrote one: draw it with the measured points
    (out_dir / PLOT_PROJECTION).unlink(missing_ok=True)
    if projection is not None:
        plots.append(Plot(PLOT_PROJECTION, "Projected scaling", plot_projection(projection, out_dir / PLOT_PROJECTION),
                          projection_caption(projection)))
    path = write_text_atomic(out_dir / "report.md", "\n".join(compose(in_dir, inputs, sel, plots, drift)))
    return Report(path, sel.runs, sel.derived, inputs.skipped)
