"""report: Markdown and PNG plots built from dpcompare's JSON files only.

`python -m dpcompare report DIR` reads, recursively under DIR, every run result (a JSON object with
schema_version and backend), at most one compare summary (kind: compare) and any number of collective
microbenchmarks (kind: collectives), and writes into OUT (default: DIR):

  report.md                      environment, verdict table, cost tables (every n/a with its reason)
  throughput_vs_world_size.png   samples/s per backend against the ideal line from the reference run
  step_breakdown.png             compute / exposed communication / other time of a step
  busbw_vs_message_size.png      microbenchmark bus bandwidth by message size and what training reached
  grad_error_heatmap.png         the compare matrix: gradient distances in float32 noise floors
  trajectory_drift.png           each run's parameter distance to the float64 trajectory by step, with floor and tolerance

Where several results exist for one backend and world size, the newest (created_unix) is reported.
A plot whose inputs are absent is skipped, and report.md says why.

Owns: reading and classifying result JSON, the derived figures (scaling efficiency, the unattributed
rest of a step), the Markdown and the plots. Imports no adapter and no torch: past results can be
re-reported on a machine without the backends.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import numpy as np
from matplotlib import colormaps
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure
from matplotlib.ticker import FixedLocator, FuncFormatter, MaxNLocator, NullLocator

from dpcompare import SCHEMA_VERSION
from dpcompare.measure.scaling import other_ms, scaling_efficiency

DPI = 150
PLOT_THROUGHPUT = "throughput_vs_world_size.png"
PLOT_BREAKDOWN = "step_breakdown.png"
PLOT_BUSBW = "busbw_vs_message_size.png"
PLOT_HEATMAP = "grad_error_heatmap.png"
PLOT_TRAJECTORY = "trajectory_drift.png"
BACKEND_ORDER = ("reference", "dp", "ddp", "horovod", "deepspeed")
NON_NUMERIC_METRICS: dict[str, type] = {"stragglers": list, "comm_total_method": str, "model_state_mib": dict,
                                         "scaling": str, "reasons": dict}
TRAINING_MARKERS = ("*", "D", "^", "v", "P", "X", "s", "p", "h")


# -- pure helpers ----------------------------------------------------------------------------------
# Config knobs that make a run a variant of the baseline computation (compare --sweep varies them).
VARIANT_KNOBS = {"compression": "none", "grad_accum": 1, "bucket_mb": None}


def variant_of(run: dict[str, Any]) -> str:
    """'' for a baseline run, else 'knob=value ...' for the knobs it changes."""
    config = run.get("config") or {}
    return " ".join(f"{k}={config[k]:g}" if isinstance(config[k], float) else f"{k}={config[k]}"
                    for k, default in VARIANT_KNOBS.items() if config.get(k, default) != default)


def _fmt_sweep(value: Any, spec: str) -> str:
    return format(value, spec) if _is_number(value) else "n/a"


def newest_per_backend_world_size(runs: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One run per (backend, world_size): the newest by created_unix (a result without it counts as
    oldest; on a tie the later one in the input wins). Sorted reference, dp, ddp, horovod, deepspeed,
    others, then by world size."""
    best: dict[tuple[str, int], dict[str, Any]] = {}
    for run in runs:
        key = (run["backend"], run["world_size"])
        if key not in best or _created(run) >= _created(best[key]):
            best[key] = run
    return sorted(best.values(), key=_run_order)


