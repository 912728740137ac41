"""Scaling arithmetic (seed 001): efficiency against a single-process baseline, and the part of a step that
is neither compute nor exposed communication. Pure functions of figures; imports nothing heavy."""

from __future__ import annotations


def scaling_efficiency(throughput_n: float | None, n: int, throughput_1: float | None) -> float | None:
    """throughput_N / (N x throughput_1): 1.0 is perfect scaling. None when a throughput is missing or the
    single-process throughput is not positive. The same formula serves strong and weak scaling: in both,
    ideal samples/s grow N-fold."""
    if n < 1:
        raise ValueError(f"world size must be >= 1, got {n}")
    if throughput_n is None or throughput_1 is None or throughput_1 <= 0:
        return None
    return throughput_n / (n * throughput_1)


def other_ms(step_ms: float | None, compute_ms: float | None, exposed_ms: float | None) -> float | None:
    """The part of a step that is neither compute nor exposed communication (data, optimizer, Python),
    floored at 0 because the three are separate p50s. None when any of them is missing."""
    if step_ms is None or compute_ms is None or exposed_ms is None:
        return None
    return max(step_ms - compute_ms - exposed_ms, 0.0)
