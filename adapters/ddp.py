"""ddp: torch.nn.parallel.DistributedDataParallel over a torch.distributed process group.

`.grad` is the global mean when `loss.backward()` returns: DDP copies each gradient into a bucket
scaled by 1/N (division before the sum) and all-reduces buckets while backward still runs, so `reduce`
has nothing left to wait for. `no_sync()` accumulates locally; it must surround the forward too.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta

import torch.distributed as dist
from torch import nn

from dpcompare.run import launch
from dpcompare.contract import Adapter, Capabilities, Wrapped
from dpcompare.run.process_group import ProcessGroupMixin


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
        # find_unused_parameters costs a graph traversal every step: on only when the model needs it.
        self._ddp_kwargs = {"bucket_cap_mb": float(self.options.get("bucket_mb") or 25),
                            "find_unused_parameters": bool(self.model_facts.unused),
                            "device_ids": [self.device.index] if self.device.type == "cuda" else None}
        model = nn.parallel.DistributedDataParallel(module, **self._ddp_kwargs)
        compression = self.options.get("compression", "none")
        if compression != "none":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            hook = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}[compression]
            model.register_comm_hook(dist.group.WORLD, hook)
        # Record DDP's runtime stats every iteration (default: the first 10, then every 100th).
        model._set_ddp_runtime_logging_sample_rate(1)
        notes = []
        if self.model_facts.unused:
            notes.append(f"ddp: find_unused_parameters=True because {', '.join(self.model_facts.unused)} take no part "
                         "in the loss (found by a float64 forward/backward before wrapping)")
        if self.env.world_size & (self.env.world_size - 1):
            notes.append(f"ddp divides each gradient by {self.env.world_size} before summing (Horovod and DeepSpeed "
                         "divide after): not a power of two, so the backends may differ by an ulp")
        self.wrapped = Wrapped(model, module, optimizer, notes)
        self._noop_twin = None
        return self.wrapped

    @contextlib.contextmanager
    def comm_off(self):
        # no_sync would also skip the bucket copies and autograd hooks that a synced step pays; a twin
        # DDP over the same module with noop_hook keeps all of that and drops only the all-reduce
        # (PyTorch documents noop_hook for this headroom analysis). A twin, because a DDP instance takes
        # one comm hook for life and the measured DDP must keep its built-in path.
        if self._noop_twin is None:
            from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook

            self._noop_twin = nn.parallel.DistributedDataParallel(self.wrapped.module, **self._ddp_kwargs)
            self._noop_twin.register_comm_hook(None, noop_hook)
        measured, self.wrapped.model = self.wrapped.model, self._noop_twin
        try:
            yield
        finally:
            self.wrapped.model = measured

    def sync(self, enabled: bool):
        assert self.wrapped is not None
        return super().sync(enabled) if enabled else self.wrapped.model.no_sync()

    def message_bytes(self, grad_bytes: int) -> tuple[int | None, str | None]:
        # The buckets DDP really built (after its first iteration), else what the cap implies.
        sizes = str(self.wrapped.model._get_ddp_logging_data().get("rebuilt_bucket_sizes", "")).split(",")
        sizes = [int(s) for s in sizes if s.strip().isdigit()]
        if sizes:
            return sum(sizes) // len(sizes), None
        cap = int(float(self.options.get("bucket_mb") or 25) * 1024 * 1024)
        return min(cap, grad_bytes), None

    def comm_buffer_bytes(self, grad_bytes: int) -> int | None:
        return grad_bytes  # buckets hold a copy of every gradient (gradient_as_bucket_view=False)

    def comm_counters_begin(self, workdir: str) -> None:
        self._last_iteration = int(self.wrapped.model._get_ddp_logging_data().get("iteration", 0) or 0)
        self._comm_ns: list[int] = []
        self._overlap_ns: list[int] = []

    def comm_counters_step(self) -> None:
        # The logging data holds the latest recorded iteration (sample rate 1: every one), in ns:
        # backward_comm_time = first bucket ready -> last all-reduce done; the overlap part ends where
        # backward compute ends, so comm - overlap is the wait DDP leaves at the end of backward.
        data = self.wrapped.model._get_ddp_logging_data()
        iteration = int(data.get("iteration", 0) or 0)
        if iteration > self._last_iteration:
            self._last_iteration = iteration
            self._comm_ns.append(int(data.get("backward_comm_time", 0)))
            self._overlap_ns.append(int(data.get("backward_compute_comm_overlap_time", 0)))

    def comm_counters_end(self) -> dict:
        if not self._comm_ns:
            return {"reason": "DDP recorded no iteration in the window"}
        return {"total_ms": sum(self._comm_ns) / 1e6, "overlap_ms": sum(self._overlap_ns) / 1e6,
                "per_step_total_ms": [t / 1e6 for t in self._comm_ns],
                "per_step_overlap_ms": [t / 1e6 for t in self._overlap_ns],
                "method": "DDP logging data (backward_comm_time per iteration)"}
