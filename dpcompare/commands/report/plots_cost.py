"""The cost plots: throughput and scaling efficiency against world size, where a step's time goes, bus
bandwidth by message size (microbenchmark curves with the training runs placed at their bucket size), and the model
state per component against the ZeRO paper's formula.
Each plot function draws its PNG and returns None, or returns why it was skipped and draws nothing."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

from dpcompare.commands.report.derive import STEP_PARTS, format_bytes, step_parts
from dpcompare.commands.report.style import TRAINING_MARKERS, colour, marker, save
from dpcompare.measure import consistency
from dpcompare.measure.scaling import other_ms, scaling_efficiency
from dpcompare.result_view import RunResult


# -- throughput ------------------------------------------------------------------------------------------
def _throughput_series(runs: list[RunResult]) -> dict[str, list[tuple[int, float]]]:
    series: dict[str, list[tuple[int, float]]] = {}
    for run in runs:
        samples = run.metrics.samples_per_s.value
        if samples is not None:
            series.setdefault(run.backend, []).append((run.world_size, samples))
    for points in series.values():
        points.sort()
    return series


def _draw_throughput(axes: list[Axes], series: dict[str, list[tuple[int, float]]], baseline: float | None,
                     sizes: list[int], ideal: str) -> float:
    """The ideal line and one line per backend; returns the largest efficiency drawn (at least 1)."""
    if baseline is not None:
        axes[0].plot(sizes, [baseline * n for n in sizes], "--", color="black", linewidth=1.2, label=ideal)
        axes[1].axhline(1.0, linestyle="--", color="black", linewidth=1.2, label=ideal)
    best_eff = 1.0
    for backend, points in series.items():
        xs, ys = zip(*points)
        style = dict(color=colour(backend), marker=marker(backend), markersize=7, label=backend)
        axes[0].plot(xs, ys, "-", **style)
        if baseline is not None:
            effs = [scaling_efficiency(y, x, baseline) for x, y in points]
            axes[1].plot(xs, effs, "-", **style)
            best_eff = max(best_eff, *effs)
    return best_eff


def world_size_axes(axes: list[Axes], sizes: list[int], legend: bool = True) -> None:
    """World sizes on the x axis (log 2 from a 16x span), each size a tick; a legend on each axis unless told not."""
    for ax in axes:
        if sizes[-1] / sizes[0] >= 16:
            ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(FixedLocator(sizes))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _pos: f"{x:g}"))
        ax.set_xlabel("world size (processes)")
        ax.grid(True, alpha=0.3)
        if legend:
            ax.legend(fontsize=8)


def plot_throughput(runs: list[RunResult], baseline_throughput: float | None, scaling: str,
                    path: Path) -> str | None:
    """samples/s against world size per backend with the ideal line N x the scaling baseline's samples/s,
    and beside it the scaling efficiency when the baseline is known. Returns why it was skipped, or None
    when drawn."""
    series = _throughput_series(runs)
    if not series:
        return "no run recorded samples_per_s (see the n/a reasons in the cost table)"
    panels = 2 if baseline_throughput is not None else 1
    fig = Figure(figsize=(6.5 * panels, 4.8), layout="constrained")
    axes = list(fig.subplots(1, panels, squeeze=False)[0])
    sizes = sorted({ws for points in series.values() for ws, _ in points} | {1})
    ideal = f"ideal ({scaling} scaling)" if scaling in ("strong", "weak") else "ideal (N x baseline)"
    best_eff = _draw_throughput(axes, series, baseline_throughput, sizes, ideal)
    world_size_axes(axes, sizes)
    axes[0].set_ylim(bottom=0)
    axes[0].set_ylabel("throughput (samples/s)")
    axes[0].set_title("Throughput vs world size")
    if panels == 2:
        axes[1].set_ylim(0, best_eff * 1.1)
        axes[1].yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:.0%}"))
        axes[1].set_ylabel("scaling efficiency (samples/s / (N x baseline))")
        axes[1].set_title("Scaling efficiency vs world size")
    save(fig, path)
    return None


# -- step breakdown ---------------------------------------------------------------------------------------
_PART_NAMES = {"compute": "compute (sync off)", "exposed": "exposed communication",
               "other": "other (counters, drift: see report.md)", "unknown": "n/a (not attributed)"}


def _draw_step(ax: Axes, y: int, parts: tuple[float | None, ...], labelled: set[str]) -> tuple[float, list[str]]:
    """One stacked bar; returns where it ends and what to say about its missing parts."""
    step, compute, exposed = parts

    def bar(left: float, width: float, key: str, **style: Any) -> None:
        ax.barh(y, width, left=left, height=0.6, label=None if key in labelled else _PART_NAMES[key], **style)
        labelled.add(key)

    left = 0.0
    if compute is not None:
        bar(left, compute, "compute", color="#4C72B0")
        left += compute
    if exposed is not None:
        bar(left, exposed, "exposed", color="#DD8452")
        left += exposed
    other = other_ms(step, compute, exposed)
    notes = []
    if other is not None:
        bar(left, other, "other", color="#A0A0A0")
    elif step is not None:
        bar(left, max(step - left, 0.0), "unknown", color="white", edgecolor="#555555", hatch="//")
        notes.append("n/a: " + ", ".join(f.name.replace("_ms_p50", "").replace("comm_exposed_ms", "exposed comm")
                                          for f, v in zip(STEP_PARTS[1:], (compute, exposed)) if v is None))
    else:
        notes.append("step time n/a")
    return max(left, step or 0.0), notes


def _part_legend(fig: Figure, ax: Axes) -> None:
    handles, names = ax.get_legend_handles_labels()
    order = sorted(range(len(names)), key=lambda i: ["compute", "exposed", "other", "n/a"].index(names[i].split()[0]))
    fig.legend([handles[i] for i in order], [names[i] for i in order], loc="outside lower center",
               ncol=len(order), fontsize=8, frameon=False)


def plot_step_breakdown(runs: list[RunResult], path: Path) -> str | None:
    """Stacked horizontal bars: compute, exposed communication, other; the unattributed rest of a step
    whose parts are unknown is hatched and the missing parts are named."""
    rows = [(run, tuple(part.value for part in step_parts(run))) for run in runs]
    rows = [r for r in rows if any(v is not None for v in r[1])]
    if not rows:
        return f"no run recorded {', '.join(f.name for f in STEP_PARTS[:-1])} or {STEP_PARTS[-1].name}"
    fig = Figure(figsize=(8.5, 1.6 + 0.55 * len(rows)), layout="constrained")
    ax = fig.add_subplot()
    labelled: set[str] = set()
    longest = max(max(v for v in parts if v is not None) for _, parts in rows)
    for y, (run, parts) in enumerate(reversed(rows)):
        end, notes = _draw_step(ax, y, parts, labelled)
        if consistency.breakdown_flag(run.metrics):
            notes.append("(!) compute + exposed > step: the machine was slower during the ablation")
        step = parts[0]
        text = (f"{step:.3g} ms" if step is not None else "") + ("  " + "; ".join(notes) if notes else "")
        ax.text(end + longest * 0.01, y, text.strip(), va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), [r[0].label for r in reversed(rows)])
    ax.set_xlim(0, longest * 1.45)
    ax.set_xlabel("time per step, p50 (ms)")
    ax.set_title("Where a step's time goes (p50 of each part)")
    ax.grid(True, axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    _part_legend(fig, ax)
    save(fig, path)
    return None


# -- bus bandwidth -----------------------------------------------------------------------------------------
def _log2_ticks(lo: float, hi: float, most: int = 10) -> list[float]:
    first, last = math.floor(math.log2(lo)), math.ceil(math.log2(hi))
    stride = max(1, math.ceil((last - first + 1) / most))
    return [2.0**e for e in range(first, last + 1, stride)]


def _draw_microbench(ax: Axes, entries: list[dict[str, Any]], xs_all: list[float], ys_all: list[float]) -> float:
    """One curve per microbenchmark entry, wrong results crossed in red; returns the best correct busbw."""
    best, wrong_labelled = 0.0, False
    for entry in entries:
        points = sorted((s["bytes"], s["busbw_gbps"], s.get("correct", True)) for s in entry["sizes"]
                        if s.get("bytes") and s.get("busbw_gbps") is not None and s["busbw_gbps"] > 0)
        if not points:
            continue
        xs, ys, ok = zip(*points)
        transport, backend = entry.get("transport") or "?", entry.get("backend")
        name = (f"{transport}/{backend}" if backend and backend != transport else transport) \
            + f" N={entry['world_size']} (microbenchmark)"
        ax.plot(xs, ys, "-o", markersize=4, label=name)
        bad = [(x, y) for x, y, c in points if c is False]
        if bad:
            ax.scatter(*zip(*bad), marker="x", s=70, color="red", zorder=5,
                       label=None if wrong_labelled else "wrong result (correct: false)")
            wrong_labelled = True
        best = max(best, max(y for y, c in zip(ys, ok) if c is not False) if any(c is not False for c in ok) else 0.0)
        xs_all += xs
        ys_all += ys
    return best


def _draw_training(ax: Axes, runs: list[RunResult], xs_all: list[float], ys_all: list[float]) -> None:
    for i, run in enumerate(runs):
        bucket, busbw = run.metrics.bucket_bytes.value, run.metrics.busbw_gbps.value
        if bucket and busbw:
            ax.scatter([bucket], [busbw], marker=TRAINING_MARKERS[i % len(TRAINING_MARKERS)], s=140,
                       color=colour(run.backend), edgecolor="black", zorder=6, label=f"{run.label} in training")
            xs_all.append(bucket)
            ys_all.append(busbw)


def _peak_line(link_peak_gbps: float | None, best: float) -> tuple[float | None, str, str]:
    """(the peak to draw or None, its legend label, the sentence for report.md)."""
    if link_peak_gbps is not None:
        return (link_peak_gbps, f"link peak (given): {link_peak_gbps:g} GB/s",
                f"The dashed line is the link peak given with --link-peak-gbps: {link_peak_gbps:g} GB/s.")
    if best > 0:
        return (best, f"best observed (microbenchmark): {best:.3g} GB/s",
                f"The dashed line is the best bus bandwidth any microbenchmark reached ({best:.3g} GB/s), not the "
                "link's nominal peak: pass --link-peak-gbps to draw that instead.")
    return None, "", "No peak line: no microbenchmark size gave a correct result."


def _busbw_axes(ax: Axes, xs_all: list[float], ys_all: list[float]) -> None:
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(_log2_ticks(min(xs_all), max(xs_all))))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _pos: format_bytes(x)))
    log_y = max(ys_all) / min(ys_all) > 100
    if log_y:
        ax.set_yscale("log")
    else:
        ax.set_ylim(bottom=0, top=max(ys_all) * 1.1)
    ax.set_xlabel("message size (bytes, log2 scale)")
    ax.set_ylabel("bus bandwidth (GB/s" + (", log scale)" if log_y else ")"))
    ax.set_title("All-reduce bus bandwidth vs message size")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="best")


def plot_busbw(entries: list[dict[str, Any]], runs: list[RunResult], link_peak_gbps: float | None,
               path: Path) -> tuple[str | None, str]:
    """Microbenchmark busbw by message size, training points at their bucket size, and a peak line.
    Returns (why skipped or None, a sentence about the peak line)."""
    if not entries:
        return ("no collectives microbenchmark (JSON with kind: collectives) under the directory: run "
                "python -m dpcompare bench-collectives and put its JSON beside the results"), ""
    fig = Figure(figsize=(8.5, 5.2), layout="constrained")
    ax = fig.add_subplot()
    xs_all: list[float] = []
    ys_all: list[float] = []
    best = _draw_microbench(ax, entries, xs_all, ys_all)
    _draw_training(ax, runs, xs_all, ys_all)
    if not xs_all:
        return "the collectives files hold no size with a positive busbw_gbps", ""
    peak, peak_label, sentence = _peak_line(link_peak_gbps, best)
    if peak is not None:
        ax.axhline(peak, linestyle="--", color="black", linewidth=1.2, label=peak_label)
        ys_all.append(peak)
    _busbw_axes(ax, xs_all, ys_all)
    save(fig, path)
    return None, sentence


# -- model state -------------------------------------------------------------------------------------------
PLOT_MODEL_STATE = "model_state.png"
MODEL_STATE_CAPTION = (
    "Rank 0's model state per component, measured after the reduce of the last measured step (the tensors the backend "
    "lists, each storage byte once; hatched comm buffers are the backend's analytic figure), one bar per backend and "
    "knob; the hollow black bar and its tick mark the ZeRO paper's formula total for the same model, precision, "
    "optimizer and stage (it leaves out comm buffers and any fp32 copy a backend keeps beyond it).")
_STATE_PARTS = (("params", "parameters", "#4C72B0"), ("grads", "gradients", "#DD8452"),
                ("optimizer", "optimizer state", "#55A868"), ("master_params", "fp32 master copies", "#C44E52"),
                ("comm_buffers", "comm buffers", "#8172B3"))


def _rank0_state(run: RunResult) -> dict[str, Any] | None:
    """Rank 0's census (model_state_mib_per_rank[0]), else model_state_mib (older results: the analytic figure)."""
    ranks = run.metrics.model_state_mib_per_rank.value
    if ranks and isinstance(ranks[0], dict):
        return ranks[0]
    return run.metrics.model_state_mib.value


