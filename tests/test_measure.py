"""Measurement arithmetic on synthetic timings: every reported figure against a hand-computed value.

Checks dpcompare.measure.run_metrics.summarize (step percentiles of the slowest rank, throughput, rank spread,
stragglers, ablation, overlap, bandwidth, the seed T_comm model, memory, nulls with reasons),
model_state_mib, the Horovod timeline parser (dpcompare.measure.timeline) and the CPU memory window, each with a
case where the figure must come out different (a planted stall, a missing counter, overlapping
intervals counted once).
"""

from __future__ import annotations

import contextlib

import json

import numpy as np
import pytest
import torch

from dpcompare.measure import ablation, bandwidth, clocks, consistency
from dpcompare.measure import run_metrics as measure
from dpcompare.measure.samples import RankSample
from dpcompare.measure import timeline


def sample(step_ms, synced=(), unsynced=(), comm=None, peak=100.0):
    return RankSample(list(step_ms), list(synced), list(unsynced),
                              {"peak_mem_mib": peak, "peak_mem_reserved_mib": None}, None, comm)


def summarize(samples, **overrides):
    kwargs = dict(world_size=len(samples), local_batch=8, tokens_per_sample=1, warmup_steps=2, grad_bytes=4_000_000,
                  message_bytes=4_000_000, message_reason=None, model_state={"total": 1.0},
                  microbench_busbw=None, microbench_reason="no microbenchmark", scaling="strong", comm_possible=None)
    kwargs.update(overrides)
    return measure.summarize(samples, **kwargs)


def test_step_time_is_the_slowest_rank_per_step():
    m = summarize([sample([10, 12, 10, 30]), sample([11, 11, 14, 10])])
    # per step max: 11, 12, 14, 30
    assert m["step_ms_p50"] == pytest.approx(13.0)
    assert m["step_ms_mean"] == pytest.approx((11 + 12 + 14 + 30) / 4)
    assert m["step_ms_p90"] == pytest.approx(float(torch.tensor([11., 12., 14., 30.]).quantile(0.9)))
    assert m["rank_spread_ms_p50"] == pytest.approx(2.5)  # spreads 1, 1, 4, 20 -> median 2.5
    # 8 samples per rank x 2 ranks per 13 ms
    assert m["samples_per_s"] == pytest.approx(16 / 0.013)
    assert m["tokens_per_s"] is None and "token" in m["reasons"]["tokens_per_s"]


def test_tokens_per_second_for_a_token_model():
    m = summarize([sample([10, 10])], tokens_per_sample=16)
    assert m["tokens_per_s"] == pytest.approx(8 * 16 / 0.010)


def test_a_planted_stall_on_one_rank_is_named_as_the_straggler():
    steady = [10.0] * 10
    stalled = [10.0 + 5.0] * 10
    m = summarize([sample(steady, [20] * 10, steady), sample(steady, [20] * 10, stalled), sample(steady, [20] * 10, steady)])
    flagged = [s for s in m["stragglers"] if s["straggler"]]
    assert [s["rank"] for s in flagged] == [1]
    assert flagged[0]["slowest_fraction"] == 1.0
    assert flagged[0]["excess_ms_mean"] == pytest.approx(5.0)


def test_a_few_stalled_steps_make_no_straggler_and_a_rank_slow_in_most_steps_does():
    """Two ranks on a shared box: one is a little slower in most steps and stalled (the scheduler) in two; its mean
    excess is above 10 % of the step, its median excess is not."""
    steady = [40.0] * 10
    noisy = [41.0] * 8 + [90.0, 90.0]
    m = summarize([sample(steady, [45] * 10, steady), sample(steady, [45] * 10, noisy)])
    rank1 = m["stragglers"][1]
    assert rank1["excess_ms_mean"] > 0.1 * 40 and rank1["slowest_fraction"] == 1.0 and not rank1["straggler"]
    slow = [52.0] * 10  # the twin: slower by 30 % in every step (its excess over the two ranks' median: 6 ms)
    m = summarize([sample(steady, [45] * 10, steady), sample(steady, [45] * 10, slow)])
    assert m["stragglers"][1]["straggler"] and m["straggler_rank"] == 1


