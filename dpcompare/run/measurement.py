"""The measurement phase: what a step costs, with nothing else running.

Owns: the order of the phase on every rank — warm-up steps, then `measure_steps` timed steps (clocks,
memory window and the backend's native counter, all off under --no-instrument but the loop's wall clock),
then the ablation: pairs of the same step with gradient synchronisation on and off, in alternating blocks
(exposed communication = synced - unsynced). Rank 0 gathers every rank's samples and dpcompare.measure
does the arithmetic.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from dpcompare.contract import Adapter
from dpcompare.measure import clocks, summary
from dpcompare.measure.bandwidth import busbw_at
from dpcompare.measure.comm import CommWindow
from dpcompare.run.config import RunConfig
from dpcompare.run.step import StepRunner

ABLATION_BLOCK = 5
"""Steps per block of one ablation arm before switching to the other."""


class MeasurementPhase:
    def __init__(self, cfg: RunConfig, adapter: Adapter, runner: StepRunner, local_batch: int, is_rank0: bool) -> None:
        self.cfg, self.adapter, self.runner = cfg, adapter, runner
        self.local_batch, self.rank0 = local_batch, is_rank0
        self.first = cfg.steps  # steps continue the verification phase's data stream
        self.comm_reason = adapter.no_communication_reason()

    def run(self) -> dict[str, Any] | None:
        if self.cfg.measure_steps == 0:
            return None
        for i in range(self.cfg.warmup_steps):
            self.runner.step(self.first + i, *self.runner.batch(self.first + i)[1:], phase="warm-up")
        start = self.first + self.cfg.warmup_steps
        self.batches = [self.runner.batch(start + i)[1:] for i in range(self.cfg.measure_steps)]
        clock, memory, comm, loop_ms = self._timed(start)
        synced, unsynced = self._ablation(start + self.cfg.measure_steps)
        sample = summary.RankSample(clock.step_ms(), synced.step_ms(), unsynced.step_ms(), memory.peak() if self.cfg.instrument
                                    else {"peak_mem_mib": None, "peak_mem_reserved_mib": None}, memory.reason, comm)
        gathered = self.adapter.all_gather_object((sample, loop_ms))
        return self._summarize(gathered) if self.rank0 else None

    def _timed(self, start: int) -> tuple[clocks.SegmentClock, clocks.MemoryWindow, dict[str, Any] | None, float]:
        """The measured steps: one clock segment per step, the memory window and the native counter around them."""
        instrument = self.cfg.instrument
        clock = clocks.SegmentClock(self.runner.device, enabled=instrument)
        memory = clocks.MemoryWindow(self.runner.device)
        counter = self.adapter.comm_counter() if instrument and self.comm_reason is None else None
        workdir = Path(tempfile.mkdtemp(prefix="dpcompare-"))
        window = CommWindow(counter, self.runner.device, workdir) if counter is not None else None
        self.adapter.all_gather_object(None)  # line the ranks up: the window starts together
        if instrument:
            memory.reset()
        if window is not None:
            window.begin()
        loop_start = time.perf_counter()
        for i, (x, y) in enumerate(self.batches):
            clock.start()
            self.runner.step(start + i, x, y, phase="measured")
            clock.stop()
            clock.end_step()
            if window is not None:
                window.step()
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize()
        loop_ms = (time.perf_counter() - loop_start) * 1e3 / self.cfg.measure_steps
        comm = None
        if instrument and self.comm_reason is None:
            comm = window.end(self.cfg.measure_steps) if window is not None else \
                {"reason": f"{self.adapter.name} exposes no communication counter"}
        shutil.rmtree(workdir, ignore_errors=True)
        return clock, memory, comm, loop_ms

    def _ablation(self, first: int) -> tuple[clocks.SegmentClock, clocks.SegmentClock]:
        """The same step with gradient synchronisation on and off, in alternating blocks run like the measured
        loop (no barrier between steps, so ranks run free as in training). No optimizer step in either arm:
        the weights stay where the run left them and the arms differ only by communication. Medians absorb
        the one step per block that pays for the ranks drifting apart."""
        arms = {True: clocks.SegmentClock(self.runner.device), False: clocks.SegmentClock(self.runner.device)}
        pairs = self.cfg.measure_steps if self.cfg.ablation_steps is None else self.cfg.ablation_steps
        if self.comm_reason is None and not self.adapter.capabilities.can_disable_sync:
            self.comm_reason = f"{self.adapter.name} cannot switch gradient synchronisation off"
        if not (self.cfg.instrument and self.comm_reason is None and pairs):
            return arms[True], arms[False]
        block = min(ABLATION_BLOCK, pairs)
        done = {True: 0, False: 0}
        sync = True
        while done[True] < pairs or done[False] < pairs:
            for _ in range(min(block, pairs - done[sync])):
                x, y = self.batches[(done[True] + done[False]) % len(self.batches)]
                arms[sync].start()
                self.runner.step(first + done[True] + done[False], x, y, phase="ablation", sync=sync, update=False)
                arms[sync].stop()
                arms[sync].end_step()
                done[sync] += 1
            sync = not sync
        return arms[True], arms[False]

    def _summarize(self, gathered: list[tuple[summary.RankSample, float]]) -> dict[str, Any]:
        wrapped, cfg = self.adapter.wrapped, self.cfg
        world_size = self.runner.world_size
        grad_bytes = sum(p.numel() * p.element_size() for p in wrapped.module.parameters() if p.requires_grad)
        optimizer, masters = self.adapter.optimizer_view()  # the torch optimizer behind the backend's, its masters
        message, message_reason = self.adapter.message_bytes(grad_bytes)
        microbench, microbench_reason = microbench_busbw(cfg, self.adapter.capabilities.collective_transport,
                                                         world_size, message or grad_bytes)
        metrics = summary.summarize(
            [g[0] for g in gathered], world_size=world_size, local_batch=self.local_batch,
            tokens_per_sample=self.runner.workload.tokens_per_sample, warmup_steps=cfg.warmup_steps,
            grad_bytes=grad_bytes, message_bytes=message, message_reason=message_reason,
            model_state=clocks.model_state_mib(wrapped.module, optimizer or wrapped.optimizer,
                                               self.adapter.comm_buffer_bytes(grad_bytes), masters),
            microbench_busbw=microbench, microbench_reason=microbench_reason, scaling=cfg.scaling,
            comm_possible=self.comm_reason, instrumented=cfg.instrument,
        )
        metrics["loop_ms_per_step"] = max(g[1] for g in gathered)
        return metrics


def microbench_busbw(cfg: RunConfig, transport: str, world_size: int, nbytes: int) -> tuple[float | None, str | None]:
    """The bench-collectives busbw of `transport` at this run's message size, or (None, reason)."""
    if world_size < 2:
        return None, "one rank: nothing crosses a link"
    if not cfg.collectives:
        return None, "no microbenchmark given: run `python -m dpcompare bench-collectives` and pass --collectives FILE"
    try:
        data = json.loads(Path(cfg.collectives).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--collectives={cfg.collectives!r} cannot be read as JSON ({exc}): pass a bench-collectives result") from None
    value = busbw_at(data, transport, world_size, nbytes)
    return value, None if value is not None else f"the microbenchmark has no {transport} entry at world size {world_size}"
