"""Exposed communication read from a rank's --profile trace: the second method beside the ablation.

Owns: which events of a Chrome/Perfetto trace (torch.profiler's export) are communication and which compute, the
per-step arithmetic of exposed communication from them, the agreement of that figure with the ablation's, and which
of the two to trust when they disagree. Pure functions over the trace's event list: the run reads its own trace
(dpcompare.run.measurement), a test a synthetic one.

  communication   the collectives' own events: the process group's work (`gloo:all_reduce`, `nccl:all_reduce`, ...)
                  on whichever thread ran it, the c10d ops the step's thread called (`c10d::allreduce_`), and on a
                  GPU the NCCL kernels (`ncclDevKernel_*`, `ncclKernel_*`)
  compute         on a GPU, every other kernel; without kernels (a CPU run), the CPU ops of the thread that ran the
                  step (the one holding the `dpcompare.step N` ranges), the communication ops nested in them taken out
  window          a step's range, cut at the end of its `dpcompare.reduce` phase: what communication still runs after
                  the gradients were handed to the optimizer is no longer the step's to wait for. On a GPU the host
                  runs ahead of the kernels: the whole range, which ends with a synchronize (every kernel of the step
                  inside it, the optimizer's queued behind the collectives it waits for)
  exposed         the time in the window where communication is in flight and no compute runs (the HTA definition,
                  "communication not overlapped by computation"), ms per step
  arrival         when the rank asked for each collective: the c10d op's start on the step's thread (a CPU run),
                  the NCCL kernel's start (a GPU); a rank's wait at a collective is the last rank's arrival less its
                  own, its arrival skew

A rank that reaches a collective before its peers waits out their compute there: its trace books that skew as
exposed communication, and the rank that arrived last shows the collective alone. The step, as slow as its slowest
rank, pays the latter, which the ablation's slowest-rank difference is meant to measure (it also carries the ranks'
skew: `trust`): the run's figure takes the smallest rank in each traced step, the median over the steps
(`comm_exposed_trace_ms`), every rank's beside it.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Sequence

import numpy as np

COMM_EVENT = re.compile(r"^(gloo|nccl|mpi|ucc|xccl):|^c10d::|^nccl(Dev)?Kernel_|^record_param_comms$")
"""The names of communication events (the process groups' work, the c10d ops, NCCL's kernels)."""
STEP = re.compile(r"^dpcompare\.step (\d+)$")
AGREEMENT = 0.20
"""The two figures agree when they differ by no more than this fraction of the ablation's."""
SKEW_FACTOR = 1.5
"""An ablation above the trace by at most this many times the ranks' skew is explained by it (a rank slower by s ms
makes the ablation the collective plus s; a planted 7.6 ms straggler on this box showed waits of 9-10 ms and a gap
of 11.2-11.5 ms: docs/results/2026-11-28-traces-cpu.md)."""

Interval = tuple[float, float]


def _union(intervals: Iterable[Interval]) -> list[Interval]:
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if b <= a:
            continue
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _minus(these: list[Interval], those: list[Interval]) -> list[Interval]:
    """`these` less `those` (both unions, sorted, disjoint)."""
    out, j = [], 0
    for a, b in these:
        start = a
        while j < len(those) and those[j][1] <= start:
            j += 1
        k = j
        while k < len(those) and those[k][0] < b:
            if those[k][0] > start:
                out.append((start, those[k][0]))
            start = max(start, those[k][1])
            k += 1
        if start < b:
            out.append((start, b))
    return out


def _clip(intervals: list[Interval], lo: float, hi: float) -> list[Interval]:
    return [(max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi]


def _length(intervals: Iterable[Interval]) -> float:
    return sum(b - a for a, b in intervals)


def _span(e: dict[str, Any]) -> Interval:
    return float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))


def is_comm(name: str) -> bool:
    return bool(COMM_EVENT.search(name or ""))


def per_step(events: Sequence[dict[str, Any]]) -> list[dict[str, float]]:
    """Each traced step's communication and exposed communication (ms), from a trace's events (`traceEvents`).
    Empty when the trace holds no `dpcompare.step N` range."""
    complete = [e for e in events if e.get("ph") == "X" and "ts" in e]
    steps = [e for e in complete if STEP.match(str(e.get("name", "")))]
    if not steps:
        return []
    main = steps[0].get("tid")
    kernels = [e for e in complete if e.get("cat") == "kernel"]
    comm = [_span(e) for e in complete if is_comm(str(e.get("name", "")))]
    if kernels:  # a GPU: kernels against kernels, the window stretched to the step's last kernel
        compute = _union(_span(e) for e in kernels if not is_comm(str(e.get("name", ""))))
        comm = [_span(e) for e in kernels if is_comm(str(e.get("name", "")))]
    else:
        on_main = [e for e in complete if e.get("tid") == main and e.get("cat") == "cpu_op"]
        waits = _union(_span(e) for e in on_main if is_comm(str(e.get("name", ""))))
        compute = _minus(_union(_span(e) for e in on_main if not is_comm(str(e.get("name", "")))), waits)
    launches = sorted(_span(e)[0] for e in (kernels if kernels else [e for e in complete if e.get("tid") == main])
                      if is_comm(str(e.get("name", ""))) and (kernels or str(e.get("name", "")).startswith("c10d::")))
    comm = _union(comm)
    reduces = sorted(_span(e) for e in complete if e.get("name") == "dpcompare.reduce" and e.get("tid") == main)
    out = []
    for s in sorted(steps, key=lambda e: float(e["ts"])):
        lo, hi = _span(s)
        cut = [b for a, b in reduces if lo <= a <= hi]
        end = cut[0] if cut else hi
        if kernels:  # the GPU runs behind the host: the step's range ends after a synchronize, its kernels inside it
            end = hi
        in_flight = _clip(comm, lo, end)
        exposed = _minus(in_flight, _union(_clip(compute, lo, end)))
        out.append({"step": int(STEP.match(str(s["name"])).group(1)), "comm_ms": _length(in_flight) / 1e3,
                    "exposed_ms": _length(exposed) / 1e3, "arrivals_us": [t for t in launches if lo <= t <= end]})
    return out


