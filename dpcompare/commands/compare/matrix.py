"""The cross-run figures compare.json holds: the backend x backend x oracle gradient matrix built from the
runs' .npz dumps (and which pairs cannot be compared), how each backend left the gradients of unused
parameters, which steps each fp16 run's loss scaler skipped (the same at one world size, or not), and scaling
efficiency against the run whose backend declares itself the scaling baseline.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from dpcompare.commands.compare.plan import Job
from dpcompare.measure.scaling import scaling_efficiency
from dpcompare.result_view import RunResult


def _load(dump: Path) -> dict[int, dict[str, np.ndarray]]:
    """step -> {'reduced' | 'oracle' | 'floor': flat float64 vector}, parameters in a fixed order."""
    by_step: dict[int, dict[str, dict[str, np.ndarray]]] = {}
    with np.load(dump) as z:
        for key in z.files:
            step, kind, name = key.split("/", 2)
            by_step.setdefault(int(step), {}).setdefault(kind, {})[name] = z[key]
    return {s: {k: np.concatenate([v[n].ravel() for n in sorted(v)]) for k, v in kinds.items()}
            for s, kinds in by_step.items()}


RANDOM_ACROSS_WORLD_SIZES = (
    "not comparable: the forward draws random numbers (dropout) and the two runs have different world sizes; each "
    "rank seeds its own generator from (seed, rank), so they drew different masks and their distance measures "
    "randomness, not rounding (each run's oracle column applies its own captured masks; compare with --run-arg=--no-dropout)")


def _stochastic(job: Job) -> bool:
    """Whether the run's forward draws random numbers (False for a result written before this was probed)."""
    return job.result is not None and job.result.equivalence.stochastic


PER_REPLICA_ACROSS_SPLITS = (
    "not comparable: the run is judged per replica (BatchNorm without --sync-bn, or a forward that depends on how the "
    "batch is split) and the two runs split the global batch into different forwards, so each computes another "
    "function; each run's oracle column judges it against its own split (for BatchNorm, compare with "
    "--run-arg=--sync-bn for one computation)")


def _per_replica_split(job: Job) -> int | None:
    """The number of forwards a run computed separately (BatchNorm per replica, or a forward that depends on the
    split), or None when it did not."""
    return job.result.equivalence.per_replica_forwards if job.result is not None else None


def _not_comparable(a: Job, b: Job) -> str | None:
    """Why the gradients of runs a and b cannot be compared, or None. Runs at the same world size seed their
    ranks alike and draw the same masks; at different world sizes a rank's shard and generator differ. Runs that
    normalise BatchNorm per replica compute the same function only when they split the batch alike."""
    if a.world_size != b.world_size and (_stochastic(a) or _stochastic(b)):
        return RANDOM_ACROSS_WORLD_SIZES
    if _per_replica_split(a) != _per_replica_split(b):
        return PER_REPLICA_ACROSS_SPLITS
    return None


def build_matrix(jobs: list[Job]) -> dict[str, Any]:
    """Entry (a, b) at a step: ||g_a - g_b|| / ||oracle|| divided by the noise floor ||floor - oracle|| /
    ||oracle||, both from run a at that step. Column 'oracle': each run against its own oracle. At step 0
    every run starts from the same weights (verified by fingerprint), so step 0 compares one computation;
    later steps also carry each run's own trajectory. Where the forward draws random numbers, runs at
    different world sizes drew different masks: their entry is null, with the reason under 'not_comparable'."""
    by_label = {j.label: j for j in jobs}
    loaded = {j.label: _load(j.dump) for j in jobs if j.result is not None and j.dump.exists()}
    # A run stopped before its first check (unverifiable) dumps an empty file: no row, or no common step at all.
    loaded = {label: steps for label, steps in loaded.items() if steps}
    labels = list(loaded)
    steps = sorted(set.intersection(*(set(v) for v in loaded.values()))) if loaded else []
    runs = [by_label[label] for label in labels]
    per_step = {}
    for step in steps:
        at_step = {label: loaded[label][step] for label in labels}
        per_step[str(step)] = {a.label: _matrix_row(a, runs, at_step) for a in runs}
    return {"labels": labels, "steps": steps, "per_step": per_step,
            "definition": " ".join(build_matrix.__doc__.split())}


