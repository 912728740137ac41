"""Figures the report derives from the runs: which runs are reported (the newest per backend and world size; a run
that changes a knob from its backend's baseline, as it recorded its knobs, is a row of its own), the scaling
baseline, each run's scaling efficiency, the unattributed rest of a step and its bus bandwidth against the
microbenchmark, and the number formats the tables and plots share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from dpcompare.commands.report.load import is_number, run_order
from dpcompare.measure import consistency
from dpcompare.measure.scaling import other_ms, scaling_efficiency
from dpcompare.result_view import Field, Figure, Metrics, RunResult

NO_BASELINE = ("no run at world size 1 declares itself the scaling baseline (capabilities.scaling_baseline): get "
               "one with python -m dpcompare --backend reference (a result written before capabilities were "
               "recorded declares nothing)")
STEP_PARTS: tuple[Field, ...] = (Metrics.step_ms_p50, Metrics.compute_ms_p50, Metrics.comm_exposed_ms)
"""A step, and the two parts of it the ablation measures: the rest is `other`."""


# -- which runs are reported ------------------------------------------------------------------------
def newest_per_backend_world_size(runs: Iterable[RunResult]) -> list[RunResult]:
    """One run per (backend, world_size): the newest by created_unix (a result without it counts as
    oldest; on a tie the later one in the input wins). Sorted in dpcompare.run.registry.BACKENDS order,
    other backends after, then by world size."""
    best: dict[tuple[str, int], RunResult] = {}
    for run in runs:
        key = (run.backend, run.world_size)
        if key not in best or run.created_unix >= best[key].created_unix:
            best[key] = run
    return sorted(best.values(), key=run_order)


def scaling_mode(runs: list[RunResult], compare: dict[str, Any] | None) -> str:
    if compare and compare.get("scaling_mode") in ("strong", "weak"):
        return compare["scaling_mode"]
    modes = {run.scaling for run in runs} - {None}
    return modes.pop() if len(modes) == 1 else "mixed"


# -- the scaling baseline -----------------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class Baseline:
    run: RunResult | None
    """The run whose samples/s at world size 1 is the denominator of scaling efficiency, if any."""
    throughput: float | None
    reason: str | None
    """Why throughput is None."""


def scaling_baseline(runs: Iterable[RunResult]) -> Baseline:
    """The newest run at world size 1 that declares itself the scaling baseline, with its samples/s."""
    candidates = [r for r in runs if r.world_size == 1 and r.scaling_baseline]
    if not candidates:
        return Baseline(None, None, NO_BASELINE)
    run = max(candidates, key=lambda r: r.created_unix)
    throughput, why = run.metrics.samples_per_s.value, run.metrics.samples_per_s.reason
    if throughput is None:
        return Baseline(run, None, f"the scaling baseline {run.label} has no samples_per_s: {why}")
    if throughput <= 0:
        return Baseline(run, None, f"the scaling baseline {run.label} has samples_per_s {throughput:g}: "
                                   "efficiency needs a positive throughput at world size 1")
    return Baseline(run, throughput, None)


# -- per-run figures ----------------------------------------------------------------------------------
@dataclass(slots=True)
class Derived:
    efficiency: float | None
    efficiency_reason: str | None
    other_ms: float | None
    other_reason: str | None
    busbw_ratio: float | None
    busbw_ratio_reason: str | None


def step_parts(run: RunResult) -> tuple[Figure, ...]:
    """The step, its compute and its exposed communication (STEP_PARTS)."""
    return tuple(run.metrics.figure(part) for part in STEP_PARTS)


def _missing(run: RunResult, fields: Iterable[Field]) -> list[str]:
    return [f.name for f in fields if run.metrics.figure(f).value is None]


def _efficiency(run: RunResult, baseline: Baseline) -> tuple[float | None, str | None]:
    samples = run.metrics.samples_per_s.value
    eff = scaling_efficiency(samples, run.world_size, baseline.throughput)
    if eff is not None:
        return eff, None
    return None, "samples_per_s is n/a for this run" if samples is None else baseline.reason


def _other(run: RunResult) -> tuple[float | None, str | None]:
    mismatch = consistency.breakdown_flag(run.metrics)
    if mismatch is not None:
        return None, mismatch
    other = other_ms(*(part.value for part in step_parts(run)))
    if other is not None:
        return other, None
    return None, (f"other = {' - '.join(f.name for f in STEP_PARTS)} needs all three; n/a: "
                  + ", ".join(_missing(run, STEP_PARTS)))


def _busbw_ratio(run: RunResult) -> tuple[float | None, str | None]:
    busbw, micro = run.metrics.busbw_gbps.value, run.metrics.microbench_busbw_gbps.value
    if busbw is not None and micro is not None and micro > 0:
        return busbw / micro, None
    missing = _missing(run, (Metrics.busbw_gbps, Metrics.microbench_busbw_gbps)) or ["microbench_busbw_gbps is 0"]
    return None, "busbw / microbenchmark busbw needs both; n/a: " + ", ".join(missing)


def derive(run: RunResult, baseline: Baseline) -> Derived:
    return Derived(*_efficiency(run, baseline), *_other(run), *_busbw_ratio(run))


# -- number formats -------------------------------------------------------------------------------------
def format_bytes(n: float) -> str:
    """Binary units, as message sizes are powers of two: 1024 -> '1 KiB', 1.5 * 2**20 -> '1.5 MiB'."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            value = n / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{n:.0f} B"


def num(x: float) -> str:
    """A figure with about three significant digits, thousands separated from 100 up."""
    a = abs(x)
    if a >= 100:
        return f"{x:,.0f}"
    if a >= 10:
        return f"{x:.1f}"
    if a >= 1 or a == 0:
        return f"{x:.2f}"
    return f"{x:.3g}"


def fmt_sweep(value: Any, spec: str) -> str:
    return format(value, spec) if is_number(value) else "n/a"
