"""dp: torch.nn.DataParallel, one process replicating the module over the visible CUDA devices.

Every forward scatters the batch over `device_ids`, replicates the module, and the replicas' gradients
are summed onto device 0 through autograd; the loss is taken on the gathered output, so `.grad` is the
global-batch gradient when `loss.backward()` returns. With no CUDA device DataParallel is a pass-through:
the run is the reference run, and says so instead of claiming a speed-up.
"""

from __future__ import annotations

import torch
from torch import nn

from dpcompare.contract import Adapter, Capabilities, Wrapped


class _CountingDataParallel(nn.DataParallel):
    """DataParallel whose scatter, replicate and gather (its communication in the forward pass) are
    bracketed by CUDA events while counting; the events are resolved once, after the measured window."""

    counting = False

    def _timed(self, fn, *args, **kwargs):
        if not self.counting:
            return fn(*args, **kwargs)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn(*args, **kwargs)
        end.record()
        self.events.append((start, end))
        return out

    def scatter(self, *args, **kwargs):
        return self._timed(super().scatter, *args, **kwargs)

    def replicate(self, *args, **kwargs):
        return self._timed(super().replicate, *args, **kwargs)

    def gather(self, *args, **kwargs):
        return self._timed(super().gather, *args, **kwargs)


class DataParallelAdapter(Adapter):
    name = "dp"
    capabilities = Capabilities(
        multi_process=False,
        launchers=frozenset({"python"}),
        launch_hint="python -m dpcompare --backend dp  (one process drives all local GPUs)",
        can_disable_sync=False,
    )

    def wrap(self, module: nn.Module, optimizer, local_batch: int, global_batch: int) -> Wrapped:
        notes = []
        if self.device.type == "cuda":
            count = int(self.options.get("dp_devices") or torch.cuda.device_count())
            device_ids = list(range(count))
            if global_batch < count:
                raise ValueError(f"--global-batch={global_batch} is smaller than the {count} DataParallel devices: "
                                 f"use at least {count} samples")
            model = _CountingDataParallel(module, device_ids=device_ids, output_device=device_ids[0])
            if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules()) and count > 1:
                notes.append("dp: BatchNorm statistics are per replica and only device 0's running buffers survive")
            notes.append(f"dp: replicating over {count} CUDA device(s)")
        else:
            model = nn.DataParallel(module)
            notes.append("dp: no CUDA device, so DataParallel is a pass-through (no parallelism on CPU): "
                         "this run is the reference computation, not a speed-up")
        self.wrapped = Wrapped(model, module, optimizer, notes)
        return self.wrapped

    def no_communication_reason(self) -> str | None:
        if self.device.type != "cuda":
            return "DataParallel without CUDA devices is a pass-through: no communication"
        if len(self.wrapped.model.device_ids) < 2:
            return "DataParallel on one device: no communication"
        # Scatter/replicate/gather are inside forward and backward: no switch turns them off alone.
        return None

    def comm_counters_begin(self, workdir: str) -> None:
        self.wrapped.model.events = []
        self.wrapped.model.counting = True

    def comm_counters_end(self) -> dict:
        model = self.wrapped.model
        model.counting = False
        torch.cuda.synchronize()
        return {"total_ms": sum(a.elapsed_time(b) for a, b in model.events), "overlap_ms": None,
                "method": "CUDA events around DataParallel scatter/replicate/gather (the gradient sum onto "
                          "device 0 runs inside autograd and is not included)"}

    def rng_replay_reason(self) -> str | None:
        if self.device.type == "cuda" and len(self.wrapped.model.device_ids) > 1:
            return "DataParallel's replicas draw their random numbers on their own devices, which one rank's state does not hold"
        return None

    def comm_buffer_bytes(self, grad_bytes: int) -> int | None:
        if self.device.type != "cuda":
            return 0
        return grad_bytes * (len(self.wrapped.model.device_ids) - 1)  # replicas' weights on other devices
