"""What DeepSpeed's CPU shared-memory all-reduce op leaves on the host: each rank's /dev/shm segment, which DeepSpeed
never removes, and the build lock a killed build of the op leaves under torch's extensions directory, on which every
later launch would wait forever.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path


def remove_shm_segment(rank: int) -> None:
    """Remove this rank's /dev/shm segment of DeepSpeed's CPU shared-memory all-reduce (deepspeed_shm_comm_op, used
    under its own launcher): 66 MB per rank that DeepSpeed never unlinks, so run after run they fill /dev/shm and then
    memory. Every rank mapped its peers' segments when the op started, so each removes its own once it is done."""
    name = (f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
            f"{os.environ.get('MASTER_PORT', '')}_{rank}")
    with contextlib.suppress(OSError):
        os.unlink(name)


STALE_BUILD_LOCK_S = 600.0
"""A torch-extension build lock older than this was left by a killed build: the shm op builds in about 90 s on two
cores, and torch's FileBaton waits for a lock to go away, forever."""


def stale_build_lock(op: str = "deepspeed_shm_comm", now: float | None = None) -> Path | None:
    """The build lock of DeepSpeed's CPU op `op` under torch's extensions directory when a killed build left it
    (older than STALE_BUILD_LOCK_S), else None. Every later DeepSpeed launch on CPU would wait on it forever."""
    from torch.utils import cpp_extension

    try:
        lock = Path(cpp_extension._get_build_directory(op, verbose=False)) / "lock"
        age = (time.time() if now is None else now) - lock.stat().st_mtime
    except (OSError, AttributeError, RuntimeError):
        return None
    return lock if age > STALE_BUILD_LOCK_S else None
