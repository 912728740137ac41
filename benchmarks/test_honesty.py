"""Honesty benchmarks: does dpcompare measure what it claims, at a cost it can afford?

Each benchmark launches real two-rank DDP runs (torchrun, gloo on CPU / NCCL on CUDA), measures its sides
in alternation (A, B, A, B, ... at least 5 rounds each: this machine is shared and noisy), prints a
table of medians and min-max, puts every figure in the benchmark's extra_info, and asserts its target:

  a. harness overhead        dpcompare's measured loop against a hand-written DDP loop (experiments/
                             plain_ddp.py) on the same model, data and world size: the median per-round
                             ratio of loop_ms_per_step is at most 1.03. Reported both with dpcompare's
                             instrumentation on (what users run) and off; the target is on the former.
  b. instrumentation cost    dpcompare with metrics on against --no-instrument (same series as a):
                             median per-round ratio of loop_ms_per_step at most 1.02.
  c. exposed communication   the ablation's figure (synced - unsynced step) against DDP's own
                             (avg_backward_comm_time - avg_backward_compute_comm_overlap_time), both from
                             the same runs: the median per-run ratio within 15 % of 1. (What each of
                             the two includes: test_exposed_communication's docstring.)
  d. bandwidth               the in-training busbw against bench-collectives' torch transport at the same
                             message size (busbw_vs_microbench): reported; asserted only positive and finite.

Run them with (`pytest` alone collects tests/ only):

    cd /work/main && OMP_NUM_THREADS=1 .venv/bin/python -m pytest benchmarks -s -p no:cacheprovider --benchmark-only

DPCOMPARE_BENCH_ROUNDS raises the number of rounds (default 5, the minimum; a and b use at least 7).
Every figure comes with the median's 90 % bootstrap interval: where that interval straddles a target,
the verdict (on the median, as specified) is within this machine's noise, and the table says so.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from benchmarks.conftest import (
    REPO_ROOT,
    Runner,
    alternate,
    paired_ratios,
    print_table,
    spread,
)

pytestmark = pytest.mark.timeout(1200)  # a hang guard over the per-launch timeouts (benchmarks/conftest.py)

ROUNDS = max(5, int(os.environ.get("DPCOMPARE_BENCH_ROUNDS", "5")))
OVERHEAD_ROUNDS = max(ROUNDS, 7)
"""The overhead targets are 2-3 %, well inside this machine's run-to-run noise: they get more rounds."""

MODEL = "benchmarks.workloads:wide_mlp"  # ~4.2 M parameters, ~16.8 MB of gradients per step
GLOBAL_BATCH = 64
WARMUP_STEPS = 5
MEASURE_STEPS = 60
ABLATION_STEPS = 30

HARNESS_OVERHEAD_MAX = 1.03
INSTRUMENT_OVERHEAD_MAX = 1.02
EXPOSED_AGREEMENT = 0.15

# Both sides of every comparison: the same model, batch, seed, optimizer (dpcompare's default SGD
# lr 0.05, momentum 0.9), warm-up and measured steps. dpcompare runs one verification step first
# (--steps 1, no oracle); its measured phase then reads the data stream from step 1, and so does plain_ddp.
COMMON = ["--model", MODEL, "--global-batch", str(GLOBAL_BATCH), "--warmup-steps", str(WARMUP_STEPS),
          "--measure-steps", str(MEASURE_STEPS)]
DPCOMPARE = ["--backend", "ddp", *COMMON, "--steps", "1", "--check-every", "0"]
PLAIN = [*COMMON, "--first-step", "1"]


def _finite_positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


