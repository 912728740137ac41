"""The cost sections of report.md (what does it cost?): throughput and step time, communication, communication
by kind, memory and the model state per rank against the ZeRO formula, the runs that change a knob as rows of their
own in the last three; and the collective microbenchmarks."""

from __future__ import annotations

from typing import Any, Callable

from dpcompare.commands.report.derive import Derived, format_bytes, num
from dpcompare.commands.report.load import is_number, run_order
from dpcompare.commands.report.markdown import Footnotes, cell, table
from dpcompare.measure import consistency
from dpcompare.measure.bandwidth import bus_factor
from dpcompare.result_view import Metrics, RunResult


def _stragglers(value: list[Any]) -> str:
    shown = []
    for s in value:
        if not isinstance(s, dict):
            continue
        fraction, excess = s.get("slowest_fraction"), s.get("excess_ms_mean")
        shown.append(("**straggler** " if s.get("straggler") is True else "") + f"rank {s.get('rank')} ("
                     + (f"{fraction:.0%} slowest" if is_number(fraction) else "slowest")
                     + (f", {excess:+.3g} ms" if is_number(excess) else "") + ")")
    return "; ".join(shown) or "none"


def _waits(m: Metrics) -> str:
    """From the --profile traces: each rank's wait at the collectives for the last rank to arrive."""
    waits = m.comm_arrival_wait_ms_per_rank.value
    if not waits:
        return ""
    return "; waits at collectives (trace): " + ", ".join(
        f"rank {r} {w:.3g} ms" for r, w in enumerate(waits) if is_number(w))


def _time_rows(runs: list[RunResult], derived: list[Derived], tokens: bool, notes: Footnotes) -> list[list[str]]:
    rows = []
    for run, d in zip(runs, derived):
        m = run.metrics
        warm, measured, strag = m.warmup_steps.value, m.measured_steps, m.stragglers
        rows.append([
            run.backend, str(run.world_size), cell(m.samples_per_s, notes),
            *([cell(m.tokens_per_s, notes)] if tokens else []),
            f"{d.efficiency:.2f}" if d.efficiency is not None else notes.na(d.efficiency_reason),
            cell(m.step_ms_p50, notes), cell(m.step_ms_p90, notes), _compute_cell(m, notes),
            _exposed_cell(m, notes),
            num(d.other_ms) if d.other_ms is not None else notes.na(d.other_reason),
            cell(m.rank_spread_ms_p50, notes), cell(strag, notes, _stragglers) + _waits(m),
            cell(measured, notes, lambda v: f"{v}" + (f" (+{warm} warm-up)" if warm else ""))])
    return rows


def _compute_cell(m: Metrics, notes: Footnotes) -> str:
    """Compute, flagged in bold with its footnote when compute + exposed communication exceed the measured step."""
    text = cell(m.compute_ms_p50, notes)
    why = consistency.breakdown_flag(m)
    return text if why is None else f"**{text} (!)**" + notes.ref(why)


def _exposed_cell(m: Metrics, notes: Footnotes) -> str:
    """Exposed communication, flagged in bold with its footnote when it contradicts the total, marked (~) with
    its footnote when it is above the total only within its interval."""
    text = cell(m.comm_exposed_ms, notes)
    flag = consistency.exposed_flag(m)
    if flag is None:
        return text
    return (f"**{text} (!)**" if flag[0] == "!" else f"{text} (~)") + notes.ref(flag[1])


def _trace_cell(m: Metrics, notes: Footnotes) -> str:
    """Exposed communication read from the --profile traces, with the figure to trust footnoted where the two
    methods disagree (dpcompare.measure.trace.trust)."""
    text = cell(m.comm_exposed_trace_ms, notes)
    trust, why = m.comm_exposed_trust.value, m.comm_exposed_trust_why.value
    if m.comm_exposed_trace_ms.value is None or trust in (None, "both"):
        return text
    return f"{text} (trust: {trust})" + notes.ref(str(why))


