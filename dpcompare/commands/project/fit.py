"""Fitting one backend's step to its measured runs and predicting it at other world sizes on a link.

  compute(N)   = (c0 + c1 * b(N)) * ceil(N / slots)     b(N): per-rank batch (strong: global/N; weak: fixed);
                                                          c0, c1 fitted to the measured compute (world size 1: the
                                                          step, no sync; above: the unsynced arm of the ablation);
                                                          slots: ranks that run at once (the CPU cores of the box
                                                          the runs ran on, when the link is that box's; else
                                                          unlimited: one device per rank); ceil, not N / slots:
                                                          oversubscription() says why
  T_comm(N)    = k * sum over the step's messages of collective_s(kind, S, N)   (model.py; k: 1 on a preset link;
                                                          on a measured link the ratio of the backend's measured
                                                          communication time to the model at the fit sizes)
                 + (N > slots on a measured link) one scheduler slice (sched_slice_s) per latency step of each
                   collective
  overlapped   = min(f * T_comm(N), W * compute(N))      f: overlap_fraction measured at the fit sizes; W: the
                                                          share of compute that is backward, where buckets can
                                                          overlap (assumed 2/3)
  exposed(N)   = max(0, T_comm(N) - overlapped)
  step(N)      = compute(N) + exposed(N)
  efficiency   = strong: step(1) / (N * step(N)); weak: step(1) / step(N)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from dpcompare.commands.project.model import Link, collective_s
from dpcompare.measure.flops import DATASHEET_TFLOPS
from dpcompare.result_view import Figure, Metrics, RunResult

BACKWARD_SHARE = 2 / 3
"""Share of a step's compute during which gradient buckets can be in flight (backward ~ 2x forward)."""

SCHED_BASE_SLICE_S = 0.75e-3
"""The Linux scheduler's base time slice before scaling: sysctl_sched_base_slice, "0.75 msec * (1 + ilog(ncpus))"
(kernel/sched/fair.c, EEVDF; the same scaling applied to CFS's minimum granularity before it)."""


def sched_slice_s(cpus: int) -> float:
    """The base slice on a box with `cpus` CPUs: 0.75 ms * (1 + floor(log2(min(cpus, 8)))), the kernel's default
    logarithmic scaling (1.5 ms on 2 CPUs). When more ranks than cores share a box, a ring step waits for its peer to
    be scheduled: each latency step of a collective is charged one slice on top of alpha. Only on a measured link
    with CPU runs above `slots` ranks."""
    return SCHED_BASE_SLICE_S * (1 + int(math.log2(min(max(cpus, 1), 8))))


def oversubscription(n: int, slots: int | None) -> float:
    """How much longer a rank's compute takes when n ranks share `slots` cores: ceil(n / slots), the ranks on the
    fullest core if each rank stayed on its core's run queue through a step (a fair share of the box would be
    n / slots). A step ends in a collective that waits for the slowest rank. Measured on the 2-core box with no
    backend (experiments/core_sharing.py: the workload's forward and backward in k processes, a barrier before each
    step): 1.69 for 3 processes, 2.03-2.07 for 4, so the scheduler does move some work at 3; in the backends' runs the
    compute arm at 3 ranks came out at or above ceil (their communication threads share the same cores), which is
    why ceil and not the fair share. 1 without slots (one device per rank)."""
    return float(math.ceil(n / slots)) if slots and n > slots else 1.0


TRANSPORT_OF_LAUNCHER = {"torchrun": "torch", "horovodrun": "horovod", "deepspeed": "deepspeed", "mpirun": "mpi"}


def num(figure: Figure) -> float | None:
    """A recorded figure as a float, None where missing."""
    return None if figure.value is None else float(figure.value)


def local_batch(run: RunResult) -> float | None:
    lb = run.local_batch
    return None if lb is None else float(lb)


def messages(run: RunResult) -> list[tuple[str, float, int]]:
    """(collective kind, bytes per call, calls per step) of one run's gradient synchronisation: per kind from
    metrics.comm_by_kind (its measured calls per step, else the bucket count), else one all-reduce of
    grad_bytes_per_step cut into bucket_bytes."""
    grad = num(run.metrics.grad_bytes_per_step)
    bucket = num(run.metrics.bucket_bytes)
    by_kind = run.metrics.comm_by_kind.value
    out = []
    if isinstance(by_kind, dict) and by_kind:
        for kind, info in sorted(by_kind.items()):
            if not isinstance(info, dict):
                continue
            total = info.get("analytic_bytes_per_step") or info.get("bytes_per_step")
            if not isinstance(total, (int, float)) or total <= 0:
                continue
            calls = info.get("calls_per_step")
            if not (isinstance(calls, (int, float)) and calls >= 1):
                calls = math.ceil(total / bucket) if bucket else 1
            out.append((kind, float(total) / round(calls), int(round(calls))))
    if not out and grad:
        calls = max(1, math.ceil(grad / bucket)) if bucket else 1
        out.append(("all_reduce", grad / calls, calls))
    return out


