"""The transports bench-collectives times, and the launcher each one is started by.

Owns: one class per transport with the same small surface (buffers, refill, barrier, timed all-reduce,
allgather, close): torch.distributed (gloo on CPU, NCCL on CUDA) and deepspeed.comm over it, mpi4py
(Open MPI) and Horovod; `connect`, which opens the right one inside a rank; `launcher`, the launcher a
transport is started by (the native launcher its dpcompare backend declares); and `availability`. A
transport's runtime is imported only inside the rank that uses it.
"""

from __future__ import annotations

import importlib.util
import os
import time
from datetime import timedelta
from typing import Any, Literal, get_args

import numpy as np

from dpcompare.contract import launch_env as launch
from dpcompare.run import launchers, registry

Transport = Literal["torch", "mpi", "horovod", "deepspeed"]
TRANSPORTS: tuple[Transport, ...] = get_args(Transport)

BACKEND: dict[Transport, str] = {"torch": "ddp", "horovod": "horovod", "deepspeed": "deepspeed"}
"""The dpcompare backend whose link each transport measures; mpi (mpi4py) is no dpcompare backend."""


def launcher(transport: Transport) -> str:
    """The launcher that starts `transport`'s ranks: the native launcher its backend's adapter declares
    (loading the adapter class imports torch, not Horovod or DeepSpeed); mpirun for mpi."""
    if transport == "mpi":
        return "mpirun"
    adapter = registry.load(BACKEND[transport], registry.BACKENDS, "backend")
    return adapter.capabilities.native_launcher


def availability(transport: Transport) -> tuple[bool, str]:
    """(available, reason) without importing the transport's runtime into this process."""
    if transport == "torch":
        if importlib.util.find_spec("torch") is None:
            return False, "torch is not installed: bash scripts/setup.sh"
    elif transport == "mpi":
        if importlib.util.find_spec("mpi4py") is None:
            return False, "mpi4py is not installed: pip install mpi4py (needs an MPI library, e.g. apt install libopenmpi-dev)"
    else:
        ok, reason = registry.availability(BACKEND[transport])
        if not ok:
            return ok, reason
    try:
        launchers.launcher_bin(launcher(transport))
    except (RuntimeError, ImportError, ValueError) as exc:
        return False, str(exc)
    return True, ""


class _TorchComm:
    """torch.distributed tensors; the data op is torch's all_reduce or deepspeed.comm's (same process group)."""

    def __init__(self, transport: Transport, env: launch.LaunchEnv, device_choice: str, timeout_s: float) -> None:
        import torch
        import torch.distributed as dist

        self.torch = torch
        self.transport, self.rank = transport, env.rank
        launch.ensure_rendezvous(env)
        self.device = launch.pick_device(device_choice, env.local_rank)
        self.is_cuda = self.device.type == "cuda"
        self.backend = "nccl" if self.is_cuda else "gloo"
        if transport == "deepspeed":
            import deepspeed
            import deepspeed.comm as dscomm

            from dpcompare.adapters.deepspeed_host import stale_build_lock

            if not self.is_cuda and (lock := stale_build_lock()) is not None:
                raise ValueError(f"deepspeed: {lock} is a build lock a killed build left: DeepSpeed's CPU all-reduce "
                                 f"op would wait on it forever; remove it (rm {lock}) and run again")

            deepspeed.init_distributed(dist_backend=self.backend, timeout=timedelta(seconds=timeout_s),
                                       rank=env.rank, world_size=env.world_size, verbose=False)
            op = dscomm.ReduceOp.SUM
            self._all_reduce = lambda t: dscomm.all_reduce(t, op=op)
            self._barrier, self._gather = dscomm.barrier, dscomm.all_gather_object
        else:
            dist.init_process_group(self.backend, rank=env.rank, world_size=env.world_size,
                                    timeout=timedelta(seconds=timeout_s),
                                    device_id=self.device if self.is_cuda else None)
            op = dist.ReduceOp.SUM
            self._all_reduce = lambda t: dist.all_reduce(t, op=op)
            self._barrier, self._gather = dist.barrier, dist.all_gather_object
        self.dist = dist

    def buffers(self, source: np.ndarray):
        src = self.torch.from_numpy(source).to(self.device)
        return self.torch.empty_like(src), src

    def refill(self, buf, src) -> None:
        buf.copy_(src)

    def barrier(self) -> None:
        self._barrier()
        if self.is_cuda:
            self.torch.cuda.synchronize()

    def allreduce_s(self, buf) -> float:
        if self.is_cuda:
            # NCCL returns once the kernel is queued: time on the stream with events.
            start, end = self.torch.cuda.Event(enable_timing=True), self.torch.cuda.Event(enable_timing=True)
            start.record()
            self._all_reduce(buf)
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        self._all_reduce(buf)  # gloo on CPU: returns when the result is in buf
        return time.perf_counter() - t0

    def allgather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.dist.get_world_size()
        self._gather(out, obj)
        return out

    def to_numpy(self, buf) -> np.ndarray:
        return buf.cpu().numpy() if self.is_cuda else buf.numpy()

    def corrupt(self, buf) -> None:
        buf[-1] += 1

    def close(self) -> None:
        if self.transport == "deepspeed":
            from dpcompare.adapters.deepspeed_host import remove_shm_segment

            remove_shm_segment(self.rank)
        if self.dist.is_initialized():
            self.dist.destroy_process_group()


