"""The run's metrics: rank 0 turns every rank's samples into figures whose names carry their units.

Owns: percentiles, stragglers and `summarize` (the arithmetic of every reported figure). The clocks and the
memory window are in dpcompare.measure.clocks, bandwidth formulas in dpcompare.measure.bandwidth, native
communication counters' arithmetic in dpcompare.measure.comm, and whether a recorded result's figures hold together
(exposed communication against the total, the step breakdown) in dpcompare.measure.consistency. Imports no adapter
and no torch.

Definitions:
  step time            forward + backward + reduce + optimizer step, excluding the equivalence check;
                       a step is as slow as its slowest rank
  compute time         the same step with gradient synchronisation switched off, timed up to where the synced
                       step's reduce ends (both arms of the ablation leave the optimizer step out, so they differ
                       only by communication)
  exposed comm         the ablation: each paired measured step (synced arm, timed up to its reduce) is followed by
                       the same batch with gradient sync off (unsynced arm, timed up to the same point); the
                       difference is the median over pairs of synced - unsynced (`comm_ablation_ms`), exposed is
                       that difference bounded by the total: min(difference, total), the rest
                       (`comm_interference_ms`) the computation slowed by the collectives beside it, not
                       communication; a 95 % bootstrap interval over the pairs, bounded the same way
  total comm           the backend's own counter (DDP logging data, Horovod timeline with negotiation,
                       DeepSpeed timers) on the rank that spent longest in communication, its wait for the
                       other ranks included (the ablation's exposed figure includes that wait too)
  transfer             the same counter on the rank that spent least there (Horovod: ALLREDUCE alone)
  overlap fraction     1 - exposed / total
  algbw, busbw         nccl-tests: algbw = bytes / transfer time, all-reduce busbw = algbw * 2(n-1)/n, in GB/s
  T_comm model         2 * P * (N-1) / (N * B), B = the microbenchmark's busbw at the run's message size
  model state          each rank's census of the tensors its adapter lists (model_state_tensors) after the reduce of
                       the last measured step, each storage byte once; model_state_mib is the largest rank's, beside
                       the ZeRO paper's formula for the run's model, precision, optimizer and stage
  comm by kind         bytes, calls and time per step of all-reduce, reduce-scatter, all-gather (broadcast, reduce)
                       where Python dispatched them, beside the analytic volume; busbw with nccl-tests' factor per kind
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dpcompare.measure import trace
from dpcompare.measure.bandwidth import algbw_gbps, busbw_gbps, tcomm_model_ms
from dpcompare.measure.volume import comm_by_kind


# -- arithmetic ------------------------------------------------------------------------------------
def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "mean": None}
    a = np.asarray(values, dtype=float)
    return {"p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)), "mean": float(a.mean())}


def stragglers(per_rank_ms: list[list[float]], threshold: float = 0.10) -> list[dict[str, Any]]:
    """Per rank: how often it is the slowest and by how much it exceeds the median rank, per step.
    A rank is flagged when it is the slowest in more than half the steps and its median excess is above
    `threshold` of the median step time (the median: a few steps the scheduler stalled on a shared box do not make
    a straggler; a rank slow in most steps does)."""
    if len(per_rank_ms) < 2 or not per_rank_ms[0]:
        return []
    a = np.asarray(per_rank_ms, dtype=float)  # ranks x steps
    median = np.median(a, axis=0)
    slowest = np.argmax(a, axis=0)
    out = []
    for rank in range(a.shape[0]):
        excess = float(np.mean(a[rank] - median))
        typical = float(np.median(a[rank] - median))
        fraction = float(np.mean(slowest == rank))
        out.append({"rank": rank, "slowest_fraction": fraction, "excess_ms_mean": excess, "excess_ms_median": typical,
                    "straggler": fraction > 0.5 and typical > threshold * float(np.median(median))})
    return out


@dataclass(slots=True)
class RankSample:
    """What one rank measured, gathered to rank 0."""

    step_ms: list[float]
    synced_ms: list[float]
    unsynced_ms: list[float]
    memory: dict[str, float | None]
    memory_reason: str | None
    comm: dict[str, Any] | None
    """Native counter over the measured window: {'total_ms', 'overlap_ms', 'steps', 'method'} or {'reason'}."""
    model_state: dict[str, Any] | None = None
    """This rank's model-state census in MiB (dpcompare.measure.memory.census_mib), or None when none was taken."""
    collectives: dict[str, Any] | None = None
    """This rank's Python collectives by kind (dpcompare.measure.collectives.CollectiveRecorder.record), or None."""