# -- a and b: one alternating series of three sides -----------------------------------------------
@pytest.fixture(scope="module")
def overhead_series(tmp_path_factory: pytest.TempPathFactory) -> Callable[[], dict[str, Any]]:
    """plain DDP, dpcompare instrumented, dpcompare --no-instrument, rotating every round. Measured once
    per session, by whichever of benchmarks a and b runs first (inside its benchmark timer)."""
    cache: dict[str, Any] = {}

    def measure() -> dict[str, Any]:
        if "series" in cache:
            return {**cache, "shared_with_earlier_benchmark": True}
        runner = Runner(tmp_path_factory.mktemp("overhead"))
        # No ablation in these runs: its unsynced steps, interleaved with the measured ones, are left out of
        # loop_ms_per_step, but a plain loop has nothing like them; the instrumented side keeps its clocks.
        sides = {
            "plain_ddp": lambda: runner.plain_ddp(PLAIN),
            "dpcompare": lambda: runner.dpcompare([*DPCOMPARE, "--ablation-steps", "0"], "instrumented"),
            "dpcompare_no_instrument": lambda: runner.dpcompare([*DPCOMPARE, "--no-instrument"], "no-instrument"),
        }
        started = time.monotonic()
        print(f"\nharness / instrumentation overhead: {OVERHEAD_ROUNDS} rounds of {', '.join(sides)}")
        cache["series"] = alternate(sides, OVERHEAD_ROUNDS)
        cache["wall_s"] = time.monotonic() - started
        return {**cache, "shared_with_earlier_benchmark": False}

    return measure


def _bookkeeping_us(heartbeat_dir: Path, repeats: int = 2000) -> dict[str, float]:
    """What dpcompare's measured loop does per step beyond the hand-written loop, timed in this process:
    the watchdog heartbeats (StepRunner.step beats at each of its 4 stages, inside the step clock; a beat is a
    memory write, the watchdog thread writes the file) and module.train() (inside the clock)."""
    from benchmarks.workloads import wide_mlp
    from dpcompare.run.watchdog import Watchdog

    os.environ["DPCOMPARE_HEARTBEAT_DIR"] = str(heartbeat_dir)
    try:
        watchdog = Watchdog(rank=0, world_size=2, job_id="bookkeeping", timeout_s=3600)  # thread not started
        model = wide_mlp(0).model
        out = {}
        work = {"watchdog_beats": lambda i: [watchdog.beat(stage, i) for stage in ("forward", "reduce", "reduced", "stepped")],
                "module_train": lambda i: model.train()}
        for name, fn in work.items():
            for i in range(50):
                fn(i)
            started = time.perf_counter()
            for i in range(repeats):
                fn(i)
            out[name] = (time.perf_counter() - started) / repeats * 1e6
        watchdog.stop()
        return out
    finally:
        del os.environ["DPCOMPARE_HEARTBEAT_DIR"]


def _loop(series: dict[str, list[dict[str, Any]]], side: str) -> list[float]:
    return [r["loop_ms_per_step"] for r in series[side]]


def _resolution(ratio: dict[str, Any], target: float) -> str:
    lo, hi = ratio["median_ci90"]
    if hi <= target:
        return f"resolved: the median's 90% interval {lo:.3f}-{hi:.3f} lies below {target}"
    if lo > target:
        return f"resolved: the median's 90% interval {lo:.3f}-{hi:.3f} lies above {target}"
    return f"NOT resolved by this machine's noise: the median's 90% interval {lo:.3f}-{hi:.3f} straddles {target}"