class _MpiComm:
    """mpi4py's buffer interface on numpy arrays (host memory), MPI_Allreduce in place."""

    backend = "mpi"
    device = "cpu"

    def __init__(self, env: launch.LaunchEnv) -> None:
        from mpi4py import MPI

        self.MPI, self.comm = MPI, MPI.COMM_WORLD
        if self.comm.Get_size() != env.world_size or self.comm.Get_rank() != env.rank:
            raise RuntimeError(f"MPI sees rank {self.comm.Get_rank()} of {self.comm.Get_size()} but {env.launcher} "
                               f"started rank {env.rank} of {env.world_size}: start the mpi transport with mpirun -np N")

    def buffers(self, source: np.ndarray):
        return np.empty_like(source), source

    def refill(self, buf, src) -> None:
        np.copyto(buf, src)

    def barrier(self) -> None:
        self.comm.Barrier()

    def allreduce_s(self, buf) -> float:
        t0 = time.perf_counter()
        self.comm.Allreduce(self.MPI.IN_PLACE, buf, op=self.MPI.SUM)
        return time.perf_counter() - t0

    def allgather(self, obj: Any) -> list[Any]:
        return self.comm.allgather(obj)

    def to_numpy(self, buf) -> np.ndarray:
        return buf

    def corrupt(self, buf) -> None:
        buf[-1] += 1

    def close(self) -> None:
        pass


class _HorovodComm:
    """horovod.torch in place (hvd.allreduce_, op=hvd.Sum), as DistributedOptimizer reduces gradients."""

    def __init__(self, env: launch.LaunchEnv, device_choice: str, timeout_s: float) -> None:
        import horovod.torch as hvd
        import torch

        os.environ.setdefault("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", str(int(timeout_s)))
        os.environ.setdefault("HOROVOD_GLOO_TIMEOUT_SECONDS", str(int(timeout_s)))
        hvd.init()
        # hvd.init() with no launcher silently runs as size 1.
        if hvd.size() != env.world_size or hvd.rank() != env.rank:
            raise RuntimeError(f"Horovod sees rank {hvd.rank()} of {hvd.size()} but {env.launcher} started rank "
                               f"{env.rank} of {env.world_size}: start it with horovodrun -np N")
        self.hvd, self.torch = hvd, torch
        device = launch.pick_device(device_choice, env.local_rank)
        # A build without NCCL would stage CUDA tensors through host memory: measure host memory instead.
        self.device = device if device.type == "cpu" or hvd.nccl_built() else torch.device("cpu")
        self.is_cuda = self.device.type == "cuda"
        self.backend = "nccl" if self.is_cuda else ("gloo" if hvd.gloo_enabled() else "mpi")
        self.name = "dpcompare.bench"

    def buffers(self, source: np.ndarray):
        src = self.torch.from_numpy(source).to(self.device)
        # One fixed name per size: Horovod's response cache then skips renegotiation, as it does for named
        # gradients in training (unnamed ops get a fresh name each call and never hit the cache).
        self.name = f"dpcompare.bench.{source.size}"
        return self.torch.empty_like(src), src

    def refill(self, buf, src) -> None:
        buf.copy_(src)

    def barrier(self) -> None:
        self.hvd.barrier()

    def allreduce_s(self, buf) -> float:
        t0 = time.perf_counter()
        self.hvd.allreduce_(buf, op=self.hvd.Sum, name=self.name)  # waits for the result
        if self.is_cuda:
            self.torch.cuda.synchronize()
        return time.perf_counter() - t0

    def allgather(self, obj: Any) -> list[Any]:
        return self.hvd.allgather_object(obj)

    def to_numpy(self, buf) -> np.ndarray:
        return buf.cpu().numpy() if self.is_cuda else buf.numpy()

    def corrupt(self, buf) -> None:
        buf[-1] += 1

    def close(self) -> None:
        self.hvd.shutdown()


def connect(transport: Transport, env: launch.LaunchEnv, device: str, timeout_s: float):
    """This rank's end of `transport`, connected to every other rank the launcher started."""
    if transport in ("torch", "deepspeed"):
        return _TorchComm(transport, env, device, timeout_s)
    if transport == "mpi":
        return _MpiComm(env)
    return _HorovodComm(env, device, timeout_s)
