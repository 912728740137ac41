"""The regression gate's statistics: is the current build slower than the baseline, beyond the noise?

Owns: the decision for one benchmark from its per-run figures on each side (one figure per run, e.g. each
run's median step time), and the limits of that decision at small sample sizes. Pure functions over lists of
seconds; imports numpy and scipy only (no command, no adapter, no file handling).

The rule (the shape of asv's: significant *and* large enough; runs, not rounds, are the samples, because the
rounds of one run are autocorrelated):

  ratio r        median(current figures) / median(baseline figures)
  90% CI of r    percentile bootstrap: each side's runs resampled with replacement, RESAMPLES times, from a
                 numpy Generator with a fixed seed (the same inputs always give the same interval)
  regression     one-sided Mann-Whitney U, current > baseline, p < alpha   AND  r >= 1 + min_effect
  improvement    one-sided Mann-Whitney U, current < baseline, p < alpha   AND  r <= 1 / (1 + min_effect)
  same           otherwise

With m and n runs the smallest one-sided p-value Mann-Whitney U can give (exact distribution, no ties) is
1 / C(m + n, m): 1/20 = 0.05 with 3 per side, 1/70 ~ 0.014 with 4, 1/252 ~ 0.004 with 5. A configuration
whose alpha is at or below that floor could never flag anything, so it is refused, naming the runs needed.

Paired (runs interleaved A B A B ..., the k-th baseline run paired with the k-th current run): consecutive
runs share the machine's state (load, heat, a neighbour), which the unpaired test counts as noise. Then

  ratio r        exp(median(log(current_k / baseline_k))), the typical per-pair slowdown
  90% CI of r    percentile bootstrap over the pairs
  the test       one-sided Wilcoxon signed-rank on log(current_k / baseline_k); smallest p = 1 / 2^n
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Sequence

import numpy as np

Verdict = Literal["regression", "improvement", "same"]

MIN_RUNS = 3
RESAMPLES = 10_000
SEED = 20_240_917
CI_LEVEL = 0.90


@dataclass(frozen=True)
class Decision:
    """One benchmark's verdict and the figures behind it (times in seconds)."""

    n_baseline: int
    n_current: int
    baseline_median_s: float
    current_median_s: float
    ratio: float
    """median(current) / median(baseline): above 1 is slower."""
    ci90: tuple[float, float]
    """90% percentile-bootstrap interval of the ratio."""
    p_value: float
    """One-sided Mann-Whitney U p-value in the direction of the ratio (current slower when ratio >= 1,
    current faster otherwise)."""
    verdict: Verdict
    reason: str
    design: str = "unpaired"
    """unpaired (Mann-Whitney U over the two sides' runs) or paired (Wilcoxon signed-rank over interleaved pairs)."""


def smallest_p(n_baseline: int, n_current: int) -> float:
    """The smallest one-sided p-value the exact Mann-Whitney U test can give with these sample sizes."""
    return 1.0 / math.comb(n_baseline + n_current, n_baseline)


def runs_needed(alpha: float) -> int:
    """The fewest runs per side (at least MIN_RUNS) whose smallest one-sided p-value is below alpha."""
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must lie between 0 and 1, got {alpha:g}: use e.g. --alpha 0.05")
    n = MIN_RUNS
    while smallest_p(n, n) >= alpha:
        n += 1
    return n


def check_runs(name: str, n_baseline: int, n_current: int, alpha: float,
               baseline_where: str = "the baseline", current_where: str = "the current side") -> None:
    """Refuse (ValueError, one line) sample sizes that cannot support the test at this alpha."""
    needed = runs_needed(alpha)
    for n, where in ((n_baseline, baseline_where), (n_current, current_where)):
        if n < MIN_RUNS:
            raise ValueError(
                f"a significance test needs at least {MIN_RUNS} runs per side; {name} has {n} in {where}: repeat "
                f"the run, alternating baseline and current, until each side has at least {needed} runs "
                f"(alpha {alpha:g})")
    floor = smallest_p(n_baseline, n_current)
    if alpha <= floor:
        raise ValueError(
            f"alpha {alpha:g} cannot be reached by {name} with {n_baseline} baseline and {n_current} current runs "
            f"(the smallest one-sided Mann-Whitney p-value is 1/C({n_baseline + n_current},{n_baseline}) = "
            f"{floor:.3g}), so nothing could ever be flagged: use at least {needed} runs per side, or an alpha "
            f"above {floor:.3g}")


def bootstrap_ratio_ci(baseline: np.ndarray, current: np.ndarray, resamples: int = RESAMPLES,
                       seed: int = SEED, level: float = CI_LEVEL) -> tuple[float, float]:
    """Percentile-bootstrap interval of median(current) / median(baseline), resampling runs per side."""
    rng = np.random.default_rng(seed)
    base = np.median(baseline[rng.integers(0, baseline.size, size=(resamples, baseline.size))], axis=1)
    cur = np.median(current[rng.integers(0, current.size, size=(resamples, current.size))], axis=1)
    tail = (1.0 - level) / 2.0 * 100.0
    low, high = np.percentile(cur / base, [tail, 100.0 - tail])
    return float(low), float(high)


