"""What the backends built on a torch.distributed process group (ddp, deepspeed, fsdp) do alike; public as
`dpcompare.ProcessGroupMixin` for a third-party backend.

Owns: global BatchNorm over the default group (torch's SyncBatchNorm on CUDA; dpcompare's CPU-capable one
elsewhere), the control-plane gather and the teardown. A mixin for adapters, not an adapter: adapters do
not inherit from one another.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dpcompare.contract import Option
from dpcompare.contract import syncbn

DIST_BACKEND = Option("dist_backend", str, "auto",
                      "process-group backend: auto (NCCL on CUDA, gloo on CPU), nccl, or gloo (gloo also carries "
                      "CUDA tensors, through host memory: the way to run several ranks on one GPU)",
                      choices=("auto", "nccl", "gloo"))


class ProcessGroupMixin:
    device: Any
    env: Any
    settings: Any

    def dist_backend(self) -> str:
        """The process-group backend for --opt dist_backend; refuses what NCCL or the device cannot do."""
        choice = self.settings.options.get("dist_backend", "auto")
        if self.device.type != "cuda":
            if choice == "nccl":
                raise ValueError(f"--opt dist_backend=nccl needs CUDA tensors, but this rank runs on {self.device}: "
                                 "use --device cuda, or --opt dist_backend=gloo")
            return "gloo"
        if choice == "gloo":
            return "gloo"
        devices = torch.cuda.device_count()
        if self.env.local_world_size > devices:
            raise ValueError(
                f"{self.env.local_world_size} ranks on this node share {devices} CUDA device(s), and NCCL refuses two "
                f"ranks on one device: use --opt dist_backend=gloo (CUDA tensors reduced through host memory), or at "
                f"most {devices} rank(s) per node")
        return "nccl"

    def init_process_group(self, timeout_s: float) -> str:
        """The default process group, bound to this rank's device only under NCCL (gloo ranks may share a GPU);
        returns its backend."""
        if dist.is_initialized():
            return dist.get_backend()
        backend = self.dist_backend()
        dist.init_process_group(backend=backend, rank=self.env.rank, world_size=self.env.world_size,
                                timeout=timedelta(seconds=timeout_s),
                                device_id=self.device if backend == "nccl" else None)
        return backend

    def sync_batchnorm(self, module: nn.Module) -> nn.Module:
        if self.device.type == "cuda":
            return nn.SyncBatchNorm.convert_sync_batchnorm(module)
        # torch's SyncBatchNorm refuses CPU tensors: use the differentiable all-reduce of torch.distributed.
        return syncbn.convert_global_batchnorm(module, self.allreduce_sum_autograd())

    def allreduce_sum_autograd(self):
        return syncbn.process_group_allreduce_sum()

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out

    def all_gather_object(self, obj: Any) -> list[Any]:
        out = [None] * self.env.world_size
        dist.all_gather_object(out, obj)
        return out

    def teardown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
