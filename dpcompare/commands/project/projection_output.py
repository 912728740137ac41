"""What `project` prints: the predictions per backend and world size, the validation of the held-out world sizes
against the goal, the backends not fitted and the assumptions."""

from __future__ import annotations

from typing import Any


def _f(value: Any, fmt: str = "{:.1f}") -> str:
    return "n/a" if value is None else fmt.format(value)


def print_projection(payload: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:  # piped or captured: wide enough that no column is cut
        console = Console(width=140)
    link = payload["link"]
    table = Table(title=f"dpcompare project: {link['name']} (alpha {link['alpha_us']:.3g} us, beta "
                        f"{link['beta_GBps']:.4g} GB/s), fit on world sizes {payload['fit_world_sizes']}")
    for col in ("backend", "N", "compute ms", "comm ms", "exposed ms", "step ms", "efficiency", "algorithm"):
        table.add_column(col, justify="left" if col in ("backend", "algorithm") else "right", no_wrap=True)
    for p in payload["predictions"]:
        table.add_row(p["backend"], str(p["world_size"]), _f(p["compute_ms"]), _f(p["comm_total_ms"], "{:.2f}"),
                      _f(p["comm_exposed_ms"], "{:.2f}"), _f(p["step_ms"]), _f(p["efficiency"], "{:.2f}"),
                      p["algorithm"])
    console.print(table)
    v = payload.get("validation")
    if v is None:
        console.print("validation: no run held out (every measured world size is in the fit; --validate fits on the "
                      "two smallest)", highlight=False)
    else:
        if v.get("why_not"):
            console.print(f"validation: not done: {v['why_not']}", highlight=False)
        else:
            vt = Table(title=f"validation: fit on {payload['fit_world_sizes']}, predicted on {v['link']}, "
                             f"goal |error| <= {v['target']:.0%}")
            for col in ("backend", "N", "measured step ms", "predicted step ms", "error", "compute meas/pred",
                        "exposed meas/pred"):
                vt.add_column(col, justify="left" if col == "backend" else "right", no_wrap=True)
            for r in v["rows"]:
                err = r["error"]
                style = "green" if r["within_target"] else "red"
                vt.add_row(r["backend"], str(r["world_size"]), _f(r["measured_step_ms"]), _f(r["predicted_step_ms"]),
                           f"[{style}]{_f(None if err is None else err * 100, '{:+.1f}')} %[/]",
                           f"{_f(r['measured_compute_ms'])} / {_f(r['predicted_compute_ms'])}",
                           f"{_f(r['measured_exposed_ms'])} / {_f(r['predicted_exposed_ms'])}")
            console.print(vt)
            per: dict[str, list[str]] = {}
            for r in v["rows"]:
                per.setdefault(r["backend"], []).append(
                    f"{_f(None if r['error'] is None else r['error'] * 100, '{:+.1f}')} % at N={r['world_size']}")
            for backend, errs in per.items():
                console.print(f"validation error {backend}: {', '.join(errs)}", highlight=False)
            console.print(f"validation: max |error| {_f(None if v['max_abs_error'] is None else v['max_abs_error'] * 100)}"
                          f" %, {'within' if v['within_target'] else 'NOT within'} the {v['target']:.0%} goal",
                          highlight=False)
    for b, why in payload["skipped"].items():
        console.print(f"skipped {b}: {why}", highlight=False)
    console.print("assumptions:", highlight=False)
    for line in payload["assumptions"]:
        console.print(f"  - {line}", highlight=False, soft_wrap=True)

