"""ddp: torch.nn.parallel.DistributedDataParallel over a torch.distributed process group.

`.grad` is the global mean when `loss.backward()` returns: DDP copies each gradient into a bucket
scaled by 1/N (division before the sum) and all-reduces buckets while backward still runs, so `reduce`
has nothing left to wait for. `no_sync()` accumulates locally; it must surround the forward too. Under --compile the
wrapped module is compiled in place and DDP's reducer still all-reduces (see `compile`).
"""

from __future__ import annotations

import contextlib
import inspect

import torch
import torch.distributed as dist
from torch import nn

from dpcompare import (DIST_BACKEND, Adapter, Capabilities, CommCounter, CommCounts, Note, Option, ProcessGroupMixin, Wrapped,
                       ensure_rendezvous)


DEFAULT_BUCKET_MB = 25.0
"""DDP's own default bucket_cap_mb."""
FIRST_BUCKET_MB = 1.0
"""DDP's first bucket (torch.distributed's _DEFAULT_FIRST_BUCKET_BYTES), made small to start communicating early."""


def _buffer_sync(every_forward: bool) -> dict[str, bool]:
    """DDP's keyword for syncing buffers every forward: `forward_sync_buffers` where DDP has it (torch 2.13
    deprecates `broadcast_buffers` with a FutureWarning on every construction), else `broadcast_buffers`.
    The new keyword still syncs buffers once at construction; every rank builds them from the same seed, so
    that sync changes nothing here."""
    if "forward_sync_buffers" in inspect.signature(nn.parallel.DistributedDataParallel).parameters:
        return {"forward_sync_buffers": every_forward}
    return {"broadcast_buffers": every_forward}


