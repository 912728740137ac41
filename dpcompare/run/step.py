"""The step runner: one training step's body, written once, for every phase of a run.

Owns: this rank's shard of a step's global batch, the forward and backward over `grad_accum` equal
micro-batches (synchronising only the last when the backend can switch sync off; forward and loss inside the
adapter's autocast), the reduce, the loss scale undone, the gradient clipped (--clip-grad-norm), the optimizer step,
the injected faults of the failure tests, the watchdog's heartbeat at every stage, under --compile what the
checks compile kept apart from what the step compiles (dpcompare.run.compilation), and an exception the model's own
code raised in the forward, the loss or the backward told from the backend's (dpcompare.run.raised: ModelRaised).
The verification phase hangs its checks on the hooks; measurement and the ablation time whole steps.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import Any, Callable

import torch

from dpcompare.contract import Adapter, batches
from dpcompare.run import raised
from dpcompare.run.compilation import CompileLog
from dpcompare.run.watchdog import Watchdog
from dpcompare.contract.workload import Workload, shard

Hook = Callable[[], None] | None
BACKWARD_FLOPS_FACTOR = 3.0
"""Forward + backward costs about 3 forwards (the backward about twice the forward's arithmetic)."""


class StepRunner:
    def __init__(self, *, adapter: Adapter, workload: Workload, device: torch.device, dtype: torch.dtype,
                 grad_accum: int, watchdog: Watchdog, rank: int, world_size: int, global_batch: int,
                 clip_grad_norm: float | None = None, inject_fault: str | None = None,
                 inject_slowdown: float = 0.0, compile_log: CompileLog | None = None,
                 slow_rank: int | None = None, loss_normalisation: str = "local") -> None:
        self.adapter, self.workload, self.device, self.dtype = adapter, workload, device, dtype
        self.marking = False
        """Mark the step's phases for torch.profiler (MeasurementPhase's --profile steps)."""
        self.grad_accum, self.watchdog = grad_accum, watchdog
        self.rank, self.world_size, self.global_batch = rank, world_size, global_batch
        self.inject_fault = inject_fault
        self.inject_slowdown = inject_slowdown if slow_rank is None or slow_rank == rank else 0.0
        self.clip_grad_norm = clip_grad_norm
        self.grad_norm: float | None = None
        """The total norm the backend reported clipping the last step's gradient by (None: no clipping, or none reported)."""
        self.forward_s = 0.0
        self.compile_log = compile_log
        """--compile: what torch.compile did in this runner's steps, the checks' own compiles (the hooks) left out."""
        if compile_log is not None:
            compile_log.start()
        # Floating inputs go in the dtype of the model's weights: the run dtype, or a backend's low-precision
        # weights (DeepSpeed's bf16/fp16 engine); under autocast the weights stay float32 and autocast casts.
        weights = [p for p in adapter.wrapped.module.parameters() if p.is_floating_point()] if adapter.wrapped else []
        self.input_dtype = weights[0].dtype if weights else dtype
        # --inject-fault dupdata: every rank reads rank 0's shard (a data-sharding bug the check must catch).
        self.sample_rank = 0 if inject_fault == "dupdata" else rank
        self._part = "forward"
        """The part of the step running: forward (the forward and the loss) or backward (for ModelRaised)."""
        self._code: tuple[frozenset[str], frozenset[str]] | None = None
        self.global_count = loss_normalisation == "global"
        """--loss-normalisation global: each micro-batch's loss is its sum over items divided by the step's count, summed
        over the micro-batches and all-reduced over the ranks before the first backward."""
        self.items: int | None = None
        """The last step's count of items over every rank and micro-batch (--loss-normalisation global)."""

    # -- data --------------------------------------------------------------------------------------
    def batch(self, step: int) -> tuple[tuple[Any, Any], Any, Any]:
        """(the step's global batch as (inputs, targets), this rank's shard of them on the device, floating inputs in
        the weights' dtype). Inputs and targets are any structure of tensors (dpcompare.contract.batches)."""
        batch = batches.pair(self.workload.make_batch(step, self.global_batch))
        x, y = shard(batch, self.sample_rank, self.world_size)
        x, y = self.inputs(x, y)
        return batch, x, y

    def inputs(self, x: Any, y: Any) -> tuple[Any, Any]:
        return batches.to(x, self.device, self.input_dtype), batches.to(y, self.device)

    # -- the step ------------------------------------------------------------------------------------
    def step(self, step: int, x: Any, y: Any, *, phase: str = "train", sync: bool = True,
             update: bool = True, after_reduce: Hook = None, after_update: Hook = None,
             recording: Callable[[], contextlib.AbstractContextManager] | None = None) -> None:
        """One step: forward and backward (sync=False: the ablation's unsynced arm, no communication), reduce,
        the loss scale undone, the gradient clipped by its global norm (--clip-grad-norm), then the optimizer step
        (update=False: gradients dropped unscaled, weights untouched). The hooks run where the verification checks:
        after the reduce and the unscale (gradients global and not yet clipped, weights not yet moved) and after the
        update (`grad_norm` then holds the norm the backend clipped by). `recording`: a context around the forwards and
        backwards alone (the verification's record of the random numbers they draw; the hooks' work stays outside)."""
        self._inject(step)
        self.beat(f"{phase}: forward", step)
        self.forward_s = 0.0
        try:
            with recording() if recording is not None else contextlib.nullcontext():
                self.forward_backward(x, y, comm=sync)
        except Exception as exc:
            if self._raised_by_model(exc):
                raise raised.ModelRaised(exc, step=step, phase=phase, part=self._part, rank=self.rank,
                                         world_size=self.world_size) from exc
            raise
        if self.inject_slowdown:
            # Compute = forward + backward ~ 3 x forward (the backward's wall time also holds the all-reduce).
            _spin(self.inject_slowdown * BACKWARD_FLOPS_FACTOR * self.forward_s)
        if sync:
            self.beat(f"{phase}: reduce", step)
            with self.mark("reduce"):
                self.adapter.reduce()
        if update:
            self.adapter.unscale()
        self.beat(f"{phase}: reduced", step)
        if after_reduce is not None:
            with self._aside():
                after_reduce()
            self.beat(f"{phase}: checked", step)
        self.grad_norm = None
        if update:
            clip = self.clip_grad_norm is not None
            with self.mark("optimizer_step"):
                if clip:
                    self.grad_norm = self.adapter.clip_grad_norm(self.clip_grad_norm)
                self.adapter.step()
            if clip and self.grad_norm is None:  # a backend that clips inside its own step
                self.grad_norm = self.adapter.grad_norm_after_step()
        self.adapter.zero_grad()
        self.beat(f"{phase}: stepped", step)
        if after_update is not None:
            with self._aside():
                after_update()
            self.beat(f"{phase}: done", step)

    def _raised_by_model(self, exc: Exception) -> bool:
        """Whether the model's own code raised `exc` (dpcompare.run.raised), not the backend's communication."""
        if self._code is None:
            self._code = (raised.model_files(self.adapter.wrapped.module, self.workload.loss_fn),
                          raised.communication_files(self.adapter))
        return raised.model_raised(exc, *self._code)

    def mark(self, phase: str):
        """The step's phase as a torch.profiler range `dpcompare.PHASE` while `marking` (--profile's steps), else
        nothing: the measured steps carry no mark."""
        return torch.profiler.record_function(f"dpcompare.{phase}") if self.marking else contextlib.nullcontext()

    def _aside(self):
        """Around the hooks: what they compile (rank 0's compiled reference copy) is not the run's."""
        return self.compile_log.aside() if self.compile_log is not None else contextlib.nullcontext()

    def _host_time(self) -> float:
        """Now; with --inject-slowdown on CUDA, after the device has finished what was queued."""
        if not self.inject_slowdown:
            return 0.0
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def beat(self, phase: str, step: int) -> None:
        self.watchdog.beat(phase, step)

    def forward_backward(self, x: Any, y: Any, comm: bool = True) -> None:
        """Forward and backward over the rank's shard in `grad_accum` equal micro-batches. Only the last one
        synchronises (when the backend can switch sync off); each loss is scaled by 1/grad_accum so the
        accumulated gradient is the mean over the shard. comm=False runs the whole step inside the adapter's
        comm_off()."""
        if not comm:
            with self.adapter.comm_off():
                self._micro_batches(x, y, lambda last: contextlib.nullcontext())
            return
        # sync(False) around every micro-batch but the last: the backend may keep their gradients local (whether it
        # really sends nothing is `capabilities.can_disable_sync`, which only the ablation relies on).
        self._micro_batches(x, y, lambda last: self.adapter.sync(last))

    def _micro_batches(self, x: Any, y: Any, context) -> None:
        k = self.grad_accum
        count = self._step_count(y) if self.global_count else None
        for j, (xj, yj) in enumerate(zip(batches.chunk(x, k), batches.chunk(y, k))):
            with context(j == k - 1):
                started = self._host_time()
                self._part = "forward"
                with self.mark("forward"), self.adapter.autocast():
                    loss = self._loss(self._forward(xj, count), yj, count)
                self.forward_s += self._host_time() - started
                self._part = "backward"
                with self.mark("backward"):
                    self.adapter.backward(loss / k if k > 1 and count is None else loss)

    def _forward(self, inputs: Any, count: float | None) -> Any:
        """The wrapped model's forward of a micro-batch; under --loss-normalisation global, to a model whose own loss
        takes the step's count (Workload.num_items_kwarg: transformers' num_items_in_batch), that count over the ranks
        (the backend's mean over the ranks then makes the step's gradient the global batch's sum over its count)."""
        keyword = self.workload.num_items_kwarg
        if count is None or keyword is None:
            return batches.call(self.adapter.wrapped.model, inputs)
        items = torch.tensor(count / self.world_size, dtype=torch.float32, device=self.device)
        if isinstance(inputs, dict):
            return batches.call(self.adapter.wrapped.model, {**inputs, keyword: items})
        return self.adapter.wrapped.model(*(inputs if isinstance(inputs, (tuple, list)) else (inputs,)), **{keyword: items})

    def _step_count(self, y: Any) -> float:
        """The step's items over every micro-batch of every rank: this rank's counted from its targets, then summed over
        the ranks by the backend's own all-reduce (as transformers sums num_items_in_batch), before any backward."""
        loss = self.workload.loss_fn
        own = loss.items_of(y) if hasattr(loss, "items_of") else None
        local = torch.tensor([float(own if own is not None else batches.rows(y))], dtype=torch.float64,
                             device=self.device)
        self.items = float(self.adapter.all_reduce_sum(local).item())
        return self.items

    def _loss(self, output, target: Any, count: float | None) -> torch.Tensor:
        """The micro-batch's loss as the backward takes it: its own mean (the backward then divides by grad_accum), or
        with the step's `count`, its sum over items times world_size over `count` (a model whose loss took the count
        returns that itself): the backend's mean over the ranks then makes the step's gradient the global batch's sum
        over its count."""
        loss = self.workload.loss_fn
        if count is None or self.workload.num_items_kwarg is not None:
            return loss(output, target)
        total, _ = loss.sum_and_count(output, target)  # a count only the forward knows is refused before the run
        return total * (self.world_size / count)

    def _inject(self, step: int) -> None:
        """--inject-fault KIND:RANK:STEP (failure tests): at that step this rank exits 17 (crash), is killed by
        SIGKILL (kill), suspends itself with SIGSTOP (stop), or sleeps forever (hang)."""
        if not self.inject_fault or self.inject_fault == "dupdata" or self.inject_fault.startswith("ckpt-"):
            return
        kind, fault_rank, fault_step = self.inject_fault.split(":")
        if int(fault_rank) == self.rank and int(fault_step) == step:
            if kind == "crash":
                os._exit(17)
            if kind in ("kill", "stop"):
                os.kill(os.getpid(), signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
            while True:
                time.sleep(3600)


def _spin(seconds: float) -> None:
    """--inject-slowdown: keep this core busy for `seconds` (a sleep would hand the core to another rank)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass
