"""What the backends built on a torch.distributed process group (ddp, deepspeed) do alike.

Owns: global BatchNorm over the default group (torch's SyncBatchNorm on CUDA; dpcompare's CPU-capable one
elsewhere), the control-plane gather and the teardown. A mixin for adapters, not an adapter: adapters do
not inherit from one another.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn

from dpcompare.run import syncbn


class ProcessGroupMixin:
    device: Any
    env: Any

    def sync_batchnorm(self, module: nn.Module) -> nn.Module:
        if self.device.type == "cuda":
            return nn.SyncBatchNorm.convert_sync_batchnorm(module)
        # torch's SyncBatchNorm refuses CPU tensors: use the differentiable all-reduce of torch.distributed.
        return syncbn.convert(module, self.allreduce_sum_autograd())

    def allreduce_sum_autograd(self):
        return syncbn.process_group_allreduce_sum()

    def all_gather_object(self, obj: Any) -> list[Any]:
        out = [None] * self.env.world_size
        dist.all_gather_object(out, obj)
        return out

    def teardown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
