"""Bandwidth arithmetic, as nccl-tests defines it (doc/PERFORMANCE.md), and the ring all-reduce time model.

Owns: algbw and busbw, reading a bench-collectives result at a message size, seed 001's T_comm model, and the run's
bandwidth figures rank 0 writes (`record_bandwidth`). Imports numpy only: the report, the commands and a rank's
measurement all use it.

  algbw, busbw   nccl-tests: algbw = bytes / transfer time, all-reduce busbw = algbw * 2(n-1)/n, in GB/s
  T_comm model   2 * P * (N-1) / (N * B), B = the microbenchmark's busbw at the run's message size
"""

from __future__ import annotations

import math

import numpy as np

from dpcompare.measure.samples import Metrics


def algbw_gbps(nbytes: float, seconds: float) -> float:
    """Algorithm bandwidth: message bytes over time, in GB/s (1 GB = 1e9 bytes)."""
    if seconds <= 0 or not math.isfinite(seconds):
        raise ValueError(f"time must be a positive number of seconds, got {seconds!r}")
    return nbytes / seconds / 1e9


def busbw_gbps(algbw: float, n: int) -> float:
    """All-reduce bus bandwidth: algbw * 2(n-1)/n, the per-link traffic of a ring all-reduce over n ranks;
    comparable with the hardware's peak link bandwidth whatever n is (0 for n = 1: nothing crosses a link)."""
    if n < 1:
        raise ValueError(f"world size must be at least 1, got {n}")
    return algbw * 2 * (n - 1) / n


BUS_FACTOR_DOC = "nccl-tests: all_reduce 2(n-1)/n, all_gather and reduce_scatter (n-1)/n, broadcast and reduce 1"


def bus_factor(kind: str, n: int) -> float:
    """nccl-tests' busbw / algbw for a collective over n ranks (doc/PERFORMANCE.md), with its byte count the full
    buffer (all_gather: the gathered output, reduce_scatter: the input before the scatter): all_reduce 2(n-1)/n,
    all_gather and reduce_scatter (n-1)/n, broadcast and reduce 1 (0 for every kind at n = 1: nothing crosses a link)."""
    if n < 1:
        raise ValueError(f"world size must be at least 1, got {n}")
    if n == 1:
        return 0.0
    factors = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n,
               "broadcast": 1.0, "reduce": 1.0}
    if kind not in factors:
        raise ValueError(f"no bus factor for collective {kind!r}: expected one of {', '.join(factors)}")
    return factors[kind]


def busbw_at(collectives_json: dict, transport: str, world_size: int, nbytes: int) -> float | None:
    """The measured all-reduce busbw (GB/s) of `transport` at `world_size` ranks for a message of `nbytes`,
    interpolated linearly in log(bytes)-log(busbw) between the two nearest measured sizes. None when the
    file has no such entry or `nbytes` lies outside the measured range (no extrapolation). Sizes whose
    result was wrong are not used. With several matching entries the last one wins."""
    if nbytes <= 0:
        raise ValueError(f"nbytes must be positive, got {nbytes}")
    points: list[tuple[int, float]] = []
    for entry in collectives_json.get("entries", []):
        if entry.get("transport") != transport or entry.get("world_size") != world_size:
            continue
        found = sorted((int(s["bytes"]), float(s["busbw_gbps"])) for s in entry.get("sizes", [])
                       if s.get("correct") and s.get("busbw_gbps") is not None)
        if found:
            points = found
    if not points or not points[0][0] <= nbytes <= points[-1][0]:
        return None
    for size, busbw in points:
        if size == nbytes:
            return busbw
    if world_size == 1:
        return 0.0  # no bus traffic at one rank, by definition
    xs = np.log([p[0] for p in points])
    ys = np.log([max(p[1], 1e-300) for p in points])
    return float(np.exp(np.interp(math.log(nbytes), xs, ys)))


# -- the sweep ----------------------------------------------------------------------------------------


def tcomm_model_ms(grad_bytes: float, n: int, bandwidth_gbps: float | None) -> float | None:
    """Seed 001's ring all-reduce model, T = 2 P (N-1) / (N B), in ms."""
    if not bandwidth_gbps or n < 2:
        return None
    return 2.0 * grad_bytes * (n - 1) / (n * bandwidth_gbps * 1e9) * 1e3


def record_bandwidth(m: Metrics, total: float | None, grad_bytes: int, message_bytes: int | None,
                     message_reason: str | None, world_size: int, microbench_busbw: float | None,
                     microbench_reason: str | None, comm_possible: str | None) -> None:
    """The bytes a step reduces and the backend's message (bucket) size; in-training algbw and busbw from the
    transfer time (`total`: comm_transfer_ms), against the microbenchmark's busbw, and the T_comm model."""
    m.set("grad_bytes_per_step", grad_bytes)
    m.set("bucket_bytes", message_bytes, message_reason)
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
