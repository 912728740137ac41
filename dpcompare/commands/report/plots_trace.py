"""The traced steps of a profiled run, rank by rank (trace_timeline.png): the step's phases on the thread that ran it,
the collectives in flight beside them, and the exposed communication read from them (dpcompare.measure.trace)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from matplotlib.patches import Patch

from dpcompare.commands.report.style import save
from dpcompare.measure import trace
from dpcompare.result_view import RunResult

PLOT_TRACE = "trace_timeline.png"
TRACE_CAPTION = (
    "The traced steps of the newest run recorded with --profile, one pair of lanes per rank on one clock: the step's "
    "phases (dpcompare.forward, .backward, .reduce, .optimizer_step) on the thread that ran it, and below them the "
    "collectives in flight (the process group's work, the c10d ops; on CUDA the NCCL kernels). Each rank's exposed "
    "communication read from its trace is in its lane's label. Open a rank's JSON in ui.perfetto.dev for every op.")
_PHASES = (("dpcompare.forward", "forward", "#4C72B0"), ("dpcompare.backward", "backward", "#DD8452"),
           ("dpcompare.reduce", "reduce", "#55A868"), ("dpcompare.optimizer_step", "optimizer step", "#8172B3"))
_COMM = "#C44E52"


def _events(path: str) -> list[dict[str, Any]] | None:
    try:
        return [e for e in json.loads(Path(path).read_text()).get("traceEvents", []) if e.get("ph") == "X" and "ts" in e]
    except (OSError, ValueError, AttributeError):
        return None


def _profiled(runs: list[RunResult]) -> tuple[RunResult | None, list[list[dict[str, Any]]], str]:
    """The newest run whose every trace can be read, its ranks' events, else why none."""
    profiled = [r for r in runs if isinstance(r.metrics.profile.value, dict)]
    if not profiled:
        return None, [], "no run was traced (run or compare with --profile)"
    for run in sorted(profiled, key=lambda r: r.created_unix, reverse=True):
        paths = run.metrics.profile.value.get("traces") or []
        ranks = [_events(str(p)) for p in paths]
        if ranks and all(r is not None for r in ranks):
            return run, [r for r in ranks if r is not None], ""
    return None, [], "the traces the profiled runs list cannot be read here (moved, or written on another host)"


def plot_trace_timeline(runs: list[RunResult], path: Path) -> str | None:
    """Draw the newest profiled run's traced steps rank by rank. Returns why it was skipped, or None when drawn."""
    run, ranks, why = _profiled(runs)
    if run is None:
        return why
    steps = [[e for e in events if trace.STEP.match(str(e.get("name", "")))] for events in ranks]
    if not all(steps):
        return f"{run.label}: a trace holds no dpcompare.step range"
    zero = min(float(e["ts"]) for s in steps for e in s)
    fig = Figure(figsize=(10.0, 1.2 + 0.9 * len(ranks)), layout="constrained")
    ax = fig.add_subplot()
    labels = []
    for rank, (events, own) in enumerate(zip(ranks, steps)):
        y = 2 * (len(ranks) - 1 - rank)
        main = own[0].get("tid")
        lo, hi = min(float(e["ts"]) for e in own), max(float(e["ts"]) + float(e.get("dur", 0)) for e in own)
        for name, _, colour in _PHASES:
            spans = [((float(e["ts"]) - zero) / 1e3, float(e.get("dur", 0)) / 1e3) for e in events
                     if e.get("name") == name and e.get("tid") == main]
            ax.broken_barh(spans, (y + 1.05, 0.8), color=colour)
        kernels = any(e.get("cat") == "kernel" for e in events)
        comm = [((float(e["ts"]) - zero) / 1e3, float(e.get("dur", 0)) / 1e3) for e in events
                if trace.is_comm(str(e.get("name", ""))) and (not kernels or e.get("cat") == "kernel")
                and lo <= float(e["ts"]) <= hi]
        ax.broken_barh(comm, (y + 0.15, 0.8), color=_COMM)
        figure = trace.rank_figure(trace.per_step(events))
        exposed = f", exposed {figure['exposed_ms']:.2f} ms/step" if figure else ""
        labels += [(y + 0.55, f"rank {rank} comm{exposed}"), (y + 1.45, f"rank {rank} step")]
    ax.set_yticks([t for t, _ in labels], [text for _, text in labels])
    ax.set_xlabel("ms from the first traced step's start")
    twins = any(trace.UNSYNCED.match(str(e.get("name", ""))) for e in ranks[0])
    ax.set_title(f"{run.label}: {len(steps[0])} traced step(s)"
                 + (", each followed by its unsynced twin (no collective)" if twins else ""))
    ax.legend(handles=[*(Patch(color=c, label=label) for _, label, c in _PHASES), Patch(color=_COMM, label="collective")],
              loc="upper center", bbox_to_anchor=(0.5, -0.25 if len(ranks) < 3 else -0.12), ncol=5, frameon=False)
    save(fig, path)
    return None