def _formula_total_bytes(run: RunResult) -> float | None:
    formula = run.metrics.model_state_formula_mib.value
    total = formula.get("total") if formula is not None else None
    return total * 2**20 if isinstance(total, (int, float)) and not isinstance(total, bool) else None


def _draw_state(ax: Axes, y: int, state: dict[str, Any], labelled: set[str]) -> float:
    """One stacked bar of the components (bytes); returns where it ends."""
    left = 0.0
    analytic = str(state.get("comm_buffers_method", "")).startswith("analytic")
    for key, name, colour_ in _STATE_PARTS:
        value = state.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            continue
        width = value * 2**20
        hatch = "//" if key == "comm_buffers" and analytic else None
        shown = name + (" (analytic where hatched)" if key == "comm_buffers" else "")
        ax.barh(y, width, left=left, height=0.6, color=colour_, hatch=hatch, edgecolor="white" if hatch else None,
                label=None if key in labelled else shown)
        labelled.add(key)
        left += width
    return left


CLIP_FACTOR = 4.0
"""A bar longer than this many times the largest bar without comm buffers (or formula) runs off the model-state
axis rather than squeezing every other bar to a sliver."""


def _state_bytes(state: dict[str, Any], without_comm: bool = False) -> float:
    parts = [k for k, _, _ in _STATE_PARTS if not (without_comm and k == "comm_buffers")]
    return sum(v * 2**20 for k in parts if isinstance(v := state.get(k), (int, float)) and not isinstance(v, bool) and v > 0)


