"""Time figures of a run: step time, throughput, the rank spread and stragglers.

Owns: `percentiles`, `stragglers` and the figures rank 0 writes from every rank's step times (`record_step_times`,
`record_stragglers`). The clocks that took the times are in dpcompare.measure.clocks, scaling efficiency against a
single-process run in dpcompare.measure.scaling, MFU in dpcompare.measure.flops. Imports numpy only.

  step time   forward + backward + reduce + optimizer step, excluding the equivalence check; a step is as slow as
              its slowest rank
  straggler   a rank slowest in most steps of the compute-only arm (the ablation's unsynced steps; the step times
              where no ablation ran) by more than 10 % of the median step
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dpcompare.measure.samples import Metrics, RankSample, paired_steps


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


def record_step_times(m: Metrics, samples: list[RankSample], global_samples: int, tokens_per_sample: int,
                      why_no_steps: str) -> tuple[list[list[float]], float | None]:
    """Step-time percentiles of the slowest rank per step, the rank spread and the throughput. Returns each
    rank's measured step times, cut to the steps every rank measured, and the median step (None: no steps)."""
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
    return per_rank, p["p50"]


def record_stragglers(m: Metrics, samples: list[RankSample], per_rank: list[list[float]]) -> None:
    """Stragglers from the compute-only arm (the ablation's unsynced steps; `per_rank`, the measured step times,
    when no ablation ran) and the one named: the flagged rank with the largest mean excess."""
    pairs = paired_steps(samples)
    found = stragglers([s.unsynced_ms[:pairs] for s in samples] if pairs else per_rank)
    m.set("stragglers", found)
    flagged = [r for r in found if r["straggler"]]
    slowest = max(flagged, key=lambda r: r["excess_ms_mean"]) if flagged else None
    m.set("straggler_rank", slowest["rank"] if slowest else None,
          "one rank" if len(samples) < 2 else "no rank is the slowest in most steps by more than 10 % of the median step")
    m.set("straggler_excess_ms", slowest["excess_ms_mean"] if slowest else None, "no straggler")
