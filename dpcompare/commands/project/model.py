"""The alpha-beta cost model of the collectives, the link presets, and fitting alpha and beta to a microbenchmark.

Every time is in seconds, every size in bytes, beta in bytes per second (per direction of one rank's link).

  ring all-reduce       T = 2(N-1) alpha + 2(N-1)/N * S / beta         (reduce-scatter then all-gather, N-1 steps each)
  tree all-reduce       T = 2 ceil(log2 N) alpha + 2 S / beta          (pipelined double binary tree, NCCL >= 2.4:
                                                                        up the tree and down again, each half of S on
                                                                        one of two trees; log depth, no 1/N saving)
  ring reduce-scatter,  T = (N-1) alpha + (N-1)/N * S / beta           (S: the full, unsharded buffer)
  ring all-gather
  broadcast, reduce     T = ceil(log2 N) alpha + S / beta              (pipelined tree)

Owns no file reading beyond the microbenchmark entries it is handed; imports no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np

ALGORITHMS = ("auto", "ring", "tree")


def ring_allreduce_s(size: float, n: int, alpha: float, beta: float) -> float:
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * alpha + 2 * (n - 1) / n * size / beta


def tree_allreduce_s(size: float, n: int, alpha: float, beta: float) -> float:
    if n <= 1:
        return 0.0
    return 2 * math.ceil(math.log2(n)) * alpha + 2 * size / beta


def ring_half_s(size: float, n: int, alpha: float, beta: float) -> float:
    """Ring reduce-scatter or all-gather of a buffer of `size` bytes (unsharded)."""
    if n <= 1:
        return 0.0
    return (n - 1) * alpha + (n - 1) / n * size / beta


def tree_rooted_s(size: float, n: int, alpha: float, beta: float) -> float:
    """Broadcast or reduce over a pipelined tree."""
    if n <= 1:
        return 0.0
    return math.ceil(math.log2(n)) * alpha + size / beta


def collective_s(kind: str, size: float, n: int, alpha: float, beta: float, algorithm: str = "ring") -> tuple[float, str]:
    """(seconds, the algorithm used) for one call of `kind` on `size` bytes at world size n. algorithm 'auto'
    takes the faster of ring and tree for an all-reduce (as NCCL's tuner does); the halves (reduce-scatter,
    all-gather) are always rings, broadcast and reduce always trees."""
    if kind == "all_reduce":
        ring, tree = ring_allreduce_s(size, n, alpha, beta), tree_allreduce_s(size, n, alpha, beta)
        if algorithm == "ring" or (algorithm == "auto" and ring <= tree):
            return ring, "ring"
        return tree, "tree"
    if kind in ("reduce_scatter", "all_gather"):
        return ring_half_s(size, n, alpha, beta), "ring"
    if kind in ("broadcast", "reduce"):
        return tree_rooted_s(size, n, alpha, beta), "tree"
    raise ValueError(f"no cost model for the collective {kind!r}: use all_reduce, reduce_scatter, all_gather, "
                     "broadcast or reduce")


@dataclass(slots=True)
class Link:
    name: str
    alpha_s: float
    beta_Bps: float
    sources: list[str] = field(default_factory=list)
    """One line per figure: where it comes from, or that it is an assumption."""
    measured: bool = False
    """Fitted to a microbenchmark (on the box the runs ran on when it came from the result folder)."""
    per_transport: dict[str, tuple[float, float]] = field(default_factory=dict)
    """transport -> (alpha_s, beta_Bps) where a microbenchmark measured several transports."""
    fit_points: int = 0
    fit_rms_rel_error: float | None = None

    def for_transport(self, transport: str | None) -> tuple[float, float, str]:
        """(alpha, beta, which fit) for one backend's transport."""
        if transport in self.per_transport:
            a, b = self.per_transport[transport]
            return a, b, transport
        return self.alpha_s, self.beta_Bps, "pooled" if self.per_transport else self.name

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "alpha_us": self.alpha_s * 1e6, "beta_GBps": self.beta_Bps / 1e9,
                "measured": self.measured, "sources": self.sources, "fit_points": self.fit_points,
                "fit_rms_rel_error": self.fit_rms_rel_error,
                "per_transport": {t: {"alpha_us": a * 1e6, "beta_GBps": b / 1e9} for t, (a, b) in self.per_transport.items()}}


