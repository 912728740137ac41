"""Native communication counters over a measured window: the adapter's counter says where communication
happened in the backend's own terms (`dpcompare.contract.CommCounts`); this module owns the window, the
units and the arithmetic that turn it into figures in milliseconds.

Imports no adapter; the Horovod timeline is parsed by dpcompare.measure.timeline.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from dpcompare.contract import CommCounter, CommCounts, CounterWindow
from dpcompare.measure.clocks import IntervalClock
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
