"""The report's inputs: finding dpcompare JSON under a directory, sorting it into run results, compare
summaries and collective microbenchmarks (a malformed file is skipped with its reason, never raised), and
reading one run: a metric or why it is missing, its place in the backend order and its label."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dpcompare import SCHEMA_VERSION
from dpcompare.run.registry import BACKENDS

NON_NUMERIC_METRICS: dict[str, type] = {"stragglers": list, "step_ms": list, "comm_total_method": str, "model_state_mib": dict,
                                         "scaling": str, "reasons": dict}


@dataclass(slots=True)
class Inputs:
    runs: list[dict[str, Any]] = field(default_factory=list)
    """Every readable run result; '_source' holds its path."""
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
def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def created(run: dict[str, Any]) -> float:
    value = run.get("created_unix")
    return float(value) if is_number(value) else -math.inf


def backend_index(backend: str) -> int | None:
    """The backend's place in dpcompare.run.registry.BACKENDS, None for a backend not registered there."""
    order = list(BACKENDS)
    return order.index(backend) if backend in order else None


def run_order(run: dict[str, Any]) -> tuple[int, str, int]:
    """Registered backends in registry order, then any others by name; within a backend by world size."""
    index = backend_index(run["backend"])
    return (len(BACKENDS) if index is None else index, run["backend"], run["world_size"])


def label(run: dict[str, Any]) -> str:
    return f"{run['backend']}/{run['world_size']}"


# -- finding and classifying the files ----------------------------------------------------------------
def _json_files(root: Path) -> list[Path]:
    found = []
    for dirpath, _dirs, files in os.walk(root):  # does not follow symlinked directories: no loops
        found += [Path(dirpath) / f for f in files if f.endswith(".json") and not f.startswith(".")]
    return sorted(found)


def _run_problem(obj: dict[str, Any]) -> str | None:
    if obj.get("schema_version") != SCHEMA_VERSION:
        return f"schema_version {obj.get('schema_version')!r}; this dpcompare reads {SCHEMA_VERSION}"
    if not isinstance(obj.get("backend"), str):
        return f"backend {obj.get('backend')!r} is not a string"
    ws = obj.get("world_size")
    if not isinstance(ws, int) or isinstance(ws, bool) or ws < 1:
        return f"world_size {ws!r} is not a positive whole number"
    if obj.get("metrics") is not None and not isinstance(obj["metrics"], dict):
        return "metrics is not an object"
    return None


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
    problem = _run_problem(obj)
    if problem:
        inputs.skipped.append(f"{path}: {problem}")
    else:
        inputs.runs.append({**obj, "_source": str(path)})


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


# -- metric access --------------------------------------------------------------------------------------
def reasons(run: dict[str, Any]) -> dict[str, Any]:
    """metrics.reasons: why each null metric is null ({} when the run recorded none)."""
    metrics = run.get("metrics")
    found = metrics.get("reasons") if isinstance(metrics, dict) else None
    return found if isinstance(found, dict) else {}


def metric(run: dict[str, Any], name: str) -> tuple[Any, str | None]:
    """(value, None) or (None, why it is missing)."""
    metrics = run.get("metrics")
    if not isinstance(metrics, dict):
        if "metrics" in run:  # the trainer writes metrics: null when the measurement phase was off
            return None, ("the run measured nothing (metrics: null): pass --measure-steps N, "
                          "e.g. compare --run-arg=--measure-steps=20")
        return None, "this result has no metrics (written before dpcompare recorded them)"
    value = metrics.get(name)
    if value is not None:
        expected = NON_NUMERIC_METRICS.get(name)
        if expected is None and not is_number(value):
            return None, f"metrics.{name} is {value!r}, not a number"
        if expected is not None and not isinstance(value, expected):
            return None, f"metrics.{name} is {value!r}, not a {expected.__name__}"
        return value, None
    why = reasons(run).get(name)
    if why:
        return None, str(why)
    return None, f"metrics.{name} is {'null' if name in metrics else 'absent'} and no reason was recorded"


def raw_metric(run: dict[str, Any], name: str) -> tuple[Any, str | None]:
    """A structured metric as the run recorded it (a dict or a list), or (None, why it is missing)."""
    metrics = run.get("metrics")
    value = metrics.get(name) if isinstance(metrics, dict) else None
    if value is not None:
        return value, None
    return None, metric(run, name)[1]
