"""The projected-scaling plot: a projection JSON (python -m dpcompare project, kind: projection) drawn as step time
and scaling efficiency against world size per backend, lines for the prediction and markers for the measured runs
(open markers: the runs held out of the fit, which the prediction is validated against)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from dpcompare.commands.report.plots_cost import world_size_axes
from dpcompare.commands.report.style import colour, marker, save

PLOT_PROJECTION = "projected_scaling.png"


def find_projection(in_dir: Path) -> dict[str, Any] | None:
    """The newest readable projection JSON directly in in_dir (projection*.json), or None."""
    found = []
    for path in sorted(Path(in_dir).glob("projection*.json")):
        try:
            obj = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            continue
        if isinstance(obj, dict) and obj.get("kind") == "projection" and isinstance(obj.get("predictions"), list):
            found.append(obj)
    return max(found, key=lambda o: o.get("created_unix") or 0) if found else None


def projection_caption(projection: dict[str, Any] | None) -> str:
    if not projection:
        return ""
    link = projection.get("link") or {}
    v = projection.get("validation") or {}
    text = (f"Lines: predicted by `dpcompare project` on link {link.get('name')} (alpha {link.get('alpha_us', 0):.3g} us, "
            f"beta {link.get('beta_GBps', 0):.4g} GB/s), fitted on world sizes {projection.get('fit_world_sizes')}; "
            "filled markers: measured runs used by the fit, open markers: measured runs held out.")
    if v.get("max_abs_error") is not None:
        text += f" Held-out step time error at most {v['max_abs_error']:.0%} (goal {v.get('target', 0.15):.0%})."
    return text


def plot_projection(projection: dict[str, Any] | None, path: Path) -> str | None:
    """Draw the projection; returns why it was skipped, or None when drawn."""
    if projection is None:
        return "no projection JSON in the folder (python -m dpcompare project DIR --world-sizes ... --link ...)"
    preds = [p for p in projection.get("predictions") or [] if isinstance(p.get("step_ms"), (int, float))]
    if not preds:
        return "the projection JSON holds no prediction"
    v = projection.get("validation") or {}
    if v.get("link") == (projection.get("link") or {}).get("name"):  # the held-out predictions are on the same link
        preds = preds + [{"backend": r["backend"], "world_size": r["world_size"], "step_ms": r["predicted_step_ms"],
                          "efficiency": None} for r in v.get("rows") or []
                         if isinstance(r.get("predicted_step_ms"), (int, float))]
    fit = set(projection.get("fit_world_sizes") or [])
    measured = [m for m in projection.get("measured") or [] if isinstance(m.get("step_ms"), (int, float))]
    fig = Figure(figsize=(13, 4.8), layout="constrained")
    ax_step, ax_eff = fig.subplots(1, 2)
    backends = list(dict.fromkeys(p["backend"] for p in preds))
    for backend in backends:
        pts = sorted((p["world_size"], p["step_ms"], p.get("efficiency")) for p in preds if p["backend"] == backend)
        c = colour(backend)
        ax_step.plot([x for x, _, _ in pts], [y for _, y, _ in pts], "--", color=c, label=f"{backend} predicted")
        ax_eff.plot([x for x, _, e in pts if e is not None], [e for _, _, e in pts if e is not None], "--", color=c,
                    label=f"{backend} predicted")
        for m in measured:
            if m["backend"] != backend:
                continue
            face = c if m["world_size"] in fit else "none"
            style = dict(marker=marker(backend), color=c, markerfacecolor=face, markersize=8, linestyle="none")
            ax_step.plot([m["world_size"]], [m["step_ms"]], **style)
            if m.get("efficiency") is not None:
                ax_eff.plot([m["world_size"]], [m["efficiency"]], **style)
    sizes = sorted({p["world_size"] for p in preds} | {m["world_size"] for m in measured})
    world_size_axes([ax_step, ax_eff], sizes, legend=False)
    steps = [p["step_ms"] for p in preds] + [m["step_ms"] for m in measured]
    if min(steps) > 0 and max(steps) / min(steps) >= 20:
        ax_step.set_yscale("log")
    else:
        ax_step.set_ylim(bottom=0)
    ax_step.set_ylabel("step time (ms)")
    ax_step.set_title(f"Projected step time ({(projection.get('link') or {}).get('name')})")
    ax_step.legend(fontsize=8)
    ax_eff.set_ylim(bottom=0)
    ax_eff.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:.0%}"))
    ax_eff.set_ylabel("scaling efficiency (vs the backend at world size 1)")
    ax_eff.set_title("Projected scaling efficiency")
    save(fig, path)
    return None
