"""horovod: horovod.torch's DistributedOptimizer (gloo or MPI controller).

Gradient hooks start an asynchronous all-reduce per tensor during backward (tensor fusion batches them:
128 MiB buffer, 1 ms cycle, so the summation grouping can vary step to step); `.grad` is the global mean
only after `optimizer.synchronize()` (op=Average: sum, then x 1/N). The step then runs inside
`skip_synchronize()` so it does not reduce twice. Under --amp fp16, Horovod's documented AMP order: the scaled
loss's backward, `synchronize()`, `scaler.unscale_(optimizer)`, then `scaler.step(optimizer)` inside
`skip_synchronize()` and `scaler.update()`.
"""

from __future__ import annotations

import contextlib
import os
import types

import torch
from torch import nn

from dpcompare import Adapter, Capabilities, CommCounter, CommCounts, Note, Option, Wrapped, convert_global_batchnorm


class HorovodAdapter(Adapter):
    name = "horovod"
    capabilities = Capabilities(
        multi_process=True,
        launchers=frozenset({"python", "horovodrun", "mpirun", "slurm"}),
        launch_hint="horovodrun -np N -H localhost:N python -m dpcompare --backend horovod  (or mpirun -np N python -m dpcompare --backend horovod)",
        native_launcher="horovodrun",
        compressions=frozenset({"none", "fp16"}),
        has_buckets=True,
        collective_transport="horovod",
        compiles=True,
    )
    OPTIONS = (
        Option("timeline", str, "auto",
               "Horovod's timeline as the native communication counter when instrumented: on, off, or auto (on where "
               "the host has two cores per local rank; its writer thread spins on a core from hvd.init to the end)",
               choices=("auto", "on", "off")),
        Option("broadcast_optimizer_state", bool, False,
               "call hvd.broadcast_optimizer_state after wrapping, as Horovod's examples do (it runs a real step() "
               "on zero gradients: horovod/horovod#3743)"),
    )
    NATIVE_NAMES = {"fusion_threshold": "bucket_mb", "HOROVOD_FUSION_THRESHOLD": "bucket_mb",
                    "HOROVOD_TIMELINE": "instrument"}

    @classmethod
    def shared_device_refusal(cls) -> str:
        return ("Horovod cannot put two ranks on one GPU: built with NCCL it reduces CUDA tensors over NCCL, which "
                "refuses two ranks on one device (ncclCommInitRank: invalid usage; Horovod 0.28.1, NCCL 2.28.9, one "
                "H200), and it has no other transport for them; run at most one rank per GPU, or --device cpu")

    def setup(self, timeout_s: float) -> None:
        import horovod.torch as hvd

        # Before hvd.init: NCCL would fail in every rank at the first collective, with a line naming NCCL only.
        if self.device.type == "cuda" and self.env.local_world_size > torch.cuda.device_count() and hvd.nccl_built():
            raise ValueError(self.shared_device_refusal())
        # Horovod's own stall detector ends a job whose ranks stop submitting the same tensors. It checks every
        # HOROVOD_STALL_CHECK_TIME_SECONDS (60) and switches the shutdown off, with a warning on every run, when
        # the shutdown time is below that: check at half the timeout so a short --timeout-s keeps it on.
        os.environ.setdefault("HOROVOD_STALL_CHECK_TIME_SECONDS", str(max(1, min(60, int(timeout_s) // 2))))
        os.environ.setdefault("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", str(int(timeout_s)))
        os.environ.setdefault("HOROVOD_GLOO_TIMEOUT_SECONDS", str(int(timeout_s)))
        self._timeline_off = timeline_off_reason(self.settings.options["timeline"], self.settings.instrument,
                                                 usable_cores(), self.env.local_world_size, self.env.world_size)
        if self.settings.instrument and self._timeline_off is None:
            # The timeline can then be started and stopped around the measured window (hvd.start_timeline).
            os.environ.setdefault("HOROVOD_TIMELINE", "DYNAMIC")
        if self.settings.bucket_mb:
            os.environ["HOROVOD_FUSION_THRESHOLD"] = str(int(self.settings.bucket_mb * 1024 * 1024))
        hvd.init()
        # hvd.init() with no launcher silently runs as size 1: a run that thinks it is distributed is not.
        if hvd.size() != self.env.world_size or hvd.rank() != self.env.rank:
            raise RuntimeError(
                f"Horovod sees rank {hvd.rank()} of {hvd.size()} but {self.env.launcher} started rank "
                f"{self.env.rank} of {self.env.world_size}: start it with horovodrun -np N or mpirun -np N"
            )
        self.hvd = hvd
        self._sync_enabled = True

    def sync_batchnorm(self, module: nn.Module) -> nn.Module:
        return convert_global_batchnorm(module, self.allreduce_sum_autograd())

    def allreduce_sum_autograd(self):
        return lambda t: self.hvd.allreduce(t, op=self.hvd.Sum)

    def wrap(self, module: nn.Module, optimizer, local_batch: int, global_batch: int) -> Wrapped:
        hvd = self.hvd
        state = module.state_dict()
        if bools := [k for k, t in state.items() if t.dtype == torch.bool]:  # refused alike on every rank
            raise ValueError(f"--backend horovod: the model holds bool tensors ({', '.join(bools)}) and Horovod cannot "
                             "broadcast one (hvd.broadcast_parameters: 'Tensor type torch.BoolTensor is not "
                             "supported'); hold them as torch.uint8, or use another backend")
        hvd.broadcast_parameters(state, root_rank=0)
        compression = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16}[self.settings.compression]
        dist_opt = hvd.DistributedOptimizer(
            optimizer, named_parameters=module.named_parameters(), op=hvd.Average, compression=compression
        )
        notes = []
        if self.settings.options["broadcast_optimizer_state"]:
            # Horovod's documented order: wrap first, then broadcast the wrapped optimizer's state (the
            # DistributedOptimizer starts with a state of its own, so a broadcast before wrapping is lost).
            hvd.broadcast_optimizer_state(dist_opt, root_rank=0)
            notes.append(Note("horovod.broadcast_optimizer_state",
                              "horovod: broadcast_optimizer_state ran on a fresh optimizer; it calls step() on zero "
                              "gradients (horovod/horovod#3743): Adam's step count and weight decay move the weights"))
        else:
            notes.append(Note("horovod.broadcast_optimizer_state_skipped",
                              "horovod: broadcast_optimizer_state skipped on the fresh optimizer (it would run a real "
                              "step() on zero gradients, horovod/horovod#3743); its state is identical on all ranks "
                              "by construction"))
        self.wrapped = Wrapped(module, module, dist_opt, notes)
        return self.wrapped

    @contextlib.contextmanager
    def sync(self, enabled: bool):
        self._sync_enabled = enabled  # reduce() after an unsynced step must not reduce behind our back
        if enabled:
            yield
            return
        # The hooks all-reduce a gradient when its countdown reaches 0; a countdown too high to reach
        # keeps this step's gradients local (what backward_passes_per_step does for accumulation).
        opt = self.wrapped.optimizer
        for p in opt._allreduce_delay:
            opt._allreduce_delay[p] = 1 << 30
        try:
            yield
        finally:
            opt._handles.clear()
            for p in opt._allreduce_delay:
                opt._allreduce_delay[p] = opt.backward_passes_per_step

    def reduce(self) -> None:
        if self._sync_enabled:
            self.wrapped.optimizer.synchronize()

    def step(self) -> None:
        with self.wrapped.optimizer.skip_synchronize():
            super().step()  # the optimizer's step, or the GradScaler's under --amp fp16

    def link_transport(self) -> str | None:
        """Horovod's own runtime: NCCL for CUDA tensors (a NCCL build), else its gloo or MPI operations."""
        import horovod.torch as hvd

        if self.env.world_size < 2:
            return None
        if self.device.type == "cuda" and hvd.nccl_built():
            return "nccl"
        return "gloo" if hvd.gloo_enabled() else "mpi"

    def message_bytes(self, grad_bytes: int) -> tuple[int | None, str | None]:
        return min(self._fusion_threshold(), grad_bytes), None

    def comm_buffer_bytes(self, grad_bytes: int) -> int | None:
        return min(self._fusion_threshold(), grad_bytes)  # the fusion buffer holds at most one cycle's tensors

    @staticmethod
    def _fusion_threshold() -> int:
        return int(os.environ.get("HOROVOD_FUSION_THRESHOLD", 128 * 1024 * 1024))

    def comm_counter(self) -> CommCounter:
        if self._timeline_off is not None:
            return _NoCounter(self._timeline_off)
        return _TimelineCounter(self.hvd, self.env.rank)

    @classmethod
    def checkpoint_formats(cls) -> tuple[str, ...]:
        return ("torch",)  # rank 0's torch.save of the full state, as Horovod's examples save

    def load_checkpoint(self, directory: str, fmt: str) -> None:
        """Every rank reads the file into its model and optimizer (torch.distributed.checkpoint's set_state_dict),
        then rank 0's state is broadcast as Horovod documents (broadcast_parameters, broadcast_optimizer_state): every
        rank holds state by then, so no broadcast steps a fresh optimizer (horovod/horovod#3743)."""
        assert self.wrapped is not None
        optimizer = self.wrapped.optimizer
        # set_state_dict sets up an empty optimizer state through zero_grad(set_to_none=...), which Horovod's
        # DistributedOptimizer.zero_grad does not take: its torch class's own serves the load.
        optimizer.zero_grad = types.MethodType(torch.optim.Optimizer.zero_grad, optimizer)
        try:
            super().load_checkpoint(directory, fmt)
        finally:
            del optimizer.zero_grad
        self.hvd.broadcast_parameters(self.wrapped.module.state_dict(), root_rank=0)
        self.hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    def all_reduce_sum(self, tensor):
        return self.hvd.allreduce(tensor, op=self.hvd.Sum, name="dpcompare.items")

    def all_gather_object(self, obj):
        # One fixed name: by default Horovod names the collective after type(obj), so ranks sending objects
        # of different types (rank 0's answer, the others' None) would wait on differently named tensors forever.
        return self.hvd.allgather_object(obj, name="dpcompare.control")

    def teardown(self) -> None:
        if getattr(self, "hvd", None) is not None:
            self.hvd.shutdown()

    def before_exit(self) -> None:
        self.teardown()  # Horovod's shutdown calls MPI_Finalize under MPI, which mpirun requires of every rank


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, which containers and mpirun narrow), else cpu_count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def timeline_off_reason(option: str, instrument: bool, cores: int, local_ranks: int, world_size: int) -> str | None:
    """Why this run keeps Horovod's timeline off, or None when it records one. Once HOROVOD_TIMELINE is set at
    hvd.init, even to DYNAMIC with no file, every rank's timeline writer thread loops without sleeping
    (horovod/common/timeline.cc, TimelineWriter::WriterLoop: std::this_thread::yield()) until shutdown; where the
    ranks have no spare core it takes a share of theirs (+31 % on Horovod's step on a 2-core host with 2 ranks,
    docs/results/2026-11-25-overhead-cpu.md). auto records it only with two cores per local rank; never in one process,
    which has no communication to record."""
    if not instrument:
        return "not instrumented"
    if world_size == 1:
        return "one process, no gradient communication"
    if option == "off":
        return "Horovod's timeline is off (--opt timeline=off)"
    if option == "auto" and cores < 2 * local_ranks:
        return (f"Horovod's timeline is off: its writer thread spins on a core from hvd.init on, and this host has "
                f"{cores} core(s) for {local_ranks} local rank(s), fewer than 2 per rank (--opt timeline=on records "
                "it anyway, at that cost to the step)")
    return None


class _NoCounter(CommCounter):
    """No counter, and why (the measured window's figures say so)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def end(self) -> CommCounts:
        return CommCounts(reason=self.reason)


class _TimelineCounter(CommCounter):
    """Horovod's timeline, started and stopped around the window (HOROVOD_TIMELINE=DYNAMIC); rank 0 writes
    it. Measurement reads the file: the union of its ALLREDUCE activity is the communication time."""

    def __init__(self, hvd, rank: int) -> None:
        self.hvd, self.rank = hvd, rank

    def begin(self, window) -> None:
        self.path = str(window.workdir / f"horovod-timeline-{os.getpid()}.json")
        self.hvd.start_timeline(self.path, mark_cycles=False)

    def end(self) -> CommCounts:
        self.hvd.stop_timeline()
        if self.rank != 0:
            return CommCounts(reason="Horovod writes its timeline on rank 0 only")
        return CommCounts(method="Horovod timeline (union of NEGOTIATE_ALLREDUCE and ALLREDUCE intervals)", timeline=self.path)
