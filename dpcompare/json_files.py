"""Every JSON file the library writes (a run's result, compare.json, checkpoint.json, a benchmark's payload): written
atomically, headed by the schema version and the environment it was made in.

Owns: the environment fingerprint, the payload's head (`base_payload`), atomic writes (temp file in the same
directory + fsync + rename: a reader never sees half a file, and an earlier file is never clobbered by a partial one),
the `latest` link, and JSON's lack of inf/nan (`sanitize`). A run's result is written by dpcompare.run.result_writer
alone and read back by dpcompare.result_view alone. Imports no adapter and no backend runtime (versions are read from
package metadata).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import socket
import subprocess
import tempfile
from importlib import metadata
from pathlib import Path
from typing import IO, Any, Iterator

from dpcompare._version import SCHEMA_VERSION, __version__



def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def mpi_version() -> str | None:
    for cmd in (["mpirun", "--version"], ["mpiexec", "--version"]):
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            continue
        if out:
            return out.splitlines()[0]
    return None


def environment() -> dict[str, Any]:
    import torch

    cuda = torch.cuda.is_available()
    nccl = None
    if cuda:
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001 - NCCL missing from a CUDA build is reported, not fatal
            nccl = None
    return {
        "dpcompare": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": nccl,
        "gloo": torch.distributed.is_available() and torch.distributed.is_gloo_available(),
        "deepspeed": _version("deepspeed"),
        "horovod": _version("horovod"),
        "mpi4py": _version("mpi4py"),
        "mpi": mpi_version(),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "device_names": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda
        else [platform.processor() or platform.machine()],
    }


class Closed(RuntimeError):
    """A fenced write found its fence: whoever would read the file has stopped waiting for it."""


@contextlib.contextmanager
def atomic_file(path: Path, mode: str = "w", *, durable: bool = True,
                unless: str | os.PathLike | None = None) -> Iterator[IO[Any]]:
    """Open a temporary file beside `path` for writing; on a clean exit it is flushed, synced and renamed
    over `path`, so a reader sees the old file or the whole new one, never half of it. The one atomic
    writer: JSON results, gradient dumps, reports, plots and heartbeats all go through it. durable=False skips
    the fsync, for files that only matter while the process runs (heartbeats). `unless`: a fence file; when it
    exists at the moment of the rename, nothing is written and Closed is raised."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # mkstemp creates 0600; a result is an ordinary file
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            if durable:
                os.fsync(f.fileno())
        if unless is not None and os.path.exists(unless):
            raise Closed(f"not writing {path}: {unless} exists, so the command that started this run has "
                         "finished or given up on it (a late result must not land in its folder)")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_atomic(path: Path, payload: dict[str, Any], *, unless: str | os.PathLike | None = None) -> Path:
    """Write a JSON object atomically (non-finite floats become null); `unless` as in atomic_file."""
    with atomic_file(path, unless=unless) as f:
        json.dump(sanitize(payload), f, indent=2, allow_nan=False, default=str)
        f.write("\n")
    return Path(path)


def write_text_atomic(path: Path, text: str) -> Path:
    with atomic_file(path) as f:
        f.write(text)
    return Path(path)


def point_latest(folder: Path, name: str = "latest") -> Path | None:
    """Make `folder`'s parent hold a link `name` to it (relative, replaced atomically: a reader sees the old link or
    the new one), so that `results/latest` names the newest compare. None where the file system has no links."""
    link = folder.parent / name
    tmp = folder.parent / f".{name}.{os.getpid()}"
    try:
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(folder.name, target_is_directory=True)
        os.replace(tmp, link)
    except OSError:
        tmp.unlink(missing_ok=True)
        return None
    return link


def sanitize(obj: Any) -> Any:
    """JSON has no inf/nan: a non-finite figure becomes null (its reason travels beside it)."""
    if isinstance(obj, float):
        return obj if obj == obj and abs(obj) != float("inf") else None
    if isinstance(obj, dict):
        return {k: sanitize(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [sanitize(v) for v in obj]
    return obj


def base_payload(**fields: Any) -> dict[str, Any]:
    return {"schema_version": SCHEMA_VERSION, **fields}
