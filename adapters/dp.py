"""dp: torch.nn.DataParallel, one process replicating the module over the visible CUDA devices.

Every forward scatters the batch over `device_ids`, replicates the module, and the replicas' gradients
are summed onto device 0 through autograd; the loss is taken on the gathered output, so `.grad` is the
global-batch gradient when `loss.backward()` returns. With no CUDA device DataParallel is a pass-through:
the run is the reference run, and says so instead of claiming a speed-up.
"""

from __future__ import annotations

import torch
from torch import nn

import contextlib

from dpcompare import Adapter, Capabilities, CommCounter, CommCounts, Note, Wrapped


class _CountingDataParallel(nn.DataParallel):
    """DataParallel whose scatter, replicate and gather (its communication in the forward pass) run inside
    `interval()` while a measurement window counts them (measurement owns the clock)."""

    interval = None

    def _bracketed(self, fn, *args, **kwargs):
        with self.interval() if self.interval is not None else contextlib.nullcontext():
            return fn(*args, **kwargs)

    def scatter(self, *args, **kwargs):
        return self._bracketed(super().scatter, *args, **kwargs)

    def replicate(self, *args, **kwargs):
        return self._bracketed(super().replicate, *args, **kwargs)

    def gather(self, *args, **kwargs):
        return self._bracketed(super().gather, *args, **kwargs)


class _IntervalCounter(CommCounter):
    def __init__(self, model: _CountingDataParallel) -> None:
        self.model = model

    def begin(self, window) -> None:
        self.model.interval = window.interval

    def end(self) -> CommCounts:
        self.model.interval = None
        return CommCounts(method="scatter/replicate/gather of DataParallel, timed by the window's clock (the gradient "
                                 "sum onto device 0 runs inside autograd and is not included)", timed_intervals=True)


class DataParallelAdapter(Adapter):
    name = "dp"
    capabilities = Capabilities(
        multi_process=False,
        launchers=frozenset({"python"}),
        launch_hint="python -m dpcompare --backend dp  (one process drives all local GPUs)",
        can_disable_sync=False,
        device_replicas=True,
        compile_refusal="dp offers no compiled path: without CUDA nn.DataParallel is a pass-through (--backend "
                        "reference --compile is that run), and its replicate and scatter over several GPUs on every "
                        "forward have not been checked under torch.compile",
    )
    NATIVE_NAMES = {"device_ids": "dp_devices"}

    def wrap(self, module: nn.Module, optimizer, local_batch: int, global_batch: int) -> Wrapped:
        notes = []
        if self.device.type == "cuda":
            count = self.settings.dp_devices or torch.cuda.device_count()
            if count > torch.cuda.device_count():
                raise ValueError(f"--dp-devices={count} is more than the {torch.cuda.device_count()} visible CUDA "
                                 f"devices: use at most {torch.cuda.device_count()}")
            device_ids = list(range(count))
            if global_batch < count:
                raise ValueError(f"--global-batch={global_batch} is smaller than the {count} DataParallel devices: "
                                 f"use at least {count} samples")
            model = _CountingDataParallel(module, device_ids=device_ids, output_device=device_ids[0])
            if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules()) and count > 1:
                notes.append(Note("dp.batchnorm_per_replica",
                                  "dp: BatchNorm statistics are per replica and only device 0's running buffers survive"))
            notes.append(Note("dp.replicas", f"dp: replicating over {count} CUDA device(s)"))
        else:
            model = nn.DataParallel(module)
            notes.append(Note("no_parallelism", "dp: no CUDA device, so DataParallel is a pass-through (no parallelism "
                              "on CPU): this run is the reference computation, not a speed-up"))
        self.wrapped = Wrapped(model, module, optimizer, notes)
        return self.wrapped

    def no_communication_reason(self) -> str | None:
        if self.device.type != "cuda":
            return "DataParallel without CUDA devices is a pass-through: no communication"
        if len(self.wrapped.model.device_ids) < 2:
            return "DataParallel on one device: no communication"
        # Scatter/replicate/gather are inside forward and backward: no switch turns them off alone.
        return None

    def comm_counter(self) -> CommCounter | None:
        return _IntervalCounter(self.wrapped.model) if isinstance(self.wrapped.model, _CountingDataParallel) else None

    def replicas_per_process(self) -> int:
        # Each replica normalises (BatchNorm) and draws dropout masks on its own part of the micro-batch; the
        # masks are captured per device, and the oracle splits the micro-batch as DataParallel's scatter does.
        if self.device.type == "cuda" and isinstance(self.wrapped.model, _CountingDataParallel):
            return len(self.wrapped.model.device_ids)
        return 1

    def comm_buffer_bytes(self, grad_bytes: int) -> int | None:
        if self.device.type != "cuda":
            return 0
        return grad_bytes * (len(self.wrapped.model.device_ids) - 1)  # replicas' weights on other devices