def format_bytes(n: float) -> str:
    """Binary units, as message sizes are powers of two: 1024 -> '1 KiB', 1.5 * 2**20 -> '1.5 MiB'."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            value = n / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{n:.0f} B"


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _created(run: dict[str, Any]) -> float:
    value = run.get("created_unix")
    return float(value) if _is_number(value) else -math.inf


def _run_order(run: dict[str, Any]) -> tuple[int, str, int]:
    b = run["backend"]
    return (BACKEND_ORDER.index(b) if b in BACKEND_ORDER else len(BACKEND_ORDER), b, run["world_size"])


def _label(run: dict[str, Any]) -> str:
    return f"{run['backend']}/{run['world_size']}"


def _num(x: float) -> str:
    a = abs(x)
    if a >= 100:
        return f"{x:,.0f}"
    if a >= 10:
        return f"{x:.1f}"
    if a >= 1 or a == 0:
        return f"{x:.2f}"
    return f"{x:.3g}"


# -- inputs ----------------------------------------------------------------------------------------
@dataclass(slots=True)
class Inputs:
    runs: list[dict[str, Any]] = field(default_factory=list)
    """Every readable run result; '_source' holds its path."""
    compare: dict[str, Any] | None = None
    """The newest compare summary, if any."""
    collectives: list[dict[str, Any]] = field(default_factory=list)
    """Microbenchmark entries from every collectives file."""
    unavailable_transports: list[dict[str, Any]] = field(default_factory=list)
    """{'transport', 'reason'} from the collectives files."""
    skipped: list[str] = field(default_factory=list)
    """'path: why' for every file that looked like ours and could not be used."""
    ignored: int = 0
    """Readable JSON that is none of ours (a DeepSpeed config, say)."""


def _json_files(root: Path) -> list[Path]:
    found = []
    for dirpath, _dirs, files in os.walk(root):  # does not follow symlinked directories: no loops
        found += [Path(dirpath) / f for f in files if f.endswith(".json") and not f.startswith(".")]
    return sorted(found)


def _run_problem(obj: dict[str, Any]) -> str | None:
    if obj.get("schema_version") != SCHEMA_VERSION:
        return f"schema_version {obj.get('schema_version')!r}; this dpcompare reads {SCHEMA_VERSION}"
    if not isinstance(obj.get("backend"), str):
        return f"backend {obj.get('backend')!r} is not a string"
    ws = obj.get("world_size")
    if not isinstance(ws, int) or isinstance(ws, bool) or ws < 1:
        return f"world_size {ws!r} is not a positive whole number"
    if obj.get("metrics") is not None and not isinstance(obj["metrics"], dict):
        return "metrics is not an object"
    return None


def _entry_problem(entry: Any) -> str | None:
    if not isinstance(entry, dict):
        return "an entry is not an object"
    if not isinstance(entry.get("world_size"), int) or not isinstance(entry.get("sizes"), list):
        return "an entry lacks world_size (whole number) or sizes (list)"
    for size in entry["sizes"]:
        if not isinstance(size, dict) or not _is_number(size.get("bytes")) or not (
                size.get("busbw_gbps") is None or _is_number(size["busbw_gbps"])):
            return f"a size is not an object with numeric bytes and busbw_gbps: {size!r}"
    return None


def load_inputs(in_dir: Path) -> Inputs:
    """Classify every *.json under in_dir. Malformed files land in Inputs.skipped, never raise."""
    if not in_dir.is_dir():
        raise ValueError(f"report directory {str(in_dir)!r} does not exist or is not a directory: expected a "
                         "directory holding dpcompare JSON results, e.g. results/<timestamp>/ from python -m dpcompare compare")
    inputs = Inputs()
    compares: list[tuple[Path, dict[str, Any]]] = []
    for path in _json_files(in_dir):
        try:
            obj = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            inputs.skipped.append(f"{path}: not readable JSON ({exc})")
            continue
        if not isinstance(obj, dict):
            inputs.ignored += 1
        elif obj.get("kind") == "compare":
            compares.append((path, obj))
        elif obj.get("kind") == "collectives":
            entries = obj.get("entries")
            if not isinstance(entries, list):
                inputs.skipped.append(f"{path}: collectives file without an 'entries' list")
                continue
            for entry in entries:
                problem = _entry_problem(entry)
                if problem:
                    inputs.skipped.append(f"{path}: {problem}")
                else:
                    inputs.collectives.append({**entry, "_source": str(path)})
            inputs.unavailable_transports += [u for u in obj.get("unavailable") or [] if isinstance(u, dict)]
        elif "schema_version" in obj and "backend" in obj:
            problem = _run_problem(obj)
            if problem:
                inputs.skipped.append(f"{path}: {problem}")
            else:
                inputs.runs.append({**obj, "_source": str(path)})
        else:
            inputs.ignored += 1
    if compares:
        compares.sort(key=lambda pc: _created(pc[1]))
        inputs.compare = compares[-1][1]
        inputs.skipped += [f"{p}: an older compare summary (only the newest, {compares[-1][0]}, is reported)"
                           for p, _ in compares[:-1]]
    return inputs


# -- metric access and footnotes ---------------------------------------------------------------------
def _reasons(run: dict[str, Any]) -> dict[str, Any]:
    metrics = run.get("metrics")
    reasons = metrics.get("reasons") if isinstance(metrics, dict) else None
    return reasons if isinstance(reasons, dict) else {}


def metric(run: dict[str, Any], name: str) -> tuple[Any, str | None]:
    """(value, None) or (None, why it is missing)."""
    metrics = run.get("metrics")
    if not isinstance(metrics, dict):
        if "metrics" in run:  # the trainer writes metrics: null when the measurement phase was off
            return None, ("the run measured nothing (metrics: null): pass --measure-steps N, "
                          "e.g. compare --run-arg=--measure-steps=20")
        return None, "this result has no metrics (written before dpcompare recorded them)"
    value = metrics.get(name)
    if value is not None:
        expected = NON_NUMERIC_METRICS.get(name)
        if expected is None and not _is_number(value):
            return None, f"metrics.{name} is {value!r}, not a number"
        if expected is not None and not isinstance(value, expected):
            return None, f"metrics.{name} is {value!r}, not a {expected.__name__}"
        return value, None
    reasons = _reasons(run)
    if reasons.get(name):
        return None, str(reasons[name])
    return None, f"metrics.{name} is {'null' if name in metrics else 'absent'} and no reason was recorded"


class Footnotes:
    """n/a cells point at a numbered reason; one number per distinct reason."""

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}

    def na(self, reason: str) -> str:
        return f"n/a[^{self._ids.setdefault(reason, len(self._ids) + 1)}]"

    def lines(self) -> list[str]:
        return [f"[^{n}]: {_escape(reason)}" for reason, n in self._ids.items()]


def _escape(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    out += ["| " + " | ".join(_escape(c) for c in row) + " |" for row in rows]
    return out


# -- derived per-run figures ---------------------------------------------------------------------------
@dataclass(slots=True)
class Derived:
    efficiency: float | None
    efficiency_reason: str | None
    other_ms: float | None
    other_reason: str | None
    busbw_ratio: float | None
    busbw_ratio_reason: str | None


def _missing(run: dict[str, Any], names: Iterable[str]) -> list[str]:
    return [n for n in names if metric(run, n)[0] is None]


def derive(run: dict[str, Any], reference_throughput: float | None) -> Derived:
    samples, _ = metric(run, "samples_per_s")
    eff = scaling_efficiency(samples, run["world_size"], reference_throughput)
    eff_reason = None
    if eff is None:
        eff_reason = ("samples_per_s is n/a for this run" if samples is None else
                      "no reference run at world size 1 with samples_per_s: run python -m dpcompare --backend reference")
    parts = ("step_ms_p50", "compute_ms_p50", "comm_exposed_ms")
    other = other_ms(*(metric(run, n)[0] for n in parts))
    other_reason = None if other is not None else (
        "other = step_ms_p50 - compute_ms_p50 - comm_exposed_ms needs all three; n/a: " + ", ".join(_missing(run, parts)))
    busbw, _ = metric(run, "busbw_gbps")
    micro, _ = metric(run, "microbench_busbw_gbps")
    ratio, ratio_reason = None, None
    if busbw is not None and micro is not None and micro > 0:
        ratio = busbw / micro
    else:
        missing = _missing(run, ("busbw_gbps", "microbench_busbw_gbps")) or ["microbench_busbw_gbps is 0"]
        ratio_reason = "busbw / microbenchmark busbw needs both; n/a: " + ", ".join(missing)
    return Derived(eff, eff_reason, other, other_reason, ratio, ratio_reason)


# -- plots -----------------------------------------------------------------------------------------
def _colour(backend: str) -> Any:
    palette = colormaps["tab10"]
    index = BACKEND_ORDER.index(backend) if backend in BACKEND_ORDER else len(BACKEND_ORDER) + sum(map(ord, backend)) % 5
    return palette(index % 10)


def _save(fig: Figure, path: Path) -> None:
    fig.savefig(path, dpi=DPI, bbox_inches="tight")


def _marker(backend: str) -> str:
    # Distinct markers keep points visible where backends coincide (reference and dp at world size 1).
    markers = ("o", "s", "D", "^", "v", "P", "X")
    return markers[BACKEND_ORDER.index(backend) if backend in BACKEND_ORDER else sum(map(ord, backend)) % len(markers)]


def plot_throughput(runs: list[dict[str, Any]], reference_throughput: float | None, scaling: str,
                    path: Path) -> str | None:
    """samples/s against world size per backend with the ideal line N x reference, and beside it the
    scaling efficiency when the reference is known. Returns why it was skipped, or None when drawn."""
    series: dict[str, list[tuple[int, float]]] = {}
    for run in runs:
        samples, _ = metric(run, "samples_per_s")
        if samples is not None:
            series.setdefault(run["backend"], []).append((run["world_size"], samples))
    if not series:
        return "no run recorded samples_per_s (see the n/a reasons in the cost table)"
    panels = 2 if reference_throughput is not None else 1
    fig = Figure(figsize=(6.5 * panels, 4.8), layout="constrained")
    axes = fig.subplots(1, panels, squeeze=False)[0]
    sizes = sorted({ws for points in series.values() for ws, _ in points} | {1})
    ideal = f"ideal ({scaling} scaling)" if scaling in ("strong", "weak") else "ideal (N x reference)"
    throughput_ax = axes[0]
    if reference_throughput is not None:
        throughput_ax.plot(sizes, [reference_throughput * n for n in sizes], "--", color="black", linewidth=1.2,
                           label=ideal)
        axes[1].axhline(1.0, linestyle="--", color="black", linewidth=1.2, label=ideal)
    best_eff = 1.0
    for backend, points in series.items():
        points.sort()
        xs, ys = zip(*points)
        style = dict(color=_colour(backend), marker=_marker(backend), markersize=7, label=backend)
        throughput_ax.plot(xs, ys, "-", **style)
        if reference_throughput is not None:
            effs = [scaling_efficiency(y, x, reference_throughput) for x, y in points]
            axes[1].plot(xs, effs, "-", **style)
            best_eff = max(best_eff, *effs)
    for ax in axes:
        if sizes[-1] / sizes[0] >= 16:
            ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(FixedLocator(sizes))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _pos: f"{x:g}"))
        ax.set_xlabel("world size (processes)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    throughput_ax.set_ylim(bottom=0)
    throughput_ax.set_ylabel("throughput (samples/s)")
    throughput_ax.set_title("Throughput vs world size")
    if panels == 2:
        axes[1].set_ylim(0, best_eff * 1.1)
        axes[1].yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:.0%}"))
        axes[1].set_ylabel("scaling efficiency (samples/s / (N x reference))")
        axes[1].set_title("Scaling efficiency vs world size")
    _save(fig, path)
    return None


def plot_step_breakdown(runs: list[dict[str, Any]], path: Path) -> str | None:
    """Stacked horizontal bars: compute, exposed communication, other; the unattributed rest of a step
    whose parts are unknown is hatched and the missing parts are named."""
    parts = ("step_ms_p50", "compute_ms_p50", "comm_exposed_ms")
    rows = [(run, *(metric(run, n)[0] for n in parts)) for run in runs]
    rows = [r for r in rows if any(v is not None for v in r[1:])]
    if not rows:
        return "no run recorded step_ms_p50, compute_ms_p50 or comm_exposed_ms"
    fig = Figure(figsize=(8.5, 1.6 + 0.55 * len(rows)), layout="constrained")
    ax = fig.add_subplot()
    labelled: set[str] = set()

    def bar(y: int, left: float, width: float, key: str, **style: Any) -> None:
        names = {"compute": "compute (sync off)", "exposed": "exposed communication", "other": "other",
                 "unknown": "n/a (not attributed)"}
        ax.barh(y, width, left=left, height=0.6, label=None if key in labelled else names[key], **style)
        labelled.add(key)

    longest = max(max(v for v in r[1:] if v is not None) for r in rows)
    for y, (run, step, compute, exposed) in enumerate(reversed(rows)):
        left = 0.0
        if compute is not None:
            bar(y, left, compute, "compute", color="#4C72B0")
            left += compute
        if exposed is not None:
            bar(y, left, exposed, "exposed", color="#DD8452")
            left += exposed
        other = other_ms(step, compute, exposed)
        notes = []
        if other is not None:
            bar(y, left, other, "other", color="#A0A0A0")
        elif step is not None:
            bar(y, left, max(step - left, 0.0), "unknown", color="white", edgecolor="#555555", hatch="//")
            notes.append("n/a: " + ", ".join(n.replace("_ms_p50", "").replace("comm_exposed_ms", "exposed comm")
                                              for n, v in zip(parts[1:], (compute, exposed)) if v is None))
        else:
            notes.append("step time n/a")
        end = max(left, step or 0.0)
        text = (f"{step:.3g} ms" if step is not None else "") + ("  " + "; ".join(notes) if notes else "")
        ax.text(end + longest * 0.01, y, text.strip(), va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), [_label(r[0]) for r in reversed(rows)])
    ax.set_xlim(0, longest * 1.45)
    ax.set_xlabel("time per step, p50 (ms)")
    ax.set_title("Where a step's time goes (p50 of each part)")
    ax.grid(True, axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    handles, names = ax.get_legend_handles_labels()
    order = sorted(range(len(names)), key=lambda i: ["compute", "exposed", "other", "n/a"].index(names[i].split()[0]))
    fig.legend([handles[i] for i in order], [names[i] for i in order], loc="outside lower center",
               ncol=len(order), fontsize=8, frameon=False)
    _save(fig, path)
    return None


def _log2_ticks(lo: float, hi: float, most: int = 10) -> list[float]:
    first, last = math.floor(math.log2(lo)), math.ceil(math.log2(hi))
    stride = max(1, math.ceil((last - first + 1) / most))
    return [2.0**e for e in range(first, last + 1, stride)]


def plot_busbw(entries: list[dict[str, Any]], runs: list[dict[str, Any]], link_peak_gbps: float | None,
               path: Path) -> tuple[str | None, str]:
    """Microbenchmark busbw by message size, training points at their bucket size, and a peak line.
    Returns (why skipped or None, a sentence about the peak line)."""
    if not entries:
        return ("no collectives microbenchmark (JSON with kind: collectives) under the directory: run "
                "python -m dpcompare bench-collectives and put its JSON beside the results"), ""
    fig = Figure(figsize=(8.5, 5.2), layout="constrained")
    ax = fig.add_subplot()
    xs_all, ys_all, best = [], [], 0.0
    wrong_labelled = False
    for entry in entries:
        points = sorted((s["bytes"], s["busbw_gbps"], s.get("correct", True)) for s in entry["sizes"]
                        if s.get("bytes") and s.get("busbw_gbps") is not None and s["busbw_gbps"] > 0)
        if not points:
            continue
        xs, ys, ok = zip(*points)
        transport, backend = entry.get("transport") or "?", entry.get("backend")
        label = (f"{transport}/{backend}" if backend and backend != transport else transport) \
            + f" N={entry['world_size']} (microbenchmark)"
        ax.plot(xs, ys, "-o", markersize=4, label=label)
        bad = [(x, y) for x, y, c in points if c is False]
        if bad:
            ax.scatter(*zip(*bad), marker="x", s=70, color="red", zorder=5,
                       label=None if wrong_labelled else "wrong result (correct: false)")
            wrong_labelled = True
        best = max(best, max(y for y, c in zip(ys, ok) if c is not False) if any(c is not False for c in ok) else 0.0)
        xs_all += xs
        ys_all += ys
    for i, run in enumerate(runs):
        bucket, _ = metric(run, "bucket_bytes")
        busbw, _ = metric(run, "busbw_gbps")
        if bucket and busbw:
            ax.scatter([bucket], [busbw], marker=TRAINING_MARKERS[i % len(TRAINING_MARKERS)], s=140,
                       color=_colour(run["backend"]), edgecolor="black", zorder=6, label=f"{_label(run)} in training")
            xs_all.append(bucket)
            ys_all.append(busbw)
    if not xs_all:
        return "the collectives files hold no size with a positive busbw_gbps", ""
    if link_peak_gbps is not None:
        peak, peak_label = link_peak_gbps, f"link peak (given): {link_peak_gbps:g} GB/s"
        sentence = f"The dashed line is the link peak given with --link-peak-gbps: {link_peak_gbps:g} GB/s."
    elif best > 0:
        peak, peak_label = best, f"best observed (microbenchmark): {best:.3g} GB/s"
        sentence = (f"The dashed line is the best bus bandwidth any microbenchmark reached ({best:.3g} GB/s), not the "
                    "link's nominal peak: pass --link-peak-gbps to draw that instead.")
    else:
        peak, sentence = None, "No peak line: no microbenchmark size gave a correct result."
    if peak is not None:
        ax.axhline(peak, linestyle="--", color="black", linewidth=1.2, label=peak_label)
        ys_all.append(peak)
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
    _save(fig, path)
    return None, sentence


@dataclass(slots=True)
class Panel:
    title: str
    rows: list[str]
    columns: list[str]
    values: np.ndarray
    """In noise floors; 0 where the gradients were bitwise equal, nan where unknown."""


def matrix_panels(matrix: dict[str, Any]) -> list[Panel]:
    """The first checked step, and the maximum over steps when there is more than one."""
    labels, steps = list(matrix.get("labels") or []), list(matrix.get("steps") or [])
    per_step = matrix.get("per_step") or {}
    if not labels or not steps:
        return []
    columns = ["oracle", *labels]

    def grid(step: Any) -> np.ndarray:
        values = np.full((len(labels), len(columns)), np.nan)
        for i, a in enumerate(labels):
            row = (per_step.get(str(step)) or {}).get(a) or {}
            rel, floors = row.get("rel_err") or {}, row.get("in_noise_floors") or {}
            for j, b in enumerate(columns):
                if rel.get(b) == 0:
                    values[i, j] = 0.0
                elif floors.get(b) is not None:
                    values[i, j] = floors[b]
        return values

    panels = [Panel(f"step {steps[0]}", labels, columns, grid(steps[0]))]
    if len(steps) > 1:
        stack = np.stack([grid(s) for s in steps])
        known = ~np.isnan(stack)
        worst = np.where(known.any(axis=0), np.nanmax(np.where(known, stack, -np.inf), axis=0), np.nan)
        panels.append(Panel(f"max over steps {steps[0]}-{steps[-1]}", labels, columns, worst))
    return panels


def plot_heatmap(compare: dict[str, Any] | None, path: Path) -> str | None:
    if compare is None:
        return "no compare summary (JSON with kind: compare) under the directory: run python -m dpcompare compare"
    panels = matrix_panels(compare.get("matrix") or {})
    if not panels:
        return "the compare summary holds no gradient matrix (no two runs dumped gradients at a common checked step)"
    positive = np.concatenate([p.values[(p.values > 0) & np.isfinite(p.values)] for p in panels])
    vmax = float(positive.max()) if positive.size else 1.0
    # The decade below the smallest distance: bitwise-equal cells take the lowest colour and stay
    # distinguishable from the smallest non-zero one.
    vmin = 10.0 ** math.floor(math.log10((float(positive.min()) if positive.size else 1.0) / 2))
    norm = LogNorm(vmin=vmin, vmax=vmax)
    cmap = colormaps["YlOrRd"].with_extremes(bad="#D0D0D0")
    n_rows, n_cols = panels[0].values.shape
    fig = Figure(figsize=(max(5.0, 1.4 + 1.0 * n_cols) * len(panels) + 1.2, max(3.6, 1.8 + 0.55 * n_rows)),
                 layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    image = None
    for ax, panel in zip(axes, panels):
        shown = np.ma.masked_invalid(np.where(panel.values == 0, vmin, panel.values))
        image = ax.imshow(shown, cmap=cmap, norm=norm, aspect="auto")
        for (i, j), v in np.ndenumerate(panel.values):
            text = "n/a" if np.isnan(v) else "0" if v == 0 else f"{v:.3g}"
            r, g, b, _ = cmap(norm(v if v > 0 else vmin)) if not np.isnan(v) else (0.8, 0.8, 0.8, 1)
            ax.text(j, i, text, ha="center", va="center", fontsize=8,
                    color="white" if 0.299 * r + 0.587 * g + 0.114 * b < 0.5 else "black")
        ax.set_xticks(range(n_cols), panel.columns, rotation=30, ha="right")
        ax.set_yticks(range(n_rows), panel.rows)
        ax.set_xlabel("compared with")
        ax.set_ylabel("run")
        ax.set_title(panel.title)
    bar = fig.colorbar(image, ax=list(axes), label="noise floors (log scale)")
    ticks = [m * 10.0**k for k in range(math.floor(math.log10(vmin)), math.ceil(math.log10(vmax)) + 1) for m in (1, 2, 5)]
    bar.set_ticks([t for t in ticks if vmin <= t <= vmax] or [vmin, vmax])
    bar.ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
    bar.ax.yaxis.set_minor_locator(NullLocator())
    fig.suptitle("Reduced gradients: distance to the float64 oracle and to each other,\n"
                 "in float32 noise floors (0 = bitwise equal, grey = unknown)")
    _save(fig, path)
    return None


def _drift(run: dict[str, Any], key: str, failed_only: bool = False) -> list[tuple[float, float]]:
    """(step, value) of equivalence.drift where both are finite and value > 0 (a log axis has no 0); with
    failed_only, only the entries whose ok is false."""
    drift = (run.get("equivalence") or {}).get("drift")
    return [(d["step"], d[key]) for d in (drift if isinstance(drift, list) else []) if isinstance(d, dict)
            and _is_number(d.get("step")) and _is_number(d.get(key)) and d[key] > 0
            and (not failed_only or d.get("ok") is False)]


def plot_trajectory_drift(runs: list[dict[str, Any]], path: Path) -> str | None:
    """Each run's parameter distance to the float64 single-process trajectory by step (log y), the floor (a
    single process in the run dtype) in grey and the tolerance dashed, each once when all runs share it, else per
    run, faint in the run's colour; steps that failed ringed in red. Returns why it was skipped, or None when drawn."""
    drawn = [r for r in runs if _drift(r, "rel_param_distance")]
    if not drawn:
        return ("no run has a trajectory drift value (equivalence.drift is empty or its rel_param_distance null "
                "in every run: the trajectory check did not run)")
    fig = Figure(figsize=(6.5, 4.8), layout="constrained")
    ax = fig.add_subplot()
    for key, name, style in (("floor_rel_param_distance", "single process in the run dtype (floor)", "-"),
                             ("tolerance", "tolerance", "--")):
        series = [(run, s) for run in drawn if (s := _drift(run, key))]
        shared = len({tuple(s) for _, s in series}) == 1  # floor and tolerance depend on model, world size, dtype
        for i, (run, s) in enumerate(series[:1] if shared else series):
            ax.plot(*zip(*s), style, linewidth=1.2, **(dict(color="grey", label=name) if shared else dict(
                color=_colour(run["backend"]), alpha=0.35, label=f"{name}, per run (faint)" if i == 0 else None)))
    for run in drawn:
        ax.plot(*zip(*_drift(run, "rel_param_distance")), "-", color=_colour(run["backend"]),
                marker=_marker(run["backend"]), markersize=5, label=_label(run))
    failed = [p for r in drawn for p in _drift(r, "rel_param_distance", failed_only=True)]
    if failed:
        ax.plot(*zip(*failed), "o", markersize=11, markerfacecolor="none", markeredgecolor="red",
                markeredgewidth=1.5, label="failed step (ok: false)")
    ax.set_yscale("log")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step (after the optimizer update)")
    ax.set_ylabel("parameter distance to float64 reference\n(relative Frobenius, log scale)")
    ax.set_title("Trajectory drift from a float64 single process")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path)
    return None


