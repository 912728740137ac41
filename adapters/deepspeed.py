"""deepspeed: a DeepSpeed engine with ZeRO stage 0 (plain data parallelism).

`.grad` is the global mean when `engine.backward(loss)` returns at an accumulation boundary: after the
whole backward (no overlap) the gradients are flattened into buffers, summed and multiplied by 1/N.
`engine.step()` sets them to None, so the trainer reads them before the step. Two defaults are changed
on purpose and stated in the verdict's notes: gradient clipping (1.0 by default since 0.19.3, which
would make its parameters differ from DDP's) is set to 0.0, and nothing else scales the loss.
"""

from __future__ import annotations

import argparse
from datetime import timedelta

import torch
from torch import nn

from dpcompare.run import launch
from dpcompare.contract import Adapter, Capabilities, CommCounter, CommCounts, Note, Option, Wrapped
from dpcompare.run.process_group import DIST_BACKEND, ProcessGroupMixin


class DeepSpeedAdapter(ProcessGroupMixin, Adapter):
    name = "deepspeed"
    capabilities = Capabilities(
        multi_process=True,
        launchers=frozenset({"python", "deepspeed", "torchrun", "mpirun", "slurm"}),
        launch_hint="deepspeed --num_gpus N --module dpcompare --backend deepspeed  (or torchrun --nproc_per_node=N -m dpcompare --backend deepspeed)",
        native_launcher="deepspeed",
        compressions=frozenset({"none", "fp16", "bf16"}),
        collective_transport="deepspeed",
    )
    OPTIONS = (
        DIST_BACKEND,
        Option("gradient_clipping", float, 0.0,
               "clip the global gradient norm at this value (0: off; DeepSpeed's own default since 0.19.3 is 1.0)"),
    )
    NATIVE_NAMES = {"communication_data_type": "compression", "allreduce_bucket_size": "bucket_mb",
                    "reduce_bucket_size": "bucket_mb", "wall_clock_breakdown": "instrument"}

    def setup(self, timeout_s: float) -> None:
        # Without RANK/WORLD_SIZE/MASTER_* DeepSpeed tries MPI discovery (mpi4py, a non-loopback address).
        launch.ensure_rendezvous(self.env)
        import logging

        import deepspeed
        from deepspeed.utils import logger

        # wall_clock_breakdown logs every step's timers at INFO; the run prints its own summary.
        logger.setLevel(logging.WARNING)
        self.deepspeed = deepspeed
        # The group first, as ddp makes it: DeepSpeed's own init binds it to cuda:LOCAL_RANK, which does not
        # exist when gloo ranks share one GPU. init_distributed then adopts the existing group.
        backend = self.init_process_group(timeout_s)
        deepspeed.init_distributed(
            dist_backend=backend,
            timeout=timedelta(seconds=timeout_s),
            rank=self.env.rank,
            world_size=self.env.world_size,
            verbose=False,
        )

    def wrap(self, module: nn.Module, optimizer, local_batch: int, global_batch: int) -> Wrapped:
        config = {
            "train_batch_size": global_batch,
            "train_micro_batch_size_per_gpu": local_batch,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": self.settings.options["gradient_clipping"],
            "zero_optimization": {"stage": 0},
            "steps_per_print": 1 << 30,
            # Its timers are the native communication counter ('bwd_allreduce'); on CUDA they synchronise,
            # so they run only when the run is instrumented.
            "wall_clock_breakdown": self.settings.instrument,
        }
        if self.settings.compression != "none":
            config["communication_data_type"] = self.settings.compression
        # DeepSpeed puts the engine on cuda:LOCAL_RANK unless told the device: several ranks sharing one GPU
        # (--opt dist_backend=gloo) would reach for a device that does not exist.
        args = argparse.Namespace(device_rank=self.device.index) if self.device.type == "cuda" else None
        engine, ds_optimizer, _, _ = self.deepspeed.initialize(args=args, model=module, optimizer=optimizer, config=config)
        timers = engine.timers

        def reset_quietly(names, normalizer=1.0, reset=True, **_):
            # engine.step() calls timers.log(), which print()s every step (no log level silences it) and
            # resets the timers; keep the reset, drop the print. The values were cached just before.
            for name in names:
                if name in timers.timers:
                    timers.timers[name].elapsed(reset=reset)

        timers.log = reset_quietly
        clip = self.settings.options["gradient_clipping"]
        notes = [Note("deepspeed.gradient_clipping",
                      "deepspeed: gradient_clipping set to 0.0 (DeepSpeed >= 0.19.3 clips at 1.0 by default, which "
                      "changes the update relative to DDP and Horovod)" if not clip else
                      f"deepspeed: gradient_clipping={clip:g} (--opt): the update is clipped, unlike DDP's and Horovod's")]
        if self.settings.bucket_mb:
            notes.append(Note("knob_not_applicable",
                              "deepspeed: --bucket-mb does not apply to ZeRO stage 0 (allreduce_bucket_size is a stage "
                              "1-3 setting); all gradients go in one flattened all-reduce"))
        self.wrapped = Wrapped(engine, module, ds_optimizer, notes)
        return self.wrapped

    def sync(self, enabled: bool):
        return super().sync(enabled) if enabled else self.wrapped.model.no_sync()

    def backward(self, loss: torch.Tensor) -> None:
        self.wrapped.model.backward(loss)

    def step(self) -> None:
        self.wrapped.model.step()

    def zero_grad(self) -> None:
        self.wrapped.model.zero_grad()

    def message_bytes(self, grad_bytes: int) -> tuple[int | None, str | None]:
        # ZeRO-0 flattens all gradients and all-reduces them after backward (allreduce_bucket_size does
        # not apply to stage 0), so one message carries the whole gradient.
        return grad_bytes, None

    def comm_buffer_bytes(self, grad_bytes: int) -> int | None:
        return grad_bytes  # the flattened copy

    def comm_counter(self) -> CommCounter:
        return _TimerCounter(self.wrapped.model)


class _TimerCounter(CommCounter):
    """DeepSpeed's wall_clock_breakdown timer bwd_allreduce_microstep: engine.step() caches each timer's value
    for the step, then logs and resets the timers. ZeRO-0 reduces after the whole backward: no overlap."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def begin(self, window) -> None:
        self._ms: list[float] = []

    def step(self) -> None:
        from deepspeed.utils.timer import BACKWARD_REDUCE_MICRO_TIMER

        self._ms.append(float(self.engine.get_wall_clock_timers().get(BACKWARD_REDUCE_MICRO_TIMER, 0.0)))

    def end(self) -> CommCounts:
        return CommCounts(method="DeepSpeed wall_clock_breakdown timer bwd_allreduce_microstep (no overlap in ZeRO-0)",
                          unit_s=1e-3, window_total=sum(self._ms))
