"""--profile: one torch.profiler trace per rank of a few steps after the measured window, the step's phases marked,
readable as Chrome/Perfetto JSON (dpcompare.run.measurement.MeasurementPhase._profile, StepRunner.mark)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

PHASES = ("dpcompare.forward", "dpcompare.backward", "dpcompare.reduce", "dpcompare.optimizer_step")


def _names(trace: str) -> Counter:
    events = json.loads(Path(trace).read_text())["traceEvents"]
    return Counter(e.get("name") for e in events if e.get("ph") == "X")


@pytest.mark.multiproc
def test_each_rank_writes_a_trace_with_the_steps_phases_and_its_collectives(launch):
    finished, result = launch("ddp", 2, "mlp", ["--profile", "--measure-steps", "3", "--steps", "1"], "torchrun")
    assert result is not None, finished.output[-3000:]
    profile = result["metrics"]["profile"]
    assert profile["steps"] == 3 and list(profile["phases"]) == list(PHASES)
    assert [Path(t).name for t in profile["traces"]] == ["rank0.json", "rank1.json"]
    for trace in profile["traces"]:
        names = _names(trace)
        # one of each per traced step, and a forward and backward more in each step's unsynced twin
        assert [names[p] for p in PHASES] == [6, 6, 3, 3], {p: names[p] for p in PHASES}
        assert sum(n.startswith("dpcompare.unsynced ") for n in names.elements() if n) == 3
        collectives = [n for n in names if n and ("all_reduce" in n or "allreduce" in n)]
        assert collectives, sorted(n for n in names if n)[:40]
    # the measured window's figures are the profiler's no more than a run without it: the traced steps come after it
    assert result["metrics"]["measured_steps"] == 3
    m = result["metrics"]  # read back from the traces: every rank's exposed communication, the figure to trust
    assert len(m["comm_exposed_trace_ms_per_rank"]) == 2 and m["comm_exposed_trace_ms"] <= max(m["comm_exposed_trace_ms_per_rank"])
    assert 0 < m["comm_exposed_trace_ms"] <= m["comm_trace_ms"] and m["comm_exposed_trust"] in ("both", "ablation")
    assert m["comm_exposed_trust_why"] and m["comm_link"]["transport"] == "gloo" and m["comm_link"]["algorithm"] == "Ring"
    assert isinstance(m["comm_slowed_compute_trace_ms"], float)  # held against the twins' compute
    waits = m["comm_arrival_wait_ms_per_rank"]  # the rank that arrived last at every collective waited for no one
    assert len(waits) == 2 and min(waits) >= 0 and all(w is not None for w in waits), waits
    # report draws the traced steps rank by rank, and shows both exposed-communication figures
    from dpcompare.commands.report import build_report

    out = Path(profile["traces"][0]).parents[2]
    report = build_report(out, out / "report")
    assert (out / "report" / "trace_timeline.png").stat().st_size > 10_000
    text = report.read_text()
    assert "Traced steps, rank by rank" in text and "exposed (trace, ms)" in text and "gloo Ring over tcp" in text


def test_without_profile_no_trace_is_written_and_the_result_says_why(shared_launch):
    finished, result = shared_launch("reference", 1, "mlp", ["--steps", "1", "--measure-steps", "5"], "python")
    assert result is not None, finished.output[-3000:]
    assert result["metrics"]["profile"] is None and "--profile" in result["metrics"]["reasons"]["profile"]


# -- exposed communication read from a trace (dpcompare.measure.trace) ----------------------------------------------
def _x(name: str, ts: float, dur: float, tid: int = 1, cat: str = "cpu_op") -> dict:
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": tid, "cat": cat}


def _cpu_step(overlapped: bool) -> list[dict]:
    """One step on a CPU, in µs: compute on the step's thread (tid 1), the collective on gloo's (tid 2); the step's
    thread waits inside the hook that launched it (a c10d op nested in AccumulateGrad) unless `overlapped`."""
    events = [_x("dpcompare.step 4", 0, 10_000, cat="user_annotation"), _x("aten::linear", 0, 2_000),
              _x("autograd::engine::evaluate_function: AddmmBackward0", 2_000, 3_000),
              _x("dpcompare.reduce", 9_100, 100, cat="user_annotation"), _x("aten::add_", 9_200, 700),
              _x("gloo:all_reduce", 9_500, 400, tid=2, cat="user_annotation")]  # after the reduce: not the step's
    if overlapped:
        return events + [_x("gloo:all_reduce", 3_000, 1_500, tid=2, cat="user_annotation"),
                         _x("aten::mul", 5_000, 4_100)]
    return events + [_x("autograd::engine::evaluate_function: torch::autograd::AccumulateGrad", 5_000, 4_100),
                     _x("c10d::allreduce_", 5_050, 3_950), _x("gloo:all_reduce", 5_100, 3_700, tid=2,
                                                               cat="user_annotation")]


def test_a_collective_the_step_waits_for_is_exposed_and_one_beside_compute_is_not():
    from dpcompare.measure import trace

    waited, = trace.per_step(_cpu_step(overlapped=False))
    assert waited["step"] == 4 and waited["comm_ms"] == pytest.approx(3.95) and waited["exposed_ms"] == pytest.approx(3.95)
    hidden, = trace.per_step(_cpu_step(overlapped=True))
    assert hidden["comm_ms"] == pytest.approx(1.5) and hidden["exposed_ms"] == 0.0


def test_on_a_gpu_nccl_kernels_are_held_against_the_other_kernels():
    from dpcompare.measure import trace

    events = [_x("dpcompare.step 0", 0, 8_000, cat="user_annotation"),  # ends with a synchronize
              _x("dpcompare.reduce", 900, 50, cat="user_annotation"),
              _x("sm90_xmma_gemm_bf16", 500, 4_000, tid=7, cat="kernel"),
              _x("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)", 3_500, 3_500,
                 tid=8, cat="kernel")]
    step, = trace.per_step(events)  # the kernels run behind the host: past the reduce's range
    assert step["comm_ms"] == pytest.approx(3.5) and step["exposed_ms"] == pytest.approx(2.5)


def test_a_trace_without_the_steps_ranges_has_no_figure():
    from dpcompare.measure import trace
    from dpcompare.measure.samples import Metrics

    assert trace.per_step([_x("gloo:all_reduce", 0, 10)]) == [] and trace.rank_figure([]) is None
    m = Metrics()
    trace.record_traced(m, None, 2.0)
    assert m.values["comm_exposed_trace_ms"] is None and "--profile" in m.reasons["comm_exposed_trace_ms"]
    assert m.values["comm_exposed_trust"] == "ablation"


@pytest.mark.parametrize("ablation, ci, traced, which, words", [
    (3.0, [1.0, 6.0], 5.5, "both", "interval"),
    (3.0, None, 3.5, "both", "within 20%"),
    (3.0, None, 2.0, "ablation", "beside it"),  # the step pays more than the trace books: compute slowed
    (3.0, None, 4.0, "ablation", "profiler"),  # the trace books more: its steps ran under the profiler
    (None, None, 4.0, "trace", "did not run"),
])
def test_where_the_two_figures_disagree_the_result_says_which_to_trust_and_why(ablation, ci, traced, which, words):
    from dpcompare.measure import trace

    trusted, why = trace.trust(ablation, ci, traced)
    assert trusted == which and words in why, why


def test_an_ablation_above_the_trace_by_the_compute_synchronising_slowed_agrees_with_it():
    from dpcompare.measure import trace

    trusted, why = trace.trust(10.0, [9.0, 11.0], 5.0, 4.5)  # 5 + 4.5 ms: within 20 % of the ablation's 10
    assert trusted == "both" and "slowed" in why and "4.5 ms" in why, why
    trusted, why = trace.trust(10.0, [9.0, 11.0], 5.0, 1.0)  # the twin: too little slowed compute to explain it
    assert trusted == "ablation" and "6 ms with the exposed figure" in why, why
    assert trace.trust(10.0, [9.0, 11.0], 5.0)[0] == "ablation"  # no unsynced twins traced: nothing to count


def test_a_traced_steps_unsynced_twin_gives_the_compute_synchronising_added():
    """The synced step's compute up to its reduce's end against its unsynced twin's whole range."""
    from dpcompare.measure import trace

    twin = [_x("dpcompare.unsynced 4", 20_000, 6_000, cat="user_annotation"), _x("aten::linear", 20_000, 2_000),
            _x("autograd::engine::evaluate_function: AddmmBackward0", 22_000, 2_500),
            _x("aten::mul", 27_000, 500)]  # after the twin: not its compute
    step, = trace.per_step(_cpu_step(overlapped=True) + twin)
    assert step["unsynced_compute_ms"] == pytest.approx(4.5) and step["compute_ms"] == pytest.approx(9.1)
    figure = trace.rank_figure([step])
    assert figure["slowed_ms"] == pytest.approx(4.6)
    assert "unsynced_compute_ms" not in trace.per_step(_cpu_step(overlapped=True))[0]
    # the run's: the rank that arrived last in each step (least exposed), as the ablation's slowest rank pays it
    early = trace.rank_figure([{"step": 4, "comm_ms": 9.0, "exposed_ms": 8.0, "compute_ms": 9.0,
                                "unsynced_compute_ms": 8.9}])
    assert trace.run_slowed([early, figure]) == pytest.approx(4.6)
    assert trace.run_slowed([trace.rank_figure([{"step": 4, "comm_ms": 1.0, "exposed_ms": 1.0}])]) is None


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("backend", ["ddp", "deepspeed"])
def test_a_rank_slower_in_compute_is_named_and_does_not_lift_the_ablation(launch, backend):
    """compare's model (mlp-wide), rank 1 slowed (its compute tripled by spinning after its backward). The ranks are
    lined up before each synced arm of the ablation, so the unsynced step before it leaves no lag in it: the exposed
    figure stays below 1.5 times the slowed rank's excess, where the lag it would carry is twice the excess (without
    the realignment it held the collective plus that lag: 124-156 ms against a trace of 6 ms,
    docs/results/2026-11-28-ablation-realigned-cpu.md). Not below the excess itself: on a CPU whose compute is fast
    beside gloo's all-reduce the collective alone can exceed it. The excess is judged against the unslowed rank's own
    step, not in milliseconds: the spin is a multiple of the forward, and a faster CPU shortens both. Not against the
    run's step, the slowed rank's: on a box shared with another test's ranks that step stretches with the contention
    more than the excess (half the spin, about one compute) does (CI, 2026-12-04: 25.7 ms against a run step of 135 ms,
    0.19, and about 0.28 of the unslowed rank's; on an idle box 0.30 of the run's step and 0.74 of the unslowed rank's)."""
    args = ["--steps", "1", "--profile", "--measure-steps", "20", "--global-batch", "1024", "--inject-slowdown", "2",
            "--inject-slowdown-rank", "1"]
    finished, result = launch(backend, 2, "mlp-wide", args, "torchrun")
    assert result is not None, finished.output[-3000:]
    m = result["metrics"]
    unslowed_step_ms = m["step_ms_per_rank_p50"][0]
    assert m["straggler_rank"] == 1 and m["straggler_excess_ms"] > 0.2 * unslowed_step_ms, (
        m["straggler_rank"], m["step_ms_per_rank_p50"], m["stragglers"])
    # the lag, the slowed rank's compute less the other's, is twice its excess over the two ranks' median: carried
    # into the synced arm it would put the figure above twice the excess
    assert m["comm_exposed_ms"] < 1.5 * m["straggler_excess_ms"], (m["comm_exposed_ms"], m["straggler_excess_ms"],
                                                                          m["comm_exposed_trace_ms"], m["comm_total_ms"])