def _plot_md(name: str, title: str, why: str | None, caption: str) -> list[str]:
    return [f"### {title}", "", *([f"![{title}]({name})", "", caption, ""] if why is None else
                                  [f"Skipped `{name}`: {why}.", ""])]


# -- report.md ---------------------------------------------------------------------------------------
def _cell(run: dict[str, Any], name: str, notes: Footnotes, fmt=_num) -> str:
    value, reason = metric(run, name)
    return notes.na(reason) if value is None else fmt(value)


def _stragglers(value: list[Any]) -> str:
    shown = []
    for s in value:
        if not isinstance(s, dict):
            continue
        fraction, excess = s.get("slowest_fraction"), s.get("excess_ms_mean")
        shown.append(f"rank {s.get('rank')} (" + (f"{fraction:.0%} slowest" if _is_number(fraction) else "slowest")
                     + (f", {excess:+.3g} ms" if _is_number(excess) else "") + ")")
    return "; ".join(shown) or "none"


def _scaling_mode(runs: list[dict[str, Any]], compare: dict[str, Any] | None) -> str:
    if compare and compare.get("scaling_mode") in ("strong", "weak"):
        return compare["scaling_mode"]
    modes = {run.get("scaling") or (run.get("metrics") or {}).get("scaling") for run in runs} - {None}
    return modes.pop() if len(modes) == 1 else "mixed"