@dataclass(slots=True)
class Metrics:
    values: dict[str, Any] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)

    def set(self, name: str, value: Any, reason: str | None = None) -> None:
        self.values[name] = value
        if value is None:
            self.reasons[name] = reason or "not measured"

    def to_dict(self) -> dict[str, Any]:
        return {**self.values, "reasons": self.reasons}


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
    per_rank = _step_times(m, samples, world_size * local_batch, tokens_per_sample, why_no_steps)
    p50 = percentiles(np.max(np.asarray(per_rank), axis=0).tolist() if per_rank and per_rank[0] else [])["p50"]
    record_mfu(m, flops_facts, local_batch / (p50 / 1e3) if p50 else None,
                 why_no_steps if not instrumented else "not measured")
    total, transfer = _native_comm(m, samples, comm_possible)
    exposed, interval = _ablation(m, samples, per_rank, comm_possible,
                        why_no_steps if not instrumented else "no ablation steps ran (--ablation-steps 0)", total)
    if total and exposed is not None:
        m.set("overlap_fraction", min(max(1.0 - exposed / total, 0.0), 1.0))
    else:
        m.set("overlap_fraction", None, "needs both total and exposed communication time")
    m.set("grad_bytes_per_step", grad_bytes)
    m.set("bucket_bytes", message_bytes, message_reason)
    _bandwidth(m, transfer, grad_bytes, world_size, microbench_busbw, microbench_reason, comm_possible)
    _memory(m, samples, model_state, model_state_formula, model_state_formula_reason)
    _by_kind(m, samples, world_size, comm_analytic, comm_analytic_method, comm_measured_reason, comm_replicas)
    record_traced(m, traced, exposed, interval)
    m.set("comm_link", link, "one process: its gradients cross no link")
    m.set("profile", profile, "not asked for (--profile)")
    return m.to_dict()


def record_traced(m: Metrics, figures: list[dict[str, Any] | None] | None, ablation: float | None,
                  ablation_ci: list[float] | None = None) -> None:
    """Exposed communication read from the ranks' traces beside the ablation's, and which to trust (measure.trace)."""
    found = trace.run_figure(figures) if figures else None
    why = ("not asked for (--profile)" if figures is None else
           "the traces hold no dpcompare.step range with a collective in it")
    m.set("comm_exposed_trace_ms", found[0] if found else None, why)
    m.set("comm_exposed_trace_rank", found[1] if found else None, why)
    m.set("comm_trace_ms", found[2] if found else None, why)
    m.set("comm_exposed_trace_ms_per_rank", [f["exposed_ms"] if f else None for f in figures] if found else None, why)
    m.set("comm_exposed_trace_ratio", found[0] / ablation if found and ablation else None,
          "needs the trace's exposed communication and the ablation's, non-zero")
    waits = trace.arrival_waits(figures) if found and figures else None
    m.set("comm_arrival_wait_ms_per_rank", waits,
          why if not found else "needs two ranks' traces whose steps issued the same collectives")
    slowed = trace.run_slowed(figures) if found and figures else None
    m.set("comm_slowed_compute_trace_ms", slowed,
          why if not found else "the traced steps had no unsynced twins (no ablation: --ablation-steps 0, or a backend "
          "that cannot switch synchronisation off)")
    which, because = trace.trust(ablation, ablation_ci, found[0] if found else None, slowed)
    m.set("comm_exposed_trust", which, because)
    m.set("comm_exposed_trust_why", because)


