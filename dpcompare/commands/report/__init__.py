"""report: Markdown and PNG plots built from dpcompare's JSON files only.

`python -m dpcompare report DIR` reads, recursively under DIR, every run result (a JSON object with
schema_version and backend), at most one compare summary (kind: compare) and any number of collective
microbenchmarks (kind: collectives), and writes into OUT (default: DIR):

  report.md                      environment, verdict table, cost tables (every n/a with its reason)
  throughput_vs_world_size.png   samples/s per backend against the ideal line from the scaling baseline
  step_breakdown.png             compute / exposed communication / other time of a step
  busbw_vs_message_size.png      microbenchmark bus bandwidth by message size and what training reached
  grad_error_heatmap.png         the compare matrix: gradient distances in float32 noise floors
  trajectory_drift.png           each run's parameter distance to the float64 trajectory by step, with floor and tolerance
  trace_timeline.png             the newest --profile run's traced steps rank by rank: phases, collectives, exposed

Where several results exist for one backend and world size, the newest (created_unix) is reported.
A plot whose inputs are absent is skipped, and report.md says why.

The scaling baseline is the newest run at world size 1 whose result declares
capabilities.scaling_baseline (the reference backend does).

Owns: finding and classifying result JSON (load; each run read through dpcompare.result_view, whose recorded facts
it takes as written: the knobs that make a run a row of its own, the floors, the power), the derived figures such as
scaling efficiency and the unattributed rest of a step (derive), the plots (style, plots_cost, plots_verify, plots_trace), the
Markdown sections (markdown) and putting them together (build). Imports no adapter and no torch: past results can be
re-reported on a machine without the backends.
"""

from __future__ import annotations

from dpcompare.commands.report.build import Report
from dpcompare.commands.report.report_command import add_arguments, build_report, main
from dpcompare.commands.report.derive import (Baseline, Derived, derive, format_bytes, newest_per_backend_world_size,
                                              scaling_baseline)
from dpcompare.commands.report.load import Inputs, load_inputs
from dpcompare.commands.report.markdown import Footnotes
from dpcompare.commands.report.plots_cost import plot_busbw, plot_step_breakdown, plot_throughput
from dpcompare.commands.report.plots_verify import Panel, matrix_panels, plot_heatmap, plot_trajectory_drift
from dpcompare.commands.report.style import (PLOT_BREAKDOWN, PLOT_BUSBW, PLOT_HEATMAP, PLOT_THROUGHPUT,
                                             PLOT_TRAJECTORY)

__all__ = ["PLOT_BREAKDOWN", "PLOT_BUSBW", "PLOT_HEATMAP", "PLOT_THROUGHPUT", "PLOT_TRAJECTORY", "Baseline", "Derived",
           "Footnotes", "Inputs", "Panel", "Report", "add_arguments", "build_report", "derive", "format_bytes",
           "load_inputs", "main", "matrix_panels", "newest_per_backend_world_size", "plot_busbw",
           "plot_heatmap", "plot_step_breakdown", "plot_throughput", "plot_trajectory_drift", "scaling_baseline"]
