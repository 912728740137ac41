"""The report's inputs: finding dpcompare JSON under a directory and sorting it into run results (read through
dpcompare.result_view), compare summaries and collective microbenchmarks (a malformed file is skipped with its
reason, never raised), and a run's place in the backend order."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dpcompare.result_view import RunResult, is_number
from dpcompare.run.registry import BACKENDS

__all__ = ["Inputs", "backend_index", "created", "is_number", "label", "load_inputs", "run_order"]


@dataclass(slots=True)
class Inputs:
    runs: list[RunResult] = field(default_factory=list)
    """Every readable run result, with the path it was read from (`source`)."""
    compare: dict[str, Any] | None = None
    """The newest compare summary, if any."""
    collectives: list[dict[str, Any]] = field(default_factory=list)
    """Microbenchmark entries from every collectives file."""
    unavailable_transports: list[dict[str, Any]] = field(default_factory=list)
    """{'transport', 'reason'} from the collectives files."""
    skipped: list[str] = field(default_factory=list)
    """'path: why' for every file that looked like ours and could not be used."""
    ignored: int = 0
    """Readable JSON that is none of ours (a DeepSpeed config, say)."""


# -- small readers shared by the whole report --------------------------------------------------------
def created(obj: dict[str, Any]) -> float:
    """When a compare summary was written (-inf without the time: the oldest)."""
    value = obj.get("created_unix")
    return float(value) if is_number(value) else -math.inf


def backend_index(backend: str) -> int | None:
    """The backend's place in dpcompare.run.registry.BACKENDS, None for a backend not registered there."""
    order = list(BACKENDS)
    return order.index(backend) if backend in order else None


def run_order(run: RunResult) -> tuple[int, str, int]:
    """Registered backends in registry order, then any others by name; within a backend by world size."""
    index = backend_index(run.backend)
    return (len(BACKENDS) if index is None else index, run.backend, run.world_size)


def label(run: RunResult) -> str:
    return run.label


# -- finding and classifying the files ----------------------------------------------------------------
def _json_files(root: Path) -> list[Path]:
    found = []
    for dirpath, _dirs, files in os.walk(root):  # does not follow symlinked directories: no loops
        found += [Path(dirpath) / f for f in files if f.endswith(".json") and not f.startswith(".")]
    return sorted(found)


def _entry_problem(entry: Any) -> str | None:
    if not isinstance(entry, dict):
        return "an entry is not an object"
    if not isinstance(entry.get("world_size"), int) or not isinstance(entry.get("sizes"), list):
        return "an entry lacks world_size (whole number) or sizes (list)"
    for size in entry["sizes"]:
        if not isinstance(size, dict) or not is_number(size.get("bytes")) or not (
                size.get("busbw_gbps") is None or is_number(size["busbw_gbps"])):
            return f"a size is not an object with numeric bytes and busbw_gbps: {size!r}"
    return None


def _add_collectives(inputs: Inputs, path: Path, obj: dict[str, Any]) -> None:
    entries = obj.get("entries")
    if not isinstance(entries, list):
        inputs.skipped.append(f"{path}: collectives file without an 'entries' list")
        return
    for entry in entries:
        problem = _entry_problem(entry)
        if problem:
            inputs.skipped.append(f"{path}: {problem}")
        else:
            inputs.collectives.append({**entry, "_source": str(path)})
    inputs.unavailable_transports += [u for u in obj.get("unavailable") or [] if isinstance(u, dict)]


def _add_run(inputs: Inputs, path: Path, obj: dict[str, Any]) -> None:
    problem = RunResult.problem(obj)
    if problem:
        inputs.skipped.append(f"{path}: {problem}")
    else:
        inputs.runs.append(RunResult(obj, str(path)))


def _keep_newest_compare(inputs: Inputs, compares: list[tuple[Path, dict[str, Any]]]) -> None:
    if not compares:
        return
    compares.sort(key=lambda pc: created(pc[1]))
    inputs.compare = compares[-1][1]
    inputs.skipped += [f"{p}: an older compare summary (only the newest, {compares[-1][0]}, is reported)"
                       for p, _ in compares[:-1]]


def load_inputs(in_dir: Path) -> Inputs:
    """Classify every *.json under in_dir. Malformed files land in Inputs.skipped, never raise."""
    if not in_dir.is_dir():
        raise ValueError(f"report directory {str(in_dir)!r} does not exist or is not a directory: expected a "
                         "directory holding dpcompare JSON results, e.g. results/<timestamp>/ from python -m dpcompare compare")
    inputs = Inputs()
    compares: list[tuple[Path, dict[str, Any]]] = []
    for path in _json_files(in_dir):
        try:
            obj = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            inputs.skipped.append(f"{path}: not readable JSON ({exc})")
            continue
        if not isinstance(obj, dict):
            inputs.ignored += 1
        elif obj.get("kind") == "compare":
            compares.append((path, obj))
        elif obj.get("kind") == "collectives":
            _add_collectives(inputs, path, obj)
        elif "schema_version" in obj and "backend" in obj:
            _add_run(inputs, path, obj)
        else:
            inputs.ignored += 1
    _keep_newest_compare(inputs, compares)
    return inputs