def _step_times(m: Metrics, samples: list[RankSample], global_samples: int, tokens_per_sample: int,
                why_no_steps: str) -> list[list[float]]:
    """Step-time percentiles of the slowest rank per step, the rank spread and the throughput. Returns each
    rank's measured step times, cut to the steps every rank measured."""
    steps = min(len(s.step_ms) for s in samples)
    m.set("measured_steps", steps)
    per_rank = [s.step_ms[:steps] for s in samples]
    slowest = np.max(np.asarray(per_rank), axis=0).tolist() if steps else []
    p = percentiles(slowest)
    m.set("step_ms_p50", p["p50"], why_no_steps)
    m.set("step_ms_p90", p["p90"], why_no_steps)
    m.set("step_ms_mean", p["mean"], why_no_steps)
    m.set("step_ms", slowest)
    m.set("step_ms_per_rank_p50", [percentiles(r)["p50"] for r in per_rank])
    spread = (np.max(per_rank, axis=0) - np.min(per_rank, axis=0)).tolist() if steps and len(per_rank) > 1 else []
    m.set("rank_spread_ms_p50", percentiles(spread)["p50"], "one rank" if len(per_rank) == 1 else why_no_steps)
    m.set("samples_per_s", global_samples / (p["p50"] / 1e3) if p["p50"] else None, why_no_steps)
    if tokens_per_sample > 1:
        m.set("tokens_per_s", global_samples * tokens_per_sample / (p["p50"] / 1e3) if p["p50"] else None, why_no_steps)
    else:
        m.set("tokens_per_s", None, "not a token model")
    return per_rank


def _ablation(m: Metrics, samples: list[RankSample], per_rank: list[list[float]], comm_possible: str | None,
              why_no_pairs: str, total: float | None = None) -> tuple[float | None, list[float] | None]:
    """The synced/unsynced ablation: the slowest rank per step of each arm, the pairs' differences, exposed
    communication bounded by `total` (exposed_split); stragglers from the compute-only arm (the step times when no
    ablation ran). Returns the exposed communication time and its interval, None where not measured."""
    pairs = min(min(len(s.synced_ms), len(s.unsynced_ms)) for s in samples)
    synced = np.max([s.synced_ms[:pairs] for s in samples], axis=0) if pairs else np.array([])
    unsynced = np.max([s.unsynced_ms[:pairs] for s in samples], axis=0) if pairs else np.array([])
    compute_only = [s.unsynced_ms[:pairs] for s in samples]
    found = stragglers(compute_only if pairs else per_rank)
    m.set("stragglers", found)
    flagged = [r for r in found if r["straggler"]]
    slowest = max(flagged, key=lambda r: r["excess_ms_mean"]) if flagged else None
    m.set("straggler_rank", slowest["rank"] if slowest else None,
          "one rank" if len(samples) < 2 else "no rank is the slowest in most steps by more than 10 % of the median step")
    m.set("straggler_excess_ms", slowest["excess_ms_mean"] if slowest else None, "no straggler")
    if comm_possible or not pairs:
        for name in ("compute_ms_p50", "step_synced_ms_p50", "comm_exposed_ms"):
            m.set(name, None, comm_possible or why_no_pairs)
        return None, None
    m.set("compute_ms_p50", float(np.median(unsynced)))
    m.set("step_synced_ms_p50", float(np.median(synced)))
    m.set("step_synced_ms", synced.tolist())
    m.set("step_unsynced_ms", unsynced.tolist())
    difference = ablation_difference(synced, unsynced)
    exposed, interference = exposed_split(difference, total)
    m.set("comm_ablation_ms", difference)
    m.set("comm_exposed_ms", exposed)
    m.set("comm_interference_ms", interference, "no total communication time to bound the exposed figure by")
    raw = exposed_interval(synced, unsynced)
    too_few = f"{pairs} ablation pairs are too few for an interval (at least {MIN_PAIRS_FOR_INTERVAL})"
    m.set("comm_ablation_ci_ms", raw, None if raw else too_few)
    interval = [exposed_split(v, total)[0] for v in raw] if raw else None
    m.set("comm_exposed_ci_ms", interval, None if interval else too_few)
    m.set("ablation_pairs", pairs)
    return exposed, interval


