"""Launch and environment detection: who started this process, and which rank it is.

Owns: reading rank, local rank and world size from whatever launcher started the process (torchrun /
torch elastic, the deepspeed launcher, horovodrun's gloo controller, Open MPI, PMI/PMIx (MPICH, Intel MPI),
Slurm's srun), choosing the device, and filling in the torch.distributed rendezvous variables for
launchers that do not set them (mpirun, srun, horovodrun). Imports no adapter.
"""

from __future__ import annotations

import json
import os
import socket
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Literal


Launcher = Literal["python", "torchrun", "deepspeed", "horovodrun", "mpirun", "slurm"]


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True, slots=True)
class LaunchEnv:
    launcher: Launcher
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    job_id: str
    """Identifies this launch across its ranks (used to name the shared heartbeat directory)."""

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0


def _int(env: dict[str, str], *names: str) -> int | None:
    for name in names:
        if name in env and env[name].strip():
            try:
                return int(env[name])
            except ValueError as exc:
                raise RuntimeError(f"environment variable {name}={env[name]!r} is not an integer: fix the launcher command") from exc
    return None


def _horovod(e: dict[str, str]) -> LaunchEnv | None:
    if "HOROVOD_RANK" not in e or "HOROVOD_SIZE" not in e:
        return None
    return LaunchEnv(
        "horovodrun",
        _int(e, "HOROVOD_RANK") or 0,
        _int(e, "HOROVOD_LOCAL_RANK") or 0,
        _int(e, "HOROVOD_SIZE") or 1,
        _int(e, "HOROVOD_LOCAL_SIZE") or 1,
        f"hvd-{e.get('HOROVOD_GLOO_RENDEZVOUS_ADDR', '')}-{e.get('HOROVOD_GLOO_RENDEZVOUS_PORT', '')}",
    )


def _torch_style(e: dict[str, str]) -> LaunchEnv | None:
    """RANK/WORLD_SIZE, set by torchrun, the deepspeed launcher, or by hand over mpirun or srun."""
    if "RANK" not in e or "WORLD_SIZE" not in e:
        return None
    launcher: Launcher
    if "TORCHELASTIC_RUN_ID" in e:
        launcher = "torchrun"
    elif "CROSS_RANK" in e and "LOCAL_SIZE" in e:
        launcher = "deepspeed"
    elif "OMPI_COMM_WORLD_RANK" in e:
        launcher = "mpirun"
    elif "SLURM_PROCID" in e:
        launcher = "slurm"
    else:
        launcher = "torchrun"  # a torch.distributed-style environment set by hand or by another tool
    return LaunchEnv(
        launcher,
        _int(e, "RANK") or 0,
        _int(e, "LOCAL_RANK") or 0,
        _int(e, "WORLD_SIZE") or 1,
        _int(e, "LOCAL_WORLD_SIZE", "LOCAL_SIZE") or 1,
        f"{launcher}-{e.get('TORCHELASTIC_RUN_ID', '')}-{e.get('MASTER_ADDR', '')}-{e.get('MASTER_PORT', '')}",
    )


def _open_mpi(e: dict[str, str]) -> LaunchEnv | None:
    if "OMPI_COMM_WORLD_RANK" not in e:
        return None
    return LaunchEnv(
        "mpirun",
        _int(e, "OMPI_COMM_WORLD_RANK") or 0,
        _int(e, "OMPI_COMM_WORLD_LOCAL_RANK") or 0,
        _int(e, "OMPI_COMM_WORLD_SIZE") or 1,
        _int(e, "OMPI_COMM_WORLD_LOCAL_SIZE") or 1,
        "ompi-" + e.get("OMPI_MCA_ess_base_jobid", e.get("OMPI_MCA_orte_ess_jobid", "")),
    )


def _pmi(e: dict[str, str]) -> LaunchEnv | None:
    """MPICH, Intel MPI (Hydra)."""
    if "PMI_RANK" not in e or "PMI_SIZE" not in e:
        return None
    return LaunchEnv(
        "mpirun", _int(e, "PMI_RANK") or 0, _int(e, "MPI_LOCALRANKID", "PMI_LOCAL_RANK") or 0,
        _int(e, "PMI_SIZE") or 1, _int(e, "MPI_LOCALNRANKS", "PMI_LOCAL_SIZE") or 1,
        "pmi-" + e.get("PMI_ID", e.get("PMI_FD", "")),
    )