def plot_model_state(runs: list[RunResult], path: Path) -> str | None:
    """Stacked horizontal bars of rank 0's model state per component, one per run and knob, with the ZeRO
    formula's total marked beside each (a hollow bar and a tick). Returns why it was skipped, or None when drawn."""
    rows = [(run, _rank0_state(run)) for run in runs]
    rows = [(run, state) for run, state in rows if state is not None]
    if not rows:
        return "no run recorded model_state_mib (see the n/a reasons in the memory table)"
    fig = Figure(figsize=(9.0, 1.8 + 0.5 * len(rows)), layout="constrained")
    ax = fig.add_subplot()
    labelled: set[str] = set()
    # The axis spans what the components other than comm buffers and the formulas need; a comm buffer many times
    # larger (ZeRO-3's default gradient bucket, 1.9 GiB whatever the model) runs off the axis, and its bar says so.
    reach = max([_state_bytes(state, without_comm=True) for _, state in rows]
                + [_formula_total_bytes(run) or 0.0 for run, _ in rows] + [1.0])
    limit = max([_state_bytes(state) for _, state in rows if _state_bytes(state) <= CLIP_FACTOR * reach] + [reach])
    for y, (run, state) in enumerate(reversed(rows)):
        end = _draw_state(ax, y, state, labelled)
        formula = _formula_total_bytes(run)
        if formula is not None:
            ax.barh(y, formula, height=0.8, fill=False, edgecolor="black", linewidth=1.0,
                    label=None if "formula" in labelled else "ZeRO formula total")
            ax.plot([formula, formula], [y - 0.45, y + 0.45], color="black", linewidth=2.0)
            labelled.add("formula")
        clipped = end > limit * 1.5
        text = (format_bytes(end) + (" (off the axis)" if clipped else "")
                + (f" (formula {format_bytes(formula)})" if formula is not None else ""))
        x = limit * 1.02 if clipped else max(end, formula or 0.0) + limit * 0.01
        ax.text(x, y, text, va="center", fontsize=8,
                bbox={"facecolor": "white", "edgecolor": "none", "pad": 1.0} if clipped else None)
    names = [run.label + (f" {run.knob_label}" if run.knob_label else "") for run, _ in reversed(rows)]
    ax.set_yticks(range(len(rows)), names)
    ax.set_xlim(0, limit * 1.5)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _pos: format_bytes(x)))
    ax.set_xlabel("model state on rank 0 (bytes)")
    ax.set_title("Model state per component, measured (rank 0) and the ZeRO formula")
    ax.grid(True, axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    fig.legend(*ax.get_legend_handles_labels(), loc="outside lower center", ncol=3, fontsize=8, frameon=False)
    save(fig, path)
    return None