def _link_cell(m: Metrics, notes: Footnotes) -> str:
    """The transport and what it chose (NCCL: algorithm/protocol by collective, the most used first)."""
    facts = m.comm_link.value
    if not facts:
        return cell(m.comm_link, notes)
    if facts.get("transport") == "nccl":
        chosen = facts.get("chosen") or {}
        picks = "; ".join(f"{kind} {', '.join(by)}" for kind, by in chosen.items())
        text = f"NCCL {facts.get('version') or '?'}" + (f": {picks}" if picks else "")
        return text if picks else text + notes.ref(str(facts.get("chosen_reason")))
    if facts.get("transport") == "gloo":
        return f"gloo {facts.get('algorithm', '?')} over {facts.get('device', '?')}"
    return " ".join(str(v) for v in (facts.get("transport"), facts.get("library")) if v)


def _comm_rows(runs: list[RunResult], derived: list[Derived], notes: Footnotes) -> list[list[str]]:
    rows = []
    for run, d in zip(runs, derived):
        m = run.metrics
        method = m.comm_total_method.value
        rows.append([
            run.backend, str(run.world_size), cell(m.grad_bytes_per_step, notes, format_bytes),
            cell(m.bucket_bytes, notes, format_bytes),
            cell(m.comm_total_ms, notes, lambda v: num(v) + (f" ({method})" if method else "")),
            cell(m.comm_transfer_ms, notes), _exposed_cell(m, notes), _trace_cell(m, notes),
            cell(m.overlap_fraction, notes, lambda v: f"{v:.0%}"),
            cell(m.tcomm_model_ms, notes), cell(m.algbw_gbps, notes), cell(m.busbw_gbps, notes),
            cell(m.microbench_busbw_gbps, notes), _link_cell(m, notes),
            f"{d.busbw_ratio:.2f}" if d.busbw_ratio is not None else notes.na(d.busbw_ratio_reason)])
    return rows


PARTS = ("params", "grads", "optimizer", "master_params", "comm_buffers")
STATE_HEADER = ["params", "grads", "optimizer", "fp32 master", "comm buffers"]


def _who(run: RunResult, with_knob: bool) -> list[str]:
    return [run.backend, str(run.world_size), *([run.knob_label or "-"] if with_knob else [])]


def _state_cells(run: RunResult, state: dict[str, Any] | None, state_reason: str | None, notes: Footnotes,
                 name: str = Metrics.model_state_mib.name) -> list[str]:
    """params, grads, optimizer, fp32 master, comm buffers (marked (a) with its footnote where analytic), total."""
    cells = []
    for part in (*PARTS, "total"):
        value = state.get(part, 0.0 if part == "master_params" and state else None) if state is not None else None
        if not is_number(value):
            cells.append(notes.na(state_reason or run.metrics.reasons.get(f"{name}.{part}")
                                  or f"{name}.{part} is {'null' if value is None else repr(value)} and no reason was recorded"))
            continue
        text = num(value)
        method = state.get("comm_buffers_method") if isinstance(state, dict) else None
        if part == "comm_buffers" and isinstance(method, str) and method.startswith("analytic"):
            text += " (a)" + notes.ref(f"comm buffers {method}")
        cells.append(text)
    return cells


def _formula_cell(run: RunResult, notes: Footnotes) -> str:
    formula, why = run.metrics.model_state_formula_mib.value, run.metrics.model_state_formula_mib.reason
    if formula is None or not is_number(formula.get("total")):
        return notes.na(why or "no ZeRO formula recorded (results written before it was)")
    return f"{num(formula['total'])} (ZeRO-{formula.get('stage', '?')})" + notes.ref(str(formula.get("formula", "")))


def _memory_rows(runs: list[RunResult], notes: Footnotes, with_knob: bool = False) -> list[list[str]]:
    rows = []
    for run in runs:
        state, state_reason = run.metrics.model_state_mib.value, run.metrics.model_state_mib.reason
        method = state.get("method") if isinstance(state, dict) else None
        source = ("-" if state is None else f"census, rank {state['rank']}" if isinstance(state.get("rank"), int)
                  else "analytic" + (notes.ref(method) if method else ""))
        rows.append([*_who(run, with_knob), cell(run.metrics.peak_mem_mib, notes),
                     *_state_cells(run, state, state_reason, notes), _formula_cell(run, notes), source])
    return rows