NO_CHECKS = ("this result has no equivalence.checks (written before dpcompare checked the update and the "
             "trajectory): rerun to check them")


def _verdict_cell(verdict: str) -> str:
    """Bold where the verdict is not a clean pass: the reader's eye goes there first."""
    return f"**{verdict}**" if verdict in ("different", "unverifiable", "failed", "timeout") else verdict


def _verdict_section(runs: list[dict[str, Any]], compare: dict[str, Any] | None, notes: Footnotes) -> list[str]:
    rows = []
    for run in runs:
        e = run.get("equivalence") or {}
        verdict = e.get("verdict") or "n/a"
        unchecked = "no gradient check ran (verdict unchecked)" if verdict == "unchecked" else None
        unverifiable = e.get("unverifiable_reason") if verdict == "unverifiable" else None

        def figure(name: str, spec: str) -> str:
            v = e.get(name)
            return format(v, spec) if _is_number(v) else notes.na(
                unchecked or unverifiable
                or f"equivalence.{name} is {'null' if v is None else repr(v)} and no reason was recorded")

        def check_figure(check: str, name: str, spec: str) -> str:
            checks = e.get("checks")
            if not isinstance(checks, dict):
                return notes.na(unchecked or NO_CHECKS)
            c = checks.get(check) if isinstance(checks.get(check), dict) else {}
            v, status = c.get(name), c.get("status")
            if _is_number(v):
                return format(v, spec)
            if status == "unverifiable":
                return notes.na(unverifiable or f"the {check} check could not be made and no reason was recorded")
            if status == "off":
                return notes.na(unchecked or f"the {check} check did not run (checks.{check}.status: off)")
            return notes.na(f"equivalence.checks.{check}.{name} is {'null' if v is None else repr(v)} and no reason "
                            "was recorded")

        d = e.get("first_divergence")
        if d:
            check = f" ({d['check']} check)" if d.get("check") else ""
            last = f"step {d.get('step')}{check}, `{d.get('parameter')}`: {d.get('reason', '')}"
        else:
            last = unverifiable or "none"
        rows.append([run["backend"], str(run["world_size"]), str(run.get("launcher", "?")), str(run.get("model", "?")),
                     _verdict_cell(verdict), figure("noise_ratio", ".2f"), figure("max_rel_fro_err", ".2e"),
                     check_figure("update", "noise_ratio", ".2f"), check_figure("update", "norm_ratio", ".4f"),
                     check_figure("trajectory", "noise_ratio", ".2f"), last])
    have = {(r["backend"], r["world_size"]) for r in runs}
    for job in (compare or {}).get("runs") or []:
        if job.get("status") in ("failed", "timeout") and (job.get("backend"), job.get("world_size")) not in have:
            rows.append([str(job.get("backend")), str(job.get("world_size")), "-", "-", _verdict_cell(job["status"]),
                         "-", "-", "-", "-", "-", job.get("error") or "no result written"])
    return ["Three checks per checked step, each as its worst error in multiples of the run dtype's own noise floor "
            "(x floor): the reduced gradient against the float64 oracle, the update against a float64 optimizer step "
            "from the same parameters and state (norm ratio: ||update|| / ||reference update||, 1 = the same step "
            "length), and the trajectory, the parameters' distance to a float64 single process trained beside the "
            "run. **unverifiable**: part of the run could not be checked; the reason is in the last column.", "",
            *_table(["backend", "ws", "launcher", "model", "verdict", "gradient (x floor)", "gradient max rel fro err",
                     "update (x floor)", "update norm ratio", "trajectory (x floor)",
                     "first divergence / unverifiable reason / error"], rows)]


