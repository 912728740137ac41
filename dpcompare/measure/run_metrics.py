"""A run's metrics dict: rank 0 assembles every rank's samples into figures whose names carry their units.

Owns: `summarize`, the order the figures are written in (a result's metrics keep it) and the run's facts recorded as
handed over (scaling, warmup_steps, comm_link, profile). Each figure is written by the module of the concern it
measures, in this order:

  time           step_time.record_step_times  measured_steps, step_ms_*, rank_spread_ms_p50, samples_per_s,
                                              tokens_per_s
                 flops.record_mfu             compute_dtype, model_flops_per_sample, peak_tflops_*, mfu, mfu_datasheet
  communication  comm.record_native           comm_total_*, comm_transfer_ms, comm_native_* (the backend's counter)
  time           step_time.record_stragglers  stragglers, straggler_rank, straggler_excess_ms
  communication  ablation.record_ablation     compute_ms_p50, step_synced_*, step_unsynced_ms, comm_ablation_*,
                                              comm_exposed_ms, comm_interference_ms, comm_exposed_ci_ms, ablation_pairs
                 ablation.record_overlap      overlap_fraction
                 bandwidth.record_bandwidth   grad_bytes_per_step, bucket_bytes, algbw_gbps, busbw_gbps,
                                              microbench_busbw_gbps, busbw_vs_microbench, tcomm_model_ms
  memory         memory.record_memory         peak_mem_*, mem_method, peak_above_start_*, model_state_*
  communication  volume.record_by_kind        comm_by_kind
                 trace.record_traced          comm_exposed_trace_*, comm_trace_ms, comm_arrival_wait_ms_per_rank,
                                              comm_slowed_compute_trace_ms, comm_exposed_trust*
Each module's docstring defines its figures. The clocks and the memory window that took the samples are in
dpcompare.measure.clocks; whether a recorded result's figures hold together in dpcompare.measure.consistency.
Imports no adapter.
"""

from __future__ import annotations

from typing import Any

from dpcompare.measure import ablation, bandwidth, comm, flops, memory, step_time, trace, volume
from dpcompare.measure.samples import Metrics, RankSample


def summarize(
    samples: list[RankSample],
    *,
    world_size: int,
    local_batch: int,
    tokens_per_sample: int,
    warmup_steps: int,
    grad_bytes: int,
    message_bytes: int | None,
    message_reason: str | None,
    model_state: dict[str, float | None],
    microbench_busbw: float | None,
    microbench_reason: str | None,
    scaling: str,
    comm_possible: str | None,
    instrumented: bool = True,
    model_state_formula: dict[str, Any] | None = None,
    model_state_formula_reason: str | None = None,
    comm_analytic: dict[str, int] | None = None,
    comm_analytic_method: str = "",
    comm_measured_reason: str | None = None,
    comm_replicas: int = 1,
    flops_facts: dict[str, Any] | None = None,
    traced: list[dict[str, Any] | None] | None = None,
    link: dict[str, Any] | None = None,
    profile: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Rank 0 turns the gathered per-rank samples into the run's metrics (units in the names). `model_state` is the
    analytic model state, used only where a rank took no census; `comm_analytic` the predicted bytes per step by
    kind (dpcompare.measure.volume.analytic_bytes_per_step; None: no communication, comm_by_kind is None),
    `comm_measured_reason` why the collective recorder did not run (None: it did, on every rank that has
    `collectives`); `comm_replicas` the backend's capabilities.shard_replicas (HSDP: the ranks each kind spans);
    `traced` each rank's figure read from its --profile trace (dpcompare.measure.trace.rank_figure; None: not
    profiled); `link` the transport's facts (dpcompare.measure.link; None: one process)."""
    m = Metrics()
    m.set("scaling", scaling)
    m.set("warmup_steps", warmup_steps)
    why_no_steps = ("instrumentation off (--no-instrument): only loop_ms_per_step is measured" if not instrumented
                    else "no measured steps (--measure-steps 0)")
    per_rank, p50 = step_time.record_step_times(m, samples, world_size * local_batch, tokens_per_sample,
                                                why_no_steps)
    flops.record_mfu(m, flops_facts, local_batch / (p50 / 1e3) if p50 else None,
                     why_no_steps if not instrumented else "not measured")
    total, transfer = comm.record_native(m, samples, comm_possible)
    step_time.record_stragglers(m, samples, per_rank)
    exposed, interval = ablation.record_ablation(
        m, samples, comm_possible, why_no_steps if not instrumented else "no ablation steps ran (--ablation-steps 0)",
        total)
    ablation.record_overlap(m, total, exposed)
    bandwidth.record_bandwidth(m, transfer, grad_bytes, message_bytes, message_reason, world_size, microbench_busbw,
                               microbench_reason, comm_possible)
    memory.record_memory(m, samples, model_state, model_state_formula, model_state_formula_reason)
    volume.record_by_kind(m, samples, world_size, comm_analytic, comm_analytic_method, comm_measured_reason,
                          comm_replicas)
    trace.record_traced(m, traced, exposed, interval)
    m.set("comm_link", link, "one process: its gradients cross no link")
    m.set("profile", profile, "not asked for (--profile)")
    return m.to_dict()
