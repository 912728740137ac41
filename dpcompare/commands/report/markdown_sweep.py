"""The sweep section of report.md (one knob at a time): each variant of a baseline run (a --sweep knob, another
precision recipe, a backend variant such as a ZeRO stage) with its verdict and its costs."""

from __future__ import annotations

from typing import Any

from dpcompare.commands.report.derive import fmt_sweep, num, variant_of
from dpcompare.commands.report.load import is_number, metric, raw_metric, run_order
from dpcompare.commands.report.markdown import table, verdict_cell


def _model_state_cell(run: dict[str, Any]) -> str:
    """The model state (the largest rank's census, or the analytic figure), its fp32 masters, the ZeRO formula's total."""
    state = metric(run, "model_state_mib")[0]
    if not isinstance(state, dict) or not is_number(state.get("total")):
        return "n/a"
    master = state.get("master_params")
    formula = raw_metric(run, "model_state_formula_mib")[0]
    extra = [f"{num(master)} fp32 master"] if is_number(master) and master > 0 else []
    if isinstance(formula, dict) and is_number(formula.get("total")):
        extra.append(f"ZeRO-{formula.get('stage', '?')} formula {num(formula['total'])}")
    return num(state["total"]) + (f" ({'; '.join(extra)})" if extra else "")


def sweep_section(variants: list[dict[str, Any]]) -> list[str]:
    if not variants:
        return []
    rows = [[str(r["backend"]), str(r["world_size"]), variant_of(r),
             verdict_cell(str(r.get("equivalence", {}).get("verdict"))),
             fmt_sweep(r.get("equivalence", {}).get("max_rel_fro_err"), ".2e"),
             fmt_sweep(metric(r, "step_ms_p50")[0], ".2f"), fmt_sweep(metric(r, "comm_exposed_ms")[0], ".2f"),
             fmt_sweep(metric(r, "busbw_gbps")[0], ".3f"), _model_state_cell(r)]
            for r in sorted(variants, key=lambda r: (run_order(r), variant_of(r)))]
    return ["## Sweep (one knob at a time)", "",
            "Each row changes one knob from the baseline run of the same backend and world size (compare --sweep; "
            "under compare --amp, deepspeed's engine recipe).", "",
            *table(["backend", "ws", "knob", "verdict", "max rel fro err", "step p50 (ms)", "exposed comm (ms)",
                    "busbw (GB/s)", "model state (MiB)"], rows), ""]