def test_no_straggler_when_ranks_take_turns():
    a = [10, 11] * 5
    b = [11, 10] * 5
    m = summarize([sample(a, a, a), sample(b, b, b)])
    assert not any(s["straggler"] for s in m["stragglers"])


def test_ablation_overlap_and_bandwidth():
    comm = {"total_ms": 40.0, "overlap_ms": 10.0, "steps": 10, "method": "test counter"}
    ranks = [sample([20] * 10, [15] * 10, [12] * 10, comm), sample([20] * 10, [16] * 10, [11] * 10)]
    m = summarize(ranks, microbench_busbw=2.0, microbench_reason=None)
    assert m["compute_ms_p50"] == 12.0
    assert m["step_synced_ms_p50"] == 16.0
    assert m["comm_exposed_ms"] == pytest.approx(4.0)
    assert m["comm_total_ms"] == pytest.approx(4.0)  # 40 ms over 10 steps
    assert m["comm_native_overlap_ms"] == pytest.approx(1.0)
    assert m["overlap_fraction"] == pytest.approx(0.0)
    # 4e6 bytes in 4 ms = 1 GB/s algbw; busbw at n=2 is the same
    assert m["algbw_gbps"] == pytest.approx(1.0)
    assert m["busbw_gbps"] == pytest.approx(1.0)
    assert m["busbw_vs_microbench"] == pytest.approx(0.5)
    # seed model: 2 * 4e6 * (2-1) / (2 * 2e9) s = 2 ms
    assert m["tcomm_model_ms"] == pytest.approx(2.0)


def test_total_is_the_rank_longest_in_communication_and_bandwidth_uses_the_shortest():
    r0 = {"per_step_total_ms": [3.0, 9.0, 4.0], "method": "test counter"}
    r1 = {"per_step_total_ms": [7.0, 8.0, 6.0], "method": "test counter"}
    m = summarize([sample([20] * 3, [15] * 3, [12] * 3, r0), sample([20] * 3, [16] * 3, [11] * 3, r1),
                   sample([20] * 3, [16] * 3, [11] * 3)])
    # The total is the rank that spent longest in communication (its wait included), the transfer the shortest.
    assert m["comm_total_ms_per_rank"] == [pytest.approx(4.0), pytest.approx(7.0), None]
    assert m["comm_total_ms"] == pytest.approx(7.0) and m["comm_total_rank"] == 1
    assert m["comm_transfer_ms"] == pytest.approx(4.0)
    assert m["algbw_gbps"] == pytest.approx(1.0)  # 4e6 bytes in the 4 ms transfer
    none = summarize([sample([5, 5])], comm_possible="one process")
    assert none["comm_total_ms_per_rank"] is None and none["reasons"]["comm_total_ms_per_rank"]


def test_a_timeline_counter_gives_the_total_with_negotiation_and_the_transfer_without():
    comm = {"total_ms": 90.0, "transfer_ms": 40.0, "steps": 10, "method": "timeline"}
    m = summarize([sample([20] * 10, [15] * 10, [12] * 10, comm), sample([20] * 10, [16] * 10, [11] * 10,
                                                                         {"reason": "rank 0 only"})])
    assert m["comm_total_ms"] == pytest.approx(9.0) and m["comm_transfer_ms"] == pytest.approx(4.0)
    assert m["busbw_gbps"] == pytest.approx(1.0)


def test_overlap_fraction_when_half_is_hidden():
    comm = {"total_ms": 80.0, "overlap_ms": None, "steps": 10, "method": "test counter"}
    m = summarize([sample([20] * 4, [16] * 4, [12] * 4, comm), sample([20] * 4, [16] * 4, [12] * 4)])
    assert m["overlap_fraction"] == pytest.approx(0.5)  # 1 - 4/8


def test_missing_figures_are_null_with_a_reason_never_zero():
    m = summarize([sample([5, 5])], comm_possible="one process, no gradient communication")
    for name in ("comm_total_ms", "comm_exposed_ms", "compute_ms_p50", "overlap_fraction", "busbw_gbps", "algbw_gbps"):
        assert m[name] is None
        assert m["reasons"][name]
    assert m["reasons"]["comm_total_ms"] == "one process, no gradient communication"