def test_the_run_figure_is_the_rank_that_arrived_last():
    """The rank that reached the collective early books its wait for the others as exposed: the smallest rank's
    figure is the collective's own, the one the ablation's slowest-rank difference measures."""
    from dpcompare.measure import trace
    from dpcompare.measure.samples import Metrics

    early = trace.rank_figure([{"step": 1, "comm_ms": 9.0, "exposed_ms": 8.0}])
    last = trace.rank_figure([{"step": 1, "comm_ms": 3.0, "exposed_ms": 2.5}])
    m = Metrics()
    trace.record_traced(m, [early, last], 2.4)
    values = m.values
    assert values["comm_exposed_trace_ms"] == 2.5 and values["comm_exposed_trace_rank"] == 1
    assert values["comm_exposed_trace_ms_per_rank"] == [8.0, 2.5] and values["comm_exposed_trust"] == "both"
    assert values["comm_exposed_trace_ratio"] == pytest.approx(2.5 / 2.4)
    # the last to arrive changes from step to step: each step's is taken
    a = trace.rank_figure([{"step": k, "comm_ms": 4.0, "exposed_ms": e} for k, e in enumerate([1.0, 6.0, 1.2])])
    b = trace.rank_figure([{"step": k, "comm_ms": 3.0, "exposed_ms": e} for k, e in enumerate([5.0, 1.1, 4.0])])
    assert trace.run_figure([a, b]) == (1.1, 0, 4.0)  # per step 1.0 (rank 0), 1.1 (rank 1), 1.2 (rank 0)


