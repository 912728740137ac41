"""Figures the report derives from the runs: which runs are reported (the newest per backend and world size,
variants apart: sweep knobs, other precision recipes, backend variants such as a ZeRO stage), the scaling
baseline, each run's scaling efficiency, the unattributed rest of a step and its bus bandwidth against the
microbenchmark, and the number formats the tables and plots share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from dpcompare.commands.report.declarations import variant_options
from dpcompare.commands.report.load import created, is_number, label, metric, run_order
from dpcompare.measure import consistency
from dpcompare.measure.scaling import other_ms, scaling_efficiency

# Config knobs that make a run a variant of the baseline computation (compare --sweep varies them). Backend options
# (--opt) do the same, with the value that is the baseline as the adapters declare it (declarations.variant_options):
# compare --amp runs deepspeed's engine recipe beside its autocast one; compare --backends deepspeed:zero2 (--opt
# zero_stage=2) a ZeRO stage beside stage 0, fsdp:noreshard (--opt reshard_after_forward=false) FSDP keeping its
# gathered parameters through the backward.
VARIANT_KNOBS = {"compression": "none", "grad_accum": 1, "bucket_mb": None}
NO_BASELINE = ("no run at world size 1 declares itself the scaling baseline (capabilities.scaling_baseline): get "
               "one with python -m dpcompare --backend reference (a result written before capabilities were "
               "recorded declares nothing)")
STEP_PARTS = ("step_ms_p50", "compute_ms_p50", "comm_exposed_ms")


# -- which runs are reported ------------------------------------------------------------------------
def _same_option(value: Any, default: Any) -> bool:
    """An --opt value as the result records it (the text given, or typed) against its baseline value: 2 == '2',
    True == 'true'."""
    return str(value).strip().lower() == str(default).lower()


def backend_variant(run: dict[str, Any]) -> str:
    """The named backend variant a compare job ran, from its tag (`zero2` of `deepspeed:zero2/2`), else ''."""
    tag, backend = run.get("tag"), run.get("backend")
    if not isinstance(tag, str) or not isinstance(backend, str) or not tag.startswith(f"{backend}:"):
        return ""
    name, slash, _ = tag[len(backend) + 1:].partition("/")
    return name if slash and name and " " not in name else ""


def variant_of(run: dict[str, Any]) -> str:
    """'' for a baseline run, else 'knob=value ...' for the knobs and options it changes (`zero_stage=2`, whatever
    named it). A compare job of a named backend variant whose options are none of the variant options (a variant
    this report has no option for) is named by its variant (`fsdp:grad_op/2` -> 'grad_op'), never taken for the
    baseline; a ZeRO stage 0 run (deepspeed:zero0) is deepspeed's baseline, stage 0 being its default."""
    baselines = variant_options()
    config = run.get("config") or {}
    options = config.get("options") or {}
    knobs = [f"{k}={config[k]:g}" if isinstance(config[k], float) else f"{k}={config[k]}"
             for k, default in VARIANT_KNOBS.items() if config.get(k, default) != default]
    named = backend_variant(run)
    if named and not any(k in options for k in baselines):
        knobs.insert(0, named)
    return " ".join(knobs + [f"{k}={options[k]}" for k, default in baselines.items()
                             if not _same_option(options.get(k, default), default)])


def newest_per_backend_world_size(runs: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One run per (backend, world_size): the newest by created_unix (a result without it counts as
    oldest; on a tie the later one in the input wins). Sorted in dpcompare.run.registry.BACKENDS order,
    other backends after, then by world size."""
    best: dict[tuple[str, int], dict[str, Any]] = {}
    for run in runs:
        key = (run["backend"], run["world_size"])
        if key not in best or created(run) >= created(best[key]):
            best[key] = run
    return sorted(best.values(), key=run_order)


def scaling_mode(runs: list[dict[str, Any]], compare: dict[str, Any] | None) -> str:
    if compare and compare.get("scaling_mode") in ("strong", "weak"):
        return compare["scaling_mode"]
    modes = {run.get("scaling") or (run.get("metrics") or {}).get("scaling") for run in runs} - {None}
    return modes.pop() if len(modes) == 1 else "mixed"


# -- the scaling baseline -----------------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class Baseline:
    run: dict[str, Any] | None
    """The run whose samples/s at world size 1 is the denominator of scaling efficiency, if any."""
    throughput: float | None
    reason: str | None
    """Why throughput is None."""


def declares_scaling_baseline(run: dict[str, Any]) -> bool:
    """The result says its backend is the scaling baseline (capabilities.scaling_baseline: true)."""
    capabilities = run.get("capabilities")
    return isinstance(capabilities, dict) and capabilities.get("scaling_baseline") is True


def scaling_baseline(runs: Iterable[dict[str, Any]]) -> Baseline:
    """The newest run at world size 1 that declares itself the scaling baseline, with its samples/s."""
    candidates = [r for r in runs if r["world_size"] == 1 and declares_scaling_baseline(r)]
    if not candidates:
        return Baseline(None, None, NO_BASELINE)
    run = max(candidates, key=created)
    throughput, why = metric(run, "samples_per_s")
    if throughput is None:
        return Baseline(run, None, f"the scaling baseline {label(run)} has no samples_per_s: {why}")
    if throughput <= 0:
        return Baseline(run, None, f"the scaling baseline {label(run)} has samples_per_s {throughput:g}: "
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


def _missing(run: dict[str, Any], names: Iterable[str]) -> list[str]:
    return [n for n in names if metric(run, n)[0] is None]


def _efficiency(run: dict[str, Any], baseline: Baseline) -> tuple[float | None, str | None]:
    samples, _ = metric(run, "samples_per_s")
    eff = scaling_efficiency(samples, run["world_size"], baseline.throughput)
    if eff is not None:
        return eff, None
    return None, "samples_per_s is n/a for this run" if samples is None else baseline.reason


def _other(run: dict[str, Any]) -> tuple[float | None, str | None]:
    mismatch = consistency.breakdown_flag(run.get("metrics") or {})
    if mismatch is not None:
        return None, mismatch
    other = other_ms(*(metric(run, n)[0] for n in STEP_PARTS))
    if other is not None:
        return other, None
    return None, ("other = step_ms_p50 - compute_ms_p50 - comm_exposed_ms needs all three; n/a: "
                  + ", ".join(_missing(run, STEP_PARTS)))


def _busbw_ratio(run: dict[str, Any]) -> tuple[float | None, str | None]:
    busbw, _ = metric(run, "busbw_gbps")
    micro, _ = metric(run, "microbench_busbw_gbps")
    if busbw is not None and micro is not None and micro > 0:
        return busbw / micro, None
    missing = _missing(run, ("busbw_gbps", "microbench_busbw_gbps")) or ["microbench_busbw_gbps is 0"]
    return None, "busbw / microbenchmark busbw needs both; n/a: " + ", ".join(missing)


def derive(run: dict[str, Any], baseline: Baseline) -> Derived:
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