def _time_rows(runs: list[dict[str, Any]], derived: list[Derived], tokens: bool, notes: Footnotes) -> list[list[str]]:
    rows = []
    for run, d in zip(runs, derived):
        warm, (measured, measured_reason) = metric(run, "warmup_steps")[0], metric(run, "measured_steps")
        strag, strag_reason = metric(run, "stragglers")
        rows.append([
            run["backend"], str(run["world_size"]), _cell(run, "samples_per_s", notes),
            *([_cell(run, "tokens_per_s", notes)] if tokens else []),
            f"{d.efficiency:.2f}" if d.efficiency is not None else notes.na(d.efficiency_reason),
            _cell(run, "step_ms_p50", notes), _cell(run, "step_ms_p90", notes), _cell(run, "compute_ms_p50", notes),
            _cell(run, "comm_exposed_ms", notes),
            _num(d.other_ms) if d.other_ms is not None else notes.na(d.other_reason),
            _cell(run, "rank_spread_ms_p50", notes),
            notes.na(strag_reason) if strag is None else _stragglers(strag),
            notes.na(measured_reason) if measured is None else f"{measured}" + (f" (+{warm} warm-up)" if warm else "")])
    return rows


def _comm_rows(runs: list[dict[str, Any]], derived: list[Derived], notes: Footnotes) -> list[list[str]]:
    rows = []
    for run, d in zip(runs, derived):
        total, total_reason = metric(run, "comm_total_ms")
        method = metric(run, "comm_total_method")[0]
        rows.append([
            run["backend"], str(run["world_size"]), _cell(run, "grad_bytes_per_step", notes, format_bytes),
            _cell(run, "bucket_bytes", notes, format_bytes),
            notes.na(total_reason) if total is None else _num(total) + (f" ({method})" if method else ""),
            _cell(run, "comm_exposed_ms", notes), _cell(run, "overlap_fraction", notes, lambda v: f"{v:.0%}"),
            _cell(run, "tcomm_model_ms", notes), _cell(run, "algbw_gbps", notes), _cell(run, "busbw_gbps", notes),
            _cell(run, "microbench_busbw_gbps", notes),
            f"{d.busbw_ratio:.2f}" if d.busbw_ratio is not None else notes.na(d.busbw_ratio_reason)])
    return rows


