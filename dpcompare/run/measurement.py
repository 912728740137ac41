"""The measurement phase: what a step costs, with nothing else running.

Owns: the order of the phase on every rank — warm-up steps, then `measure_steps` timed steps (clocks,
memory window, the backend's native counter and the recorder of Python collectives by kind, all off under
--no-instrument but the loop's wall clock; the model-state census after the reduce of the last measured step,
outside its clock segments and the loop's wall clock), with the ablation interleaved: each paired measured step is
followed by the same step with gradient synchronisation off (A B A B ...). The measured step is the synced arm, timed
up to its reduce (its optimizer step left out); the unsynced step, timed up to the same point, is the compute arm
(exposed communication = synced - unsynced, measured on the very steps the counter counts); after it the ranks are
lined up again, so the next synced step starts as a training step does. Under --compile a
measured step that compiled anything on any rank (with its unsynced twin) is left out of the figures and counted.
Rank 0 gathers every rank's samples and dpcompare.measure does the arithmetic.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from dpcompare.contract import Adapter
from dpcompare.measure import clocks, flops, link, memory, run_metrics, samples, trace, volume
from dpcompare.measure.bandwidth import busbw_at
from dpcompare.measure.collectives import CollectiveRecorder
from dpcompare.measure.comm import CommWindow
from dpcompare.run.config import RunConfig
from dpcompare.run.step import StepRunner


PROFILE_STEPS = 5
"""--profile: the steps traced after the measured window, after one untraced under the profiler, each with its
unsynced twin where the run has an ablation (a trace of a few steps stays a few MB: 11 MB a rank for ResNet-18 at
two micro-batches a step)."""
PHASES = ("forward", "backward", "reduce", "optimizer_step")
"""The step's phases marked in a trace (StepRunner.mark)."""


