"""How a rank of a launch leaves: always, and without destructors.

Owns: keeping alive what holds a launch's process group (`hold`) and leaving the process with `os._exit` once its
lines are printed and flushed (`exit_if_held`). Destroying a gloo process group joins its worker threads on the
thread that drops the last reference, which holds the GIL: when a worker is still freeing a finished collective whose
tensors Python made (all_gather_object's), it waits for the GIL and the process never exits (seen here in
`ProcessGroupGloo::~ProcessGroupGloo` while DDP's Reducer was released, after the result was written; FIELD_NOTES).
Nothing a rank still has to do needs those destructors: every rank has passed the run's last collective, the result
is written, and the launcher only waits for the exit status. So `dpcompare.cli.main` does not return after a run of a
backend of one process per replica (one rank or several) when it is the process's program (`leaves_by_exit`); called
in-process (a test) it returns, and the backend is torn down as before. What must happen before a process leaves is the
adapter's `before_exit()` (MPI_Finalize under Horovod, DeepSpeed's shared-memory file); mpi4py's MPI is finalized
here after a run that succeeded (mpirun counts a rank that skips MPI_Finalize as failed). Imports nothing heavy: the
command line imports it.
"""

from __future__ import annotations

import os
import sys
from typing import Any

_held: list[Any] = []


def leaves_by_exit() -> bool:
    """Whether this process runs dpcompare's command line as its program (`python -m dpcompare` under any launcher, or
    the `dpcompare` script), so that it may leave with os._exit; a caller that imported dpcompare and calls
    `dpcompare.cli.main` in-process (a test, a notebook) is never ended from inside: there the backend is torn down."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and (spec.name or "").split(".")[0] == "dpcompare":
        return True
    return os.path.basename(sys.argv[0] or "") == "dpcompare"


def hold(obj: Any) -> None:
    """Keep `obj` (an adapter, with the wrapper and process group it holds) alive until `exit_if_held` ends the
    process: no destructor of it runs in this process."""
    _held.append(obj)


def holding() -> bool:
    """Whether this process holds a launch's process group (and so must leave with `exit_if_held`)."""
    return bool(_held)


def exit_if_held(status: int) -> None:
    """Leave now with `status` when this process holds a launch's process group (`hold`): flush, finalize mpi4py's MPI
    after a run that succeeded, then `os._exit`. Returns where nothing is held (one process, or a run refused before
    its backend started: the interpreter may finish normally)."""
    if not _held:
        return
    try:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        mpi = sys.modules.get("mpi4py.MPI")
        if status == 0 and mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
            mpi.Finalize()
    finally:  # a closed pipe or a failing MPI_Finalize must not send the process through its destructors
        os._exit(status)