def rank_figure(steps: list[dict[str, float]]) -> dict[str, Any] | None:
    """A rank's medians over its traced steps, or None without steps."""
    if not steps:
        return None
    return {"exposed_ms": float(np.median([s["exposed_ms"] for s in steps])),
            "comm_ms": float(np.median([s["comm_ms"] for s in steps])), "steps": steps}


def trust(ablation: float | None, ablation_ci: Sequence[float] | None, traced: float | None,
          waits: Sequence[float | None] | None = None) -> tuple[str | None, str]:
    """(which figure to trust, why) for exposed communication measured both ways; which is None when neither is.
    `waits`: each rank's wait at the traced collectives for the last to arrive (arrival_waits)."""
    if traced is None and ablation is None:
        return None, "neither figure was measured"
    if traced is None:
        return "ablation", "the trace has no exposed communication (not profiled, or no collective in its steps)"
    if ablation is None:
        return "trace", "the ablation did not run (no pairs of synced and unsynced steps): the trace is the only figure"
    if ablation_ci and ablation_ci[0] <= traced <= ablation_ci[1]:
        return "both", "the trace's figure lies inside the ablation's 95 % interval"
    if abs(traced - ablation) <= AGREEMENT * max(ablation, 1e-9):
        return "both", f"they agree within {AGREEMENT:.0%}"
    skew = max([w for w in waits or [] if w is not None], default=0.0)
    if ablation > traced and ablation - traced <= SKEW_FACTOR * skew:
        return "trace", (f"the trace: the ranks arrive apart (a rank waits {skew:.3g} ms per step for the last at the "
                         "collectives), and the ablation's synced step starts with the lag the ranks built up in the "
                         "unsynced step before it, so a rank slower in compute by s ms makes it the collective plus s; "
                         "the trace's figure is the last rank's, the collective alone")
    if ablation > traced:
        return "ablation", ("the ablation: it times everything synchronising adds to the step over the measured steps "
                            "(the backend's own work around the collective, compute slowed by the collective running "
                            "beside it: on a CPU its thread shares the cores), which a trace books as compute")
    return "ablation", ("the ablation: it times unprofiled steps, the measured window's; the trace's few steps run "
                        "under the profiler, whose cost per op and per collective event lengthens the waits it books "
                        "as exposed")

def run_figure(figures: Sequence[dict[str, Any] | None]) -> tuple[float, int, float] | None:
    """(exposed ms, rank, communication ms) of the run: in each traced step the rank showing least exposed
    communication (the last to arrive, whose wait is the collective alone; it may change from step to step), the
    median over the steps, and the rank that was it most often. Where the ranks traced different steps, the rank
    whose median is least. None where no rank has a figure."""
    ranked = [(rank, {s["step"]: s for s in f["steps"]}) for rank, f in enumerate(figures) if f]
    if not ranked:
        return None
    common = sorted(set.intersection(*(set(steps) for _, steps in ranked)))
    if not common:
        return min((f["exposed_ms"], rank, f["comm_ms"]) for rank, f in enumerate(figures) if f)
    last = [min((steps[k]["exposed_ms"], rank, steps[k]["comm_ms"]) for rank, steps in ranked) for k in common]
    ranks = [rank for _, rank, _ in last]
    return (float(np.median([e for e, _, _ in last])), max(set(ranks), key=ranks.count),
            float(np.median([c for _, _, c in last])))

def arrival_waits(figures: Sequence[dict[str, Any] | None]) -> list[float | None] | None:
    """Each rank's wait at the traced steps' collectives for the last rank to arrive (ms per step, the median over
    the steps): at each collective (the i-th a step issued, on every rank), the last arrival less this rank's.
    None where fewer than two ranks have traces, or the ranks' steps issued different numbers of collectives. The
    traces' clocks are each host's: across hosts the figure is only as good as their clocks agree."""
    ranks = [{s["step"]: s.get("arrivals_us") or [] for s in f["steps"]} if f else None for f in figures]
    if sum(r is not None for r in ranks) < 2:
        return None
    steps = sorted(set.intersection(*(set(r) for r in ranks if r is not None)))
    waits: list[list[float]] = [[] for _ in ranks]
    for step in steps:
        times = [r[step] if r is not None else None for r in ranks]
        if len({len(t) for t in times if t is not None}) != 1:
            return None
        last = np.max([t for t in times if t is not None], axis=0)
        for rank, t in enumerate(times):
            if t is not None:
                waits[rank].append(float(np.sum(last - np.asarray(t))) / 1e3)
    return [float(np.median(w)) if w else None for w in waits]
