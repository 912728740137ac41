"""The sweep section of report.md (one knob at a time): each run that changes a knob from its backend's baseline (a
--sweep knob, another precision recipe, a named variant such as a ZeRO stage; its knobs as it recorded them) with its
verdict and its costs."""

from __future__ import annotations

from dpcompare import verdict_words as words
from dpcompare.commands.report.derive import fmt_sweep, num
from dpcompare.commands.report.load import is_number, run_order
from dpcompare.commands.report.markdown import table, verdict_cell
from dpcompare.result_view import RunResult


def _model_state_cell(run: RunResult) -> str:
    """The model state (the largest rank's census, or the analytic figure), its fp32 masters, the ZeRO formula's total."""
    state = run.metrics.model_state_mib.value
    if state is None or not is_number(state.get("total")):
        return "n/a"
    master = state.get("master_params")
    formula = run.metrics.model_state_formula_mib.value
    extra = [f"{num(master)} fp32 master"] if is_number(master) and master > 0 else []
    if formula is not None and is_number(formula.get("total")):
        extra.append(f"ZeRO-{formula.get('stage', '?')} formula {num(formula['total'])}")
    return num(state["total"]) + (f" ({'; '.join(extra)})" if extra else "")


def sweep_section(knob_runs: list[RunResult]) -> list[str]:
    if not knob_runs:
        return []
    rows = [[r.backend, str(r.world_size), r.knob_label, verdict_cell(str(r.equivalence.verdict)),
             fmt_sweep(r.equivalence.max_rel_fro_err.value, words.REL_ERR),
             fmt_sweep(r.metrics.step_ms_p50.value, ".2f"), fmt_sweep(r.metrics.comm_exposed_ms.value, ".2f"),
             fmt_sweep(r.metrics.busbw_gbps.value, ".3f"), _model_state_cell(r)]
            for r in sorted(knob_runs, key=lambda r: (run_order(r), r.knob_label))]
    return ["## Sweep (one knob at a time)", "",
            "Each row changes one knob from the baseline run of the same backend and world size (compare --sweep; "
            "under compare --amp, deepspeed's engine recipe).", "",
            *table(["backend", "ws", "knob", "verdict", "max rel fro err", "step p50 (ms)", "exposed comm (ms)",
                    "busbw (GB/s)", "model state (MiB)"], rows), ""]