def ablation_difference(synced: np.ndarray, unsynced: np.ndarray) -> float:
    """The median over pairs of synced - unsynced (step i of each arm ran back to back, on the same machine), at
    least 0."""
    return max(float(np.median(np.subtract(synced, unsynced))), 0.0)


def exposed_split(difference: float, total: float | None) -> tuple[float, float | None]:
    """(exposed, interference) from the ablation's difference and the backend's total communication time (the
    counter, over the same measured steps). The step cannot wait on communication for longer than communication
    took: exposed = min(difference, total) <= total. What the synced step lost beyond the total is interference,
    the computation slowed by the collectives running beside it (cores, memory bandwidth, a shared link), reported
    as such and not as communication. Without a total (no counter) exposed is the difference and interference
    None."""
    difference = max(difference, 0.0)
    if total is None:
        return difference, None
    exposed = min(difference, max(total, 0.0))
    return exposed, difference - exposed


MIN_PAIRS_FOR_INTERVAL = 5
"""Fewer steps per arm than this and a bootstrap interval of the medians means nothing."""


def exposed_interval(synced: np.ndarray, unsynced: np.ndarray) -> list[float] | None:
    """The 95 % bootstrap interval of the median over pairs of synced - unsynced (the pairs resampled together,
    percentile method, a fixed seed so a result is reproducible from its step times), clipped at 0 like the
    figure itself; None with too few pairs."""
    from scipy import stats  # scipy takes seconds to import: only where it is used
    n = min(len(synced), len(unsynced))
    if n < MIN_PAIRS_FOR_INTERVAL:
        return None
    difference = np.subtract(np.asarray(synced, float)[:n], np.asarray(unsynced, float)[:n])
    res = stats.bootstrap((difference,), lambda d, axis: np.median(d, axis=axis), vectorized=True,
                          confidence_level=0.95, n_resamples=2000, method="percentile",
                          random_state=np.random.default_rng(0))
    lo, hi = res.confidence_interval
    return [max(float(lo), 0.0), max(float(hi), 0.0)]


def per_step_total_ms(comm: dict[str, Any], key: str = "total") -> float | None:
    """One rank's counter per step (median over steps where it has them): its total communication time, or
    with key="transfer" the transfer alone where the counter tells it apart (else the total)."""
    if key == "transfer" and comm.get("transfer_ms") is not None and comm.get("steps"):
        return comm["transfer_ms"] / comm["steps"]
    if comm.get("per_step_total_ms"):
        return float(np.median(comm["per_step_total_ms"]))
    if "total_ms" in comm and comm.get("steps"):
        return comm["total_ms"] / comm["steps"]
    return None


