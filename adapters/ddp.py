"""ddp: torch.nn.parallel.DistributedDataParallel over a torch.distributed process group.

`.grad` is the global mean when `loss.backward()` returns: DDP copies each gradient into a bucket
scaled by 1/N (division before the sum) and all-reduces buckets while backward still runs, so `reduce`
has nothing left to wait for. `no_sync()` accumulates locally; it must surround the forward too. Under --compile the
wrapped module is compiled in place and DDP's reducer still all-reduces (see `compile`). find_unused_parameters is an
option (auto: from the probe before wrapping, see `_find_unused`); where it is off, a rank whose backward left a
parameter without a gradient stops the run with one line before DDP's reducer waits for it forever.
"""

from __future__ import annotations

import inspect

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
        Option("find_unused_parameters", str, "auto",
               "DDP's find_unused_parameters: true (DDP walks the autograd graph every step for parameters the loss "
               "left out), false (every parameter must get a gradient on every rank at every step), or auto (true "
               "where the probe before wrapping finds a parameter the loss leaves out, a part of the batch that leaves "
               "one out, or a forward that branches on the data)", choices=("auto", "true", "false")),
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
        s = self.settings
        find_unused, why = self._find_unused()
        self._ddp_kwargs = {"bucket_cap_mb": s.bucket_mb or DEFAULT_BUCKET_MB,
                            "find_unused_parameters": find_unused,
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
        notes = [Note("ddp.find_unused_parameters", f"ddp: find_unused_parameters={find_unused} {why}")] if why else []
        if self.env.world_size & (self.env.world_size - 1):
            notes.append(Note("division_order", f"ddp divides each gradient by {self.env.world_size} before summing "
                              "(Horovod and DeepSpeed divide after): not a power of two, so the backends may differ by an ulp"))
        self.wrapped = Wrapped(model, module, optimizer, notes)
        self._trainable = [(n, p) for n, p in module.named_parameters() if p.requires_grad] if not find_unused else []
        return self.wrapped

    def _find_unused(self) -> tuple[bool, str]:
        """find_unused_parameters, and why (empty: nothing worth a note). It costs a graph traversal every step, so auto
        turns it on only where the probe (rank 0's float64 forward/backward of the first batch, before wrapping) saw a
        reason: a parameter the loss leaves out, a part of the batch that leaves one out, or a forward that branches on
        the data (a tensor sized by its values, or a value read in the model's own code). false where the probe saw a
        parameter left out is refused: DDP would wait for its gradient forever."""
        choice, facts = self.settings.options["find_unused_parameters"], self.model_facts
        seen = [*facts.unused, *facts.left_out_by_parts]
        if choice == "false" and seen:
            why = f"{_names(facts.unused)} take no part in the loss" if facts.unused else facts.varying_use()
            raise ValueError(f"--opt find_unused_parameters=false is invalid for this model: {why}, and DDP would wait "
                             "for their gradients forever: use --opt find_unused_parameters=true (or auto)")
        if choice != "auto":
            return choice == "true", "(--opt find_unused_parameters)"
        if facts.unused:
            return True, (f"because {_names(facts.unused)} take no part in the loss (found by a float64 "
                          "forward/backward before wrapping)")
        if facts.left_out_by_parts:
            return True, f"because {facts.varying_use()}, so which parameters take part changes with the data"
        if facts.branches_on_data:
            return True, (f"because the forward branches on the data at {facts.data_reads}, so which parameters take "
                          "part can change with the data")
        if facts.data_reads:
            return False, (f"although the forward reads the data at {facts.data_reads}: every part of the first batch "
                           "used every parameter (a step that leaves one out stops the run and says so)")
        return False, ""

    def reduce(self) -> None:
        # Without find_unused_parameters DDP's reducer waits for every parameter's gradient: a rank whose backward left
        # one out would hang its peers in the all-reduce (or fail on its next forward with torch's message). Said here,
        # on the rank that left it out, in one line.
        missing = [n for n, p in self._trainable if p.grad is None]
        if missing and self.wrapped.model.require_backward_grad_sync:
            raise ValueError(f"--backend ddp: this step's forward on rank {self.env.rank} left {_names(missing)} out "
                             "of the loss (no gradient), and DDP was built with find_unused_parameters=False, so it "
                             "would wait for their gradients forever: use --opt find_unused_parameters=true")

    def compile(self) -> None:
        # The module DDP wraps has its forward compiled in place: DDP's forward stays eager and calls it inside
        # `_inside_ddp_forward`, where Dynamo hands the graph to its DDPOptimizer, which splits it at DDP's bucket
        # boundaries so each bucket's all-reduce can start while the backward of the earlier pieces runs. The same as
        # torch.compile(ddp_model) for a model whose forward is user code; for one whose forward is torch's own
        # (nn.Sequential) torch.compile(ddp_model) compiles nothing at all (Dynamo skips that frame; measured on torch
        # 2.13). The ablation's unsynced arm (no_sync) calls the same module, so it runs the same compiled code.
        super().compile()
        self.wrapped.notes.append(Note("compile", "ddp: the wrapped module's forward compiled in place, called by DDP's "
                                       "forward: Dynamo's DDPOptimizer splits its graph at DDP's bucket boundaries "
                                       f"({self.settings.bucket_mb or DEFAULT_BUCKET_MB:g} MiB, the first 1 MiB)"))

    def sync(self, enabled: bool):
        # The ablation's unsynced arm is this one wrapper under no_sync (the default comm_off), as Horovod, FSDP and
        # ZeRO-0/1 ablate: a second DDP over the same module would share its parameters' autograd hooks with this one.
        assert self.wrapped is not None
        self._unsynced_backward = not enabled
        return super().sync(enabled) if enabled else self.wrapped.model.no_sync()

    def zero_grad(self) -> None:
        # With find_unused_parameters DDP counts a parameter used in a no_sync backward as used until the next synced
        # backward, and there expects its gradient (gradients accumulate across no_sync). The ablation's unsynced arm
        # drops its gradients: set to None they would fail that backward ("Encountered gradient which is undefined, but
        # still allreduced by DDP reducer"); zeroed, their values are dropped and the gradients kept.
        if getattr(self, "_unsynced_backward", False) and self._ddp_kwargs["find_unused_parameters"]:
            self.wrapped.optimizer.zero_grad(set_to_none=False)
        else:
            super().zero_grad()
        self._unsynced_backward = False

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


def _names(names: list[str] | tuple[str, ...], shown: int = 4) -> str:
    """Parameter names for a line: the first few, then how many more."""
    more = len(names) - shown
    return ", ".join(names[:shown]) + (f" and {more} more" if more > 0 else "")


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