PRESETS: dict[str, Link] = {
    "nvlink4": Link("nvlink4", 2e-6, 450e9, [
        "beta 450 GB/s per direction: NVLink 4, 900 GB/s total bidirectional per GPU (NVIDIA H100 Tensor Core GPU "
        "datasheet, SXM5)",
        "alpha 2 us per ring step: assumption (order of NCCL's per-step latency over NVLink; not from a datasheet)",
        "a flat NVLink fabric at every N: beyond 8 GPUs (one HGX H100 board) that needs the NVLink Switch System "
        "(up to 256 GPUs); a real cluster past it crosses the inter-node network: use ib-ndr there"]),
    "ib-ndr": Link("ib-ndr", 5e-6, 50e9, [
        "beta 50 GB/s per direction: InfiniBand NDR, 400 Gb/s per port (NVIDIA ConnectX-7 / Quantum-2), one port "
        "per GPU",
        "alpha 5 us per ring step: assumption (switched fabric end-to-end latency of a few us plus NCCL's "
        "network proxy; not from a datasheet)"]),
    "100gbe": Link("100gbe", 20e-6, 12.5e9, [
        "beta 12.5 GB/s per direction: 100 Gigabit Ethernet (IEEE 802.3), line rate, no protocol overhead",
        "alpha 20 us per ring step: assumption (TCP through the kernel stack; RoCE would be lower)"]),
}


def fit_alpha_beta(points: Iterable[tuple[int, float, float]]) -> tuple[float, float, float]:
    """Least squares of the ring all-reduce model over (world size, bytes, seconds) points, weighted by 1/t so
    every message size counts alike: t = 2(N-1) alpha + 2(N-1)/N * S * (1/beta). Returns (alpha, beta, rms relative
    error). A negative alpha is refitted as 0; a fit with no positive 1/beta raises ValueError."""
    pts = [(n, s, t) for n, s, t in points if n > 1 and s > 0 and t > 0]
    if len(pts) < 2 or len({s for _, s, _ in pts}) < 2:
        raise ValueError(f"fitting alpha and beta needs timings of at least 2 message sizes at a world size above 1, "
                         f"got {len(pts)} point(s)")
    a = np.array([[2 * (n - 1), 2 * (n - 1) / n * s] for n, s, _ in pts], dtype=float)
    t = np.array([p[2] for p in pts], dtype=float)
    w = 1.0 / t
    coef, *_ = np.linalg.lstsq(a * w[:, None], t * w, rcond=None)
    alpha, inv_beta = float(coef[0]), float(coef[1])
    if alpha < 0:
        col = a[:, 1] * w
        alpha, inv_beta = 0.0, float(col @ (t * w) / (col @ col))
    if not inv_beta > 0:
        raise ValueError("the microbenchmark's times do not grow with the message size: no bandwidth can be fitted")
    pred = a @ np.array([alpha, inv_beta])
    rms = float(np.sqrt(np.mean(((pred - t) / t) ** 2)))
    return alpha, 1.0 / inv_beta, rms


def entry_points(entry: dict[str, Any]) -> list[tuple[int, float, float]]:
    """(world size, bytes, seconds) of one bench-collectives entry: time_us_p50 (robust to a noisy neighbour),
    else the time its busbw implies."""
    n = int(entry["world_size"])
    out = []
    for size in entry.get("sizes") or []:
        t_us = size.get("time_us_p50")
        if not (isinstance(t_us, (int, float)) and t_us > 0):
            busbw = size.get("busbw_gbps")
            if not (isinstance(busbw, (int, float)) and busbw > 0) or n < 2:
                continue
            t_us = size["bytes"] * 2 * (n - 1) / n / (busbw * 1e9) * 1e6
        out.append((n, float(size["bytes"]), float(t_us) * 1e-6))
    return out


def link_from_collectives(name: str, entries: list[dict[str, Any]], world_sizes: set[int] | None) -> Link:
    """alpha and beta fitted per transport (and pooled over all) to bench-collectives entries, keeping only
    entries at `world_sizes` (None: all)."""
    usable = [e for e in entries if e.get("status", "ok") == "ok" and int(e.get("world_size", 0)) > 1
              and (world_sizes is None or int(e["world_size"]) in world_sizes)]
    if not usable:
        raise ValueError(f"link {name!r}: no usable microbenchmark entry (status ok, world size above 1"
                         + (f", world size in {sorted(world_sizes)}" if world_sizes else "") + ")")
    by_transport: dict[str, list[tuple[int, float, float]]] = {}
    for e in usable:
        by_transport.setdefault(str(e.get("transport", "?")), []).extend(entry_points(e))
    pooled = [p for pts in by_transport.values() for p in pts]
    alpha, beta, rms = fit_alpha_beta(pooled)
    per = {}
    for transport, pts in by_transport.items():
        try:
            a, b, _ = fit_alpha_beta(pts)
        except ValueError:
            continue
        per[transport] = (a, b)
    sizes = sorted({int(e["world_size"]) for e in usable})
    sources = [f"alpha and beta least-squares fitted (weights 1/t) to the ring all-reduce model over "
               f"{len(pooled)} time_us_p50 point(s) of bench-collectives at world size(s) {sizes}, per transport "
               f"({', '.join(f'{t}: alpha {a * 1e6:.0f} us, beta {b / 1e9:.3f} GB/s' for t, (a, b) in per.items())})"]
    return Link(name, alpha, beta, sources, measured=True, per_transport=per, fit_points=len(pooled),
                fit_rms_rel_error=rms)
