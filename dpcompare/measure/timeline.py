"""Horovod timeline (Chrome trace) reading: how long all-reduces were in flight.

Owns: tolerant parsing of the timeline file (Horovod leaves the JSON array open while it writes) and the
union of the top-level ALLREDUCE intervals over all tensors (fusion runs several tensors through one
all-reduce at once; a union counts that time once): the transfer. With NEGOTIATE_ALLREDUCE added (on rank
0's timeline it begins when the first rank asks for a tensor and ends when the last has), the union is the
time spent in communication waiting for peers included, what DDP's own counter books on its fastest rank.
Imports no adapter and no Horovod.
"""

from __future__ import annotations

import json
from pathlib import Path


def load_events(path: str | Path) -> list[dict]:
    text = Path(path).read_text().strip()
    if not text:
        return []
    text = text.rstrip(",")
    if not text.endswith("]"):
        text += "]"
    return json.loads(text)


def allreduce_intervals(events: list[dict], ops: tuple[str, ...] = ("ALLREDUCE",)) -> list[tuple[float, float]]:
    """(begin_us, end_us) of each top-level activity named in `ops`, per tensor (pid), from B/E pairs."""
    stacks: dict[int, list[tuple[str, float]]] = {}
    out = []
    for e in events:
        ph, pid = e.get("ph"), e.get("pid")
        if ph == "B":
            stacks.setdefault(pid, []).append((e.get("name", ""), float(e["ts"])))
        elif ph == "E" and stacks.get(pid):
            name, begin = stacks[pid].pop()
            if name in ops and not stacks[pid]:
                out.append((begin, float(e["ts"])))
    return out


def union_ms(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total / 1e3


NEGOTIATED = ("NEGOTIATE_ALLREDUCE", "ALLREDUCE")


def allreduce_busy_ms(path: str | Path, ops: tuple[str, ...] = ("ALLREDUCE",)) -> float:
    return union_ms(allreduce_intervals(load_events(path), ops))