def _memory_rows(runs: list[dict[str, Any]], notes: Footnotes) -> list[list[str]]:
    rows = []
    for run in runs:
        state, state_reason = metric(run, "model_state_mib")
        cells = []
        for part in ("params", "grads", "optimizer", "comm_buffers", "total"):
            value = state.get(part) if state is not None else None
            reasons = _reasons(run)
            cells.append(_num(value) if _is_number(value) else notes.na(
                state_reason or reasons.get(f"model_state_mib.{part}")
                or f"model_state_mib.{part} is {'null' if value is None else repr(value)} and no reason was recorded"))
        rows.append([run["backend"], str(run["world_size"]), _cell(run, "peak_mem_mib", notes), *cells])
    return rows


def _cost_sections(runs: list[dict[str, Any]], derived: list[Derived], notes: Footnotes) -> list[str]:
    # One table after the other, so the footnote numbers run in reading order.
    tokens = any(metric(r, "tokens_per_s")[0] is not None for r in runs)
    lines = [
        "### Throughput and step time", "",
        "Scaling efficiency = samples/s at N / (N x samples/s of the reference run at world size 1). Times are "
        "p50 over measured steps of the slowest rank, in ms; other = step - compute - exposed comm, floored at 0.", "",
        *_table(["backend", "ws", "samples/s", *(["tokens/s"] if tokens else []), "scaling eff.", "step p50",
                 "step p90", "compute p50", "exposed comm", "other", "rank spread p50", "stragglers",
                 "measured steps"], _time_rows(runs, derived, tokens, notes)), ""]
    lines += [
        "### Communication", "",
        "Total comm is the backend's own counter (method in brackets); exposed comm is the ablation (synced - "
        "unsynced step). Bandwidths in GB/s follow nccl-tests (busbw = algbw x 2(N-1)/N for all-reduce).", "",
        *_table(["backend", "ws", "grad bytes/step", "bucket", "total comm (ms)", "exposed comm (ms)", "overlap",
                 "model t_comm (ms)", "algbw", "busbw", "microbench busbw", "busbw / microbench"],
                _comm_rows(runs, derived, notes)), ""]
    lines += [
        "### Memory (MiB)", "",
        *_table(["backend", "ws", "peak", "params", "grads", "optimizer", "comm buffers", "model state total"],
                _memory_rows(runs, notes)), ""]
    return lines


