"""A backend's own communication counter over a measured window, and what it reports.

Owns: `CommCounter` (begin / step / end, returned by `Adapter.comm_counter()`), `CounterWindow` (what measurement hands
it when a window begins) and `CommCounts` (what it saw, in its own units). The arithmetic that turns the counts into
figures is dpcompare.measure.comm's. Imports no adapter, and no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ContextManager


@dataclass(frozen=True, slots=True)
class CommCounts:
    """What a native communication counter saw over a measured window, in its own units; measurement turns it
    into figures (dpcompare.measure.comm). Either per-step values, a window total, a timeline file the
    measurement reads, intervals the window's own clock timed, or a reason there is nothing."""

    method: str = ""
    unit_s: float = 1e-3
    """Seconds per unit of the values below (1e-9: nanoseconds)."""
    per_step_total: tuple[float, ...] = ()
    per_step_overlap: tuple[float, ...] = ()
    window_total: float | None = None
    timeline: str | None = None
    """A Horovod timeline (Chrome trace) whose ALLREDUCE activity is the communication."""
    timed_intervals: bool = False
    """The communication ran inside `CounterWindow.interval()`: the window's clock holds its time."""
    reason: str | None = None


@dataclass(slots=True)
class CounterWindow:
    """What measurement hands a counter when a window begins."""

    workdir: Path
    """A directory for files the backend must write (removed with the window)."""
    interval: Callable[[], ContextManager[None]]
    """Context manager timing one interval of communication with the window's clock (CUDA events or a
    monotonic clock): for backends whose communication is a call the adapter can bracket."""


class CommCounter:
    """A backend's own communication counter for one measured window (returned by `Adapter.comm_counter`)."""

    def begin(self, window: CounterWindow) -> None:
        """Start counting."""

    def step(self) -> None:
        """Called after every measured step, for counters that only hold the latest step."""

    def end(self) -> CommCounts:
        return CommCounts(reason="no counter")