def _per_rank_rows(runs: list[RunResult], notes: Footnotes, with_knob: bool) -> list[list[str]]:
    """Every rank's census, then the ZeRO formula's row (its text in a footnote) for each run that has either."""
    rows = []
    for run in runs:
        ranks, ranks_reason = run.metrics.model_state_mib_per_rank.value, run.metrics.model_state_mib_per_rank.reason
        formula = run.metrics.model_state_formula_mib.value
        if ranks is None and formula is None:
            continue
        if ranks is not None:
            rows += [[*_who(run, with_knob), str(r), *_state_cells(run, c if isinstance(c, dict) else None,
                                                                     None if isinstance(c, dict) else "no census",
                                                                     notes, Metrics.model_state_mib_per_rank.name)]
                     for r, c in enumerate(ranks)]
        else:
            rows.append([*_who(run, with_knob), "each", *[notes.na(ranks_reason or "no per-rank census")] * 6])
        if formula is not None:
            parts = [num(formula[p]) if is_number(formula.get(p)) else "-" for p in PARTS[:-1]]
            rows.append([*_who(run, with_knob), f"**ZeRO-{formula.get('stage', '?')} formula**"
                         + notes.ref(str(formula.get("formula", ""))), *parts, "-",
                         num(formula["total"]) if is_number(formula.get("total")) else "-"])
    return rows


def _comm_kind_rows(runs: list[RunResult], notes: Footnotes, with_knob: bool) -> list[list[str]]:
    """One row per collective kind a run predicted or measured, and a bus-traffic total against DDP's all-reduce."""
    def shown(value: Any, fmt: Callable[[Any], str] = num) -> str:
        return fmt(value) if is_number(value) else "-"

    rows = []
    for run in runs:
        kinds = run.metrics.comm_by_kind.value
        if kinds is None:
            continue
        for kind, row in kinds.items():
            if not isinstance(row, dict):
                continue
            method = str(row.get("method") or "no method recorded")
            measured, analytic = row.get("bytes_per_step"), row.get("analytic_bytes_per_step")
            rows.append([*_who(run, with_knob), kind.replace("_", "-"),
                         (format_bytes(measured) if is_number(measured) else "n/a") + notes.ref(method),
                         shown(analytic, format_bytes) + (notes.ref(str(row["analytic_method"]))
                                                          if row.get("analytic_method") and is_number(analytic) else ""),
                         shown(row.get("calls_per_step")),
                         shown(row.get("ms_per_step")), shown(row.get("ms_per_step_max")), shown(row.get("busbw_gbps"))])
        grad, n = run.metrics.grad_bytes_per_step.value, run.world_size
        ddp = grad * bus_factor("all_reduce", n) if is_number(grad) and n > 1 else None
        analytic = sum(r.get("analytic_bus_bytes_per_step") or 0 for r in kinds.values() if isinstance(r, dict))
        measured_all = [r.get("bus_bytes_per_step") for r in kinds.values() if isinstance(r, dict)]
        measured = sum(measured_all) if measured_all and all(is_number(v) for v in measured_all) else None
        ratio = lambda v: f" ({v / ddp:.2f}x DDP)" if ddp and is_number(v) else ""
        rows.append([*_who(run, with_knob), "**bus total**",
                     (format_bytes(measured) + ratio(measured)) if measured is not None else "n/a",
                     format_bytes(analytic) + ratio(analytic), "", "", "", ""])
    return rows