def _native_comm(m: Metrics, samples: list[RankSample], comm_possible: str | None) -> tuple[float | None, float | None]:
    """The backends' own communication counters, per step. A rank's counter holds the time it waited inside
    communication for its peers; the rank that spent longest there shows everything synchronisation cost the
    step (as the ablation's slowest-rank figure does): that is the total. The rank that spent least there
    (or the transfer a timeline tells apart) is closest to the collective itself: bandwidth is taken from it.
    Returns (total, transfer) in ms per step, None where there is no counter."""
    if comm_possible:
        for name in ("comm_total_ms", "comm_transfer_ms", "comm_total_ms_per_rank"):
            m.set(name, None, comm_possible)
        return None, None
    comms = [s.comm or {} for s in samples]
    per_rank = [per_step_total_ms(c) for c in comms]
    known = [(t, rank) for rank, t in enumerate(per_rank) if t is not None]
    if not known:
        reason = comms[0].get("reason") or "the backend exposes no communication counter"
        for name in ("comm_total_ms", "comm_transfer_ms", "comm_total_ms_per_rank"):
            m.set(name, None, reason)
        return None, None
    total, longest = max(known)
    transfer = min(t for t in (per_step_total_ms(c, "transfer") for c in comms) if t is not None)
    m.set("comm_total_ms", total)
    m.set("comm_total_rank", longest)
    m.set("comm_transfer_ms", transfer)
    m.set("comm_total_ms_per_rank", per_rank)
    m.set("comm_total_method", comms[longest].get("method"))
    rank0 = comms[0]
    if rank0.get("per_step_overlap_ms"):
        m.set("comm_native_overlap_ms", float(np.median(rank0["per_step_overlap_ms"])))
        # Per rank: a rank that reached the collective early also waits out the others' compute (skew); the last
        # to arrive waits for the transfer alone. The step, as slow as its slowest rank, pays the latter.
        exposed = [float(np.median(np.subtract(c["per_step_total_ms"], c["per_step_overlap_ms"])))
                   if c.get("per_step_total_ms") and c.get("per_step_overlap_ms") else None for c in comms]
        m.set("comm_native_exposed_ms", exposed[0])
        m.set("comm_native_exposed_ms_per_rank", exposed)
    elif rank0.get("overlap_ms") is not None and rank0.get("steps"):
        m.set("comm_native_overlap_ms", rank0["overlap_ms"] / rank0["steps"])
    return total, transfer


def _bandwidth(m: Metrics, total: float | None, grad_bytes: int, world_size: int, microbench_busbw: float | None,
               microbench_reason: str | None, comm_possible: str | None) -> None:
    """In-training algbw and busbw from the transfer time (`total`: comm_transfer_ms), against the
    microbenchmark's busbw, and the T_comm model."""
    if total and total > 0 and world_size > 1:
        alg = algbw_gbps(grad_bytes, total / 1e3)
        m.set("algbw_gbps", alg)
        m.set("busbw_gbps", busbw_gbps(alg, world_size))
    else:
        reason = comm_possible or ("one rank: nothing crosses a link" if world_size == 1 else "no total communication time")
        m.set("algbw_gbps", None, reason)
        m.set("busbw_gbps", None, reason)
    m.set("microbench_busbw_gbps", microbench_busbw, microbench_reason)
    if microbench_busbw and m.values.get("busbw_gbps"):
        m.set("busbw_vs_microbench", m.values["busbw_gbps"] / microbench_busbw)
    else:
        m.set("busbw_vs_microbench", None, "needs the in-training busbw and a microbenchmark figure")
    m.set("tcomm_model_ms", tcomm_model_ms(grad_bytes, world_size, microbench_busbw),
          "one rank" if world_size < 2 else (microbench_reason or "no microbenchmark bandwidth"))