def _microbench_section(entries: list[dict[str, Any]], unavailable: list[dict[str, Any]]) -> list[str]:
    if not entries and not unavailable:
        return []
    rows = []
    for e in entries:
        good = [s for s in e["sizes"] if s.get("busbw_gbps") is not None and s.get("correct") is not False]
        top = max(good, key=lambda s: s["busbw_gbps"], default=None)
        wrong = [format_bytes(s["bytes"]) for s in e["sizes"] if s.get("correct") is False]
        status = str(e.get("status") or "ok") + (f": {e['error']}" if e.get("error") else "")
        rows.append([str(e.get("transport") or "?"), str(e.get("backend") or "-"), str(e["world_size"]),
                     str(e.get("device") or "-"), status, str(len(e["sizes"])),
                     "-" if top is None else _num(top["busbw_gbps"]),
                     "-" if top is None else format_bytes(top["bytes"]), ", ".join(wrong) or "none"])
    rows += [[str(u.get("transport")), "-", "-", "-", f"unavailable: {u.get('reason')}", "0", "-", "-", "-"]
             for u in unavailable]
    return ["### Collective microbenchmarks", "",
            *_table(["transport", "backend", "N", "device", "status", "sizes", "best busbw (GB/s)", "at",
                     "wrong results at"], rows), ""]


def _environment_section(runs: list[dict[str, Any]]) -> list[str]:
    newest = max(runs, key=_created)
    env = newest.get("env") or {}
    order = ["dpcompare", "python", "torch", "cuda", "nccl", "gloo", "deepspeed", "horovod", "mpi", "mpi4py", "host",
             "platform", "cpu_count", "device_names"]
    keys = [k for k in order if k in env] + sorted(k for k in env if k not in order)

    def show(v: Any) -> str:
        if v is None:
            return "not installed / not found"
        return ", ".join(map(str, v)) if isinstance(v, list) else str(v)

    lines = [f"From the newest run ({_label(newest)}, {newest['_source']}).", "",
             *_table(["component", "version / value"], [[k, show(env[k])] for k in keys]), ""]
    for key in ("host", "torch"):
        seen = sorted({str((r.get("env") or {}).get(key)) for r in runs})
        if len(seen) > 1:
            lines += [f"Note: the reported runs come from more than one {key}: {', '.join(seen)}.", ""]
    return lines


@dataclass(slots=True)
class Report:
    path: Path
    runs: list[dict[str, Any]]
    derived: list[Derived]
    skipped: list[str]