def test_harness_overhead(benchmark, overhead_series, tmp_path: Path) -> None:
    measured = benchmark.pedantic(overhead_series, rounds=1, iterations=1)
    bookkeeping = _bookkeeping_us(tmp_path / "heartbeat")
    series = measured["series"]
    plain, instrumented, bare = (_loop(series, s) for s in ("plain_ddp", "dpcompare", "dpcompare_no_instrument"))
    ratio_instr = spread(paired_ratios(instrumented, plain))
    ratio_bare = spread(paired_ratios(bare, plain))
    step_p50 = {s: spread([r["step_ms_p50"] for r in series[s]]) for s in ("plain_ddp", "dpcompare")}
    figures = {
        "model": MODEL, "global_batch": GLOBAL_BATCH, "world_size": 2, "measure_steps": MEASURE_STEPS,
        "rounds": OVERHEAD_ROUNDS, "series_wall_s": measured["wall_s"],
        "loop_ms_per_step_plain": spread(plain),
        "loop_ms_per_step_dpcompare": spread(instrumented),
        "loop_ms_per_step_dpcompare_no_instrument": spread(bare),
        "ratio_dpcompare_over_plain": ratio_instr,
        "ratio_dpcompare_no_instrument_over_plain": ratio_bare,
        "ratio_of_medians_dpcompare_over_plain": float(np.median(instrumented) / np.median(plain)),
        "ratio_of_best_dpcompare_over_plain": min(instrumented) / min(plain),
        "ratio_of_best_dpcompare_no_instrument_over_plain": min(bare) / min(plain),
        "step_ms_p50_plain": step_p50["plain_ddp"],
        "step_ms_p50_dpcompare": step_p50["dpcompare"],
        "per_round_loop_ms": {s: _loop(series, s) for s in series},
        "per_round_load1": {s: [r["_load1"] for r in series[s]] for s in series},
        "target_max_ratio": HARNESS_OVERHEAD_MAX,
        "resolution": _resolution(ratio_instr, HARNESS_OVERHEAD_MAX),
        "dpcompare_per_step_bookkeeping_us": bookkeeping,
        "bookkeeping_fraction_of_plain_step": sum(bookkeeping.values()) / 1e3 / float(np.median(plain)),
    }
    benchmark.extra_info.update(figures)
    print_table(f"a. harness overhead: dpcompare ddp vs experiments/plain_ddp.py ({MODEL}, 2 ranks, "
                f"{OVERHEAD_ROUNDS} rounds)", [
        ("loop_ms_per_step plain", figures["loop_ms_per_step_plain"], "hand-written DDP loop"),
        ("loop_ms_per_step dpcompare", figures["loop_ms_per_step_dpcompare"], "instrumented (what users run)"),
        ("loop_ms_per_step dpcompare --no-instrument", figures["loop_ms_per_step_dpcompare_no_instrument"], ""),
        ("step_ms_p50 plain", step_p50["plain_ddp"], "slowest rank per step"),
        ("step_ms_p50 dpcompare", step_p50["dpcompare"], "slowest rank per step"),
        ("ratio dpcompare / plain", ratio_instr, f"per round; VERDICT: median <= {HARNESS_OVERHEAD_MAX}"),
        ("ratio dpcompare --no-instrument / plain", ratio_bare, "per round"),
        ("ratio of medians dpcompare / plain", figures["ratio_of_medians_dpcompare_over_plain"], ""),
        ("ratio of best runs dpcompare / plain", figures["ratio_of_best_dpcompare_over_plain"],
         "fastest run of each side: the least disturbed"),
        ("ratio of best runs --no-instrument / plain", figures["ratio_of_best_dpcompare_no_instrument_over_plain"], ""),
        ("watchdog beats per step, us", bookkeeping["watchdog_beats"], "timed here; 4 beats inside the step clock"),
        ("module.train() per step, us", bookkeeping["module_train"], "timed here; inside the step clock"),
        ("bookkeeping / plain loop_ms_per_step", figures["bookkeeping_fraction_of_plain_step"],
         "the overhead these two alone predict"),
    ])
    print(f"verdict resolution: {figures['resolution']}")
    assert ratio_instr["median"] <= HARNESS_OVERHEAD_MAX, (
        f"dpcompare's measured loop is {ratio_instr['median']:.3f}x the hand-written DDP loop (median of "
        f"{OVERHEAD_ROUNDS} paired rounds, min {ratio_instr['min']:.3f}, max {ratio_instr['max']:.3f}); target <= "
        f"{HARNESS_OVERHEAD_MAX}; {figures['resolution']}")