def comm_model_s(msgs: list[tuple[str, float, int]], n: int, alpha: float, beta: float,
                 algorithm: str) -> tuple[float, str]:
    total, algos = 0.0, set()
    for kind, size, calls in msgs:
        t, algo = collective_s(kind, size, n, alpha, beta, algorithm)
        total += calls * t
        algos.add(algo)
    return total, "+".join(sorted(algos)) or "-"


@dataclass(slots=True)
class BackendFit:
    backend: str
    transport: str | None
    scaling: str
    global_batch: float | None
    local_batch: float | None
    c0_ms: float
    c1_ms: float
    """compute = c0 + c1 * per-rank batch (ms)."""
    step1_ms: float
    messages: list[tuple[str, float, int]]
    overlap: float
    overlap_source: str
    comm_measured: dict[int, float]
    """world size -> measured communication time per step (ms) used for k."""
    cpu_slots: int | None
    fit_world_sizes: list[int]
    notes: list[str] = field(default_factory=list)

    def batch_at(self, n: int) -> float:
        if self.scaling == "weak" or self.global_batch is None:
            return float(self.local_batch or 1.0)
        return self.global_batch / n

    def compute_ms(self, n: int, slots: int | None) -> float:
        per_rank = self.c0_ms + self.c1_ms * self.batch_at(n)
        return per_rank * oversubscription(n, slots)

    def calibration(self, link: Link, algorithm: str) -> tuple[float, str]:
        """k: measured communication / modelled, geometric mean over the fit sizes (measured links only)."""
        if not link.measured:
            return 1.0, "k = 1: a preset link, the backend assumed to reach the link's alpha-beta"
        alpha, beta, _ = link.for_transport(self.transport)
        ratios = []
        for n, measured in sorted(self.comm_measured.items()):
            model, _ = comm_model_s(self.messages, n, alpha, beta, algorithm)
            if model > 0 and measured > 0:
                ratios.append(measured / (model * 1e3))
        if not ratios:
            return 1.0, "k = 1: no communication time measured at the fit sizes"
        k = math.exp(sum(map(math.log, ratios)) / len(ratios))
        return k, f"k = {k:.2f}: measured communication / alpha-beta model at world size(s) {sorted(self.comm_measured)}"

    def predict(self, n: int, link: Link, algorithm: str, slots: int | None, k: float) -> dict[str, Any]:
        alpha, beta, which = link.for_transport(self.transport)
        compute = self.compute_ms(n, slots)
        t_model, algo = comm_model_s(self.messages, n, alpha, beta, algorithm)
        t_comm = k * t_model * 1e3
        if slots and n > slots and link.measured:  # oversubscribed: each latency step waits for a scheduler slice
            t_comm += comm_model_s(self.messages, n, sched_slice_s(slots), math.inf, algorithm)[0] * 1e3
        overlapped = min(self.overlap * t_comm, BACKWARD_SHARE * compute)
        exposed = max(0.0, t_comm - overlapped)
        step = compute + exposed
        step1 = self.compute_ms(1, slots)
        eff = (step1 / step if self.scaling == "weak" else step1 / (n * step)) if step > 0 else None
        return {"backend": self.backend, "world_size": n, "compute_ms": compute, "comm_total_ms": t_comm,
                "comm_exposed_ms": exposed, "step_ms": step, "efficiency": eff, "algorithm": algo,
                "samples_per_s": (self.batch_at(n) * n / step * 1e3) if step > 0 else None, "link_fit": which}


def _compute_points(runs: list[RunResult], slots: int | None) -> list[tuple[float, float]]:
    """(per-rank batch, compute ms) of the runs that ran without oversubscription."""
    pts = []
    for run in runs:
        n = run.world_size
        if slots and n > slots:
            continue
        c = num(run.metrics.step_ms_p50) if n == 1 else num(run.metrics.compute_ms_p50)
        b = local_batch(run)
        if c is not None and b is not None:
            pts.append((b, c))
    return pts


