"""deepspeed: a DeepSpeed engine with ZeRO stage 0 (plain data parallelism).

`.grad` is the global mean when `engine.backward(loss)` returns at an accumulation boundary: after the
whole backward (no overlap) the gradients are flattened into buffers, summed and multiplied by 1/N.
`engine.step()` sets them to None, so the trainer reads them before the step. Two defaults are changed
on purpose and stated in the verdict's notes: gradient clipping (1.0 by default since 0.19.3, which
would make its parameters differ from DDP's) is set to 0.0, and nothing else scales the loss.

Mixed precision, two recipes (`--opt amp_recipe=`): `autocast` (default) is DeepSpeed's `torch_autocast` section,
float32 weights with the engine's forward under torch.autocast and, for fp16, the GradScaler the engine keeps at
stage 0; `engine` is its `bf16`/`fp16` section: the model's weights and gradients in 16 bits, all-reduced in 16
bits, an fp32 master copy of every weight stepped by the client optimizer (FP16_UnfusedOptimizer at stage 0),
fp16 with DeepSpeed's dynamic loss scaler. The checks read the master copies and their optimizer state.
"""

from __future__ import annotations

import argparse
import math
from datetime import timedelta

import torch
from torch import nn

from dpcompare.run import launch
from dpcompare.contract import Adapter, Capabilities, CommCounter, CommCounts, Note, Option, Wrapped
from dpcompare.run.precision import AMP_NAMES, ScalerState
from dpcompare.run.process_group import DIST_BACKEND, ProcessGroupMixin