def test_instrumentation_overhead(benchmark, overhead_series) -> None:
    measured = benchmark.pedantic(overhead_series, rounds=1, iterations=1)
    series = measured["series"]
    instrumented, bare = _loop(series, "dpcompare"), _loop(series, "dpcompare_no_instrument")
    ratio = spread(paired_ratios(instrumented, bare))
    figures = {
        "model": MODEL, "rounds": OVERHEAD_ROUNDS, "measure_steps": MEASURE_STEPS,
        "shared_series_with_harness_overhead": measured["shared_with_earlier_benchmark"],
        "loop_ms_per_step_instrumented": spread(instrumented),
        "loop_ms_per_step_no_instrument": spread(bare),
        "ratio_instrumented_over_no_instrument": ratio,
        "ratio_of_medians": float(np.median(instrumented) / np.median(bare)),
        "ratio_of_best": min(instrumented) / min(bare),
        "target_max_ratio": INSTRUMENT_OVERHEAD_MAX,
        "resolution": _resolution(ratio, INSTRUMENT_OVERHEAD_MAX),
    }
    benchmark.extra_info.update(figures)
    print_table(f"b. instrumentation overhead: dpcompare metrics on vs --no-instrument ({OVERHEAD_ROUNDS} rounds, "
                "the series of a)", [
        ("loop_ms_per_step instrumented", figures["loop_ms_per_step_instrumented"], ""),
        ("loop_ms_per_step --no-instrument", figures["loop_ms_per_step_no_instrument"], ""),
        ("ratio instrumented / no-instrument", ratio, f"per round; VERDICT: median <= {INSTRUMENT_OVERHEAD_MAX}"),
        ("ratio of medians", figures["ratio_of_medians"], ""),
        ("ratio of best runs", figures["ratio_of_best"], "fastest run of each side"),
    ])
    print(f"verdict resolution: {figures['resolution']}")
    assert ratio["median"] <= INSTRUMENT_OVERHEAD_MAX, (
        f"instrumentation costs {ratio['median']:.3f}x (median of {OVERHEAD_ROUNDS} paired rounds, min "
        f"{ratio['min']:.3f}, max {ratio['max']:.3f}); target <= {INSTRUMENT_OVERHEAD_MAX}; {figures['resolution']}")


# -- c: exposed communication, two methods ---------------------------------------------------------
def _bucket_copy_ms(repeats: int = 30) -> float:
    """One rank's copy of every gradient into DDP's buckets, scaled by 1/N (reducer.cpp
    mark_variable_ready_dense: at::mul_out(bucket_view, grad, 1/N)), timed here on one thread. It runs
    inside backward, so DDP's counter books it as compute; the ablation's synced arm pays it."""
    import torch

    from benchmarks.workloads import wide_mlp

    numel = sum(p.numel() for p in wide_mlp(0).model.parameters())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        grad, bucket, scale = torch.randn(numel), torch.empty(numel), torch.tensor(0.5)
        for _ in range(3):
            torch.mul(grad, scale, out=bucket)
        started = time.perf_counter()
        for _ in range(repeats):
            torch.mul(grad, scale, out=bucket)
        return (time.perf_counter() - started) / repeats * 1e3
    finally:
        torch.set_num_threads(threads)