def _matrix_row(a: Job, runs: list[Job], at_step: dict[str, dict[str, np.ndarray]]) -> dict[str, Any]:
    """Run a's row at one step: its distance to its oracle and to every run, relative and in noise floors."""
    ref = at_step[a.label]
    onorm = float(np.linalg.norm(ref["oracle"])) or 1.0
    floor = float(np.linalg.norm(ref["floor"] - ref["oracle"])) / onorm
    row: dict[str, float | None] = {"oracle": float(np.linalg.norm(ref["reduced"] - ref["oracle"])) / onorm}
    not_comparable = {}
    for b in runs:
        reason = _not_comparable(a, b)
        if reason is not None:
            row[b.label], not_comparable[b.label] = None, reason
        else:
            row[b.label] = float(np.linalg.norm(ref["reduced"] - at_step[b.label]["reduced"])) / onorm
    return {"rel_err": row, "noise_floor": floor,
            "in_noise_floors": {k: (v / floor if v is not None and floor > 0 else None) for k, v in row.items()},
            "not_comparable": not_comparable}


def unused_parameter_grads(jobs: list[Job]) -> list[dict[str, Any]]:
    """How each run left the gradients of parameters that take no part in the loss, across backends: one entry
    per group of parameters every run treated alike, {'parameters', 'gradient': {form: [run labels]}, 'line'},
    form being none, zero, nonzero, mixed (across ranks) or 'not recorded'."""
    forms_by_name: dict[str, dict[str, str]] = {}  # parameter -> run label -> form
    for j in jobs:
        parameters = j.result.equivalence.section("parameters") if j.result is not None else {}
        recorded = parameters.get("unused_grad") or {}
        for name in parameters.get("unused") or []:
            forms_by_name.setdefault(name, {})[j.label] = recorded.get(name, "not recorded")
    groups: dict[tuple[tuple[str, str], ...], list[str]] = {}
    for name, by_run in forms_by_name.items():
        groups.setdefault(tuple(by_run.items()), []).append(name)
    shown = {j.label: f"{j.entry} ws={j.world_size}" for j in jobs}
    words = {"none": "None", "mixed": "mixed across ranks", "nonzero": "NONZERO"}
    entries = []
    for by_run, names in groups.items():
        gradient: dict[str, list[str]] = {}
        for label, form in by_run:
            gradient.setdefault(form, []).append(label)
        line = f"unused parameters {', '.join(names)}: gradient " + "; ".join(
            f"{words.get(form, form)} under {', '.join(shown[lb] for lb in labels)}" for form, labels in gradient.items())
        entries.append({"parameters": names, "gradient": gradient, "line": line})
    return entries


def skipped_steps(payloads: list[RunResult]) -> list[dict[str, Any]]:
    """Every backend must skip the same steps: for each world size with an fp16 run (a result whose
    equivalence.precision records loss-scaler steps), {'world_size', 'runs': {run label: skipped steps}, 'agree',
    'line'}, by world size. Results without precision (written before --amp, or --amp none/bf16) are left out."""
    by_ws: dict[int, dict[str, list[int]]] = {}
    for r in payloads:
        precision = r.equivalence.section("precision")
        if not precision.get("steps"):
            continue
        by_ws.setdefault(r.world_size, {})[r.tag or r.label] = list(precision.get("skipped_steps") or [])
    entries = []
    for ws, runs in sorted(by_ws.items()):
        agree = len({tuple(steps) for steps in runs.values()}) == 1
        if not agree:
            line = f"loss scaler: backends at world size {ws} skip different steps: " + ", ".join(
                f"{label} {steps}" for label, steps in runs.items())
        else:
            steps = next(iter(runs.values()))
            line = f"loss scaler: every backend at world size {ws} skipped " + (
                f"steps {', '.join(map(str, steps))} (fp16 overflow)" if steps else "no step")
        entries.append({"world_size": ws, "runs": runs, "agree": agree, "line": line})
    return entries


def _is_scaling_baseline(job: Job) -> bool:
    """A world-size-1 run whose result says its backend declares itself the scaling baseline."""
    return job.world_size == 1 and job.result is not None and job.result.scaling_baseline


def scaling_rows(jobs: list[Job], scaling: str) -> list[dict[str, Any]]:
    """Scaling efficiency per baseline run (seed formula): throughput_N / (N * throughput_1), with
    throughput_1 that of the world-size-1 run whose backend declares capabilities.scaling_baseline (the
    reference), measured in the same invocation."""
    base = [j for j in jobs if j.knob == "baseline" and j.result is not None and j.result.metrics.raw]
    ref = next((j for j in base if _is_scaling_baseline(j)), None)
    thr1 = ref.result.metrics.samples_per_s.value if ref else None
    rows = []
    for j in base:
        thr = j.result.metrics.samples_per_s.value
        rows.append({"label": j.label, "backend": j.backend, "entry": j.entry, "world_size": j.world_size,
                     "samples_per_s": thr, "scaling": scaling, "efficiency": scaling_efficiency(thr, j.world_size, thr1),
                     "reason": None if thr1 else
                     "no scaling-baseline run (capabilities.scaling_baseline) at world size 1 with a measured throughput"})
    return rows
