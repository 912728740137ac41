"""The measurement phase's figures of a result, each declared once (`Metrics.step_ms_p50` reads metrics.step_ms_p50)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from dpcompare.result_view.figures import Field, Figure, View, is_number, mapping

# -- the metrics --------------------------------------------------------------------------------------------
NO_METRICS = "this result has no metrics (written before dpcompare recorded them)"
MEASURED_NOTHING = ("the run measured nothing (metrics: null): pass --measure-steps N, e.g. compare "
                    "--run-arg=--measure-steps=20")


@dataclass(frozen=True, slots=True)
class Metrics(View):
    """The measurement phase's figures (units in the names); a missing one reads with its recorded reason."""

    raw: Mapping[str, Any]
    measured: bool = True
    """False: the run measured nothing (metrics: null), or the result predates metrics (`written`: False)."""
    written: bool = True
    path = "metrics"

    samples_per_s = Field()
    tokens_per_s = Field()
    step_ms_p50 = Field()
    step_ms_p90 = Field()
    step_ms = Field(list)
    """The measured steps' times, slowest rank, warm-up excluded."""
    warmup_steps = Field()
    measured_steps = Field()
    rank_spread_ms_p50 = Field()
    stragglers = Field(list)
    straggler_rank = Field()
    straggler_excess_ms = Field()
    compute_ms_p50 = Field()
    comm_exposed_ms = Field()
    comm_exposed_ci_ms = Field(list)
    comm_exposed_trace_ms = Field()
    """Exposed communication read from the --profile traces (dpcompare.measure.trace), beside the ablation's."""
    comm_exposed_trace_ms_per_rank = Field(list)
    comm_trace_ms = Field()
    comm_arrival_wait_ms_per_rank = Field(list)
    comm_exposed_trace_ratio = Field()
    comm_slowed_compute_trace_ms = Field()
    comm_exposed_trust = Field(str)
    comm_exposed_trust_why = Field(str)
    comm_total_ms = Field()
    comm_total_method = Field(str)
    comm_transfer_ms = Field()
    comm_interference_ms = Field()
    comm_ablation_ms = Field()
    ablation_pairs = Field()
    overlap_fraction = Field()
    grad_bytes_per_step = Field()
    bucket_bytes = Field()
    tcomm_model_ms = Field()
    algbw_gbps = Field()
    busbw_gbps = Field()
    microbench_busbw_gbps = Field()
    busbw_vs_microbench = Field()
    peak_mem_mib = Field()
    peak_above_start_mib = Field()
    model_state_mib = Field(dict)
    model_state_mib_per_rank = Field(list)
    model_state_formula_mib = Field(dict)
    comm_by_kind = Field(dict)
    comm_link = Field(dict)
    profile = Field(dict)
    """--profile: {steps, traces (one Chrome/Perfetto JSON per rank), phases}."""
    """The transport's facts beside busbw: what NCCL chose, gloo's ring, the MPI library (dpcompare.measure.link)."""
    scaling = Field(str)
    compute_dtype = Field(str)
    model_flops_per_sample = Field()
    peak_tflops_measured = Field()
    peak_tflops_datasheet = Field()
    mfu = Field()
    """Model FLOPs utilisation against the matmul microbenchmark's peak (dpcompare.measure.flops)."""
    mfu_datasheet = Field()

    def figure(self, field: Field) -> Figure:
        if not self.measured:
            return Figure(None, MEASURED_NOTHING if self.written else NO_METRICS)
        value = self.raw.get(field.name)
        if value is not None:
            return Figure(value) if field.accepts(value) else Figure(None, field.wrong(self.path, value))
        why = self.reasons.get(field.name)
        return Figure(None, str(why) if why else
                      f"metrics.{field.name} is {'null' if field.name in self.raw else 'absent'} and no reason was "
                      "recorded")

    @property
    def reasons(self) -> Mapping[str, Any]:
        """Why each null figure is null (keys as `model_state_mib.params` for a part of one)."""
        return mapping(self.raw.get("reasons"))

    def state_total(self) -> float | None:
        """model_state_mib.total: parameters, gradients, optimizer state, fp32 masters and communication buffers."""
        total = mapping(self.model_state_mib.value).get("total")
        return total if is_number(total) else None