def test_a_backend_without_a_counter_reports_why():
    m = summarize([sample([5] * 3, [4] * 3, [3] * 3, {"reason": "no counter here"}), sample([5] * 3, [4] * 3, [3] * 3)])
    assert m["comm_total_ms"] is None and m["reasons"]["comm_total_ms"] == "no counter here"
    assert m["comm_exposed_ms"] == pytest.approx(1.0)
    assert m["overlap_fraction"] is None


def test_instrumentation_off_says_so():
    m = summarize([sample([]), sample([])], instrumented=False)
    assert m["step_ms_p50"] is None and "--no-instrument" in m["reasons"]["step_ms_p50"]


def test_peak_memory_is_the_largest_rank():
    m = summarize([sample([1], peak=100.0), sample([1], peak=250.0)])
    assert m["peak_mem_mib"] == 250.0 and m["peak_mem_mib_per_rank"] == [100.0, 250.0]


def test_tcomm_model_needs_two_ranks_and_a_bandwidth():
    assert bandwidth.tcomm_model_ms(1e9, 1, 10.0) is None
    assert bandwidth.tcomm_model_ms(1e9, 4, None) is None
    assert bandwidth.tcomm_model_ms(1e9, 4, 10.0) == pytest.approx(2 * 1e9 * 3 / (4 * 10e9) * 1e3)


def test_model_state_counts_parameters_gradients_optimizer_and_buffers():
    model = torch.nn.Linear(100, 10)  # 1010 float32 parameters = 4040 bytes
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 100)).sum().backward()
    opt.step()  # AdamW keeps exp_avg and exp_avg_sq per parameter (+ a scalar step each)
    state = clocks.model_state_mib(model, opt, comm_buffer_bytes=4040)
    mib = 1024 * 1024
    assert state["params"] == pytest.approx(4040 / mib)
    assert state["grads"] == pytest.approx(4040 / mib)
    assert state["optimizer"] == pytest.approx((2 * 4040 + 2 * 4) / mib)
    assert state["total"] == pytest.approx((3 * 4040 + 2 * 4040 + 8) / mib)