# -- the link's facts beside busbw (dpcompare.measure.link) ---------------------------------------------------------
def test_nccl_tuning_lines_of_both_formats_are_read_and_other_lines_are_not(tmp_path):
    from dpcompare.measure import link

    log = tmp_path / "nccl-tuning.host.1.log"
    log.write_text("host:1:2 [0] NCCL INFO AllReduce: 26214400 Bytes -> Algo 1 proto 2 time 812.5\n"
                   "host:1:2 [0] NCCL INFO AllReduce: 1024 Bytes -> Algo 0 proto 0 time 9.1\n"
                   "host:1:2 [0] NCCL INFO AllReduce: 26214400 Bytes -> Algo 1 proto 2 time 812.5\n"
                   "host:1:2 [0] NCCL INFO Best tuning, algorithm, NVLS, protocol, SIMPLE\n"
                   "host:1:2 [0] NCCL INFO Channel 00/24 : 0 1\n")
    facts = link.nccl_facts(log, None, "2.27.3", environ={"NCCL_PROTO": "Simple"})
    assert facts["chosen"] == {"AllReduce": {"Ring/Simple": 2, "Tree/LL": 1}, "collectives": {"NVLS/Simple": 1}}
    assert facts["forced"] == {"NCCL_PROTO": "Simple"} and facts["chosen_reason"] is None
    empty = tmp_path / "empty.log"
    empty.write_text("host:1:2 [0] NCCL INFO Channel 00/24 : 0 1\n")
    nothing = link.nccl_facts(empty, None, "2.27.3", environ={})
    assert nothing["chosen"] is None and "no tuning line" in nothing["chosen_reason"]


