"""ddp: torch.nn.parallel.DistributedDataParallel over a torch.distributed process group.

`.grad` is the global mean when `loss.backward()` returns: DDP copies each gradient into a bucket
scaled by 1/N (division before the sum) and all-reduces buckets while backward still runs, so `reduce`
has nothing left to wait for. `no_sync()` accumulates locally; it must surround the forward too.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
from torch import nn

from dpcompare import launch
from dpcompare.contract import Adapter, Capabilities, Wrapped
from dpcompare.process_group import ProcessGroupMixin


class DDPAdapter(ProcessGroupMixin, Adapter):
    name = "ddp"
    capabilities = Capabilities(
        multi_process=True,
        launchers=frozenset({"python", "torchrun", "mpirun", "slurm", "deepspeed"}),
        launch_hint="torchrun --nproc_per_node=N -m dpcompare --backend ddp  (or mpirun -np N python -m dpcompare --backend ddp)",
        native_comm_counters=True,
        compressions=frozenset({"none", "fp16", "bf16"}),
        has_buckets=True,
    )

    def setup(self, timeout_s: float) -> None:
        launch.ensure_rendezvous(self.env)
        if not dist.is_initialized():
            dist.init_process_group(
                backend="nccl" if self.device.type == "cuda" else "gloo",
                rank=self.env.rank,
                world_size=self.env.world_size,
                timeout=timedelta(seconds=timeout_s),
                device_id=self.device if self.device.type == "cuda" else None,
            )

    def wrap(self, module: nn.Module, optimizer, local_batch: int, global_batch: int) -> Wrapped:
        kwargs = {}
        if self.options.get("bucket_mb"):
            kwargs["bucket_cap_mb"] = float(self.options["bucket_mb"])
        model = nn.parallel.DistributedDataParallel(
            module, device_ids=[self.device.index] if self.device.type == "cuda" else None, **kwargs
        )
        compression = self.options.get("compression", "none")
        if compression != "none":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            hook = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}[compression]
            model.register_comm_hook(dist.group.WORLD, hook)
        # Record DDP's runtime stats every iteration (default: the first 10, then every 100th).
        model._set_ddp_runtime_logging_sample_rate(1)
        notes = []
        if self.env.world_size & (self.env.world_size - 1):
            notes.append(f"ddp divides each gradient by {self.env.world_size} before summing (Horovod and DeepSpeed "
                         "divide after): not a power of two, so the backends may differ by an ulp")
        self.wrapped = Wrapped(model, module, optimizer, notes)
        return self.wrapped

    def sync(self, enabled: bool):
        assert self.wrapped is not None
        return super().sync(enabled) if enabled else self.wrapped.model.no_sync()

    def message_bytes(self, grad_bytes: int) -> tuple[int | None, str | None]:
        cap = int(float(self.options.get("bucket_mb") or 25) * 1024 * 1024)
        return min(cap, grad_bytes), None

    def comm_buffer_bytes(self, grad_bytes: int) -> int | None:
        return grad_bytes  # buckets hold a copy of every gradient (gradient_as_bucket_view=False)

    def _ddp_totals(self) -> tuple[float, float, int]:
        # avg_* are running means (ns) over iterations 1..iteration (iteration 0 is not recorded).
        data = self.wrapped.model._get_ddp_logging_data()
        n = int(data.get("iteration", 0) or 0)
        return (data.get("avg_backward_comm_time", 0) * n / 1e6,
                data.get("avg_backward_compute_comm_overlap_time", 0) * n / 1e6, n)

    def comm_counters_begin(self, workdir: str) -> None:
        self._comm_begin = self._ddp_totals()

    def comm_counters_end(self) -> dict:
        comm, overlap, n = self._ddp_totals()
        comm0, overlap0, n0 = self._comm_begin
        if n <= n0:
            return {"reason": "DDP recorded no iteration in the window"}
        return {"total_ms": comm - comm0, "overlap_ms": overlap - overlap0, "iterations": n - n0,
                "method": "DDP logging data (avg_backward_comm_time)"}