def cost_sections(runs: list[RunResult], derived: list[Derived], notes: Footnotes,
                  knob_runs: list[RunResult] | tuple = ()) -> list[str]:
    """The cost tables; `knob_runs` (ZeRO stages, FSDP without resharding, sweep knobs: runs that change a knob from
    their backend's baseline) join the memory and communication-by-kind tables as rows of their own."""
    # One table after the other, so the footnote numbers run in reading order.
    tokens = any(r.metrics.tokens_per_s.value is not None for r in runs)
    both = [*runs, *sorted(knob_runs, key=lambda r: (run_order(r), r.knob_label))]
    with_knob = bool(knob_runs)
    var = ["knob"] if with_knob else []
    lines = [
        "### Throughput and step time", "",
        "Scaling efficiency = samples/s at N / (N x samples/s of the scaling baseline, the run at world size 1 "
        "whose capabilities.scaling_baseline is true). Times are p50 over measured steps of the slowest rank, in "
        "ms. compute is forward and backward with gradient synchronisation switched off, exposed comm the "
        "synced minus that unsynced step, both from the ablation's interleaved pairs (which do not update the "
        "weights); other = step - compute - exposed comm, floored at 0: the optimizer step, the backend's own "
        "communication counters (they run in the measured window only: DDP's per-iteration logging, Horovod's "
        "timeline, DeepSpeed's synchronising timers) and drift of the machine between the two windows. "
        "--no-instrument switches the counters off. When compute + exposed comm exceed the step by more than 10 %, "
        "the machine was slower during the ablation than during the measured steps: compute is bold with (!) and "
        "other is n/a, with the reason.", "",
        *table(["backend", "ws", "samples/s", *(["tokens/s"] if tokens else []), "scaling eff.", "step p50",
                "step p90", "compute p50", "exposed comm", "other", "rank spread p50", "stragglers",
                "measured steps"], _time_rows(runs, derived, tokens, notes)), ""]
    lines += [
        "### Communication", "",
        "Total comm is the backend's own counter (method in brackets) on the rank that spent longest in "
        "communication, its wait for the other ranks included; transfer is the same counter on the rank that "
        "spent least there (Horovod: ALLREDUCE without negotiation). Exposed comm is the ablation (synced - "
        "unsynced step of the slowest rank, its wait included too); exposed (trace) is the same read from the "
        "--profile traces: time up to the end of the reduce with a collective in flight and no compute running, on "
        "the rank that arrived last. Bandwidths in GB/s follow nccl-tests, from "
        "the transfer time (busbw = algbw x 2(N-1)/N for all-reduce).", "",
        *table(["backend", "ws", "grad bytes/step", "bucket", "total comm (ms)", "transfer (ms)",
                "exposed comm (ms)", "exposed (trace, ms)", "overlap",
                "model t_comm (ms)", "algbw", "busbw", "microbench busbw", "link", "busbw / microbench"],
               _comm_rows(runs, derived, notes)), ""]
    kind_rows = _comm_kind_rows(both, notes, with_knob)
    if kind_rows:
        lines += [
            "#### Communication by kind (per optimizer step)", "",
            "Bytes are nccl-tests' count, the full buffer (all-gather: the gathered output, reduce-scatter: the input), "
            "measured on rank 0 where the collective passed torch.distributed's Python functions during the measured "
            "window (n/a where none did: DDP's C++ Reducer, Horovod's runtime), beside the volume the ZeRO paper's "
            "accounting predicts from what the backend shards. ms is the rank that spent least in the kind (median "
            "per step of the union of its calls; an async call lasts until its wait() returns), max the rank that "
            "spent most; busbw = bytes / ms x 2(N-1)/N (all-reduce), (N-1)/N (all-gather, reduce-scatter) or 1. "
            "The bus total weighs every kind by its factor: ZeRO-1/2 predict 1x, ZeRO-3 and FSDP with resharding 1.5x "
            "DDP's all-reduce.", "",
            *table(["backend", "ws", *var, "kind", "measured bytes", "analytic bytes", "calls", "ms", "ms (max rank)",
                    "busbw (GB/s)"], kind_rows), ""]
    lines += [
        "### Memory (MiB)", "",
        "Model state measured on every rank after the reduce of the last measured step (the tensors the backend lists, "
        "each storage byte once; comm buffers marked (a) are the backend's analytic figure), here the rank with the "
        "largest total, beside the ZeRO paper's formula for the same model, precision, optimizer and stage "
        "(Rajbhandari et al. 2020; it leaves out comm buffers and the fp32 copies a backend keeps beyond it).", "",
        *table(["backend", "ws", *var, "peak", *STATE_HEADER, "model state total", "ZeRO formula total", "measured by"],
               _memory_rows(both, notes, with_knob)), ""]
    per_rank = _per_rank_rows(both, notes, with_knob)
    if per_rank:
        lines += [
            "#### Model state per rank against the ZeRO formula (MiB)", "",
            *table(["backend", "ws", *var, "rank", *STATE_HEADER, "total"], per_rank), ""]
    return lines


def microbench_section(entries: list[dict[str, Any]], unavailable: list[dict[str, Any]]) -> list[str]:
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
                     "-" if top is None else num(top["busbw_gbps"]),
                     "-" if top is None else format_bytes(top["bytes"]), ", ".join(wrong) or "none"])
    rows += [[str(u.get("transport")), "-", "-", "-", f"unavailable: {u.get('reason')}", "0", "-", "-", "-"]
             for u in unavailable]
    return ["### Collective microbenchmarks", "",
            *table(["transport", "backend", "N", "device", "status", "sizes", "best busbw (GB/s)", "at",
                    "wrong results at"], rows), ""]