def test_exposed_communication(benchmark, runner: Runner) -> None:
    """Both figures come from the same run: the native counter over the measured window, then the
    ablation's interleaved synced/unsynced pairs. A round is one run.

    What each figure holds. DDP's: comm_end - backward_compute_end on rank 0 (reducer.cpp records
    kBackwardComputeEnd in the end-of-backward callback and kBackwardCommEnd after finalize_backward has
    waited for every bucket and copied the results back), per step, median over the window. The ablation's: the
    slowest rank's synced step minus its unsynced step (median over pairs), i.e. the wait tail plus all
    that synchronisation adds inside backward: the bucket copies, the autograd hooks, and the CPU that
    gloo's reductions and loopback transfers take from backward compute on a machine with one core per rank."""
    args = ["--backend", "ddp", "--model", MODEL, "--global-batch", str(GLOBAL_BATCH), "--steps", "1",
            "--check-every", "0", "--warmup-steps", str(WARMUP_STEPS), "--measure-steps", str(ABLATION_STEPS),
            "--ablation-steps", str(ABLATION_STEPS)]

    def measure() -> dict[str, list[dict[str, Any]]]:
        print(f"\nexposed communication: {ROUNDS} runs, each with {ABLATION_STEPS} measured steps and "
              f"{ABLATION_STEPS} ablation pairs")
        return alternate({"dpcompare": lambda: runner.dpcompare(args, "ablation")}, ROUNDS)

    runs = benchmark.pedantic(measure, rounds=1, iterations=1)["dpcompare"]
    ablation = [r["comm_exposed_ms"] for r in runs]
    native = [r["comm_native_exposed_ms"] for r in runs]  # median over steps of DDP's total - overlap
    ratio = spread(paired_ratios(ablation, native))
    copy_ms = _bucket_copy_ms()
    figures = {
        "model": MODEL, "rounds": ROUNDS, "ablation_pairs": ABLATION_STEPS, "measure_steps": ABLATION_STEPS,
        "comm_exposed_ms_ablation": spread(ablation),
        "comm_exposed_ms_native": spread(native),
        "comm_total_ms": spread([r["comm_total_ms"] for r in runs]),
        "comm_native_overlap_ms": spread([r["comm_native_overlap_ms"] for r in runs]),
        "compute_ms_p50": spread([r["compute_ms_p50"] for r in runs]),
        "step_synced_ms_p50": spread([r["step_synced_ms_p50"] for r in runs]),
        "step_ms_p50": spread([r["step_ms_p50"] for r in runs]),
        "ratio_ablation_over_native": ratio,
        "ablation_minus_native_ms": spread([a - b for a, b in zip(ablation, native, strict=True)]),
        "bucket_copy_ms_one_thread": copy_ms,
        "per_run": [{k: r.get(k) for k in ("comm_exposed_ms", "comm_total_ms", "comm_native_overlap_ms",
                                           "compute_ms_p50", "step_synced_ms_p50", "step_ms_p50", "_load1")}
                    for r in runs],
        "target_abs_deviation": EXPOSED_AGREEMENT,
    }
    benchmark.extra_info.update(figures)
    print_table(f"c. exposed communication: ablation vs DDP's own counter ({MODEL}, 2 ranks, {ROUNDS} runs)", [
        ("step_ms_p50", figures["step_ms_p50"], "measured phase, with optimizer step"),
        ("step_synced_ms_p50", figures["step_synced_ms_p50"], "ablation, sync on, no optimizer step"),
        ("compute_ms_p50", figures["compute_ms_p50"], "ablation, communication off (DDP: noop_hook twin)"),
        ("comm_exposed_ms (ablation)", figures["comm_exposed_ms_ablation"], "median of synced - unsynced"),
        ("comm_total_ms (DDP)", figures["comm_total_ms"], "backward_comm_time, median over steps"),
        ("comm_native_overlap_ms (DDP)", figures["comm_native_overlap_ms"], "backward_compute_comm_overlap_time"),
        ("exposed (DDP) = total - overlap", figures["comm_exposed_ms_native"], "per step, median"),
        ("ratio ablation / DDP", ratio, f"per run; VERDICT: |median - 1| <= {EXPOSED_AGREEMENT}"),
        ("ablation - DDP, ms", figures["ablation_minus_native_ms"], "what DDP books as compute (see docstring)"),
        ("bucket copy-in, ms", copy_ms, "one rank, timed here: part of that difference"),
    ])
    assert abs(ratio["median"] - 1.0) <= EXPOSED_AGREEMENT, (
        f"the ablation's exposed communication is {ratio['median']:.3f}x DDP's own figure (median of {ROUNDS} runs, "
        f"min {ratio['min']:.3f}, max {ratio['max']:.3f}; ablation {np.median(ablation):.1f} ms, "
        f"DDP {np.median(native):.1f} ms); target within {EXPOSED_AGREEMENT:.0%}")


# -- d: in-training bus bandwidth against the microbenchmark ----------------------------------------
def _collectives_available() -> str | None:
    if not (REPO_ROOT / "dpcompare" / "commands" / "bench_collectives" / "__init__.py").exists():
        return ("dpcompare/commands/bench_collectives/ does not exist: `python -m dpcompare bench-collectives` is needed to "
                "measure the microbenchmark side of this benchmark")
    return None