class DDPAdapter(ProcessGroupMixin, Adapter):
    name = "ddp"
    capabilities = Capabilities(
        multi_process=True,
        launchers=frozenset({"python", "torchrun", "mpirun", "slurm", "deepspeed"}),
        launch_hint="torchrun --nproc_per_node=N -m dpcompare --backend ddp  (or mpirun -np N python -m dpcompare --backend ddp)",
        native_launcher="torchrun",
        compressions=frozenset({"none", "fp16", "bf16"}),
        has_buckets=True,
        compiles=True,
    )
    OPTIONS = (
        DIST_BACKEND,
        Option("gradient_as_bucket_view", bool, False,
               "gradients are views into the all-reduce buckets: one copy of the gradients less in memory"),
        Option("broadcast_buffers", bool, True, "broadcast rank 0's module buffers (BatchNorm statistics) every forward"),
    )
    NATIVE_NAMES = {"bucket_cap_mb": "bucket_mb", "comm_hook": "compression", "device_ids": "device"}

    def __init__(self, env, device, settings=None) -> None:
        super().__init__(env, device, settings)
        if self.settings.compile and self.settings.bucket_mb is not None and self.settings.bucket_mb < FIRST_BUCKET_MB:
            # Dynamo's DDPOptimizer asserts that DDP's first bucket (1 MiB) is no larger than the others.
            raise ValueError(f"--bucket-mb={self.settings.bucket_mb:g} is invalid with --compile on --backend ddp: "
                             f"Dynamo's DDPOptimizer needs buckets of at least DDP's first bucket, {FIRST_BUCKET_MB:g} "
                             "MiB; use --bucket-mb 1 or more, or leave --compile out")

    def setup(self, timeout_s: float) -> None:
        ensure_rendezvous(self.env)
        self.init_process_group(timeout_s)

    def wrap(self, module: nn.Module, optimizer, local_batch: int, global_batch: int) -> Wrapped:
        # find_unused_parameters costs a graph traversal every step: on only when the model needs it.
        s = self.settings
        self._ddp_kwargs = {"bucket_cap_mb": s.bucket_mb or DEFAULT_BUCKET_MB,
                            "find_unused_parameters": bool(self.model_facts.unused),
                            "gradient_as_bucket_view": s.options["gradient_as_bucket_view"],
                            "device_ids": [self.device.index] if self.device.type == "cuda" else None,
                            **_buffer_sync(s.options["broadcast_buffers"])}
        model = nn.parallel.DistributedDataParallel(module, **self._ddp_kwargs)
        compression = s.compression
        if compression != "none":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            hook = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}[compression]
            model.register_comm_hook(dist.group.WORLD, hook)
        if s.instrument:
            # Record DDP's runtime stats every iteration (default: the first 10, then every 100th).
            model._set_ddp_runtime_logging_sample_rate(1)
        notes = []
        if self.model_facts.unused:
            notes.append(Note("ddp.find_unused_parameters",
                              f"ddp: find_unused_parameters=True because {', '.join(self.model_facts.unused)} take no "
                              "part in the loss (found by a float64 forward/backward before wrapping)"))
        if self.env.world_size & (self.env.world_size - 1):
            notes.append(Note("division_order", f"ddp divides each gradient by {self.env.world_size} before summing "
                              "(Horovod and DeepSpeed divide after): not a power of two, so the backends may differ by an ulp"))
        self.wrapped = Wrapped(model, module, optimizer, notes)
        self._noop_twin, self._twin_bytes = None, 0
        return self.wrapped

    @contextlib.contextmanager
    def comm_off(self):
        # no_sync would also skip the bucket copies and autograd hooks that a synced step pays; a twin
        # DDP over the same module with noop_hook keeps all of that and drops only the all-reduce
        # (PyTorch documents noop_hook for this headroom analysis). A twin, because a DDP instance takes
        # one comm hook for life and the measured DDP must keep its built-in path.
        if self._noop_twin is None:
            from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook

            before = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
            self._noop_twin = nn.parallel.DistributedDataParallel(self.wrapped.module, **self._ddp_kwargs)
            self._noop_twin.register_comm_hook(None, noop_hook)
            # The twin's buckets: allocated on the GPU now; on the CPU resident once its first backward writes them.
            self._twin_bytes = (torch.cuda.memory_allocated(self.device) - before if self.device.type == "cuda" else
                                sum(p.numel() * p.element_size() for p in self.wrapped.module.parameters()
                                    if p.requires_grad))
        measured, self.wrapped.model = self.wrapped.model, self._noop_twin
        try:
            yield
        finally:
            self.wrapped.model = measured

    def compile(self) -> None:
        # The module DDP wraps has its forward compiled in place: DDP's forward stays eager and calls it inside
        # `_inside_ddp_forward`, where Dynamo hands the graph to its DDPOptimizer, which splits it at DDP's bucket
        # boundaries so each bucket's all-reduce can start while the backward of the earlier pieces runs. The same as
        # torch.compile(ddp_model) for a model whose forward is user code; for one whose forward is torch's own
        # (nn.Sequential) torch.compile(ddp_model) compiles nothing at all (Dynamo skips that frame; measured on torch
        # 2.13). The ablation's no-op twin calls the same module, so its unsynced arm runs the same compiled code.
        super().compile()
        self.wrapped.notes.append(Note("compile", "ddp: the wrapped module's forward compiled in place, called by DDP's "
                                       "forward: Dynamo's DDPOptimizer splits its graph at DDP's bucket boundaries "
                                       f"({self.settings.bucket_mb or DEFAULT_BUCKET_MB:g} MiB, the first 1 MiB)"))

    def ablation_bytes(self) -> int:
        return self._twin_bytes  # 0 until comm_off() has built the twin

    def sync(self, enabled: bool):
        assert self.wrapped is not None
        return super().sync(enabled) if enabled else self.wrapped.model.no_sync()

    def message_bytes(self, grad_bytes: int) -> tuple[int | None, str | None]:
        # The buckets DDP really built (after its first iteration), else what the cap implies.
        sizes = str(self.wrapped.model._get_ddp_logging_data().get("rebuilt_bucket_sizes", "")).split(",")
        sizes = [int(s) for s in sizes if s.strip().isdigit()]
        if sizes:
            return sum(sizes) // len(sizes), None
        cap = int((self.settings.bucket_mb or DEFAULT_BUCKET_MB) * 1024 * 1024)
        return min(cap, grad_bytes), None

    def comm_buffer_bytes(self, grad_bytes: int) -> int | None:
        # Buckets hold a copy of every gradient, unless the gradients are views into them.
        return 0 if self.settings.options["gradient_as_bucket_view"] else grad_bytes

    def comm_counter(self) -> CommCounter:
        return _LoggingDataCounter(self.wrapped.model)


class _LoggingDataCounter(CommCounter):
    """DDP's logging data holds the latest recorded iteration (sample rate 1: every one), in ns:
    backward_comm_time = first bucket ready -> last all-reduce done; the overlap part ends where backward
    compute ends, so comm - overlap is the wait DDP leaves at the end of backward."""

    def __init__(self, model: nn.parallel.DistributedDataParallel) -> None:
        self.model = model

    def begin(self, window) -> None:
        self._last = int(self._ints().get("iteration", 0) or 0)
        self._comm: list[int] = []
        self._overlap: list[int] = []

    def _ints(self) -> dict:
        # DDP's own `_get_ddp_logging_data()` merges the string map (module names, bucket sizes) into the integer
        # one on every call, ~18 us a step here; the integers alone, straight from its logger, cost ~5 us.
        logger = getattr(self.model, "logger", None)
        return logger._get_ddp_logging_data().ints_map if logger is not None else self.model._get_ddp_logging_data()

    def step(self) -> None:
        data = self._ints()
        iteration = int(data.get("iteration", 0) or 0)
        if iteration > self._last:
            self._last = iteration
            self._comm.append(int(data.get("backward_comm_time", 0)))
            self._overlap.append(int(data.get("backward_compute_comm_overlap_time", 0)))

    def end(self) -> CommCounts:
        if not self._comm:
            return CommCounts(reason="DDP recorded no iteration in the window")
        return CommCounts(method="DDP logging data (backward_comm_time per iteration)", unit_s=1e-9,
                          per_step_total=tuple(self._comm), per_step_overlap=tuple(self._overlap))