def _slurm(e: dict[str, str]) -> LaunchEnv | None:
    """srun (also srun --mpi=pmix, which exports no size)."""
    if "SLURM_PROCID" not in e or "SLURM_STEP_ID" not in e:
        return None
    return LaunchEnv(
        "slurm",
        _int(e, "SLURM_PROCID") or 0,
        _int(e, "SLURM_LOCALID") or 0,
        _int(e, "SLURM_NTASKS", "SLURM_NPROCS") or 1,
        _int(e, "SLURM_NTASKS_PER_NODE") or 1,
        f"slurm-{e.get('SLURM_JOB_ID', '')}.{e.get('SLURM_STEP_ID', '')}",
    )


def detect(env: dict[str, str] | None = None) -> LaunchEnv:
    """Read the launcher's variables. Order matters: horovodrun --mpi and deepspeed's MPI mode also set
    Open MPI's variables, and torchrun's variables are also set by the deepspeed launcher."""
    e = dict(os.environ if env is None else env)
    for launcher in (_horovod, _torch_style, _open_mpi, _pmi, _slurm):
        found = launcher(e)
        if found is not None:
            return found
    if "PMIX_RANK" in e:
        raise RuntimeError("PMIx started this process (PMIX_RANK is set) but no launcher variable gives the world size: "
                           "start it with mpirun, srun, torchrun or horovodrun")
    return LaunchEnv("python", 0, 0, 1, 1, f"pid-{os.getpid()}")


def ensure_rendezvous(env: LaunchEnv) -> None:
    """Set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT for torch.distributed when the launcher
    did not (mpirun, srun, plain python). Under MPI, rank 0's host and a free port are broadcast through
    mpi4py when it is installed; otherwise a single-host launch uses loopback and a port derived from the
    job id, and a multi-host one must set MASTER_ADDR/MASTER_PORT itself."""
    os.environ.setdefault("RANK", str(env.rank))
    os.environ.setdefault("WORLD_SIZE", str(env.world_size))
    os.environ.setdefault("LOCAL_RANK", str(env.local_rank))
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(env.local_world_size))
    if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        return
    if env.world_size == 1:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        return
    if env.launcher == "mpirun":
        try:
            from mpi4py import MPI  # noqa: PLC0415 - optional
        except ImportError:
            MPI = None
        if MPI is not None:
            comm = MPI.COMM_WORLD
            addr, port = comm.bcast((socket.gethostname() if env.world_size > env.local_world_size else "127.0.0.1",
                                     free_port()) if env.rank == 0 else None, root=0)
            os.environ.setdefault("MASTER_ADDR", addr)
            os.environ.setdefault("MASTER_PORT", str(port))
            return
    if env.world_size == env.local_world_size:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(20000 + zlib.crc32(env.job_id.encode()) % 20000))
        return
    raise RuntimeError(
        f"{env.launcher} started {env.world_size} ranks over several hosts but MASTER_ADDR/MASTER_PORT are not set: "
        "export them (rank 0's host and a free port) or install mpi4py so dpcompare can agree on them"
    )


def pick_device(choice: str, local_rank: int):
    """torch.device for this rank: auto means CUDA (one device per local rank) when available."""
    import torch

    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda was requested but torch sees no CUDA device: use --device cpu or auto")
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def tell_launcher(line: str) -> None:
    """Under torchrun, leave dpcompare's error line in the worker's error file (TORCHELASTIC_ERROR_FILE), so
    torchrun's failure report names it as the root cause instead of "To enable traceback see ...". The
    format is torch elastic's: {"message": {"message": ..., "extraInfo": {"py_callstack": ..., "timestamp": ...}}}.
    The first error of a process wins; the line is on stderr already, so a write that fails is let go."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):
        return
    from dpcompare import json_files

    data = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}}
    try:
        json_files.write_text_atomic(Path(path), json.dumps(data))
    except OSError:
        pass
