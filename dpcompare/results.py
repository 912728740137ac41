"""Results: one JSON object per run, written atomically by rank 0, validated against the schema.

Owns: the environment fingerprint, the result file's name, atomic writes (temp file in the same
directory + fsync + rename: a reader never sees half a file, and an earlier result is never clobbered
by a partial one) and schema validation. Reading a result back is dpcompare.result_view's. Imports no
adapter and no backend runtime (versions are read from package metadata).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import socket
import subprocess
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import IO, Any, Iterator

from dpcompare._version import SCHEMA_VERSION, __version__

SCHEMA_PATH = Path(__file__).parent / "schema" / "result.schema.json"


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


def result_path(out_dir: str | os.PathLike, backend: str, world_size: int, model: str, variant: str = "") -> Path:
    """OUT/<time>-<backend>[-<variant>]-ws<N>-<model>-<pid>.json. `variant`: the named variant of the backend the
    run's options make (`zero2` for deepspeed's zero_stage=2), '' for none, so variants of one backend at one world
    size are told apart by name; the pid keeps any two runs' files apart."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    safe_backend = "".join(c if c.isalnum() or c in "-_" else "_" for c in backend)
    safe_variant = "".join(c if c.isalnum() or c in "-_" else "_" for c in variant)
    name = safe_backend + (f"-{safe_variant}" if safe_variant else "")
    return Path(out_dir) / f"{stamp}-{name}-ws{world_size}-{file_stem_of_model(model)}-{os.getpid()}.json"


def file_stem_of_model(model: str) -> str:
    """A model's name as a file name's part: `hf:meta-llama/Llama-3.2-1B` and `hf:./configs/llama/` name a path or a
    hub repository, whose last part names the model (`hf-Llama-3.2-1B`, `hf-llama`); any other character a file name
    should not hold becomes `_`."""
    kind, sep, rest = model.partition(":")
    if sep and "/" in rest:
        model = f"{kind}-{rest.rstrip('/').rsplit('/', 1)[-1] or 'model'}"
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in model)


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


def validate(payload: dict[str, Any]) -> None:
    """Raise jsonschema.ValidationError when the payload does not follow the published schema."""
    import jsonschema

    jsonschema.validate(payload, json.loads(SCHEMA_PATH.read_text()))


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
