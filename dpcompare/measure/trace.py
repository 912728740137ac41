"""Exposed communication read from a rank's --profile trace: the second method beside the ablation.

Owns: which events of a Chrome/Perfetto trace (torch.profiler's export) are communication and which compute, the
per-step arithmetic of exposed communication from them, the agreement of that figure with the ablation's, and which
of the two to trust when they disagree, and the run's comm_exposed_trace_* figures rank 0 writes from every rank's
(`record_traced`). Pure functions over the trace's event list: the run reads its own trace
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
  slowed          where the run has an ablation, each traced step is followed by its unsynced twin
                  (`dpcompare.unsynced N`, the same batch, synchronisation off, no optimizer step; its whole range,
                  as the ablation's unsynced arm runs up to where a synced step's reduce would end): the
                  step's compute less the twin's is what synchronising added to the compute (a collective's thread
                  sharing a CPU rank's cores, the backend's own copies around it), which the ablation counts and
                  the exposed figure, by definition, does not

A rank that reaches a collective before its peers waits out their compute there: its trace books that skew as
exposed communication, and the rank that arrived last shows the collective alone. The step, as slow as its slowest
rank, pays the latter, which the ablation's slowest-rank difference measures too (its arms start with the ranks lined
up): the run's figure takes the smallest rank in each traced step, the median over the steps
(`comm_exposed_trace_ms`), every rank's beside it, and that rank's slowed compute (`comm_slowed_compute_trace_ms`).
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Sequence

import numpy as np

from dpcompare.measure.samples import Metrics

COMM_EVENT = re.compile(r"^(gloo|nccl|mpi|ucc|xccl):|^c10d::|^nccl(Dev)?Kernel_|^record_param_comms$")
"""The names of communication events (the process groups' work, the c10d ops, NCCL's kernels)."""
STEP = re.compile(r"^dpcompare\.step (\d+)$")
UNSYNCED = re.compile(r"^dpcompare\.unsynced (\d+)$")
"""The ablation's unsynced twin of a traced step (the same batch, synchronisation off), where the run has one."""
AGREEMENT = 0.20
"""The two figures agree when they differ by no more than this fraction of the ablation's."""
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
    twins = {int(m.group(1)): _span(e) for e in complete if (m := UNSYNCED.match(str(e.get("name", ""))))}
    out = []
    for s in sorted(steps, key=lambda e: float(e["ts"])):
        lo, hi = _span(s)
        end = hi if kernels else _end(reduces, lo, hi)
        in_flight = _clip(comm, lo, end)
        busy = _union(_clip(compute, lo, end))
        exposed = _minus(in_flight, busy)
        step = int(STEP.match(str(s["name"])).group(1))
        figure = {"step": step, "comm_ms": _length(in_flight) / 1e3, "exposed_ms": _length(exposed) / 1e3,
                  "compute_ms": _length(busy) / 1e3, "arrivals_us": [t for t in launches if lo <= t <= end]}
        if step in twins:  # the unsynced twin: its whole range (no reduce, no optimizer step), as the ablation's arm
            figure["unsynced_compute_ms"] = _length(_clip(compute, *twins[step])) / 1e3
        out.append(figure)
    return out


def _end(phases: list[Interval], lo: float, hi: float) -> float:
    """Where the first of `phases` that starts inside [lo, hi] ends (a step's reduce), else hi."""
    return next((b for a, b in phases if lo <= a <= hi), hi)


def rank_figure(steps: list[dict[str, float]]) -> dict[str, Any] | None:
    """A rank's medians over its traced steps, or None without steps."""
    if not steps:
        return None
    slowed = [_slowed(s) for s in steps if "unsynced_compute_ms" in s]
    return {"exposed_ms": float(np.median([s["exposed_ms"] for s in steps])),
            "comm_ms": float(np.median([s["comm_ms"] for s in steps])),
            "slowed_ms": float(np.median(slowed)) if slowed else None, "steps": steps}


def _slowed(step: dict[str, Any]) -> float:
    """What synchronising added to a traced step's compute: its compute less its unsynced twin's (ms)."""
    return step["compute_ms"] - step["unsynced_compute_ms"]


