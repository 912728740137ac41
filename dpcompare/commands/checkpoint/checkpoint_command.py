"""The `checkpoint` command: each cell trains k steps under backend A at world size N and saves in A's own format,
converts it where B reads another format (with the library's own tool where it carries the whole state, else with
dpcompare convert), loads it under backend B at world size M and trains k
more; the continuation is judged against the float64 oracle's one uninterrupted run over all 2k steps, and what B
loaded against what A saved, bitwise. A cell whose saved state its conversion cannot carry whole is `refused` with the converter's one line.

Each side's save runs once per invocation, and each conversion of it into a format once: every cell that starts from
the same side (backend, world size, format) loads the same checkpoint, as the full matrix's 18 cells from each side
would otherwise train and save it 18 times.

Writes under OUT/<timestamp>/ (or the directory --resume names): sides/<side>/{saved,save,logs} (each side's
checkpoint, its run's result and log), conversions/<side>-to-<format>/ (each converted checkpoint and its log),
cells/<cell>/{load,logs} (each load's result and log) and checkpoint.json (every cell: its route, its two runs'
verdicts, the loaded state's parts; a cell whose state dpcompare convert refused to carry: its one line), rewritten
whole after each cell. --resume DIR runs the cells DIR/checkpoint.json does not hold as ran, with the settings it
records, and keeps the rest as they were.
Exit status: 0 when every cell ran (whatever the verdicts), 1 when a launch or conversion failed, 2 for bad input.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import shutil
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from dpcompare import json_files
from dpcompare.commands.checkpoint import tools
from dpcompare.commands.checkpoint.cells import BACKENDS, MATRICES, Cell, Side, matrix, parse_cell
from dpcompare.result_view import RunResult
from dpcompare.run import registry
from dpcompare.run.launchers import native_command, run_process

RECORDS = ("dpcompare-loop.pt", "dpcompare-saved.pt")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cells", default=None, metavar="A:N[:FMT]>B:M[:FMT],...",
                   help="the cells to run, e.g. ddp:2>fsdp:4,zero2:2>zero3:1 (backends: ddp, fsdp, horovod, zero1, "
                        "zero2, zero3; formats: torch, dcp, deepspeed, universal); default: --matrix")
    p.add_argument("--matrix", choices=MATRICES, default="default",
                   help="default: a covering subset (every backend, world sizes 1, 2 and 4, every conversion); all: "
                        "every pair of backends at world sizes 1, 2 and 4 (324 cells)")
    p.add_argument("--steps", type=int, default=4, help="steps before the save, and again after the load")
    p.add_argument("--model", default="mlp-dropout", help="the workload (as run's --model)")
    p.add_argument("--optimizer", default="adamw", choices=("sgd", "adamw"))
    p.add_argument("--global-batch", type=int, default=32, help="samples per step (a multiple of every world size)")
    p.add_argument("--run-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for every run (repeat: --run-arg=--amp=bf16)")
    p.add_argument("--out", default="results", help="directory; each invocation writes OUT/<timestamp>/")
    p.add_argument("--timeout-s", type=float, default=600.0, help="seconds per launch or conversion")
    p.add_argument("--jobs", type=int, default=1, metavar="N",
                   help="cells run at once (each launch holds its world size's processes; a cell waits for the save "
                        "or conversion another is making)")
    p.add_argument("--resume", default=None, metavar="DIR",
                   help="an earlier invocation's OUT/<timestamp>/: run the cells its checkpoint.json does not hold as "
                        "ran (the same cells and settings), keeping the rest")


@dataclass
class Outcome:
    cell: Cell
    status: str = "planned"
    """refused, ran, failed"""
    error: str | None = None
    runs: dict[str, dict[str, Any]] = field(default_factory=dict)
    wall_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        c = self.cell
        return {"cell": c.label, "save": _side(c.save), "load": _side(c.load), "tool": c.tool,
                "refusal": self.error if self.status == "refused" else None,
                "status": self.status, "error": self.error, "wall_s": self.wall_s,
                **{f"{k}_run": v for k, v in self.runs.items()}}


DEFAULTS = {"cells": None, "matrix": "default", "steps": 4, "model": "mlp-dropout", "optimizer": "adamw",
            "global_batch": 32, "run_arg": [], "out": "results", "timeout_s": 600.0, "resume": None, "jobs": 1}
SETTINGS = ("steps", "model", "optimizer", "global_batch", "run_arg")
"""What checkpoint.json records of an invocation, and a --resume must match."""
SUITE_BACKENDS = ("ddp", "fsdp", "zero1", "zero2", "zero3", "horovod")
SUITE_WORLD_SIZES = "1,2,4"


def from_compare(ns: argparse.Namespace, given: frozenset[str]) -> argparse.Namespace:
    """`compare --suite checkpoint`: every pair of its --backends (default: ddp, fsdp, ZeRO 1-3, horovod; deepspeed:zeroN
    names a stage) at its --world-sizes (default 1, 2, 4), with compare's flags where given (ValueError naming a
    backend no cell can hold)."""
    names = [b.split(":")[-1] if b.startswith("deepspeed:") else b
             for b in (ns.backends.split(",") if "backends" in given else SUITE_BACKENDS)]
    for name in names:
        if name not in BACKENDS:
            raise ValueError(f"--suite checkpoint: {name} saves no checkpoint a matrix cell holds; use {', '.join(BACKENDS)}"
                             " (deepspeed:zero1..zero3)")
    sizes = [int(n) for n in (ns.world_sizes if "world_sizes" in given else SUITE_WORLD_SIZES).split(",")]
    sides = [f"{b}:{n}" for b in names for n in sizes]
    values = dict(DEFAULTS, cells=",".join(f"{a}>{b}" for a in sides for b in sides), run_arg=list(ns.run_arg),
                  out=ns.out, timeout_s=ns.timeout_s, resume=getattr(ns, "resume", None),
                  jobs=getattr(ns, "jobs", 1))
    values.update({k: getattr(ns, k) for k in ("steps", "model", "optimizer", "global_batch") if k in given})
    return argparse.Namespace(**values)


def main(ns: argparse.Namespace) -> int:
    try:
        cells = [parse_cell(c) for c in ns.cells.split(",")] if ns.cells else matrix(ns.matrix)
        for c in cells:
            if ns.global_batch % c.save.world_size or ns.global_batch % c.load.world_size:
                raise ValueError(f"--global-batch {ns.global_batch} is not a multiple of {c.label}'s world sizes")
        if ns.steps < 1:
            raise ValueError("--steps: use 1 or more steps")
        if ns.jobs < 1:
            raise ValueError("--jobs: use 1 or more")
        out = Path(ns.resume) if ns.resume else Path(ns.out) / time.strftime("%Y%m%d-%H%M%S")
        done = _resumed(out, cells, ns) if ns.resume else {}
    except ValueError as exc:
        print(f"dpcompare checkpoint: error: {exc}", file=sys.stderr)
        return 2
    console = Console()
    outcomes = [done.get(c.label) or Outcome(c) for c in cells]
    if done:
        console.print(f"resuming {out}: {len(done)} of {len(cells)} cells ran before and are kept")
    shared = Shared(out)
    lock = threading.Lock()

    def record() -> None:
        json_files.write_atomic(out / "checkpoint.json", {"cells": [x.to_dict() for x in outcomes],
                                                       **{k: getattr(ns, k) for k in SETTINGS}})

    def one(i: int) -> None:
        cell = outcomes[i].cell
        what = (f"[bold]{cell.label}[/] ({cell.save.fmt} -> {cell.load.fmt}"
                f"{', ' + cell.tool.rsplit('.', 1)[-1] if cell.tool else ''})")
        if ns.jobs == 1:
            console.print(f"{what} ...", end=" ")
        ran = Outcome(cell)  # the record reads it once it is whole
        _run_cell(ran, out / "cells" / _dirname(cell.label), shared, ns)
        with lock:  # the record whole after each cell, whichever finishes first
            outcomes[i] = ran
            console.print(_verdict_of(ran) if ns.jobs == 1 else f"{what}: {_verdict_of(ran)}")
            record()

    planned = [i for i, o in enumerate(outcomes) if o.status == "planned"]
    if ns.jobs == 1:  # in this thread: Ctrl-C stops the launch it is in
        for i in planned:
            one(i)
    else:
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=ns.jobs)
        try:
            list(pool.map(one, planned))
        except BaseException:  # Ctrl-C: each launch in flight is killed, its cell recorded failed (--resume reruns it)
            shared.cancel.set()
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
    if not planned:
        record()
    console.print(_table(outcomes))
    console.print(f"-> {out / 'checkpoint.json'}")
    return 1 if any(o.status == "failed" for o in outcomes) else 0


def _dirname(label: str) -> str:
    return label.replace(":", "").replace(">", "-to-").replace("/", "").replace(" (", "-").replace(")", "")


def _resumed(out: Path, cells: list[Cell], ns: argparse.Namespace) -> dict[str, Outcome]:
    """The cells out/checkpoint.json holds as ran, by label (ValueError where it is not one of this invocation's)."""
    try:
        record = json.loads((out / "checkpoint.json").read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--resume {out}: no checkpoint.json of an earlier invocation there ({exc})") from None
    for k in SETTINGS:
        if record.get(k) != getattr(ns, k):
            raise ValueError(f"--resume {out}: it ran with --{k.replace('_', '-')} {record.get(k)!r}, not "
                             f"{getattr(ns, k)!r}; give the same settings or a new --out")
    labels = {c.label: c for c in cells}
    extra = [d["cell"] for d in record.get("cells", []) if d.get("cell") not in labels]
    if extra:
        raise ValueError(f"--resume {out}: it holds cells this invocation does not run ({', '.join(extra[:3])}); give "
                         "the same --cells or --matrix")
    done = {}
    for d in record.get("cells", []):
        if d.get("status") == "ran":
            runs = {k.removesuffix("_run"): v for k, v in d.items() if k.endswith("_run") and v is not None}
            done[d["cell"]] = Outcome(labels[d["cell"]], "ran", d.get("error"), runs, d.get("wall_s", 0.0))
    return done


@dataclass
class Shared:
    """Each side's save and each conversion of it, made once per invocation (and found again under --resume), its
    failure or refusal too; with --jobs, a cell that needs one another cell is making waits for it."""
    out: Path
    made: dict[Any, Any] = field(default_factory=dict)
    locks: dict[Any, threading.Lock] = field(default_factory=dict)
    guard: threading.Lock = field(default_factory=threading.Lock)
    cancel: threading.Event = field(default_factory=threading.Event)

    def once(self, key: Any, make: Callable[[], Any]) -> Any:
        with self.guard:
            lock = self.locks.setdefault(key, threading.Lock())
        with lock:
            if key not in self.made:
                try:
                    self.made[key] = make()
                except RuntimeError as exc:  # tools.Refused among them: every cell of this key says the same
                    if self.cancel.is_set():
                        raise
                    self.made[key] = exc
        if isinstance(self.made[key], RuntimeError):
            raise self.made[key]
        return self.made[key]

    def save(self, side: Side, ns: argparse.Namespace) -> tuple[Path, dict[str, Any]]:
        where = self.out / "sides" / _dirname(side.label)

        def make() -> dict[str, Any]:
            found = sorted((where / "save").glob("*.json"))
            if found and (where / "saved" / RECORDS[1]).exists():  # a resumed invocation's, whole
                return _run_summary(RunResult.read(found[-1]))
            shutil.rmtree(where, ignore_errors=True)
            return _launch(side, where, "save", ["--save-checkpoint", str(where / "saved")], ns, self.cancel)

        return where / "saved", self.once(side, make)

    def convert(self, cell: Cell, saved: Path, ns: argparse.Namespace) -> Path:
        where = self.out / "conversions" / f"{_dirname(cell.save.label)}-to-{cell.load.fmt}"
        converted = where / "converted"

        def make() -> Path:
            if not (converted / RECORDS[1]).exists():  # copied last: a conversion that finished
                shutil.rmtree(where, ignore_errors=True)
                tools.run(cell.tool, saved, converted, where / "convert.log", ns.timeout_s, cell.load.fmt, self.cancel)
                for name in RECORDS:
                    shutil.copy2(saved / name, converted / name)
            return converted

        return self.once((cell.save, cell.tool, cell.load.fmt), make)


def _run_cell(o: Outcome, where: Path, shared: Shared, ns: argparse.Namespace) -> None:
    start = time.monotonic()
    cell = o.cell
    shutil.rmtree(where, ignore_errors=True)  # a resumed cell's earlier attempt
    try:
        loaded, o.runs["save"] = shared.save(cell.save, ns)
        if cell.tool is not None:
            loaded = shared.convert(cell, loaded, ns)
        o.runs["load"] = _launch(cell.load, where, "load", ["--load-checkpoint", str(loaded)], ns, shared.cancel)
        o.status = "ran"
    except tools.Refused as exc:
        o.status, o.error = "refused", str(exc)
    except RuntimeError as exc:
        o.status, o.error = "failed", str(exc)
    o.wall_s = time.monotonic() - start


def _launch(side: Side, where: Path, part: str, extra: list[str], ns: argparse.Namespace,
            cancel: threading.Event | None = None) -> dict[str, Any]:
    caps = registry.load(side.backend, registry.BACKENDS, "backend").capabilities
    launcher = "python" if side.world_size == 1 and "python" in caps.launchers else caps.native_launcher
    args = ["--backend", side.backend, "--model", ns.model, "--optimizer", ns.optimizer, "--steps", str(ns.steps),
            "--global-batch", str(ns.global_batch), "--measure-steps", "0", "--checkpoint-format", side.fmt,
            "--out", str(where / part), *extra, *ns.run_arg]
    if side.stage is not None:
        args += ["--opt", f"zero_stage={side.stage}"]
    log = where / "logs" / f"{part}.log"
    finished = run_process(native_command(launcher, side.world_size, args), timeout_s=ns.timeout_s, log=log,
                           cancel=cancel)
    found = sorted((where / part).glob("*.json"))
    if finished.returncode != 0 or not found:
        lines = [ln for ln in log.read_text().splitlines() if "error" in ln.lower()] if log.exists() else []
        raise RuntimeError(f"{part} under {side.label} failed: "
                           f"{lines[0].strip() if lines else f'exit status {finished.returncode}'} (log: {log})")
    return _run_summary(RunResult.read(found[-1]))


def _side(s: Side) -> dict[str, Any]:
    return {"backend": s.name, "world_size": s.world_size, "format": s.fmt}


def _run_summary(result: RunResult) -> dict[str, Any]:
    """What checkpoint.json keeps of a run, read through dpcompare.result_view."""
    eq = result.equivalence
    first = eq.first_divergence
    return {"verdict": eq.verdict, "checkpoint": dict(eq.section("checkpoint")) or None,
            "first_divergence": first.reason if first else None, "cause": first.cause if first else None,
            "trajectory": dict(eq.trajectory.raw) or None, "steps": [e.get("step") for e in eq.drift]}


def _verdict_of(o: Outcome) -> str:
    if o.status != "ran":
        return f"[red]{o.status}[/]: {o.error}"
    load = o.runs["load"]
    colour = "green" if load["verdict"] == "equivalent" else "red"
    return f"[{colour}]{load['verdict']}[/] ({o.wall_s:.0f} s)"


def _table(outcomes: list[Outcome]) -> Table:
    table = Table(title="checkpoints: saved under A, loaded under B, judged against one uninterrupted float64 run")
    for col in ("cell", "saved", "conversion", "loaded", "state loaded", "steps judged", "verdict"):
        table.add_column(col)
    for o in outcomes:
        c = o.cell
        tool = c.tool.rsplit(".", 1)[-1] if c.tool else "-"
        if o.status != "ran":
            table.add_row(c.label, c.save.label, tool, c.load.label, "", "", f"{o.status} (see above)")
            continue
        load = o.runs["load"]
        parts = ((load["checkpoint"] or {}).get("loaded") or {}).get("parts", {})
        same = all(not v.startswith("differs") for v in parts.values())
        steps = f"0-{max(load['steps'])} (resumed at {min(load['steps'])})" if load["steps"] else "-"
        table.add_row(c.label, c.save.label, tool, c.load.label, "as saved" if same else "differs", steps,
                      load["verdict"] + (f" ({load['cause']})" if load["cause"] else ""))
    return table