def paired_steps(measure_steps: int, pairs: int) -> list[int]:
    """Which measured steps are followed by an unsynced step: `pairs` of them, spread evenly over the window (all of
    them when pairs >= measure_steps; the pairs beyond the window run after it, see MeasurementPhase._extra_pairs)."""
    n = min(pairs, measure_steps)
    return sorted({(k * measure_steps) // n for k in range(n)}) if n else []


class MeasurementPhase:
    def __init__(self, cfg: RunConfig, adapter: Adapter, runner: StepRunner, local_batch: int, is_rank0: bool,
                 template: torch.nn.Module | None = None, nccl_log: tuple[Path | None, str | None] = (None, None)) -> None:
        self.cfg, self.adapter, self.runner = cfg, adapter, runner
        self.nccl_log = nccl_log
        """Where NCCL writes this process's tuning choices (dpcompare.measure.link.ask_nccl_tuning), or why not."""
        self.template = template
        """The untouched model (the trainer's template): its FLOPs are counted on a meta copy of it (MFU)."""
        self.local_batch, self.rank0 = local_batch, is_rank0
        self.first = cfg.steps  # steps continue the verification phase's data stream
        self.comm_reason = adapter.no_communication_reason()
        self.no_communication = self.comm_reason  # before the ablation adds its own reason
        self.census: dict[str, Any] | None = None
        self.census_s = 0.0

    def run(self) -> dict[str, Any] | None:
        if self.cfg.measure_steps == 0:
            return None
        pairs, ablation_reason = self._pairs()
        if pairs:  # what an adapter's unsynced arm builds (Adapter.ablation_bytes) exists before the memory window opens
            with self.adapter.comm_off():
                pass
        facts = self._flops() if self.rank0 and self.cfg.instrument else None  # before the memory window opens
        for i in range(self.cfg.warmup_steps):  # the loop's pattern, untimed: the unsynced path is warm too
            x, y = self.runner.batch(self.first + i)[1:]
            self.runner.step(self.first + i, x, y, phase="warm-up")
            if pairs:
                self.runner.step(self.first + i, x, y, phase="warm-up", sync=False, update=False)
        start = self.first + self.cfg.warmup_steps
        self.batches = [self.runner.batch(start + i)[1:] for i in range(self.cfg.measure_steps)]
        arms = {True: clocks.SegmentClock(self.runner.device), False: clocks.SegmentClock(self.runner.device)}
        clock, window, comm, by_kind, loop_ms = self._timed(start, pairs, arms)
        self._extra_pairs(start + self.cfg.measure_steps + pairs, pairs, arms)
        traces = self._profile(start) if self.cfg.profile else None
        self.comm_reason = ablation_reason  # after the window: the counter ran all the same
        step_ms, synced_ms, unsynced_ms = clock.step_ms(), arms[True].step_ms(), arms[False].step_ms()
        compiled: list[int] = []
        if getattr(self.runner, "compile_log", None) is not None:
            # A step that compiled (on any rank) is timed with its compile: left out of every rank's figures.
            compiled = sorted(set().union(*self.adapter.all_gather_object(self.compiled_steps)))
            step_ms, synced_ms, unsynced_ms, loop_ms = self._without(compiled, step_ms, synced_ms, unsynced_ms,
                                                                      loop_ms, pairs)
        sample = samples.RankSample(step_ms, synced_ms, unsynced_ms,
                                    self._peak(window, pairs), window.reason, comm,
                                    model_state=self.census, collectives=by_kind)
        gathered = self.adapter.all_gather_object((sample, loop_ms))
        if not self.rank0:
            return None
        metrics = self._summarize(gathered, facts, traces)
        if getattr(self.runner, "compile_log", None) is not None:
            metrics["compile"] = {"measured_steps_excluded": len(compiled), "excluded_steps": compiled}
        return metrics

    def _profile(self, start: int) -> dict[str, Any]:
        """--profile, every rank: PROFILE_STEPS steps after the measured window (whose figures it leaves alone) under
        torch.profiler, the step's phases marked (dpcompare.forward, .backward, .reduce, .optimizer_step; the
        collectives are the profiler's own events), each followed, where the run has an ablation, by its unsynced twin
        (dpcompare.unsynced N) and the ranks lined up, written as one Chrome/Perfetto trace per rank under
        OUT/traces/<run>/rank<R>.json. Returns the traces' paths, rank by rank."""
        token = self.adapter.all_gather_object(f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")[0]
        directory = Path(self.cfg.out) / "traces" / token
        directory.mkdir(parents=True, exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.runner.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        steps = min(PROFILE_STEPS, len(self.batches))
        path = directory / f"rank{self.runner.rank}.json"
        # One step under the profiler before the traced ones (its schedule's warm-up): the profiler's first step
        # pays its own start-up, which the trace would otherwise book to that step's ops and collectives.
        schedule = torch.profiler.schedule(wait=0, warmup=1, active=steps, repeat=1)
        twins = self._pairs()[0] > 0
        self.runner.marking = True
        try:
            with torch.profiler.profile(activities=activities, schedule=schedule,
                                        on_trace_ready=lambda p: p.export_chrome_trace(str(path))) as profiler:
                for i, (x, y) in enumerate([self.batches[0], *self.batches[:steps]]):
                    n = start + max(i - 1, 0)
                    self._traced(f"dpcompare.step {n}" if i else "dpcompare.warm-up", n, x, y)
                    if twins:
                        self._traced(f"dpcompare.unsynced {n}" if i else "dpcompare.warm-up", n, x, y, sync=False)
                        self.adapter.all_gather_object(None)  # realigned, as in the measured window
                    profiler.step()
        finally:
            self.runner.marking = False
        events = json.loads(path.read_text()).get("traceEvents", [])
        gathered = self.adapter.all_gather_object((str(path), trace.rank_figure(trace.per_step(events))))
        return {"steps": steps, "traces": [p for p, _ in gathered], "phases": [f"dpcompare.{p}" for p in PHASES],
                "exposed": [f for _, f in gathered]}

    def _traced(self, name: str, step: int, x: torch.Tensor, y: torch.Tensor, sync: bool = True) -> None:
        """One step under the profiler in a range named `name`; sync=False: the ablation's unsynced twin (no optimizer
        step), which the trace holds against the synced step for the compute that synchronising slowed."""
        with torch.profiler.record_function(name):
            self.runner.step(step, x, y, phase="profiled", sync=sync, update=sync)
            if self.runner.device.type == "cuda":  # the step's kernels end inside its range
                torch.cuda.synchronize()

    def _flops(self) -> dict[str, Any]:
        """Rank 0, once: the model's FLOPs and the device's peak (dpcompare.measure.flops.facts)."""
        if self.template is None:
            return flops.facts(None, None, None, None, self.cfg.amp, self.runner.device)
        x, y = self.runner.batch(self.first)[1:]
        return flops.facts(self.template, self.runner.workload.loss_fn, x, y, self.cfg.amp, self.runner.device)

    def _without(self, compiled: list[int], step_ms: list[float], synced_ms: list[float], unsynced_ms: list[float],
                 loop_ms: float, pairs: int) -> tuple[list[float], list[float], list[float], float]:
        """The figures without the measured steps that compiled (their ablation pairs too); the loop's wall clock
        less their clocked time."""
        if not compiled:
            return step_ms, synced_ms, unsynced_ms, loop_ms
        drop = set(compiled)
        paired = paired_steps(self.cfg.measure_steps, pairs)
        keep_pair = [i not in drop for i in paired] + [True] * (len(synced_ms) - len(paired))
        kept = [v for i, v in enumerate(step_ms) if i not in drop]
        if step_ms and kept:
            n = self.cfg.measure_steps
            loop_ms = (loop_ms * n - sum(v for i, v in enumerate(step_ms) if i in drop)) / len(kept)
        return (kept, [v for v, k in zip(synced_ms, keep_pair) if k], [v for v, k in zip(unsynced_ms, keep_pair) if k],
                loop_ms)

    def _peak(self, window: clocks.MemoryWindow, pairs: int) -> dict[str, float | None]:
        """The window's peak memory, less what only the ablation's unsynced arm holds (Adapter.ablation_bytes): the
        peak of the training step, ablation or not; and how far it rose above what the rank held when the window
        opened. None under --no-instrument."""
        if not self.cfg.instrument:
            return {"peak_mem_mib": None, "peak_mem_reserved_mib": None, "peak_above_start_mib": None}
        peak = window.peak()
        above = window.above_start(peak)  # what the unsynced arm holds was there when the window opened
        held = self.adapter.ablation_bytes() / memory.MIB if pairs else 0.0
        return {**{k: (None if v is None else v - held) for k, v in peak.items()}, "peak_above_start_mib": above}

    def _pairs(self) -> tuple[int, str | None]:
        """(synced/unsynced pairs to run, the reason there is no exposed figure or None). --ablation-steps, default
        --measure-steps; none under --no-instrument, without communication, or where sync cannot be switched off
        (ZeRO-2/3: they reduce into partitions inside backward)."""
        pairs = self.cfg.measure_steps if self.cfg.ablation_steps is None else self.cfg.ablation_steps
        reason = self.comm_reason
        if reason is None and not self.adapter.capabilities.can_disable_sync:
            reason = f"{self.adapter.name} cannot switch gradient synchronisation off"
        return (pairs if self.cfg.instrument and reason is None else 0), reason

    def _unsynced(self, step: int, x: torch.Tensor, y: torch.Tensor, arm: clocks.SegmentClock,
                  whole: clocks.SegmentClock | None = None) -> None:
        """The compute arm: the same batch with synchronisation off, timed (`arm`) from its start to where the synced
        step's reduce ends; no optimizer step (update=False: the gradients are dropped, then zero_grad clears them,
        unreduced ones included, so the next measured step starts from the weights and gradients it would have had).
        `whole` times the whole step, for the loop's wall clock to leave out.

        Then the ranks are lined up again, outside both arms' segments: with no collective in it, the unsynced step
        lets a rank slower in compute by s fall s behind, and the synced step after it would start with that lag (its
        slowest rank's arm the collective plus s, the ablation's exposed figure too). In training every step's
        collectives end together, so each step starts as the ranks left the last: after the barrier, so does the
        synced arm."""
        if whole is not None:
            whole.start()
        arm.start()
        self.runner.step(step, x, y, phase="ablation", sync=False, update=False, after_reduce=arm.stop)
        arm.end_step()
        self.adapter.all_gather_object(None)
        if whole is not None:
            whole.stop()
            whole.end_step()

    def _timed(self, start: int, pairs: int, arms: dict[bool, clocks.SegmentClock]) -> tuple[
            clocks.SegmentClock, clocks.MemoryWindow, dict[str, Any] | None, dict[str, Any] | None, float]:
        """The measured steps: one clock segment per step, the memory window, the native counter and the recorder
        of Python collectives around them; the census of the model state after the last step's reduce, outside the
        clock's segments, the recorder's count and the loop's wall clock. The paired measured steps (paired_steps)
        are also the synced arm, timed up to their reduce, and each is followed by its unsynced step, which the
        counter (read before it), the recorder (paused) and the loop's wall clock leave out. Returns (clock, memory
        window, the native counter's figures, the recorder's record, loop ms per step)."""
        instrument = self.cfg.instrument
        clock = clocks.SegmentClock(self.runner.device, enabled=instrument)
        memory_window = clocks.MemoryWindow(self.runner.device)
        counter = self.adapter.comm_counter() if instrument and self.comm_reason is None else None
        workdir = Path(tempfile.mkdtemp(prefix="dpcompare-"))
        window = CommWindow(counter, self.runner.device, workdir) if counter is not None else None
        recorder = CollectiveRecorder(self.runner.device) if instrument and self.comm_reason is None else None
        paired = set(paired_steps(self.cfg.measure_steps, pairs))
        whole = clocks.SegmentClock(self.runner.device)  # the unsynced steps, left out of the loop's wall clock
        log = getattr(self.runner, "compile_log", None)  # --compile: a step that compiles is noted, and left out
        self.compiled_steps: list[int] = []

        def census() -> None:  # after the last measured step's reduce: gradients exist, the optimizer has state
            clock.stop()
            started = time.perf_counter()
            with recorder.paused() if recorder is not None else contextlib.nullcontext():
                self.census = self._census()
            self.census_s += time.perf_counter() - started
            clock.start()

        def after_reduce(i: int) -> None:
            if i in paired:
                arms[True].stop()  # the synced arm ends with the reduce, before the census
            if i == last:
                census()

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
                if log is not None:
                    log.mark()
                clock.start()
                if i in paired:
                    arms[True].start()
                self.runner.step(start + i, x, y, phase="measured", after_reduce=lambda i=i: after_reduce(i))
                clock.stop()
                clock.end_step()
                if window is not None:
                    window.step()
                if recorder is not None:
                    recorder.step()
                if i in paired:
                    arms[True].end_step()
                    with recorder.paused() if recorder is not None else contextlib.nullcontext():
                        self._unsynced(start + self.cfg.measure_steps + len(arms[False].steps), x, y, arms[False],
                                       whole)
                if log is not None and log.step_compiled():
                    self.compiled_steps.append(i)
            if self.runner.device.type == "cuda":
                torch.cuda.synchronize()
            loop_s = time.perf_counter() - loop_start - self.census_s - sum(whole.step_ms()) / 1e3
            loop_ms = loop_s * 1e3 / self.cfg.measure_steps
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

    def _extra_pairs(self, first: int, pairs: int, arms: dict[bool, clocks.SegmentClock]) -> None:
        """--ablation-steps above --measure-steps: the pairs the window could not hold, after it, in the same A B
        order (a training step timed up to its reduce, then the unsynced step); outside the counter's window."""
        for k in range(pairs - self.cfg.measure_steps):
            x, y = self.batches[k % len(self.batches)]
            arms[True].start()
            self.runner.step(first + 2 * k, x, y, phase="ablation", after_reduce=arms[True].stop)
            arms[True].end_step()
            self._unsynced(first + 2 * k + 1, x, y, arms[False])

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
                momentum=self.cfg.momentum, replicas=self._replicas()), None
        except ValueError as exc:
            return None, str(exc)

    def _shards(self) -> str:
        return getattr(self.adapter.capabilities, "shards", "none")

    def _replicas(self) -> int:
        """Replica groups of the sharded state (HSDP; 1: one shard group of every rank)."""
        return getattr(self.adapter.capabilities, "shard_replicas", 1)

    def _analytic_comm(self, sizes: dict[str, int]) -> tuple[dict[str, int] | None, str]:
        """The predicted bytes per step by kind (None when there is no communication) and how they were predicted.
        Parameters resharded after the forward (ZeRO-3 always, FSDP unless --opt reshard_after_forward=false) are
        gathered twice a step."""
        if self.no_communication:
            return None, ""
        shards, replicas = self._shards(), self._replicas()
        reshard = bool(self.adapter.settings.options.get("reshard_after_forward", True))
        return (volume.analytic_bytes_per_step(shards, sizes["wire_grad_bytes"], sizes["param_bytes"],
                                               self.runner.world_size, reshard, replicas),
                volume.analytic_method(shards, reshard, replicas))

    def _summarize(self, gathered: list[tuple[samples.RankSample, float]], facts: dict[str, Any] | None = None,
                   traces: dict[str, Any] | None = None) -> dict[str, Any]:
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
        metrics = run_metrics.summarize(
            [g[0] for g in gathered], world_size=world_size, local_batch=self.local_batch,
            tokens_per_sample=self.runner.workload.tokens_per_sample, warmup_steps=cfg.warmup_steps,
            grad_bytes=grad_bytes, message_bytes=message, message_reason=message_reason,
            model_state=clocks.model_state_mib(wrapped.module, optimizer or wrapped.optimizer,
                                               self.adapter.comm_buffer_bytes(grad_bytes), masters),
            microbench_busbw=microbench, microbench_reason=microbench_reason, scaling=cfg.scaling,
            comm_possible=self.comm_reason, instrumented=cfg.instrument,
            model_state_formula=formula, model_state_formula_reason=formula_reason,
            comm_analytic=analytic, comm_analytic_method=analytic_how, comm_replicas=self._replicas(), flops_facts=facts,
            traced=traces.pop("exposed") if traces else None, link=self._link(), profile=traces,
            comm_measured_reason=self.no_communication or (
                None if cfg.instrument else "instrumentation off (--no-instrument): the collectives were not wrapped"),
        )
        metrics["loop_ms_per_step"] = max(g[1] for g in gathered)
        return metrics


    def _link(self) -> dict[str, Any] | None:
        """Rank 0: the facts of the transport the gradients' collectives crossed (dpcompare.measure.link)."""
        return link.facts(self.adapter.link_transport(), self.nccl_log)


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