def test_busbw_vs_microbenchmark(benchmark, runner: Runner) -> None:
    missing = _collectives_available()
    if missing:
        pytest.fail(missing)
    from benchmarks.workloads import wide_mlp
    from dpcompare.measure.bandwidth import busbw_at

    grad_bytes = sum(p.numel() * p.element_size() for p in wide_mlp(0).model.parameters())
    bucket_bytes = min(25 * 1024 * 1024, grad_bytes)  # DDP's default bucket_cap_mb, as adapters/ddp.py reports it

    # adapters/ddp.py quotes the microbenchmark at min(25 MiB, gradient bytes) = ~16.05 MiB here; DDP's rebuilt
    # buckets for this model are ~4.0 and ~12.0 MiB. 1-32 MiB covers both readings.
    sweep = ["--transports", "torch", "--world-sizes", "2", "--min-bytes", "1MiB", "--max-bytes", "32MiB",
             "--factor", "2"]
    run_args = ["--backend", "ddp", *COMMON, "--steps", "1", "--check-every", "0", "--ablation-steps", "0"]
    latest: dict[str, Path] = {}

    def microbench() -> dict[str, Any]:
        d = runner.launch_dir("collectives")
        path = d / "collectives.json"
        runner.command([sys.executable, "-m", "dpcompare", "bench-collectives", *sweep, "--out", str(path)], d)
        data = json.loads(path.read_text())
        assert data.get("kind") == "collectives", f"{path} is not a bench-collectives result"
        latest["path"] = path
        return {"busbw_at_bucket_gbps": busbw_at(data, "torch", 2, bucket_bytes)}

    def in_training() -> dict[str, Any]:
        return runner.dpcompare([*run_args, "--collectives", str(latest["path"])], "busbw")

    def measure() -> dict[str, list[dict[str, Any]]]:
        print(f"\nbusbw: {ROUNDS} rounds of bench-collectives (torch, 2 ranks), each followed by a run quoting it")
        return alternate({"bench_collectives": microbench, "dpcompare": in_training}, ROUNDS, rotate=False)

    measured = benchmark.pedantic(measure, rounds=1, iterations=1)
    runs = measured["dpcompare"]
    for r in runs:
        assert _finite_positive(r["busbw_gbps"]) and _finite_positive(r["microbench_busbw_gbps"]), (
            f"busbw_gbps={r['busbw_gbps']}, microbench_busbw_gbps={r['microbench_busbw_gbps']}; reasons: "
            f"{r.get('reasons')}")
        assert _finite_positive(r["busbw_vs_microbench"]), r.get("reasons")
    figures = {
        "model": MODEL, "rounds": ROUNDS, "bucket_bytes": runs[0]["bucket_bytes"],
        "grad_bytes_per_step": runs[0]["grad_bytes_per_step"],
        "busbw_gbps_in_training": spread([r["busbw_gbps"] for r in runs]),
        "microbench_busbw_gbps": spread([r["microbench_busbw_gbps"] for r in runs]),
        "busbw_vs_microbench": spread([r["busbw_vs_microbench"] for r in runs]),
        "comm_total_ms": spread([r["comm_total_ms"] for r in runs]),
        "per_round": [{k: r.get(k) for k in ("busbw_gbps", "microbench_busbw_gbps", "busbw_vs_microbench",
                                             "comm_total_ms", "_load1")} for r in runs],
    }
    benchmark.extra_info.update(figures)
    print_table(f"d. in-training busbw vs bench-collectives (torch transport, 2 ranks, {ROUNDS} rounds)", [
        ("bucket_bytes", float(runs[0]["bucket_bytes"]), "dpcompare's message size; the microbenchmark is read here"),
        ("busbw_gbps in training", figures["busbw_gbps_in_training"], "grad bytes / avg_backward_comm_time"),
        ("microbench_busbw_gbps", figures["microbench_busbw_gbps"], "bench-collectives at bucket_bytes"),
        ("busbw_vs_microbench", figures["busbw_vs_microbench"], "no target"),
        ("comm_total_ms", figures["comm_total_ms"], "avg_backward_comm_time (overlaps backward compute)"),
    ])
