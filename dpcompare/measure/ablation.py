"""Exposed communication by the ablation: each paired measured step (synced arm, timed up to its reduce) is followed
by the same batch with gradient synchronisation off (unsynced arm, timed up to the same point).

Owns: the ablation's arithmetic (`ablation_difference`, `exposed_split`, `exposed_interval`) and the figures rank 0
writes from it (`record_ablation`, `record_overlap`). The second method, exposed communication read from a --profile
trace, is dpcompare.measure.trace; the backends' own counters are dpcompare.measure.comm. Imports numpy (scipy where
the interval is computed).

  compute time      the same step with gradient synchronisation switched off, timed up to where the synced step's
                    reduce ends (both arms leave the optimizer step out, so they differ only by communication)
  exposed comm      the difference is the median over pairs of synced - unsynced (`comm_ablation_ms`), exposed is
                    that difference bounded by the total: min(difference, total), the rest (`comm_interference_ms`)
                    the computation slowed by the collectives beside it, not communication; a 95 % bootstrap
                    interval over the pairs, bounded the same way
  overlap fraction  1 - exposed / total
"""

from __future__ import annotations

import numpy as np

from dpcompare.measure.samples import Metrics, RankSample, paired_steps


def record_ablation(m: Metrics, samples: list[RankSample], comm_possible: str | None, why_no_pairs: str,
                    total: float | None = None) -> tuple[float | None, list[float] | None]:
    """The synced/unsynced ablation: the slowest rank per step of each arm, the pairs' differences, exposed
    communication bounded by `total` (exposed_split). Returns the exposed communication time and its interval, None
    where not measured."""
    pairs = paired_steps(samples)
    synced = np.max([s.synced_ms[:pairs] for s in samples], axis=0) if pairs else np.array([])
    unsynced = np.max([s.unsynced_ms[:pairs] for s in samples], axis=0) if pairs else np.array([])
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


def record_overlap(m: Metrics, total: float | None, exposed: float | None) -> None:
    """The overlap fraction, 1 - exposed / total (the counter's total, the ablation's exposed), within [0, 1]."""
    if total and exposed is not None:
        m.set("overlap_fraction", min(max(1.0 - exposed / total, 0.0), 1.0))
    else:
        m.set("overlap_fraction", None, "needs both total and exposed communication time")


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