def decide(baseline_s: Sequence[float], current_s: Sequence[float], alpha: float = 0.05,
           min_effect: float = 0.05, name: str = "the benchmark", seed: int = SEED) -> Decision:
    """The verdict for one benchmark from one figure per run on each side (seconds)."""
    from scipy import stats  # scipy takes seconds to import: only where it is used
    if min_effect < 0.0:
        raise ValueError(f"min_effect must be 0 or more, got {min_effect:g}: use e.g. --min-effect 0.05 (5%)")
    baseline = np.asarray(baseline_s, dtype=float)
    current = np.asarray(current_s, dtype=float)
    check_runs(name, baseline.size, current.size, alpha)
    if not (np.all(np.isfinite(baseline)) and np.all(np.isfinite(current))
            and baseline.min() > 0.0 and current.min() > 0.0):
        raise ValueError(f"{name}: every per-run time must be a positive number of seconds")
    ratio = float(np.median(current)) / float(np.median(baseline))
    p_slower = float(stats.mannwhitneyu(current, baseline, alternative="greater").pvalue)
    p_faster = float(stats.mannwhitneyu(current, baseline, alternative="less").pvalue)
    return _decision(baseline, current, ratio, p_slower, p_faster, bootstrap_ratio_ci(baseline, current, seed=seed),
                     alpha, min_effect, "unpaired")


def _decision(baseline: np.ndarray, current: np.ndarray, ratio: float, p_slower: float, p_faster: float,
              ci90: tuple[float, float], alpha: float, min_effect: float, design: str) -> Decision:
    verdict: Verdict = "same"
    if p_slower < alpha and ratio >= 1.0 + min_effect:
        verdict = "regression"
    elif p_faster < alpha and ratio <= 1.0 / (1.0 + min_effect):
        verdict = "improvement"
    p_value = p_faster if verdict == "improvement" or (verdict == "same" and ratio < 1.0) else p_slower
    return Decision(n_baseline=int(baseline.size), n_current=int(current.size),
                    baseline_median_s=float(np.median(baseline)), current_median_s=float(np.median(current)),
                    ratio=ratio, ci90=ci90, p_value=p_value, verdict=verdict,
                    reason=f"{design}: " + _reason(ratio, ci90, p_value, verdict, alpha, min_effect), design=design)


def smallest_paired_p(pairs: int) -> float:
    """The smallest one-sided p-value of the exact Wilcoxon signed-rank test over this many pairs."""
    return 0.5**pairs


def decide_paired(baseline_s: Sequence[float], current_s: Sequence[float], alpha: float = 0.05,
                  min_effect: float = 0.05, name: str = "the benchmark", seed: int = SEED) -> Decision:
    """The verdict from interleaved runs, the k-th of each side paired (same length, in time order)."""
    from scipy import stats  # scipy takes seconds to import: only where it is used
    baseline = np.asarray(baseline_s, dtype=float)
    current = np.asarray(current_s, dtype=float)
    if baseline.size != current.size:
        raise ValueError(f"{name}: pairing needs as many baseline as current runs ({baseline.size} and {current.size})")
    if not (np.all(np.isfinite(baseline)) and np.all(np.isfinite(current))
            and baseline.min() > 0.0 and current.min() > 0.0):
        raise ValueError(f"{name}: every per-run time must be a positive number of seconds")
    floor = smallest_paired_p(baseline.size)
    if alpha <= floor:
        needed = next(n for n in range(MIN_RUNS, 64) if smallest_paired_p(n) < alpha)
        raise ValueError(f"alpha {alpha:g} cannot be reached by {name} with {baseline.size} pairs (the smallest "
                         f"one-sided signed-rank p-value is 1/2^{baseline.size} = {floor:.3g}): use at least "
                         f"{needed} interleaved pairs, or --pairing unpaired")
    logs = np.log(current / baseline)
    ratio = float(np.exp(np.median(logs)))
    if not np.any(logs):
        p_slower = p_faster = 1.0
    else:
        p_slower = float(stats.wilcoxon(logs, alternative="greater").pvalue)
        p_faster = float(stats.wilcoxon(logs, alternative="less").pvalue)
    rng = np.random.default_rng(seed)
    boot = np.exp(np.median(logs[rng.integers(0, logs.size, size=(RESAMPLES, logs.size))], axis=1))
    tail = (1.0 - CI_LEVEL) / 2.0 * 100.0
    low, high = np.percentile(boot, [tail, 100.0 - tail])
    return _decision(baseline, current, ratio, p_slower, p_faster, (float(low), float(high)), alpha, min_effect,
                     "paired")


def _reason(ratio: float, ci90: tuple[float, float], p_value: float, verdict: Verdict, alpha: float,
            min_effect: float) -> str:
    """One line in words: the effect, its interval, the test, and what decided the verdict."""
    interval = f"90% CI {ci90[0]:.2f}-{ci90[1]:.2f}"
    if ratio > 1.0:
        effect = f"{ratio:.2f}x slower ({interval})"
    elif ratio < 1.0:
        effect = f"{1.0 / ratio:.2f}x faster (ratio {ratio:.2f}, {interval})"
    else:
        effect = f"no change in the median (ratio 1.00, {interval})"
    significant = p_value < alpha
    test = f"p={p_value:.3g} {'<' if significant else '>='} {alpha:g}"
    if verdict != "same":
        return f"{effect}, {test}: {verdict}"
    if not significant:
        return f"{effect}, {test}: not significant, same"
    return f"{effect}, {test} but within the {min_effect * 100:g}% minimum effect: same"
