"""project: predict step time, scaling efficiency and exposed communication per backend at larger world sizes.

`python -m dpcompare project RESULT_DIR --world-sizes 8,64,512 --link ib-ndr` fits each backend of a compare
folder (its runs at the fit world sizes) and predicts it at the world sizes named, on the link named:

  --link nvlink4 | ib-ndr | 100gbe   a preset (beta from the vendor's figure, alpha an assumption: each is printed)
  --link measured                    alpha and beta fitted to the folder's own microbenchmark (collectives.json)
  --link FILE.json                   alpha and beta fitted to a bench-collectives JSON (busbw per message size)

Per backend (dpcompare/commands/project/fit.py; the method and its limits: docs/projection.md):

  compute(N)  = (c0 + c1 * per-rank batch) * ceil(N / slots)        fitted to the measured compute
  T_comm(N)   = k * sum over the step's messages (buckets, fusion buffer, per-kind collectives) of
                ring all-reduce 2(N-1) alpha + 2(N-1)/N * S / beta, or tree 2 ceil(log2 N) alpha + 2 S / beta
                (--algorithm auto takes the faster); reduce-scatter / all-gather (N-1) alpha + (N-1)/N * S / beta
  exposed(N)  = max(0, T_comm(N) - min(f * T_comm(N), 2/3 * compute(N)))   f: overlap measured at the fit sizes
  step(N)     = compute(N) + exposed(N)

k is 1 on a preset link and, on a measured link, the backend's measured communication over the model at the fit
sizes. slots (ranks that run at once) is the CPU count of the box on a measured link with CPU runs, else unlimited.

Validation: the runs at world sizes outside --fit-world-sizes are held out; each is predicted on the measured link
(--link FILE or the folder's microbenchmark, itself fitted without the held-out sizes) and the error printed
(goal: within 15 % of the measured step). --validate fits on the two smallest world sizes only.

Writes OUT (default RESULT_DIR/projection.json, kind: projection), which `dpcompare report` draws as
projected_scaling.png. Exit status: 0 done (whatever the errors), 2 bad input (unknown link, no such folder,
no usable results).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from dpcompare import SCHEMA_VERSION
from dpcompare.commands.project.fit import BACKWARD_SHARE, BackendFit, fit_backend, sched_slice_s
from dpcompare.commands.project.model import ALGORITHMS, PRESETS, Link, link_from_collectives
from dpcompare.results import write_atomic

TARGET = 0.15
"""The validation goal: |predicted - measured| / measured step time."""


def _sizes(text: str) -> list[int]:
    try:
        sizes = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers, got {text!r}") from None
    if not sizes or sizes[0] < 1:
        raise argparse.ArgumentTypeError(f"expected world sizes of at least 1, got {text!r}")
    return sizes


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", help="a compare result folder (searched recursively for run results)")
    p.add_argument("--world-sizes", type=_sizes, default="8,64,512", help="comma-separated world sizes to predict")
    p.add_argument("--link", required=True,
                   help=f"{', '.join(PRESETS)}, measured (the folder's microbenchmark) or a bench-collectives JSON")
    p.add_argument("--fit-world-sizes", type=_sizes, default=None,
                   help="world sizes whose runs the fit uses; the others are held out and validated "
                        "(default: every measured world size)")
    p.add_argument("--validate", action="store_true",
                   help="fit on the two smallest measured world sizes only and validate against the rest")
    p.add_argument("--algorithm", choices=ALGORITHMS, default="auto",
                   help="all-reduce algorithm: auto = ring on a measured link (gloo and MPI run rings), the faster "
                        "of ring and tree on a preset (as NCCL's tuner picks)")
    p.add_argument("--slots", type=int, default=None,
                   help="ranks that can run at once (default: the CPU count of the box on a measured link with CPU "
                        "runs, else one device per rank: unlimited)")
    p.add_argument("--out", default=None, help="the projection JSON (default: DIR/projection.json)")


# -- inputs ------------------------------------------------------------------------------------------------
def _runs_by_backend(in_dir: Path) -> tuple[dict[str, list[dict[str, Any]]], list[dict[str, Any]]]:
    from dpcompare.commands.report.derive import newest_per_backend_world_size, variant_of
    from dpcompare.commands.report.load import load_inputs

    inputs = load_inputs(in_dir)  # raises ValueError for a missing folder
    runs = newest_per_backend_world_size(r for r in inputs.runs if not variant_of(r))
    by: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        by.setdefault(r["backend"], []).append(r)
    multi = {b: rs for b, rs in by.items() if any(r["world_size"] > 1 for r in rs)}
    if not multi:
        raise ValueError(f"{str(in_dir)!r} holds no run result above world size 1 (found {len(inputs.runs)} run "
                         "result(s)): nothing to project; run python -m dpcompare compare --world-sizes 1,2 first")
    return multi, inputs.collectives


def _load_collectives_file(path: Path) -> list[dict[str, Any]]:
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
        return link_from_collectives(path.name, _load_collectives_file(path), keep)
    raise ValueError(f"unknown link {spec!r}: use {', '.join(PRESETS)}, measured, or an existing bench-collectives "
                     "JSON file")


def _slots(runs: list[dict[str, Any]], link: Link, given: int | None) -> int | None:
    if given is not None:
        if given < 1:
            raise ValueError(f"--slots must be at least 1, got {given}")
        return given
    return box_slots(runs) if link.measured else None


def box_slots(runs: list[dict[str, Any]]) -> int | None:
    """The CPU count of the box CPU runs ran on (runs above it were oversubscribed), None for device runs."""
    if any(r.get("device") not in (None, "cpu") for r in runs):
        return None
    counts = [(r.get("env") or {}).get("cpu_count") for r in runs]
    counts = [c for c in counts if isinstance(c, int) and c > 0]
    return min(counts) if counts else None


def _algorithm(given: str, link: Link) -> str:
    return ("ring" if link.measured else "auto") if given == "auto" else given


# -- the projection ---------------------------------------------------------------------------------------
def measured_point(fit_step1: float | None, run: dict[str, Any]) -> dict[str, Any]:
    from dpcompare.commands.project.fit import _num

    step = _num(run, "step_ms_p50")
    n = run["world_size"]
    scaling = run.get("scaling") or "strong"
    eff = None
    if step and fit_step1:
        eff = fit_step1 / step if scaling == "weak" else fit_step1 / (n * step)
    return {"backend": run["backend"], "world_size": n, "step_ms": step, "efficiency": eff,
            "comm_exposed_ms": _num(run, "comm_exposed_ms"), "compute_ms": _num(run, "compute_ms_p50")}


def assumptions(link: Link, algorithm: str, slots: int | None, fits: dict[str, BackendFit]) -> list[str]:
    lines = [*link.sources,
             f"link: alpha {link.alpha_s * 1e6:.3g} us, beta {link.beta_Bps / 1e9:.4g} GB/s per direction"
             + (f" (pooled fit, rms relative error {link.fit_rms_rel_error:.0%})" if link.fit_rms_rel_error is not None
                else ""),
             "ring all-reduce 2(N-1) alpha + 2(N-1)/N S/beta; tree all-reduce 2 ceil(log2 N) alpha + 2 S/beta; "
             "reduce-scatter / all-gather (N-1) alpha + (N-1)/N S/beta; broadcast / reduce ceil(log2 N) alpha + S/beta"
             f"; all-reduce algorithm: {'the faster of ring and tree per message' if algorithm == 'auto' else algorithm}",
             "a flat network: every rank has its own link of this alpha and beta, no contention, no hierarchy",
             "the messages per step (count and size) are those measured at the largest fit world size, and do not "
             "change with N (strong scaling keeps the gradient volume; sharded backends' volume is the full buffer)",
             "compute = c0 + c1 x per-rank batch, fitted on the runs that were not oversubscribed; extrapolated "
             "linearly to the per-rank batch at N (strong scaling: global batch / N)",
             f"overlap: the fraction of communication hidden behind compute measured at the fit sizes, capped at "
             f"{BACKWARD_SHARE:.2g} of compute (the backward pass)",
             ("k (backend efficiency on the link) = measured communication / model at the fit sizes, assumed the same "
              "at every N" if link.measured else
              "k = 1: each backend assumed to reach the link's alpha-beta (the inefficiency measured on this box's "
              "link does not carry over to another link)"),
             (f"slots = {slots}: at most {slots} ranks run at once (the CPU cores of the box), so above that compute "
              f"stretches by ceil(N / {slots}) (the fullest core's ranks: the scheduler keeps a task on its core "
              f"through a step) and each latency step of a collective waits one scheduler slice "
              f"({sched_slice_s(slots) * 1e3:g} ms, Linux's default base slice for {slots} CPUs: from the kernel's "
              f"defaults, not fitted)"
              if slots else "one device per rank: no oversubscription"),
             "compute is the compute measured on the results' devices: a preset link with CPU results predicts "
             "CPU ranks on that network, not GPUs"]
    for b, f in fits.items():
        lines += [f"{b}: {note}" for note in f.notes]
    return lines


def project(in_dir: Path, world_sizes: list[int], link_spec: str, fit_sizes: list[int] | None, validate: bool,
            algorithm: str, slots_given: int | None) -> dict[str, Any]:
    by_backend, folder_entries = _runs_by_backend(in_dir)
    measured_sizes = sorted({r["world_size"] for rs in by_backend.values() for r in rs})
    if validate:
        fit_sizes = measured_sizes[:2]
    fit_set = set(fit_sizes) if fit_sizes else set(measured_sizes)
    held_out = [n for n in measured_sizes if n not in fit_set]
    keep = ({n for n in fit_set if n > 1} or None) if held_out else None  # the truth never enters the fit
    link = resolve_link(link_spec, folder_entries, keep)
    all_runs = [r for rs in by_backend.values() for r in rs]
    slots = _slots(all_runs, link, slots_given)
    box = box_slots(all_runs)
    algo = _algorithm(algorithm, link)
    fits: dict[str, BackendFit] = {}
    skipped: dict[str, str] = {}
    for backend, runs in by_backend.items():
        fit_runs = [r for r in runs if r["world_size"] in fit_set]
        try:
            fits[backend] = fit_backend(backend, fit_runs, box)
        except ValueError as exc:
            skipped[backend] = str(exc)
    if not fits:
        raise ValueError("no backend could be fitted: " + "; ".join(skipped.values()))
    predictions, calib = [], {}
    for backend, f in fits.items():
        k, why = f.calibration(link, algo)
        calib[backend] = {"k": k, "why": why}
        predictions += [f.predict(n, link, algo, slots, k) for n in world_sizes]
    measured = [measured_point(fits[b].step1_ms, r) for b, rs in by_backend.items() if b in fits for r in rs]
    validation = _validation(by_backend, fits, held_out, link, folder_entries, keep, algorithm, slots_given)
    return {"schema_version": SCHEMA_VERSION, "kind": "projection", "created_unix": time.time(),
            "result_dir": str(in_dir), "world_sizes": world_sizes, "fit_world_sizes": sorted(fit_set),
            "held_out_world_sizes": held_out, "link": link.as_dict(), "algorithm": algo, "slots": slots,
            "assumptions": assumptions(link, algo, slots, fits),
            "backends": {b: {"transport": f.transport, "c0_ms": f.c0_ms, "c1_ms_per_sample": f.c1_ms,
                             "step1_ms": f.step1_ms, "messages": [{"kind": k, "bytes": s, "calls": c}
                                                                  for k, s, c in f.messages],
                             "overlap_fraction": f.overlap, "overlap_source": f.overlap_source,
                             "comm_measured_ms": f.comm_measured, **calib[b]} for b, f in fits.items()},
            "skipped": skipped, "predictions": predictions, "measured": measured, "validation": validation}


def _validation(by_backend: dict[str, list[dict[str, Any]]], fits: dict[str, BackendFit], held_out: list[int],
                link: Link, folder_entries: list[dict[str, Any]], keep: set[int] | None, algorithm: str,
                slots_given: int | None) -> dict[str, Any] | None:
    """Each held-out run predicted on the measured link (the one given, else the folder's microbenchmark)."""
    if not held_out:
        return None
    if link.measured:
        vlink = link
    else:
        try:
            vlink = resolve_link("measured", folder_entries, keep)
        except ValueError as exc:
            return {"target": TARGET, "rows": [], "why_not": f"{exc}: validation needs the link the runs ran on"}
    all_runs = [r for rs in by_backend.values() for r in rs]
    slots = _slots(all_runs, vlink, slots_given)
    algo = _algorithm(algorithm, vlink)
    rows = []
    for backend, fit in fits.items():
        k, _ = fit.calibration(vlink, algo)
        for run in by_backend[backend]:
            if run["world_size"] not in held_out:
                continue
            m = measured_point(fit.step1_ms, run)
            p = fit.predict(run["world_size"], vlink, algo, slots, k)
            err = (p["step_ms"] - m["step_ms"]) / m["step_ms"] if m["step_ms"] else None
            rows.append({"backend": backend, "world_size": run["world_size"], "measured_step_ms": m["step_ms"],
                         "predicted_step_ms": p["step_ms"], "error": err,
                         "measured_compute_ms": m["compute_ms"], "predicted_compute_ms": p["compute_ms"],
                         "measured_exposed_ms": m["comm_exposed_ms"], "predicted_exposed_ms": p["comm_exposed_ms"],
                         "within_target": err is not None and abs(err) <= TARGET})
    errors = [abs(r["error"]) for r in rows if r["error"] is not None]
    return {"target": TARGET, "link": vlink.name, "slots": slots, "rows": rows,
            "max_abs_error": max(errors) if errors else None,
            "within_target": bool(errors) and all(e <= TARGET for e in errors)}


# -- output ------------------------------------------------------------------------------------------------
def _f(value: Any, fmt: str = "{:.1f}") -> str:
    return "n/a" if value is None else fmt.format(value)


def print_projection(payload: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:  # piped or captured: wide enough that no column is cut
        console = Console(width=140)
    link = payload["link"]
    table = Table(title=f"dpcompare project: {link['name']} (alpha {link['alpha_us']:.3g} us, beta "
                        f"{link['beta_GBps']:.4g} GB/s), fit on world sizes {payload['fit_world_sizes']}")
    for col in ("backend", "N", "compute ms", "comm ms", "exposed ms", "step ms", "efficiency", "algorithm"):
        table.add_column(col, justify="left" if col in ("backend", "algorithm") else "right", no_wrap=True)
    for p in payload["predictions"]:
        table.add_row(p["backend"], str(p["world_size"]), _f(p["compute_ms"]), _f(p["comm_total_ms"], "{:.2f}"),
                      _f(p["comm_exposed_ms"], "{:.2f}"), _f(p["step_ms"]), _f(p["efficiency"], "{:.2f}"),
                      p["algorithm"])
    console.print(table)
    v = payload.get("validation")
    if v is None:
        console.print("validation: no run held out (every measured world size is in the fit; --validate fits on the "
                      "two smallest)", highlight=False)
    else:
        if v.get("why_not"):
            console.print(f"validation: not done: {v['why_not']}", highlight=False)
        else:
            vt = Table(title=f"validation: fit on {payload['fit_world_sizes']}, predicted on {v['link']}, "
                             f"goal |error| <= {v['target']:.0%}")
            for col in ("backend", "N", "measured step ms", "predicted step ms", "error", "compute meas/pred",
                        "exposed meas/pred"):
                vt.add_column(col, justify="left" if col == "backend" else "right", no_wrap=True)
            for r in v["rows"]:
                err = r["error"]
                style = "green" if r["within_target"] else "red"
                vt.add_row(r["backend"], str(r["world_size"]), _f(r["measured_step_ms"]), _f(r["predicted_step_ms"]),
                           f"[{style}]{_f(None if err is None else err * 100, '{:+.1f}')} %[/]",
                           f"{_f(r['measured_compute_ms'])} / {_f(r['predicted_compute_ms'])}",
                           f"{_f(r['measured_exposed_ms'])} / {_f(r['predicted_exposed_ms'])}")
            console.print(vt)
            per: dict[str, list[str]] = {}
            for r in v["rows"]:
                per.setdefault(r["backend"], []).append(
                    f"{_f(None if r['error'] is None else r['error'] * 100, '{:+.1f}')} % at N={r['world_size']}")
            for backend, errs in per.items():
                console.print(f"validation error {backend}: {', '.join(errs)}", highlight=False)
            console.print(f"validation: max |error| {_f(None if v['max_abs_error'] is None else v['max_abs_error'] * 100)}"
                          f" %, {'within' if v['within_target'] else 'NOT within'} the {v['target']:.0%} goal",
                          highlight=False)
    for b, why in payload["skipped"].items():
        console.print(f"skipped {b}: {why}", highlight=False)
    console.print("assumptions:", highlight=False)
    for line in payload["assumptions"]:
        console.print(f"  - {line}", highlight=False, soft_wrap=True)


def main(ns: argparse.Namespace) -> int:
    in_dir = Path(ns.dir)
    if not in_dir.is_dir():
        raise ValueError(f"result folder {str(in_dir)!r} does not exist or is not a directory")
    payload = project(in_dir, ns.world_sizes, ns.link, ns.fit_world_sizes, ns.validate, ns.algorithm, ns.slots)
    out = Path(ns.out) if ns.out else in_dir / "projection.json"
    print_projection(payload)
    write_atomic(out, payload)
    print(f"projection: {out}", flush=True)
    return 0
