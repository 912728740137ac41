"""The verification plots: the compare summary's gradient matrix as a heatmap in float32 noise floors, and
each run's trajectory drift from a float64 single process by step. Each plot function draws its PNG and
returns None, or returns why it was skipped and draws nothing."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.colors import BoundaryNorm, Colormap, ListedColormap
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, MaxNLocator, NullLocator

from dpcompare.commands.report.load import is_number
from dpcompare.commands.report.style import colour, marker, save
from dpcompare.result_view import RunResult


# -- gradient matrix -------------------------------------------------------------------------------------
@dataclass(slots=True)
class Panel:
    title: str
    rows: list[str]
    columns: list[str]
    values: np.ndarray
    """In noise floors; 0 where the gradients were bitwise equal, nan where unknown."""


def _matrix_grid(per_step: dict[str, Any], step: Any, labels: list[str], columns: list[str]) -> np.ndarray:
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


def matrix_panels(matrix: dict[str, Any]) -> list[Panel]:
    """The first checked step, and the maximum over steps when there is more than one."""
    labels, steps = list(matrix.get("labels") or []), list(matrix.get("steps") or [])
    per_step = matrix.get("per_step") or {}
    if not labels or not steps:
        return []
    columns = ["oracle", *labels]
    panels = [Panel(f"step {steps[0]}", labels, columns, _matrix_grid(per_step, steps[0], labels, columns))]
    if len(steps) > 1:
        stack = np.stack([_matrix_grid(per_step, s, labels, columns) for s in steps])
        known = ~np.isnan(stack)
        worst = np.where(known.any(axis=0), np.nanmax(np.where(known, stack, -np.inf), axis=0), np.nan)
        panels.append(Panel(f"max over steps {steps[0]}-{steps[-1]}", labels, columns, worst))
    return panels


DEFAULT_TOLERANCE_FLOORS = 10.0
"""dpcompare.verify.oracle.gradient_oracle.TOLERANCE_FACTOR, for summaries whose runs do not record their tolerance."""


def heatmap_scale(tolerance: float) -> tuple[BoundaryNorm, ListedColormap]:
    """Fixed bands in noise floors, anchored at the tolerance, so a colour means the same in every report:
    greens up to the tolerance (within noise is calm), reds beyond it (outside tolerance is alarming)."""
    # Bands are closed on the left; the verdict's rule is err <= tolerance, so the tolerance itself is green.
    bounds = [0.0, 1.0, tolerance / 3.0, float(np.nextafter(tolerance, np.inf)), tolerance * 10.0, tolerance * 100.0]
    colours = ["#EDF8E9", "#BAE4B3", "#74C476", "#FC9272", "#EF3B2C", "#A50F15"]  # the last: beyond 100x
    return BoundaryNorm(bounds, len(colours), extend="max"), ListedColormap(colours).with_extremes(bad="#D0D0D0")


def tolerance_floors(runs: list[RunResult]) -> float:
    """The tolerance factor (in noise floors) the runs were judged with: the largest any of them records."""
    factors = [r.equivalence.tolerance.factor for r in runs]
    return max((f for f in factors if f is not None and f > 0), default=DEFAULT_TOLERANCE_FLOORS)


def _draw_panel(ax: Axes, panel: Panel, cmap: Colormap, norm: BoundaryNorm) -> Any:
    """One panel with its value written in each cell; returns the image for the colour bar."""
    shown = np.ma.masked_invalid(panel.values)
    image = ax.imshow(shown, cmap=cmap, norm=norm, aspect="auto")
    for (i, j), v in np.ndenumerate(panel.values):
        text = "n/a" if np.isnan(v) else "0" if v == 0 else f"{v:.3g}"
        r, g, b, _ = cmap(norm(v)) if not np.isnan(v) else (0.8, 0.8, 0.8, 1)
        ax.text(j, i, text, ha="center", va="center", fontsize=8,
                color="white" if 0.299 * r + 0.587 * g + 0.114 * b < 0.5 else "black")
    n_rows, n_cols = panel.values.shape
    ax.set_xticks(range(n_cols), panel.columns, rotation=30, ha="right")
    ax.set_yticks(range(n_rows), panel.rows)
    ax.set_xlabel("compared with")
    ax.set_ylabel("run")
    ax.set_title(panel.title)
    return image


def _colour_bar(fig: Figure, image: Any, axes: list[Axes], norm: BoundaryNorm, tolerance: float) -> None:
    bar = fig.colorbar(image, ax=axes, label=f"noise floors (tolerance {tolerance:g}: green within, red outside)",
                       spacing="uniform")
    bar.set_ticks(list(norm.boundaries))
    bar.ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:.3g}"))
    bar.ax.yaxis.set_minor_locator(NullLocator())


def plot_heatmap(compare: dict[str, Any] | None, path: Path, tolerance: float = DEFAULT_TOLERANCE_FLOORS) -> str | None:
    if compare is None:
        return "no compare summary (JSON with kind: compare) under the directory: run python -m dpcompare compare"
    panels = matrix_panels(compare.get("matrix") or {})
    if not panels:
        return "the compare summary holds no gradient matrix (no two runs dumped gradients at a common checked step)"
    norm, cmap = heatmap_scale(tolerance)
    n_rows, n_cols = panels[0].values.shape
    fig = Figure(figsize=(max(5.0, 1.4 + 1.0 * n_cols) * len(panels) + 1.2, max(3.6, 1.8 + 0.55 * n_rows)),
                 layout="constrained")
    axes = list(fig.subplots(1, len(panels), squeeze=False)[0])
    image = None
    for ax, panel in zip(axes, panels):
        image = _draw_panel(ax, panel, cmap, norm)
    _colour_bar(fig, image, axes, norm, tolerance)
    fig.suptitle("Reduced gradients: distance to the float64 oracle and to each other,\n"
                 "in float32 noise floors (0 = bitwise equal, grey = unknown)")
    save(fig, path)
    return None


# -- trajectory drift --------------------------------------------------------------------------------------
def _drift(run: RunResult, key: str, failed_only: bool = False) -> list[tuple[float, float]]:
    """(step, value) of equivalence.drift where both are finite and value > 0 (a log axis has no 0); with
    failed_only, only the entries whose ok is false."""
    return [(d["step"], d[key]) for d in run.equivalence.drift
            if is_number(d.get("step")) and is_number(d.get(key)) and d[key] > 0
            and (not failed_only or d.get("ok") is False)]


def _draw_bounds(ax: Axes, drawn: list[RunResult]) -> None:
    """The floor and the tolerance: once in grey when every run shares them, else faint per run."""
    for key, name, style in (("floor_rel_param_distance", "single process in the run dtype (floor)", "-"),
                             ("tolerance", "tolerance", "--")):
        series = [(run, s) for run in drawn if (s := _drift(run, key))]
        shared = len({tuple(s) for _, s in series}) == 1  # floor and tolerance depend on model, world size, dtype
        for i, (run, s) in enumerate(series[:1] if shared else series):
            ax.plot(*zip(*s), style, linewidth=1.2, **(dict(color="grey", label=name) if shared else dict(
                color=colour(run.backend), alpha=0.35, label=f"{name}, per run (faint)" if i == 0 else None)))


def plot_trajectory_drift(runs: list[RunResult], path: Path) -> str | None:
    """Each run's parameter distance to the float64 single-process trajectory by step (log y), the floor (a
    single process in the run dtype) in grey and the tolerance dashed, each once when all runs share it, else per
    run, faint in the run's colour; steps that failed ringed in red. Returns why it was skipped, or None when drawn."""
    drawn = [r for r in runs if _drift(r, "rel_param_distance")]
    if not drawn:
        return ("no run has a trajectory drift value (equivalence.drift is empty or its rel_param_distance null "
                "in every run: the trajectory check did not run)")
    fig = Figure(figsize=(6.5, 4.8), layout="constrained")
    ax = fig.add_subplot()
    _draw_bounds(ax, drawn)
    for run in drawn:
        ax.plot(*zip(*_drift(run, "rel_param_distance")), "-", color=colour(run.backend),
                marker=marker(run.backend), markersize=5, label=run.label)
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
    save(fig, path)
    return None
