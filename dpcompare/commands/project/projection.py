"""The projection: each backend fitted at the fit world sizes and predicted at the world sizes asked for on the
link, the measured points beside the predictions, the assumptions the figures rest on, and the validation of the
held-out world sizes on the link the runs ran on (the projection JSON, kind: projection)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from dpcompare import SCHEMA_VERSION
from dpcompare.commands.project.fit import BACKWARD_SHARE, BackendFit, fit_backend, num, on_device, sched_slice_s
from dpcompare.commands.project.inputs import algorithm_for, box_slots, resolve_link, runs_by_backend, slots_for
from dpcompare.commands.project.model import Link
from dpcompare.result_view import RunResult

TARGET = 0.15
"""The validation goal: |predicted - measured| / measured step time."""


def measured_point(fit_step1: float | None, run: RunResult) -> dict[str, Any]:
    step = num(run.metrics.step_ms_p50)
    n = run.world_size
    scaling = run.scaling or "strong"
    eff = None
    if step and fit_step1:
        eff = fit_step1 / step if scaling == "weak" else fit_step1 / (n * step)
    return {"backend": run.backend, "world_size": n, "step_ms": step, "efficiency": eff,
            "comm_exposed_ms": num(run.metrics.comm_exposed_ms), "compute_ms": num(run.metrics.compute_ms_p50)}


def assumptions(link: Link, algorithm: str, slots: int | None, fits: dict[str, BackendFit]) -> list[str]:
    moved = any(n.startswith("compute moved to") for f in fits.values() for n in f.notes)
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
             ("compute is moved to --device at the MFU the runs reached (below)" if moved else
              "compute is the compute measured on the results' devices: a preset link with CPU results predicts "
              "CPU ranks on that network, not GPUs (--device moves it to a GPU's datasheet peak)")]
    for b, f in fits.items():
        lines += [f"{b}: {note}" for note in f.notes]
    return lines


def project(in_dir: Path, world_sizes: list[int], link_spec: str, fit_sizes: list[int] | None, validate: bool,
            algorithm: str, slots_given: int | None, device: str | None = None) -> dict[str, Any]:
    by_backend, folder_entries = runs_by_backend(in_dir)
    measured_sizes = sorted({r.world_size for rs in by_backend.values() for r in rs})
    if validate:
        fit_sizes = measured_sizes[:2]
    fit_set = set(fit_sizes) if fit_sizes else set(measured_sizes)
    held_out = [n for n in measured_sizes if n not in fit_set]
    keep = ({n for n in fit_set if n > 1} or None) if held_out else None  # the truth never enters the fit
    link = resolve_link(link_spec, folder_entries, keep)
    all_runs = [r for rs in by_backend.values() for r in rs]
    slots = slots_for(all_runs, link, slots_given)
    box = box_slots(all_runs)
    algo = algorithm_for(algorithm, link)
    fits: dict[str, BackendFit] = {}
    skipped: dict[str, str] = {}
    for backend, runs in by_backend.items():
        fit_runs = [r for r in runs if r.world_size in fit_set]
        try:
            fits[backend] = fit_backend(backend, fit_runs, box)
        except ValueError as exc:
            skipped[backend] = str(exc)
    if not fits:
        raise ValueError("no backend could be fitted: " + "; ".join(skipped.values()))
    predictions, calib = [], {}
    moved = {b: on_device(f, by_backend[b], device) for b, f in fits.items()} if device else fits
    for backend, f in moved.items():
        k, why = f.calibration(link, algo)
        calib[backend] = {"k": k, "why": why}
        predictions += [f.predict(n, link, algo, slots, k) for n in world_sizes]
    measured = [measured_point(fits[b].step1_ms, r) for b, rs in by_backend.items() if b in fits for r in rs]
    validation = _validation(by_backend, fits, held_out, link, folder_entries, keep, algorithm, slots_given)
    return {"schema_version": SCHEMA_VERSION, "kind": "projection", "created_unix": time.time(),
            "result_dir": str(in_dir), "world_sizes": world_sizes, "fit_world_sizes": sorted(fit_set),
            "held_out_world_sizes": held_out, "link": link.as_dict(), "algorithm": algo, "slots": slots,
            "device": device, "assumptions": assumptions(link, algo, slots, moved),
            "backends": {b: {"transport": f.transport, "c0_ms": f.c0_ms, "c1_ms_per_sample": f.c1_ms,
                             "step1_ms": f.step1_ms, "messages": [{"kind": k, "bytes": s, "calls": c}
                                                                  for k, s, c in f.messages],
                             "overlap_fraction": f.overlap, "overlap_source": f.overlap_source,
                             "comm_measured_ms": f.comm_measured, **calib[b]} for b, f in moved.items()},
            "skipped": skipped, "predictions": predictions, "measured": measured, "validation": validation}


def _validation(by_backend: dict[str, list[RunResult]], fits: dict[str, BackendFit], held_out: list[int],
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
    slots = slots_for(all_runs, vlink, slots_given)
    algo = algorithm_for(algorithm, vlink)
    rows = []
    for backend, fit in fits.items():
        k, _ = fit.calibration(vlink, algo)
        for run in by_backend[backend]:
            if run.world_size not in held_out:
                continue
            m = measured_point(fit.step1_ms, run)
            p = fit.predict(run.world_size, vlink, algo, slots, k)
            err = (p["step_ms"] - m["step_ms"]) / m["step_ms"] if m["step_ms"] else None
            rows.append({"backend": backend, "world_size": run.world_size, "measured_step_ms": m["step_ms"],
                         "predicted_step_ms": p["step_ms"], "error": err,
                         "measured_compute_ms": m["compute_ms"], "predicted_compute_ms": p["compute_ms"],
                         "measured_exposed_ms": m["comm_exposed_ms"], "predicted_exposed_ms": p["comm_exposed_ms"],
                         "within_target": err is not None and abs(err) <= TARGET})
    errors = [abs(r["error"]) for r in rows if r["error"] is not None]
    return {"target": TARGET, "link": vlink.name, "slots": slots, "rows": rows,
            "max_abs_error": max(errors) if errors else None,
            "within_target": bool(errors) and all(e <= TARGET for e in errors)}

