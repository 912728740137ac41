"""Native communication counters over a measured window: the adapter's counter says where communication
happened in the backend's own terms (`dpcompare.contract.CommCounts`); this module owns the window, the
units and the arithmetic that turn it into figures in milliseconds, and the run's figures rank 0 writes from
every rank's (`record_native`: comm_total_ms, comm_transfer_ms, the native overlap).

  total comm   the backend's own counter (DDP logging data, Horovod timeline with negotiation, DeepSpeed timers)
               on the rank that spent longest in communication, its wait for the other ranks included (the
               ablation's exposed figure includes that wait too)
  transfer     the same counter on the rank that spent least there (Horovod: ALLREDUCE alone)

Imports no adapter; the Horovod timeline is parsed by dpcompare.measure.timeline.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dpcompare.contract import CommCounter, CommCounts, CounterWindow
from dpcompare.measure.clocks import IntervalClock
from dpcompare.measure.samples import Metrics, RankSample
from dpcompare.measure.timeline import NEGOTIATED, allreduce_busy_ms


class CommWindow:
    """One measured window of a native counter: begin, a step() after every measured step, end() -> figures."""

    def __init__(self, counter: CommCounter, device: torch.device, workdir: Path) -> None:
        self.counter = counter
        self.clock = IntervalClock(device)
        self.workdir = workdir

    def begin(self) -> None:
        self.counter.begin(CounterWindow(self.workdir, self.clock.interval))

    def step(self) -> None:
        self.counter.step()

    def end(self, steps: int) -> dict[str, Any]:
        return figures(self.counter.end(), self.clock, steps)


def figures(counts: CommCounts, clock: IntervalClock, steps: int) -> dict[str, Any]:
    """{'total_ms', 'overlap_ms' (or None), 'steps', 'method'[, 'per_step_total_ms', 'per_step_overlap_ms',
    'transfer_ms']} over the window, or {'reason'} when the counter saw nothing it can vouch for. total_ms holds
    the time this rank spent waiting for its peers inside communication; transfer_ms, where the counter tells
    them apart (Horovod's timeline), the transfer alone."""
    if counts.reason:
        return {"reason": counts.reason}
    to_ms = counts.unit_s * 1e3
    out: dict[str, Any] = {"method": counts.method, "steps": steps, "overlap_ms": None}
    if counts.per_step_total:
        out["per_step_total_ms"] = [v * to_ms for v in counts.per_step_total]
        out["total_ms"] = sum(out["per_step_total_ms"])
        if counts.per_step_overlap:
            out["per_step_overlap_ms"] = [v * to_ms for v in counts.per_step_overlap]
            out["overlap_ms"] = sum(out["per_step_overlap_ms"])
    elif counts.timeline:
        try:
            out["total_ms"] = allreduce_busy_ms(counts.timeline, NEGOTIATED)
            out["transfer_ms"] = allreduce_busy_ms(counts.timeline)
        except (OSError, ValueError) as exc:
            return {"reason": f"cannot read the Horovod timeline {counts.timeline}: {exc}"}
        finally:
            if os.path.exists(counts.timeline):
                os.unlink(counts.timeline)
    elif counts.timed_intervals:
        out["total_ms"] = clock.total_ms()
    elif counts.window_total is not None:
        out["total_ms"] = counts.window_total * to_ms
    else:
        return {"reason": f"the counter ({counts.method or 'unnamed'}) returned no figure"}
    return out


def per_step_total_ms(comm: dict[str, Any], key: str = "total") -> float | None:
    """One rank's counter per step (median over steps where it has them): its total communication time, or
    with key="transfer" the transfer alone where the counter tells it apart (else the total)."""
    if key == "transfer" and comm.get("transfer_ms") is not None and comm.get("steps"):
        return comm["transfer_ms"] / comm["steps"]
    if comm.get("per_step_total_ms"):
        return float(np.median(comm["per_step_total_ms"]))
    if "total_ms" in comm and comm.get("steps"):
        return comm["total_ms"] / comm["steps"]
    return None


def record_native(m: Metrics, samples: list[RankSample], comm_possible: str | None) -> tuple[float | None, float | None]:
    """The backends' own communication counters, per step. A rank's counter holds the time it waited inside
    communication for its peers; the rank that spent longest there shows everything synchronisation cost the
    step (as the ablation's slowest-rank figure does): that is the total. The rank that spent least there
    (or the transfer a timeline tells apart) is closest to the collective itself: bandwidth is taken from it.
    Returns (total, transfer) in ms per step, None where there is no counter."""
    if comm_possible:
        for name in ("comm_total_ms", "comm_transfer_ms", "comm_total_ms_per_rank"):
            m.set(name, None, comm_possible)
        return None, None
    comms = [s.comm or {} for s in samples]
    per_rank = [per_step_total_ms(c) for c in comms]
    known = [(t, rank) for rank, t in enumerate(per_rank) if t is not None]
    if not known:
        reason = comms[0].get("reason") or "the backend exposes no communication counter"
        for name in ("comm_total_ms", "comm_transfer_ms", "comm_total_ms_per_rank"):
            m.set(name, None, reason)
        return None, None
    total, longest = max(known)
    transfer = min(t for t in (per_step_total_ms(c, "transfer") for c in comms) if t is not None)
    m.set("comm_total_ms", total)
    m.set("comm_total_rank", longest)
    m.set("comm_transfer_ms", transfer)
    m.set("comm_total_ms_per_rank", per_rank)
    m.set("comm_total_method", comms[longest].get("method"))
    rank0 = comms[0]
    if rank0.get("per_step_overlap_ms"):
        m.set("comm_native_overlap_ms", float(np.median(rank0["per_step_overlap_ms"])))
        # Per rank: a rank that reached the collective early also waits out the others' compute (skew); the last
        # to arrive waits for the transfer alone. The step, as slow as its slowest rank, pays the latter.
        exposed = [float(np.median(np.subtract(c["per_step_total_ms"], c["per_step_overlap_ms"])))
                   if c.get("per_step_total_ms") and c.get("per_step_overlap_ms") else None for c in comms]
        m.set("comm_native_exposed_ms", exposed[0])
        m.set("comm_native_exposed_ms_per_rank", exposed)
    elif rank0.get("overlap_ms") is not None and rank0.get("steps"):
        m.set("comm_native_overlap_ms", rank0["overlap_ms"] / rank0["steps"])
    return total, transfer