def test_the_users_nccl_debug_is_left_alone(tmp_path):
    from dpcompare.measure import link

    env, reason = link.tuning_log_env(tmp_path, {"NCCL_DEBUG": "WARN"})
    assert env == {} and "NCCL_DEBUG=WARN is the user's" in reason
    env, reason = link.tuning_log_env(tmp_path, {})
    assert env["NCCL_DEBUG"] == "INFO" and env["NCCL_DEBUG_SUBSYS"] == "TUNING" and reason is None
    assert env["NCCL_DEBUG_FILE"].startswith(str(tmp_path)) and "%h" in env["NCCL_DEBUG_FILE"]


def test_each_rank_waits_at_a_collective_for_the_last_to_arrive():
    from dpcompare.measure import trace

    def figure(*arrivals):  # two steps, each issuing two collectives at these times (µs)
        return trace.rank_figure([{"step": k, "comm_ms": 1.0, "exposed_ms": 0.5, "arrivals_us": list(a)}
                                  for k, a in enumerate(arrivals)])

    early = figure((0, 1_000), (10_000, 11_000))
    late = figure((3_000, 1_500), (12_000, 11_500))  # 3 ms, then 0.5 ms late; 2 ms, then 0.5 ms late
    assert trace.arrival_waits([early, late]) == [pytest.approx(3.0), 0.0]
    assert trace.arrival_waits([early, None]) is None
    assert trace.arrival_waits([early, figure((0,), (1,))]) is None  # different collectives: no pairing