def trust(ablation: float | None, ablation_ci: Sequence[float] | None, traced: float | None,
          slowed: float | None = None) -> tuple[str | None, str]:
    """(which figure to trust, why) for exposed communication measured both ways; which is None when neither is.
    `slowed`: what synchronising added to the traced steps' compute, as the ablation's slowest rank pays it
    (run_slowed; None where the traced steps had no unsynced twins)."""
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
    if ablation > traced and slowed is not None and slowed > 0 \
            and abs(traced + slowed - ablation) <= AGREEMENT * ablation:
        return "both", (f"they agree within {AGREEMENT:.0%} once the compute that synchronising slowed is counted: "
                        f"the trace's exposed {traced:.3g} ms plus the {slowed:.3g} ms its synced steps' compute took "
                        f"over their unsynced twins' against the ablation's {ablation:.3g} ms, which counts that "
                        "slowed compute (the collective's thread sharing the cores, the backend's own work around it) "
                        "as what synchronising costs, where the trace books it as compute")
    if ablation > traced:
        measured = (f" (the trace's synced steps' compute took {slowed:.3g} ms over their unsynced twins', "
                    f"{traced + slowed:.3g} ms with the exposed figure)" if slowed is not None else "")
        return "ablation", ("the ablation: it times everything synchronising adds to the step over the measured steps "
                            "(the backend's own work around the collective, compute slowed by the collective running "
                            f"beside it: on a CPU its thread shares the cores), which a trace books as compute{measured}")
    return "ablation", ("the ablation: it times unprofiled steps, the measured window's; the trace's few steps run "
                        "under the profiler, whose cost per op and per collective event lengthens the waits it books "
                        "as exposed")


def _lasts(figures: Sequence[dict[str, Any] | None]) -> list[tuple[int, dict[str, Any]]]:
    """In each step every rank traced, (rank, its figure for the step) of the rank showing least exposed communication
    (the last to arrive, whose wait is the collective alone; it may change from step to step); the lower rank on a
    tie. Empty where the ranks share no traced step."""
    ranked = [(rank, {s["step"]: s for s in f["steps"]}) for rank, f in enumerate(figures) if f]
    common = sorted(set.intersection(*(set(steps) for _, steps in ranked))) if ranked else []
    return [min(((rank, steps[k]) for rank, steps in ranked), key=lambda r: (r[1]["exposed_ms"], r[0], r[1]["comm_ms"]))
            for k in common]


def run_figure(figures: Sequence[dict[str, Any] | None]) -> tuple[float, int, float] | None:
    """(exposed ms, rank, communication ms) of the run: in each traced step the last rank to arrive (`_lasts`), the
    median over the steps, and the rank that was it most often. Where the ranks traced different steps, the rank
    whose median is least. None where no rank has a figure."""
    if not any(figures):
        return None
    last = _lasts(figures)
    if not last:
        return min((f["exposed_ms"], rank, f["comm_ms"]) for rank, f in enumerate(figures) if f)
    ranks = [rank for rank, _ in last]
    return (float(np.median([s["exposed_ms"] for _, s in last])), max(set(ranks), key=ranks.count),
            float(np.median([s["comm_ms"] for _, s in last])))


def run_slowed(figures: Sequence[dict[str, Any] | None]) -> float | None:
    """The compute that synchronising slowed, as the ablation's slowest rank pays it: in each traced step the last
    rank to arrive (`_lasts`), its compute less its unsynced twin's, the median over the steps. None where no step has
    a twin."""
    slowed = [_slowed(s) for _, s in _lasts(figures) if "unsynced_compute_ms" in s]
    return float(np.median(slowed)) if slowed else None


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


def record_traced(m: Metrics, figures: list[dict[str, Any] | None] | None, ablation: float | None,
                  ablation_ci: list[float] | None = None) -> None:
    """The run's figures from the ranks' traces: exposed communication beside the ablation's, each rank's wait at
    its collectives, the compute synchronising slowed, and which exposed figure to trust."""
    found = run_figure(figures) if figures else None
    why = ("not asked for (--profile)" if figures is None else
           "the traces hold no dpcompare.step range with a collective in it")
    m.set("comm_exposed_trace_ms", found[0] if found else None, why)
    m.set("comm_exposed_trace_rank", found[1] if found else None, why)
    m.set("comm_trace_ms", found[2] if found else None, why)
    m.set("comm_exposed_trace_ms_per_rank", [f["exposed_ms"] if f else None for f in figures] if found else None, why)
    m.set("comm_exposed_trace_ratio", found[0] / ablation if found and ablation else None,
          "needs the trace's exposed communication and the ablation's, non-zero")
    waits = arrival_waits(figures) if found and figures else None
    m.set("comm_arrival_wait_ms_per_rank", waits,
          why if not found else "needs two ranks' traces whose steps issued the same collectives")
    slowed = run_slowed(figures) if found and figures else None
    m.set("comm_slowed_compute_trace_ms", slowed,
          why if not found else "the traced steps had no unsynced twins (no ablation: --ablation-steps 0, or a backend "
          "that cannot switch synchronisation off)")
    which, because = trust(ablation, ablation_ci, found[0] if found else None, slowed)
    m.set("comm_exposed_trust", which, because)
    m.set("comm_exposed_trust_why", because)