def test_cpu_memory_window_sees_tensor_storage():
    window = clocks.MemoryWindow(torch.device("cpu"))
    window.reset()
    before = window.peak()["peak_mem_mib"]
    big = torch.ones(64 * 1024 * 1024 // 4)  # 64 MiB of tensor storage, invisible to tracemalloc
    after = window.peak()["peak_mem_mib"]
    del big
    assert after - before > 48, (before, after)


def test_segment_clock_leaves_out_the_gap_between_segments():
    clock = clocks.SegmentClock(torch.device("cpu"))
    clock.start()
    clock.stop()
    clock.start()
    clock.stop()
    clock.end_step()
    assert len(clock.step_ms()) == 1 and clock.step_ms()[0] >= 0


def _trace(tmp_path, events, close=True):
    text = "[\n" + ",\n".join(json.dumps(e) for e in events) + ("]" if close else ",")
    path = tmp_path / "timeline.json"
    path.write_text(text)
    return path


def test_timeline_union_counts_fused_tensors_once(tmp_path):
    events = [
        {"ph": "B", "name": "NEGOTIATE_ALLREDUCE", "ts": 0, "pid": 1}, {"ph": "E", "ts": 500, "pid": 1},
        {"ph": "B", "name": "ALLREDUCE", "ts": 1000, "pid": 1},
        {"ph": "B", "name": "GLOO_ALLREDUCE", "ts": 1100, "pid": 1}, {"ph": "E", "ts": 1900, "pid": 1},
        {"ph": "E", "ts": 2000, "pid": 1},
        {"ph": "B", "name": "ALLREDUCE", "ts": 1500, "pid": 2}, {"ph": "E", "ts": 2500, "pid": 2},
        {"ph": "B", "name": "ALLREDUCE", "ts": 4000, "pid": 3}, {"ph": "E", "ts": 4250, "pid": 3},
    ]
    # [1000, 2500] and [4000, 4250]: 1.5 ms + 0.25 ms; negotiation and nested phases not double counted
    assert timeline.allreduce_busy_ms(_trace(tmp_path, events)) == pytest.approx(1.75)
    # Horovod leaves the array open while it writes: still readable
    assert timeline.allreduce_busy_ms(_trace(tmp_path, events, close=False)) == pytest.approx(1.75)
    # With the negotiation (the wait for the other ranks): [0, 500], [1000, 2500], [4000, 4250]
    assert timeline.allreduce_busy_ms(_trace(tmp_path, events), timeline.NEGOTIATED) == pytest.approx(2.25)


def test_timeline_sums_disjoint_intervals():
    assert timeline.union_ms([(0, 1000), (2000, 3000)]) == pytest.approx(2.0)
    assert timeline.union_ms([(0, 1000), (500, 3000)]) == pytest.approx(3.0)


# -- exposed communication's interval ----------------------------------------------------------------------
def test_the_exposed_interval_holds_a_real_difference_and_excludes_none_that_is_absent() -> None:
    rng = np.random.default_rng(7)
    unsynced = 50.0 + rng.normal(0.0, 1.0, 20)
    clear = ablation.exposed_interval(unsynced + 10.0 + rng.normal(0.0, 1.0, 20), unsynced)
    assert 7.0 < clear[0] <= clear[1] < 13.0
    # the same distribution in both arms: the interval reaches 0 (clipped there, as the figure is)
    same = ablation.exposed_interval(50.0 + rng.normal(0.0, 5.0, 20), 50.0 + rng.normal(0.0, 5.0, 20))
    assert same[0] == 0.0 and same[1] > 0.0
    # wider noise, wider interval; too few steps, no interval
    noisy = ablation.exposed_interval(unsynced + 10.0 + rng.normal(0.0, 8.0, 20), unsynced)
    assert noisy[1] - noisy[0] > clear[1] - clear[0]
    assert ablation.exposed_interval(np.array([2.0, 3.0]), np.array([1.0, 1.0])) is None


def test_pairs_run_back_to_back_cancel_the_machine_s_drift() -> None:
    # The arms are interleaved (A B A B): the load of the moment slows both steps of a pair, and the difference
    # over pairs does not see it. Blocks of one arm then the other (the old ablation) saw two machines.
    rng = np.random.default_rng(3)
    load = rng.normal(0.0, 10.0, 20) + np.repeat([0.0, 8.0], 10)  # another tenant, step to step; a slow spell
    unsynced = 50.0 + load + rng.normal(0.0, 0.5, 20)
    synced = unsynced + 5.0 + rng.normal(0.0, 0.5, 20)
    assert ablation.ablation_difference(synced, unsynced) == pytest.approx(5.0, abs=0.5)
    lo, hi = ablation.exposed_interval(synced, unsynced)
    assert 4.0 < lo <= hi < 6.0
    blocks = float(np.median(synced[:10]) - np.median(unsynced[10:]))  # each arm in its own window
    assert abs(blocks - 5.0) > 2.0


@pytest.mark.parametrize(("difference", "total", "exposed", "interference"), [
    (4.0, 6.0, 4.0, 0.0),     # hidden in part: exposed is the difference
    (7.34, 6.01, 6.01, 1.33),  # beyond the total (ddp/2 of the old ablation): bounded, the rest is interference
    (-1.0, 6.0, 0.0, 0.0),    # a negative difference is no exposed time
    (3.0, None, 3.0, None),   # no counter: nothing to bound by, no interference figure
])
def test_exposed_is_bounded_by_the_total_and_the_rest_is_interference(difference, total, exposed, interference) -> None:
    got = ablation.exposed_split(difference, total)
    assert got[0] == pytest.approx(exposed) and (got[1] == pytest.approx(interference) if total is not None
                                                 else got[1] is None)
    if total is not None:
        assert got[0] <= total and got[0] + got[1] == pytest.approx(max(difference, 0.0))


def test_summarize_never_reports_exposed_above_the_total_and_says_where_the_excess_went() -> None:
    # synced - unsynced = 9 ms per pair against a counter of 6 ms per step: the old arithmetic (the difference
    # itself) would report 9 > 6 and flag it; the bounded one reports 6 and 3 ms of interference.
    comm = {"total_ms": 60.0, "steps": 10, "method": "test counter"}
    ranks = [sample([25] * 10, [21, 20] * 5, [12, 11] * 5, comm), sample([25] * 10, [20] * 10, [11] * 10)]
    m = summarize(ranks)
    assert m["comm_ablation_ms"] == pytest.approx(9.0) and m["comm_total_ms"] == pytest.approx(6.0)
    assert m["comm_exposed_ms"] == pytest.approx(6.0) and m["comm_interference_ms"] == pytest.approx(3.0)
    assert m["comm_exposed_ci_ms"][1] <= m["comm_total_ms"] < m["comm_ablation_ci_ms"][1]
    assert consistency.exposed_flag(m) is None  # nothing to flag on exposed vs total, by construction
    assert "3.00 ms beyond the total communication 6.00 ms" in consistency.interference_flag(m)
    # the negative: unbounded, the same samples would be a contradiction
    raw = dict(m, comm_exposed_ms=m["comm_ablation_ms"], comm_exposed_ci_ms=m["comm_ablation_ci_ms"])
    assert consistency.contradiction(raw) is not None
    # within the total, nothing is moved and nothing is said
    calm = summarize([sample([25] * 10, [15] * 10, [11] * 10, comm)])
    assert calm["comm_exposed_ms"] == pytest.approx(4.0) and calm["comm_interference_ms"] == 0.0
    assert consistency.interference_flag(calm) is None


def test_summarize_records_the_ablation_steps_and_the_interval() -> None:
    ranks = [sample([20] * 10, [15, 16] * 5, [12, 11] * 5), sample([20] * 10, [16] * 10, [11] * 10)]
    m = summarize(ranks)
    assert m["step_synced_ms"] == [16.0] * 10 and m["step_unsynced_ms"] == [12.0, 11.0] * 5
    lo, hi = m["comm_exposed_ci_ms"]
    assert lo <= m["comm_exposed_ms"] <= hi and lo >= 4.0 - 1e-9 and hi <= 5.0 + 1e-9
    few = summarize([sample([20] * 3, [16] * 3, [12] * 3)])
    assert few["comm_exposed_ci_ms"] is None and "too few" in few["reasons"]["comm_exposed_ci_ms"]


# -- contradicting figures are flagged, not printed silently -------------------------------------------------
@pytest.mark.parametrize(("exposed", "total", "flagged"), [
    (2.14, 1.04, True), (1.15, 1.0, True), (1.05, 1.0, False), (0.4, 1.0, False), (2.0, None, False)])
def test_exposed_beyond_total_is_a_contradiction(exposed, total, flagged) -> None:
    why = consistency.contradiction({"comm_exposed_ms": exposed, "comm_total_ms": total})
    assert (why is not None) == flagged
    if flagged:
        assert f"{exposed:.2f} ms > total {total:.2f} ms" in why and "upper bound" in why


@pytest.mark.parametrize(("interval", "kind"), [
    ([9.0, 14.0], "contradiction"),   # the whole interval above the total (with its 10 % slack): contradiction
    ([7.0, 14.0], "noise"),           # the interval reaches the total: noise, shown as such
    (None, "contradiction"),          # no interval recorded: judged on the figure
])
def test_exposed_above_total_is_a_contradiction_only_beyond_its_interval(interval, kind) -> None:
    metrics = {"comm_exposed_ms": 11.0, "comm_total_ms": 7.5, "comm_exposed_ci_ms": interval, "ablation_pairs": 20}
    clash, noisy = consistency.contradiction(metrics), consistency.within_noise(metrics)
    assert (clash is not None, noisy is not None) == (kind == "contradiction", kind == "noise")
    if kind == "noise":
        assert "11.00 ms is above total 7.50 ms" in noisy and "7.00-14.00 ms over 20 ablation pairs" in noisy
    if interval and kind == "contradiction":
        assert "(95 % interval 9.00-14.00 ms) > total 7.50 ms" in clash
    # below the total nothing is said, whatever the interval
    calm = dict(metrics, comm_exposed_ms=5.0)
    assert consistency.contradiction(calm) is None and consistency.within_noise(calm) is None


def test_compare_and_report_flag_the_contradiction(tmp_path) -> None:
    from rich.console import Console

    from dpcompare.commands.compare.plan import Job
    from dpcompare.commands.compare.compare_output import render_cost
    from dpcompare.commands.report.markdown import Footnotes
    from dpcompare.commands.report.markdown_cost import _exposed_cell
    from dpcompare.result_view import Metrics, RunResult

    metrics = {"comm_exposed_ms": 2.14, "comm_total_ms": 1.04, "step_ms_p50": 5.0}
    calm = {"comm_exposed_ms": 0.5, "comm_total_ms": 1.04, "step_ms_p50": 5.0}
    noisy = {"comm_exposed_ms": 1.6, "comm_total_ms": 1.04, "step_ms_p50": 5.0, "comm_exposed_ci_ms": [0.8, 2.5]}
    jobs = [Job("horovod", 2, [], "horovod/2", tmp_path / "a.npz", tmp_path / "a.log", result=RunResult({"metrics": metrics})),
            Job("ddp", 2, [], "ddp/2", tmp_path / "b.npz", tmp_path / "b.log", result=RunResult({"metrics": calm})),
            Job("deepspeed", 2, [], "deepspeed/2", tmp_path / "c.npz", tmp_path / "c.log", result=RunResult({"metrics": noisy}))]
    console = Console(record=True, width=200)
    render_cost(console, jobs, [])
    text = console.export_text()
    assert "2.14 (!1)" in text and "(!1) horovod/2: exposed communication 2.14 ms > total 1.04 ms" in text
    assert "1.60 (~2)" in text and "(~2) deepspeed/2: exposed communication 1.60 ms is above total" in text
    assert "(!2)" not in text and "0.50 (" not in text

    notes = Footnotes()
    assert _exposed_cell(Metrics(metrics), notes) == "**2.14 (!)**[^1]"
    assert _exposed_cell(Metrics(calm), notes) == "0.5"
    assert _exposed_cell(Metrics(noisy), notes) == "1.60 (~)[^2]"
    assert "exposed is an upper bound" in notes.lines()[0] and "not a contradiction" in notes.lines()[1]


# -- a step breakdown that does not add up is flagged, not floored silently -------------------------------------
@pytest.mark.parametrize(("step", "compute", "exposed", "flagged"), [
    (77.65, 108.75, 6.85, True),    # measured on the 2-core VM: the ablation's pairs ran in a slow spell
    (64.0, 56.9, 3.4, False),       # adds up, with 3.7 ms of other
    (60.0, 58.0, 7.0, False),       # 8 % over: within the two windows' noise
    (60.0, 70.0, -3.0, True),       # a negative exposed does not hide compute alone overrunning the step
    (60.0, None, 3.0, False),       # nothing to judge
])
def test_compute_and_exposed_beyond_the_step_are_flagged(step, compute, exposed, flagged) -> None:
    why = consistency.breakdown_flag({"step_ms_p50": step, "compute_ms_p50": compute, "comm_exposed_ms": exposed})
    assert (why is not None) == flagged
    if flagged:
        assert f"more than the measured step p50 {step:.2f} ms" in why and "ablation's pairs ran slower" in why


def test_compare_and_report_flag_a_breakdown_that_does_not_add_up(tmp_path) -> None:
    from rich.console import Console

    from dpcompare.commands.compare.plan import Job
    from dpcompare.commands.compare.compare_output import render_cost
    from dpcompare.commands.report.derive import Baseline, derive
    from dpcompare.commands.report.markdown import Footnotes
    from dpcompare.commands.report.markdown_cost import _compute_cell
    from dpcompare.result_view import Metrics, RunResult

    slow = {"step_ms_p50": 77.65, "compute_ms_p50": 108.75, "comm_exposed_ms": 6.85, "comm_total_ms": 13.02}
    fits = {"step_ms_p50": 64.0, "compute_ms_p50": 56.9, "comm_exposed_ms": 3.4, "comm_total_ms": 7.1}
    jobs = [Job("ddp", 2, [], "ddp/2", tmp_path / "a.npz", tmp_path / "a.log", result=RunResult({"metrics": slow})),
            Job("deepspeed", 2, [], "deepspeed/2", tmp_path / "b.npz", tmp_path / "b.log", result=RunResult({"metrics": fits}))]
    console = Console(record=True, width=400)
    render_cost(console, jobs, [])
    text = console.export_text()
    assert "108.75 (!1)" in text and "(!1) ddp/2: compute 108.75 ms + exposed 6.85 ms = 115.60 ms" in text
    assert "56.90 (" not in text and "(!2)" not in text

    notes = Footnotes()
    assert _compute_cell(Metrics(slow), notes) == "**109 (!)**[^1]"
    assert _compute_cell(Metrics(fits), notes) == "56.9"
    baseline = Baseline(None, 1.0, None)
    run = RunResult({"world_size": 2, "metrics": slow})
    d = derive(run, baseline)
    assert d.other_ms is None and "ran slower than the measured steps" in d.other_reason
    assert derive(RunResult({"world_size": 2, "metrics": fits}), baseline).other_ms == pytest.approx(3.7)


# -- the interleaved ablation's loop ---------------------------------------------------------------------------
def _phase(measure_steps=4, warmup_steps=1, ablation_steps=None, can_disable_sync=True):
    """A MeasurementPhase over a fake adapter and runner that log what ran, in order."""
    from types import SimpleNamespace

    from dpcompare.contract import CommCounter, CommCounts
    from dpcompare.run.measurement import MeasurementPhase

    log = []

    class Counter(CommCounter):
        def begin(self, window):
            log.append("counter.begin")

        def step(self):
            log.append("counter.step")

        def end(self):
            log.append("counter.end")
            return CommCounts(method="fake", per_step_total=(1.0,) * measure_steps)

    @contextlib.contextmanager
    def comm_off():
        log.append("comm_off")
        yield

    adapter = SimpleNamespace(name="fake", no_communication_reason=lambda: None, comm_counter=Counter,
                              capabilities=SimpleNamespace(can_disable_sync=can_disable_sync),
                              all_gather_object=lambda obj: log.append("gather" if obj is None else "gather obj")
                              or [obj], comm_off=comm_off, ablation_bytes=lambda: 0)

    class Runner:
        device = torch.device("cpu")

        def batch(self, i):
            return None, f"x{i}", f"y{i}"

        def step(self, step, x, y, *, phase, sync=True, update=True, after_reduce=None):
            log.append((phase, x, "sync" if sync else "nosync", "update" if update else "no-update"))
            if after_reduce is not None:
                after_reduce()

    cfg = SimpleNamespace(measure_steps=measure_steps, warmup_steps=warmup_steps, ablation_steps=ablation_steps,
                          instrument=True, steps=10, amp="none", profile=False)
    phase = MeasurementPhase(cfg, adapter, Runner(), 8, True)  # no template: no FLOPs counted (MFU said missing)
    phase._census = lambda: log.append("census") or {"total": 0.0}
    phase._summarize = lambda gathered, facts=None, traces=None: gathered[0][0]
    return phase, log


def test_the_ablation_interleaves_the_measured_steps_with_unsynced_ones() -> None:
    phase, log = _phase()
    sample = phase.run()
    window = log[log.index("counter.begin") + 1:log.index("counter.end")]
    measured = ("measured", "sync", "update")
    unsynced = ("ablation", "nosync", "no-update")
    # A B A B ...: each measured step, the counter read, then the same batch unsynced and the ranks lined up again
    # (the next synced arm starts without the lag a slower rank built in the unsynced step); the census after the
    # last measured step's reduce, before the counter reads that step
    expected = []
    for i in range(4):
        x = f"x{11 + i}"
        expected += [(measured[0], x, *measured[1:])] + (["census"] if i == 3 else [])
        expected += ["counter.step", (unsynced[0], x, *unsynced[1:]), "gather"]
    assert window == expected
    assert len(sample.step_ms) == len(sample.synced_ms) == len(sample.unsynced_ms) == 4
    # every synced arm is the part of its measured step up to the reduce: never longer than the step
    assert all(s <= t for s, t in zip(sample.synced_ms, sample.step_ms))
    # comm_off() entered once, empty, so what the unsynced arm builds exists before the memory window; then the
    # warm-up runs the same pattern, before the window
    assert log[:3] == ["comm_off", ("warm-up", "x10", "sync", "update"), ("warm-up", "x10", "nosync", "no-update")]


def test_fewer_pairs_spread_over_the_window_and_more_run_after_it() -> None:
    from dpcompare.run.measurement import paired_steps

    assert paired_steps(10, 5) == [0, 2, 4, 6, 8] and paired_steps(4, 10) == [0, 1, 2, 3] and paired_steps(4, 0) == []
    phase, log = _phase(ablation_steps=6)
    sample = phase.run()
    after = log[log.index("counter.end") + 1:]
    # outside the counter's window, the ranks lined up after each unsynced step there too
    assert [e[2:] if isinstance(e, tuple) else e for e in after if e != "gather obj"] == [
        ("sync", "update"), ("nosync", "no-update"), "gather"] * 2
    assert len(sample.synced_ms) == len(sample.unsynced_ms) == 6 and len(sample.step_ms) == 4
    phase, log = _phase(ablation_steps=2)
    phase.run()
    window = log[log.index("counter.begin") + 1:log.index("counter.end")]
    assert [e[1] for e in window if isinstance(e, tuple) and e[0] == "ablation"] == ["x11", "x13"]


def test_no_unsynced_step_where_sync_cannot_be_switched_off() -> None:
    phase, log = _phase(can_disable_sync=False)
    sample = phase.run()
    assert not any(isinstance(e, tuple) and e[2] == "nosync" for e in log)
    assert sample.synced_ms == [] and sample.unsynced_ms == [] and "counter.step" in log  # the counter still ran
    assert phase.comm_reason == "fake cannot switch gradient synchronisation off"


def test_compare_marks_the_interference_not_exposed_above_the_total() -> None:
    import io
    from types import SimpleNamespace

    from rich.console import Console

    from dpcompare.commands.compare import compare_output as render
    from dpcompare.result_view import RunResult

    new = {"step_ms_p50": 30.0, "compute_ms_p50": 20.0, "comm_exposed_ms": 6.0, "comm_total_ms": 6.0,
           "comm_ablation_ms": 9.0, "comm_interference_ms": 3.0, "comm_exposed_ci_ms": [5.0, 6.0]}
    old = {"step_ms_p50": 30.0, "compute_ms_p50": 20.0, "comm_exposed_ms": 9.0, "comm_total_ms": 6.0,
           "comm_exposed_ci_ms": [8.0, 10.0]}  # a result of the unbounded ablation
    console = Console(file=io.StringIO(), width=160, record=True)
    render.render_cost(console, [SimpleNamespace(label="new/2", result=RunResult({"metrics": new})),
                                 SimpleNamespace(label="old/2", result=RunResult({"metrics": old}))], [])
    text = console.export_text()
    assert "6.00 (+1)" in text and "(+1) new/2: the synced step took 9.00 ms longer" in text
    assert "9.00 (!2)" in text and "(~" not in text


def test_a_breakdown_that_does_not_add_up_is_blamed_on_the_arms_noise_not_the_machine_under_interleaving() -> None:
    # horovod/2 of an interleaved compare on the loaded 2-core VM: median(unsynced) + median(differences) went past
    # the step, whose synced part they estimate
    metrics = {"step_ms_p50": 190.35, "compute_ms_p50": 160.50, "comm_exposed_ms": 48.92, "comm_ablation_ms": 48.92}
    why = consistency.breakdown_flag(metrics)
    assert "do not add up" in why and "load changed" not in why
    old = {k: v for k, v in metrics.items() if k != "comm_ablation_ms"}
    assert "load changed between the two windows" in consistency.breakdown_flag(old)
    assert consistency.breakdown_flag(dict(metrics, compute_ms_p50=140.0)) is None