def _memory(m: Metrics, samples: list[RankSample], model_state: dict[str, float | None],
            formula: dict[str, Any] | None = None, formula_reason: str | None = None) -> None:
    """Peak memory over the window: the highest rank's, each rank's, the allocator's reserve, the most any rank rose
    above what it held when the window opened (peak_above_start_mib: the steps' own memory, activations included);
    the model state.

    model_state_mib is the census of the rank whose measured model state is largest (its whole breakdown, with
    `rank`: what the largest rank needs, as peak_mem_mib is the highest rank's; ZeRO's padded partitions make the
    ranks differ), model_state_mib_per_rank every rank's census in rank order, model_state_formula_mib the ZeRO
    paper's per-rank figure for the same model, precision and optimizer. Where a rank took no census the model state
    is the analytic one (parameters, their gradients, the optimizer's state on rank 0: not sharding-aware) and
    model_state_mib_per_rank is None."""
    peaks = [s.memory.get("peak_mem_mib") for s in samples]
    known = [x for x in peaks if x is not None]
    m.set("peak_mem_mib", max(known) if known else None, samples[0].memory_reason)
    m.set("peak_mem_mib_per_rank", peaks)
    reserved = [s.memory.get("peak_mem_reserved_mib") for s in samples if s.memory.get("peak_mem_reserved_mib") is not None]
    m.set("peak_mem_reserved_mib", max(reserved) if reserved else None, "CPU: no allocator reserve to report")
    m.set("mem_method", "cuda max_memory_allocated" if reserved else "resident high-water mark (VmHWM) over the window")
    above = [s.memory.get("peak_above_start_mib") for s in samples]
    known_above = [x for x in above if x is not None]
    m.set("peak_above_start_mib", max(known_above) if known_above else None,
          samples[0].memory_reason or "what the rank held when the window opened was not read")
    m.set("peak_above_start_mib_per_rank", above)
    censuses = [s.model_state for s in samples]
    if censuses and all(_is_census(c) for c in censuses):
        largest = max(range(len(censuses)), key=lambda r: (censuses[r]["total"], -r))
        m.set("model_state_mib", {**censuses[largest], "rank": largest,
                                  "method": "census of the tensors the adapter lists (model_state_tensors), the rank "
                                            "with the largest total"})
        m.set("model_state_mib_per_rank", censuses)
    else:
        missing = [r for r, c in enumerate(censuses) if not _is_census(c)]
        why = next((c["reason"] for c in censuses if isinstance(c, dict) and c.get("reason")), None)
        m.set("model_state_mib", {**model_state, "method": "analytic (rank 0's parameters, gradients and optimizer "
                                                           "state; no census)"} if model_state else model_state)
        m.set("model_state_mib_per_rank", None,
              f"no model-state census on rank(s) {', '.join(map(str, missing))}" + (f" ({why})" if why else "")
              + ": the model state is analytic")
    m.set("model_state_formula_mib", formula, formula_reason or "no formula for this run")


def _is_census(c: Any) -> bool:
    return isinstance(c, dict) and isinstance(c.get("total"), (int, float))


def _by_kind(m: Metrics, samples: list[RankSample], world_size: int, analytic: dict[str, int] | None,
             analytic_method: str, measured_reason: str | None, replicas: int = 1) -> None:
    """Communication by kind (dpcompare.measure.volume.comm_by_kind): measured where Python dispatched the
    collectives, beside the analytic volume. None (with `measured_reason`) where there is no analytic volume either
    (one rank: no communication)."""
    if analytic is None:
        m.set("comm_by_kind", None, measured_reason or "no communication volume for this run")
        return
    records = [s.collectives for s in samples]
    reason = measured_reason
    if reason is None and not any(isinstance(r, dict) for r in records):
        reason = "no rank recorded its collectives"
    m.set("comm_by_kind", comm_by_kind(records, analytic, world_size, reason, analytic_method, replicas))


def mfu(flops_per_sample: float | None, samples_per_s_per_rank: float | None,
        peak_tflops: float | None) -> float | None:
    """Achieved model FLOP/s per rank over the peak, or None where a figure is missing."""
    if not flops_per_sample or not samples_per_s_per_rank or not peak_tflops:
        return None
    return flops_per_sample * samples_per_s_per_rank / (peak_tflops * 1e12)


def record_mfu(m: Metrics, found: dict[str, Any] | None, samples_per_s_per_rank: float | None, why_not: str) -> None:
    """The MFU figures (dpcompare.measure.flops.facts: `found`; None: not measured, `why_not`)."""
    found = found or {"why": {}}
    why = found["why"]
    m.set("compute_dtype", found.get("dtype"), why_not)
    m.set("model_flops_per_sample", found.get("flops"), why.get("flops", why_not))
    m.set("peak_tflops_measured", found.get("measured"), why_not)
    m.set("peak_tflops_datasheet", found.get("datasheet"), why.get("datasheet", why_not))
    no_rate = "no step time (no measured steps)" if samples_per_s_per_rank is None else None
    m.set("mfu", mfu(found.get("flops"), samples_per_s_per_rank, found.get("measured")),
          why.get("flops") or no_rate or why_not)
    m.set("mfu_datasheet", mfu(found.get("flops"), samples_per_s_per_rank, found.get("datasheet")),
          why.get("datasheet") or why.get("flops") or no_rate or why_not)
