"""What every plot of the report shares: the PNG file names, each backend's colour and marker (in
dpcompare.run.registry.BACKENDS order, so a backend looks the same in every figure), and saving a figure
atomically."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from matplotlib import colormaps
from matplotlib.figure import Figure

from dpcompare.commands.report.load import backend_index
from dpcompare.json_files import atomic_file
from dpcompare.run.registry import BACKENDS

DPI = 150
PLOT_THROUGHPUT = "throughput_vs_world_size.png"
PLOT_BREAKDOWN = "step_breakdown.png"
PLOT_BUSBW = "busbw_vs_message_size.png"
PLOT_HEATMAP = "grad_error_heatmap.png"
PLOT_TRAJECTORY = "trajectory_drift.png"
ALL_PLOTS = (PLOT_THROUGHPUT, PLOT_BREAKDOWN, PLOT_BUSBW, PLOT_HEATMAP, PLOT_TRAJECTORY)
TRAINING_MARKERS = ("*", "D", "^", "v", "P", "X", "s", "p", "h")
_MARKERS = ("o", "s", "D", "^", "v", "P", "X")


def colour(backend: str) -> Any:
    index = backend_index(backend)
    if index is None:
        index = len(BACKENDS) + sum(map(ord, backend)) % 5
    return colormaps["tab10"](index % 10)


def marker(backend: str) -> str:
    # Distinct markers keep points visible where backends coincide (reference and dp at world size 1).
    index = backend_index(backend)
    return _MARKERS[(index if index is not None else sum(map(ord, backend))) % len(_MARKERS)]


def save(fig: Figure, path: Path) -> None:
    with atomic_file(path, "wb") as f:
        fig.savefig(f, format="png", dpi=DPI, bbox_inches="tight")