def fit_backend(backend: str, runs: list[RunResult], cpu_slots: int | None) -> BackendFit:
    """Fit one backend to its runs at the fit world sizes (newest per world size). Raises ValueError when they
    cannot give a compute model and a communication volume."""
    runs = sorted(runs, key=lambda r: r.world_size)
    sizes = [r.world_size for r in runs]
    pts = _compute_points(runs, cpu_slots)
    if not pts:
        raise ValueError(f"{backend}: no compute time at the fit world sizes {sizes} ({Metrics.step_ms_p50.name} "
                         f"at 1, {Metrics.compute_ms_p50.name} above; run with --measure-steps N)")
    notes = []
    bs = {b for b, _ in pts}
    if len(bs) >= 2:
        n = len(pts)
        mb, mc = sum(b for b, _ in pts) / n, sum(c for _, c in pts) / n
        c1 = sum((b - mb) * (c - mc) for b, c in pts) / sum((b - mb) ** 2 for b, _ in pts)
        c0 = mc - c1 * mb
        if c0 < 0 or c1 < 0:
            c1, c0 = max(0.0, mc / mb), 0.0
            notes.append("compute fit gave a negative term: compute taken proportional to the per-rank batch")
    else:
        b, c = pts[0]
        c0, c1 = 0.0, c / b
        notes.append("compute measured at one per-rank batch only: taken proportional to it (no fixed part)")
    multi = [r for r in runs if r.world_size > 1]
    if not multi:
        raise ValueError(f"{backend}: no run above world size 1 among the fit sizes {sizes}: nothing to measure "
                         "its communication on")
    ref = multi[-1]
    msgs = messages(ref)
    if not msgs:
        raise ValueError(f"{backend}: its runs record neither grad_bytes_per_step nor comm_by_kind")
    overlaps = [(r.world_size, num(r.metrics.overlap_fraction)) for r in multi]
    overlaps = [(n, f) for n, f in overlaps if f is not None]
    if overlaps:
        overlap = min(1.0, max(0.0, sum(f for _, f in overlaps) / len(overlaps)))
        overlap_source = f"overlap_fraction measured at world size(s) {[n for n, _ in overlaps]}"
    else:
        overlap, overlap_source = 0.0, "no overlap_fraction measured: assumed 0 (all communication exposed)"
    comm = {}
    for r in multi:
        total = num(r.metrics.comm_total_ms)
        if total is None:
            exposed = num(r.metrics.comm_exposed_ms)
            total = exposed / (1 - overlap) if exposed is not None and overlap < 1 else None
        if total is not None and total > 0:
            comm[r.world_size] = total
    step1 = next((num(r.metrics.step_ms_p50) for r in runs if r.world_size == 1), None)
    transport = TRANSPORT_OF_LAUNCHER.get(str(ref.native_launcher))
    scaling = ref.scaling or "strong"
    gb = ref.global_batch
    return BackendFit(backend, transport, str(scaling), float(gb) if isinstance(gb, (int, float)) else None,
                      local_batch(ref), c0, c1, step1 if step1 is not None else c0 + c1 * pts[0][0], msgs, overlap,
                      overlap_source, comm, cpu_slots, sizes, notes)


DEVICES = {name.lower().replace(" ", "-"): name for name in DATASHEET_TFLOPS}
"""`project --device` names: the devices whose datasheet peaks dpcompare.measure.flops knows."""


def on_device(fit: BackendFit, runs: list[RunResult], device: str) -> BackendFit:
    """`fit` with its compute moved to `device` at the MFU its runs reached: scaled by the runs' measured matmul
    peak over the device's datasheet peak in the same dtype. Raises ValueError where the runs have no peak."""
    with_peak = [r for r in sorted(runs, key=lambda r: r.created_unix or 0.0)
                 if num(r.metrics.peak_tflops_measured) and r.metrics.compute_dtype.value]
    if not with_peak:
        raise ValueError(f"{fit.backend}: no run records {Metrics.peak_tflops_measured.name} (results written before "
                         "dpcompare measured the matmul peak): rerun compare to project its compute onto --device")
    run = with_peak[-1]
    measured, dtype = float(num(run.metrics.peak_tflops_measured) or 0.0), str(run.metrics.compute_dtype.value)
    name = DEVICES[device]
    target = DATASHEET_TFLOPS[name].get(dtype)
    if not target:
        raise ValueError(f"{fit.backend}: the runs computed in {dtype}, which {name}'s datasheet figures "
                         f"({', '.join(DATASHEET_TFLOPS[name])}) do not give")
    scale = measured / target
    note = (f"compute moved to {name}: x {scale:.3g}, the runs' measured matmul peak {measured:.3g} TFLOP/s in {dtype} "
            f"over {name}'s datasheet {target:.4g} (dense), at the same MFU: a model that reaches a larger share of "
            "the bigger device's peak runs faster than projected, one bound by memory or launches slower")
    return replace(fit, c0_ms=fit.c0_ms * scale, c1_ms=fit.c1_ms * scale, step1_ms=fit.step1_ms * scale,
                   notes=[*fit.notes, note])
