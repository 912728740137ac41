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
            model = nn.DataParallel(module, device_ids=device_ids, output_device=device_ids[0])
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

    def comm_buffer_bytes(self, grad_bytes: int) -> int | None:
        if self.device.type != "cuda":
            return 0
        return grad_bytes * (len(self.wrapped.model.device_ids) - 1)  # replicas' weights on other devices
