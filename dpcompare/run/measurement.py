"""The measurement phase: what a step costs, with nothing else running.

Owns: the order of the phase on every rank — warm-up steps, then `measure_steps` timed steps (clocks,
memory window, the backend's native counter and the recorder of Python collectives by kind, all off under
--no-instrument but the loop's wall clock; the model-state census after the reduce of the last measured step,
outside its clock segments and the loop's wall clock), then the ablation: pairs of the same step with gradient
synchronisation on and off, in alternating blocks (exposed communication = synced - unsynced). Rank 0 gathers every
rank's samples and dpcompare.measure does the arithmetic.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from dpcompare.contract import Adapter
from dpcompare.measure import clocks, memory, summary, volume
from dpcompare.measure.bandwidth import busbw_at
from dpcompare.measure.collectives import CollectiveRecorder
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
        self.no_communication = self.comm_reason  # before the ablation adds its own reason
        self.census: dict[str, Any] | None = None
        self.census_s = 0.0

    def run(self) -> dict[str, Any] | None:
        if self.cfg.measure_steps == 0:
            return None
        for i in range(self.cfg.warmup_steps):
            self.runner.step(self.first + i, *self.runner.batch(self.first + i)[1:], phase="warm-up")
        start = self.first + self.cfg.warmup_steps
        self.batches = [self.runner.batch(start + i)[1:] for i in range(self.cfg.measure_steps)]
        clock, window, comm, by_kind, loop_ms = self._timed(start)
        synced, unsynced = self._ablation(start + self.cfg.measure_steps)
        sample = summary.RankSample(clock.step_ms(), synced.step_ms(), unsynced.step_ms(), window.peak() if self.cfg.instrument
                                    else {"peak_mem_mib": None, "peak_mem_reserved_mib": None}, window.reason, comm,
                                    model_state=self.census, collectives=by_kind)
        gathered = self.adapter.all_gather_object((sample, loop_ms))
        return self._summarize(gathered) if self.rank0 else None

    def _timed(self, start: int) -> tuple[clocks.SegmentClock, clocks.MemoryWindow, dict[str, Any] | None,
                                          dict[str, Any] | None, float]:
        """The measured steps: one clock segment per step, the memory window, the native counter and the recorder
        of Python collectives around them; the census of the model state after the last step's reduce, outside the
        clock's segments, the recorder's count and the loop's wall clock. Returns (clock, memory window, the native
        counter's figures, the recorder's record, loop ms per step)."""
        instrument = self.cfg.instrument
        clock = clocks.SegmentClock(self.runner.device, enabled=instrument)
        memory_window = clocks.MemoryWindow(self.runner.device)
        counter = self.adapter.comm_counter() if instrument and self.comm_reason is None else None
        workdir = Path(tempfile.mkdtemp(prefix="dpcompare-"))
        window = CommWindow(counter, self.runner.device, workdir) if counter is not None else None
        recorder = CollectiveRecorder(self.runner.device) if instrument and self.comm_reason is None else None

        def census() -> None:  # after the last measured step's reduce: gradients exist, the optimizer has state
            clock.stop()
            started = time.perf_counter()
            with recorder.paused() if recorder is not None else contextlib.nullcontext():
                self.census = self._census()
            self.census_s += time.perf_counter() - started
            clock.start()

        self.adapter.all_gather_object(None)  # line the ranks up: the window starts together
        if instrument:
            memory_window.reset()
        if window is not None:
            window.begin()
        last = len(self.batches) - 1
        try:
            if recorder is not None:
                recorder.begin()
            loop_start = time.perf_counter()
            for i, (x, y) in enumerate(self.batches):
                clock.start()
                self.runner.step(start + i, x, y, phase="measured", after_reduce=census if i == last else None)
                clock.stop()
                clock.end_step()
                if window is not None:
                    window.step()
                if recorder is not None:
                    recorder.step()
            if self.runner.device.type == "cuda":
                torch.cuda.synchronize()
            loop_ms = ((time.perf_counter() - loop_start) - self.census_s) * 1e3 / self.cfg.measure_steps
        finally:
            if recorder is not None:
                recorder.close()  # the originals are back whatever happened in the window
        by_kind = recorder.record(self.cfg.measure_steps) if recorder is not None else None
        comm = None
        if instrument and self.comm_reason is None:
            comm = window.end(self.cfg.measure_steps) if window is not None else \
                {"reason": f"{self.adapter.name} exposes no communication counter"}
        shutil.rmtree(workdir, ignore_errors=True)
        return clock, memory_window, comm, by_kind, loop_ms

    def _census(self) -> dict[str, Any]:
        """This rank's model state, measured: the bytes of the tensors the adapter lists, per component
        (dpcompare.measure.memory.census_mib), or {'reason'} when the adapter cannot list them."""
        try:
            tensors = self.adapter.model_state_tensors()
        except Exception as exc:  # a backend's listing that fails leaves the analytic figure, with the reason
            return {"reason": f"{self.adapter.name}'s model_state_tensors() raised {type(exc).__name__}: {exc}"}
        return memory.census_mib(tensors, self.adapter.comm_buffer_bytes(self._sizes()["grad_bytes"]))

    def _sizes(self) -> dict[str, int]:
        """The model's bytes, full (not this rank's shard): gradients (trainable parameters, in their dtype), the
        same on the wire (--compression or the backend's 16-bit recipe), and every parameter."""
        params = list(self.adapter.wrapped.module.parameters())
        wire = self.adapter.gradient_wire()
        wire_size = {"fp16": 2, "bf16": 2}.get(wire)
        return {"grad_bytes": sum(memory.param_numel(p) * p.element_size() for p in params if p.requires_grad),
                "wire_grad_bytes": sum(memory.param_numel(p) * (wire_size or p.element_size())
                                       for p in params if p.requires_grad),
                "param_bytes": sum(memory.param_numel(p) * p.element_size() for p in params)}

    def _formula(self) -> tuple[dict[str, Any] | None, str | None]:
        """The ZeRO paper's per-rank model state for this model, precision, optimizer and sharding, or (None, why)."""
        psi, trainable = memory.param_counts(self.adapter.wrapped.module.parameters())
        try:
            return memory.zero_formula_mib(
                psi=psi, trainable=trainable, world_size=self.runner.world_size, shards=self._shards(),
                weight_bytes=torch.empty((), dtype=self.runner.dtype).element_size(),
                masters=self.adapter.amp_recipe() == "engine", optimizer=self.cfg.optimizer,
                momentum=self.cfg.momentum), None
        except ValueError as exc:
            return None, str(exc)

    def _shards(self) -> str:
        return getattr(self.adapter.capabilities, "shards", "none")

    def _analytic_comm(self, sizes: dict[str, int]) -> tuple[dict[str, int] | None, str]:
        """The predicted bytes per step by kind (None when there is no communication) and how they were predicted.
        Parameters resharded after the forward (ZeRO-3 always, FSDP unless --opt reshard_after_forward=false) are
        gathered twice a step."""
        if self.no_communication:
            return None, ""
        shards = self._shards()
        reshard = bool(self.adapter.settings.options.get("reshard_after_forward", True))
        return (volume.analytic_bytes_per_step(shards, sizes["wire_grad_bytes"], sizes["param_bytes"],
                                               self.runner.world_size, reshard),
                volume.analytic_method(shards, reshard))

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
        sizes = self._sizes()
        grad_bytes = sizes["grad_bytes"]
        formula, formula_reason = self._formula()
        analytic, analytic_how = self._analytic_comm(sizes)
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
            model_state_formula=formula, model_state_formula_reason=formula_reason,
            comm_analytic=analytic, comm_analytic_method=analytic_how,
            comm_measured_reason=self.no_communication or (
                None if cfg.instrument else "instrumentation off (--no-instrument): the collectives were not wrapped"),
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