WIRE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}


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
        Option("amp_recipe", str, "autocast",
               "with --amp: autocast (its torch_autocast section, float32 weights) or engine (its bf16/fp16 section: "
               "16-bit weights, gradients and all-reduce, fp32 master weights)", choices=("autocast", "engine")),
        Option("buffer_dtype", str, "keep",
               "engine recipe: keep module buffers in their own dtype (DeepSpeed's default) or cast them to the --amp "
               "dtype (its data_types.buffer_dtype; BatchNorm needs it)", choices=("keep", "amp")),
    )
    NATIVE_NAMES = {"communication_data_type": "compression", "allreduce_bucket_size": "bucket_mb",
                    "reduce_bucket_size": "bucket_mb", "wall_clock_breakdown": "instrument"}

    def setup(self, timeout_s: float) -> None:
        # Without RANK/WORLD_SIZE/MASTER_* DeepSpeed tries MPI discovery (mpi4py, a non-loopback address).
        launch.ensure_rendezvous(self.env)
        self._check_precision()
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

    def _check_precision(self) -> None:
        """Refuse, before any work, a recipe DeepSpeed cannot run here (one line, exit 2)."""
        if self.settings.options["amp_recipe"] == "engine" and self.settings.amp == "none":
            raise ValueError("--opt amp_recipe=engine selects DeepSpeed's bf16/fp16 engine: add --amp bf16 or --amp fp16")
        if self.settings.options["amp_recipe"] == "engine" and self.settings.amp == "fp16":
            from deepspeed.accelerator import get_accelerator

            accelerator = get_accelerator()
            if not accelerator.is_fp16_supported():
                raise ValueError(f"--amp fp16 --opt amp_recipe=engine: DeepSpeed's {accelerator.device_name()} "
                                 "accelerator does not support fp16 weights here (is_fp16_supported() is False); use "
                                 "--amp bf16, or the autocast recipe (--opt amp_recipe=autocast), or a CUDA device")

    def _precision_config(self, module: nn.Module) -> dict:
        amp, recipe = self.settings.amp, self.settings.options["amp_recipe"]
        if amp == "none":
            return {}
        if recipe == "autocast":
            return {"torch_autocast": {"enabled": True, "dtype": AMP_NAMES[amp]}}
        cast_buffers = self.settings.options["buffer_dtype"] == "amp"
        batchnorms = [n for n, m in module.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        if batchnorms and not cast_buffers:
            # DeepSpeed >= 0.19 casts the parameters only (buffers keep their dtype, for rotary inv_freq and the like),
            # and torch's batch_norm refuses 16-bit weights with float32 running statistics.
            raise ValueError(f"--opt amp_recipe=engine with BatchNorm ({', '.join(batchnorms[:3])}"
                             f"{' ...' if len(batchnorms) > 3 else ''}): DeepSpeed casts the weights to {AMP_NAMES[amp]} "
                             "and keeps the buffers in float32, which BatchNorm cannot mix; add --opt buffer_dtype=amp "
                             "(its data_types.buffer_dtype) or use the autocast recipe")
        types = {"data_types": {"buffer_dtype": amp}} if cast_buffers else {}
        if amp == "bf16":
            return {"bf16": {"enabled": True}, **types}
        # loss_scale 0: dynamic; the initial scale is 2^initial_scale_power (a power of two, checked by the config)
        return {"fp16": {"enabled": True, "loss_scale": 0,
                         "initial_scale_power": int(math.log2(self.settings.loss_scale or 2.0**16))}, **types}

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
            **self._precision_config(module),
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
        self._skipped = 0
        self._engine_recipe = self.settings.amp != "none" and self.settings.options["amp_recipe"] == "engine"
        scaler = getattr(engine, "torch_autocast_z0_gradscaler", None)
        if scaler is not None and self.settings.loss_scale:
            # Its torch_autocast section has no initial-scale key: the engine's own GradScaler (stage 0, fp16) is
            # replaced before its first use by the same class at the run's initial scale; every call stays DeepSpeed's.
            engine.torch_autocast_z0_gradscaler = torch.amp.GradScaler(self.device.type, init_scale=self.settings.loss_scale)
        clip = self.settings.options["gradient_clipping"]
        notes = [Note("deepspeed.gradient_clipping",
                      "deepspeed: gradient_clipping set to 0.0 (DeepSpeed >= 0.19.3 clips at 1.0 by default, which "
                      "changes the update relative to DDP and Horovod)" if not clip else
                      f"deepspeed: gradient_clipping={clip:g} (--opt): the update is clipped, unlike DDP's and Horovod's")]
        if self.settings.bucket_mb:
            notes.append(Note("knob_not_applicable",
                              "deepspeed: --bucket-mb does not apply to ZeRO stage 0 (allreduce_bucket_size is a stage "
                              "1-3 setting); all gradients go in one flattened all-reduce"))
        notes += self._precision_notes(engine, ds_optimizer)
        self.wrapped = Wrapped(engine, module, ds_optimizer, notes)
        return self.wrapped

    def _precision_notes(self, engine, ds_optimizer) -> list[Note]:
        amp = self.settings.amp
        if amp == "none":
            return []
        if not self._engine_recipe:
            scaled = " with the engine's own GradScaler (dynamic loss scale)" if amp == "fp16" else ""
            return [Note("deepspeed.amp_recipe", f"deepspeed: autocast recipe (torch_autocast section, {AMP_NAMES[amp]}): "
                                                 f"float32 weights, the engine's forward under torch.autocast{scaled}")]
        wire = WIRE_NAMES.get(engine.communication_data_type, "float32")
        return [Note("deepspeed.amp_recipe",
                     f"deepspeed: engine recipe ({amp} section): {AMP_NAMES[amp]} weights and gradients, all-reduced in "
                     f"{wire}; fp32 master weights stepped by the client optimizer inside "
                     f"{type(ds_optimizer).__name__}, which takes one optimizer step on zero gradients when it is built "
                     "(initialize_optimizer_states)" + ("; dynamic loss scale" if amp == "fp16" else ""))]

    def sync(self, enabled: bool):
        return super().sync(enabled) if enabled else self.wrapped.model.no_sync()

    def backward(self, loss: torch.Tensor) -> None:
        self.wrapped.model.backward(loss)  # the engine scales the loss itself (its GradScaler or loss scaler)

    def unscale(self) -> None:
        # The autocast recipe's GradScaler: unscaled here, as DeepSpeed itself does before clipping; its step then
        # finds the gradients unscaled. The engine recipe unscales the fp32 copies inside its step: the gradients
        # are read unscaled by reduced_grads().
        scaler = self._autocast_scaler()
        if scaler is not None:
            scaler.unscale_(self.wrapped.model.optimizer)

    def step(self) -> None:
        scaler = self._autocast_scaler()
        before = scaler.get_scale() if scaler is not None else None
        self.wrapped.model.step()
        if scaler is not None and scaler.get_scale() < before:
            self._skipped += 1

    def _autocast_scaler(self):
        return getattr(self.wrapped.model, "torch_autocast_z0_gradscaler", None)

    def _engine_scale(self) -> float:
        return float(getattr(self.wrapped.model.optimizer, "loss_scale", 1.0) or 1.0)

    def scaler_state(self) -> ScalerState | None:
        if self.settings.amp != "fp16":
            return None
        scaler = self._autocast_scaler()
        if scaler is not None:
            return ScalerState(scaler.get_scale(), self._skipped, "DeepSpeed torch_autocast GradScaler (stage 0)")
        return ScalerState(self._engine_scale(), int(self.wrapped.model.skipped_steps),
                           f"DeepSpeed fp16 dynamic loss scaler ({type(self.wrapped.model.optimizer).__name__})")

    def reduced_grads(self) -> dict[str, torch.Tensor | None]:
        grads = super().reduced_grads()
        if not self._engine_recipe:
            return grads
        scale = self._engine_scale()  # a power of two: dividing is exact
        return {n: None if g is None else g.float() / scale for n, g in grads.items()}

    def master_params(self) -> dict[str, torch.Tensor]:
        named = super().master_params()
        if not self._engine_recipe:
            return named
        opt = self.wrapped.model.optimizer
        master = {id(lp): hp for lows, highs in zip(opt.fp16_groups, opt.fp32_groups) for lp, hp in zip(lows, highs)}
        return {n: master.get(id(p), p) for n, p in named.items()}

    def gradient_wire(self) -> str:
        if self._engine_recipe:
            return WIRE_NAMES.get(self.wrapped.model.communication_data_type, self.settings.compression)
        return self.settings.compression

    def amp_recipe(self) -> str:
        return "none" if self.settings.amp == "none" else self.settings.options["amp_recipe"]

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
