"""Clocks and memory on a rank: a step's segments timed with CUDA events on GPU (resolved once, after the
measured region) or a monotonic clock on CPU; the peak memory over a window (CUDA peak stats, or the
resident high-water mark VmHWM reset through /proc/self/clear_refs); the analytic model-state memory."""

from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator

import torch

MIB = 1024.0 * 1024.0


# -- clocks ----------------------------------------------------------------------------------------
def now(cuda: bool) -> Any:
    """A point in time: a recorded CUDA event (resolved later, no synchronisation now) or perf_counter_ns."""
    if cuda:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter_ns()


class SegmentClock:
    """Times a step made of segments (the check in the middle is left out). On CUDA it records events
    and resolves them once at the end, so nothing synchronises the device inside the measured region."""

    def __init__(self, device: torch.device, enabled: bool = True) -> None:
        self.cuda = device.type == "cuda"
        self.enabled = enabled
        self._open: Any = None
        self._segments: list[Any] = []
        self.steps: list[Any] = []  # per step: list of (start, end) pairs

    def _now(self) -> Any:
        return now(self.cuda)

    def start(self) -> None:
        if self.enabled:
            self._open = self._now()

    def stop(self) -> None:
        if self.enabled and self._open is not None:
            self._segments.append((self._open, self._now()))
            self._open = None

    def end_step(self) -> None:
        if self.enabled:
            self.steps.append(self._segments)
            self._segments = []

    def step_ms(self) -> list[float]:
        if self.cuda and self.steps:
            torch.cuda.synchronize()  # once, after the measured region
        out = []
        for segments in self.steps:
            if self.cuda:
                out.append(sum(a.elapsed_time(b) for a, b in segments))
            else:
                out.append(sum(b - a for a, b in segments) / 1e6)
        return out


# -- memory ----------------------------------------------------------------------------------------
class MemoryWindow:
    """The peak memory of the measured window, and how far it rose above what was held when the window opened (the
    step's own memory: activations kept for backward, gradients, temporaries; what activation checkpointing cuts)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.reason: str | None = None
        self.start_mib: float | None = None

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start_mib = torch.cuda.memory_allocated(self.device) / MIB
            return
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current resident size
        except OSError as exc:
            self.reason = f"cannot reset the resident high-water mark (/proc/self/clear_refs: {exc.strerror})"
            return
        self.start_mib = _status_mib("VmRSS:")

    def above_start(self, peak: dict[str, float | None]) -> float | None:
        """`peak`'s peak_mem_mib less what was held when the window opened (None where either is unknown)."""
        top = peak.get("peak_mem_mib")
        return None if top is None or self.start_mib is None else top - self.start_mib

    def peak(self) -> dict[str, float | None]:
        if self.device.type == "cuda":
            return {"peak_mem_mib": torch.cuda.max_memory_allocated(self.device) / MIB,
                    "peak_mem_reserved_mib": torch.cuda.max_memory_reserved(self.device) / MIB}
        if self.reason:
            return {"peak_mem_mib": None, "peak_mem_reserved_mib": None}
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return {"peak_mem_mib": int(line.split()[1]) / 1024.0, "peak_mem_reserved_mib": None}
        except OSError as exc:
            self.reason = f"cannot read /proc/self/status ({exc.strerror})"
        self.reason = self.reason or "no VmHWM line in /proc/self/status (not Linux?)"
        return {"peak_mem_mib": None, "peak_mem_reserved_mib": None}


def _status_mib(field: str) -> float | None:
    """A size line of /proc/self/status (VmRSS:, VmHWM:) in MiB, None where it cannot be read."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


def model_state_mib(module: torch.nn.Module, optimizer: Any, comm_buffer_bytes: int | None,
                    masters: dict[str, torch.Tensor] | None = None) -> dict[str, float | None]:
    """Analytic model-state memory (seed 001): parameters + gradients + optimizer state + fp32 master copies (where
    the backend keeps them apart from 16-bit weights: `masters`, the tensors its optimizer steps) + comm buffers."""
    own = {id(p) for p in module.parameters()}
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    grads = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
    master = sum(t.numel() * t.element_size() for t in (masters or {}).values() if id(t) not in own)
    state = 0
    inner = getattr(optimizer, "optimizer", optimizer)  # DeepSpeed wraps the client optimizer
    for per_param in getattr(inner, "state", {}).values():
        for value in per_param.values():
            if torch.is_tensor(value):
                state += value.numel() * value.element_size()
    total = params + grads + state + master + (comm_buffer_bytes or 0)
    return {"params": params / MIB, "grads": grads / MIB, "optimizer": state / MIB, "master_params": master / MIB,
            "comm_buffers": None if comm_buffer_bytes is None else comm_buffer_bytes / MIB, "total": total / MIB}




class IntervalClock:
    """Sums intervals bracketed by `interval()` (a backend's communication calls): CUDA events resolved once
    at the end, or a monotonic clock on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._pairs: list[tuple[Any, Any]] = []

    def _now(self) -> Any:
        return now(self.cuda)

    @contextlib.contextmanager
    def interval(self) -> Iterator[None]:
        start = self._now()
        try:
            yield
        finally:
            self._pairs.append((start, self._now()))

    def total_ms(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            return sum(a.elapsed_time(b) for a, b in self._pairs)
        return sum(b - a for a, b in self._pairs) / 1e6
