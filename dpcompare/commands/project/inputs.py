"""What a projection reads: a compare folder's runs per backend (the newest per world size, runs that change a knob
from their backend's baseline left out), the
link (a preset, the folder's microbenchmark or a bench-collectives JSON) with the world sizes its fit may use, and
how many ranks run at once (slots) and which all-reduce algorithm the link's collectives take."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dpcompare.commands.project.model import PRESETS, Link, link_from_collectives
from dpcompare.result_view import RunResult


def runs_by_backend(in_dir: Path) -> tuple[dict[str, list[RunResult]], list[dict[str, Any]]]:
    from dpcompare.commands.report.derive import newest_per_backend_world_size
    from dpcompare.commands.report.load import load_inputs

    inputs = load_inputs(in_dir)  # raises ValueError for a missing folder
    runs = newest_per_backend_world_size(r for r in inputs.runs if not r.knobs)
    by: dict[str, list[RunResult]] = {}
    for r in runs:
        by.setdefault(r.backend, []).append(r)
    multi = {b: rs for b, rs in by.items() if any(r.world_size > 1 for r in rs)}
    if not multi:
        raise ValueError(f"{str(in_dir)!r} holds no run result above world size 1 (found {len(inputs.runs)} run "
                         "result(s)): nothing to project; run python -m dpcompare compare --world-sizes 1,2 first")
    return multi, inputs.collectives


def load_collectives_file(path: Path) -> list[dict[str, Any]]:
    try:
        obj = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"--link {str(path)!r}: not readable JSON ({exc})") from None
    if not isinstance(obj, dict) or obj.get("kind") != "collectives" or not isinstance(obj.get("entries"), list):
        raise ValueError(f"--link {str(path)!r} is no bench-collectives JSON (kind: collectives with entries): "
                         "write one with python -m dpcompare bench-collectives --out FILE")
    return obj["entries"]


def resolve_link(spec: str, folder_entries: list[dict[str, Any]], keep: set[int] | None) -> Link:
    """A preset, `measured` (the folder's microbenchmark) or a bench-collectives JSON, its entries kept to the
    world sizes in `keep` (None: all)."""
    if spec in PRESETS:
        return PRESETS[spec]
    if spec == "measured":
        if not folder_entries:
            raise ValueError("--link measured: the folder holds no microbenchmark (collectives.json from compare "
                             "--collectives auto or bench-collectives)")
        return link_from_collectives("measured", folder_entries, keep)
    path = Path(spec)
    if path.suffix == ".json" and path.is_file():
        return link_from_collectives(path.name, load_collectives_file(path), keep)
    raise ValueError(f"unknown link {spec!r}: use {', '.join(PRESETS)}, measured, or an existing bench-collectives "
                     "JSON file")


def slots_for(runs: list[RunResult], link: Link, given: int | None) -> int | None:
    if given is not None:
        if given < 1:
            raise ValueError(f"--slots must be at least 1, got {given}")
        return given
    return box_slots(runs) if link.measured else None


def box_slots(runs: list[RunResult]) -> int | None:
    """The CPU count of the box CPU runs ran on (runs above it were oversubscribed), None for device runs."""
    if any(r.device not in (None, "cpu") for r in runs):
        return None
    counts = [r.env.get("cpu_count") for r in runs]
    counts = [c for c in counts if isinstance(c, int) and c > 0]
    return min(counts) if counts else None


def algorithm_for(given: str, link: Link) -> str:
    return ("ring" if link.measured else "auto") if given == "auto" else given