def _write(in_dir: Path, out_dir: Path | None, link_peak_gbps: float | None) -> Report:
    if link_peak_gbps is not None and not link_peak_gbps > 0:
        raise ValueError(f"--link-peak-gbps must be a positive number of GB/s, got {link_peak_gbps}")
    inputs = load_inputs(in_dir)
    for item in inputs.skipped:
        print(f"dpcompare: warning: skipped {item}", file=sys.stderr, flush=True)
    if not inputs.runs and inputs.compare is None and not inputs.collectives:
        raise ValueError(
            f"{str(in_dir)!r} holds no dpcompare result JSON (searched recursively; {len(inputs.skipped)} file(s) "
            "skipped as malformed): expected run results (*.json with schema_version and backend, from python -m "
            "dpcompare --out DIR), a compare.json (python -m dpcompare compare) or a collectives benchmark")
    out_dir = in_dir if out_dir is None else out_dir
    out_dir.mkdir(parents=True, exist_ok=True)

    # Baseline runs make the tables and plots; sweep variants get their own table.
    runs = newest_per_backend_world_size(r for r in inputs.runs if not variant_of(r))
    variants = [r for r in inputs.runs if variant_of(r)]
    reference = next((r for r in runs if r["backend"] == "reference" and r["world_size"] == 1), None)
    ref_throughput = metric(reference, "samples_per_s")[0] if reference else None
    scaling = _scaling_mode(runs, inputs.compare)
    derived = [derive(r, ref_throughput) for r in runs]
    notes = Footnotes()

    plots: list[tuple[str, str, str | None, str]] = []  # (file, title, why skipped, caption)
    for name in (PLOT_THROUGHPUT, PLOT_BREAKDOWN, PLOT_BUSBW, PLOT_HEATMAP, PLOT_TRAJECTORY):
        (out_dir / name).unlink(missing_ok=True)  # a skipped plot must not leave a stale one behind
    why = plot_throughput(runs, ref_throughput, scaling, out_dir / PLOT_THROUGHPUT)
    caption = ("Dashed: the reference run's samples/s at world size 1 times N; right: scaling efficiency."
               if ref_throughput is not None else
               "No ideal line: no reference run at world size 1 recorded samples_per_s.")
    plots.append((PLOT_THROUGHPUT, "Throughput vs world size", why, caption))
    why = plot_step_breakdown(runs, out_dir / PLOT_BREAKDOWN)
    plots.append((PLOT_BREAKDOWN, "Step time breakdown", why,
                  "Compute = the step with gradient sync switched off; exposed communication = synced - unsynced step."))
    why, sentence = plot_busbw(inputs.collectives, runs, link_peak_gbps, out_dir / PLOT_BUSBW)
    unplaced = [_label(r) for r in runs if metric(r, "busbw_gbps")[0] and not metric(r, "bucket_bytes")[0]]
    if unplaced:
        sentence += f" Not placed (busbw without bucket_bytes): {', '.join(unplaced)}."
    plots.append((PLOT_BUSBW, "Bus bandwidth vs message size", why, sentence))
    why = plot_heatmap(inputs.compare, out_dir / PLOT_HEATMAP)
    plots.append((PLOT_HEATMAP, "Gradient error matrix", why,
                  "Rows: the run whose reduced gradient is measured; columns: the float64 oracle and every other run. "
                  "Values: ||g_row - g_col|| / ||oracle|| in units of that run's float32 noise floor; 0 = bitwise "
                  "equal; grey n/a = noise floor of 0, or two runs whose forward draws random numbers at different world "
                  "sizes (they drew different dropout masks: the distance would measure randomness, not rounding)."))
    drift_why = plot_trajectory_drift(runs, out_dir / PLOT_TRAJECTORY)

    stamps = [r["created_unix"] for r in inputs.runs if isinstance(r.get("created_unix"), (int, float))]
    md = ["# dpcompare report", "",
          f"Generated {time.strftime('%Y-%m-%d %H:%M:%S %Z')} from `{in_dir}`"
          + (f"; runs from {time.strftime('%Y-%m-%d %H:%M', time.localtime(min(stamps)))} to "
             f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(max(stamps)))}" if stamps else "") + ".", "",
          f"{len(runs)} run(s) reported ({len(inputs.runs) - len(runs) - len(variants)} older result(s) for the same "
          f"backend and world size superseded by newer ones, {len(variants)} sweep variant(s)), scaling: {scaling}, {len(inputs.collectives)} microbenchmark curve(s), "
          f"{'a' if inputs.compare else 'no'} compare summary.", ""]
    batch = ("local_batch", "per-rank batches") if scaling == "weak" else ("global_batch", "global batches")
    for key, what in (("model", "models"), batch):
        seen = sorted({str(r.get(key)) for r in runs})
        if len(seen) > 1:
            md += [f"**Note:** the runs mix {what} ({', '.join(seen)}): their costs are not directly comparable.", ""]
    if runs:
        md += ["## Environment", "", *_environment_section(runs)]
        md += ["## Is it the same computation?", "", *_verdict_section(runs, inputs.compare, notes), ""]
        md += _plot_md(PLOT_TRAJECTORY, "Trajectory drift", drift_why,
                       "Each run's parameter distance to a float64 single process after every verification step, "
                       "against the floor (solid: a single process in the run dtype) and the pass tolerance (dashed), "
                       "grey when all runs share them, else faint in each run's colour; red rings mark failed steps.")
    unavailable = (inputs.compare or {}).get("unavailable") or []
    if unavailable:
        md += ["## Unavailable backends", "",
               *_table(["backend", "reason"], [[str(u.get("backend")), str(u.get("reason"))] for u in unavailable]), ""]
    md += ["## What does it cost?", ""]
    md += _cost_sections(runs, derived, notes) if runs else ["No run results: nothing to cost.", ""]
    if variants:
        md += ["## Sweep (one knob at a time)", "",
               "Each row changes one knob from the baseline run of the same backend and world size.", ""]
        md += _table(["backend", "ws", "knob", "verdict", "max rel fro err", "step p50 (ms)", "exposed comm (ms)",
                      "busbw (GB/s)"],
                     [[str(r["backend"]), str(r["world_size"]), variant_of(r),
                       _verdict_cell(str(r.get("equivalence", {}).get("verdict"))),
                       _fmt_sweep(r.get("equivalence", {}).get("max_rel_fro_err"), ".2e"),
                       _fmt_sweep(metric(r, "step_ms_p50")[0], ".2f"), _fmt_sweep(metric(r, "comm_exposed_ms")[0], ".2f"),
                       _fmt_sweep(metric(r, "busbw_gbps")[0], ".3f")]
                      for r in sorted(variants, key=lambda r: (_run_order(r), variant_of(r)))])
        md += [""]
    md += _microbench_section(inputs.collectives, inputs.unavailable_transports)
    md += ["## Plots", ""]
    for name, title, why, caption in plots:
        md += _plot_md(name, title, why, caption)
    if inputs.skipped or inputs.ignored:
        md += ["## Inputs not used", ""]
        md += [f"- skipped {_escape(s)}" for s in inputs.skipped]
        if inputs.ignored:
            md += [f"- {inputs.ignored} JSON file(s) that are not dpcompare results were ignored"]
        md += [""]
    footnotes = notes.lines()
    if footnotes:
        md += ["## Why values are n/a", "", *footnotes, ""]
    path = out_dir / "report.md"
    path.write_text("\n".join(md))
    return Report(path, runs, derived, inputs.skipped)


def build_report(in_dir: Path, out_dir: Path | None = None, *, link_peak_gbps: float | None = None) -> Path:
    """Write out_dir/report.md (default: in_dir) and its PNGs from the JSON under in_dir; return its path."""
    return _write(Path(in_dir), None if out_dir is None else Path(out_dir), link_peak_gbps).path


# -- command line ------------------------------------------------------------------------------------
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

    report = _write(Path(ns.dir), None if ns.out is None else Path(ns.out), ns.link_peak_gbps)
    console = Console()
    if report.runs:
        table = Table(title="dpcompare report")
        for col in ("backend", "ws", "verdict", "samples/s", "scaling eff.", "step p50 (ms)"):
            table.add_column(col, justify="left" if col in ("backend", "verdict") else "right", no_wrap=True)
        style = {"equivalent": "green", "different": "red", "unverifiable": "yellow"}
        for run, d in zip(report.runs, report.derived):
            verdict = (run.get("equivalence") or {}).get("verdict") or "n/a"
            samples, step = metric(run, "samples_per_s")[0], metric(run, "step_ms_p50")[0]
            table.add_row(run["backend"], str(run["world_size"]), f"[{style.get(verdict, 'yellow')}]{verdict}[/]",
                          "n/a" if samples is None else _num(samples),
                          "n/a" if d.efficiency is None else f"{d.efficiency:.2f}",
                          "n/a" if step is None else _num(step))
        console.print(table)
    console.print(f"report: {report.path}", highlight=False, soft_wrap=True)
    return 0
