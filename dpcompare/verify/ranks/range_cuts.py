"""A parameter cut over the ranks (dpcompare.verify.ranks.range_plan): its pieces sent to their holders, put back together on rank
0, and its figures merged from its pieces'.

Owns: `send` and `send_to` (rank 0's value of a parameter, each holder's piece sent to it), `receive_whole` (the whole value from its
holders' pieces, rank 0's own among them), `by_parameter` (figures gathered from the ranks in rank order, each
parameter's pieces' figures listed in their order), `merge_figures` (dpcompare.verify.judgement.tolerance.range_figures of a
parameter from its pieces': squared norms add, maxima and finiteness combine), `merge_drift` (the reference
trajectory's figures so merged) and `norm_of` (a cut parameter's gradient norm from its pieces' norms, as clipping
takes it). Used by dpcompare.verify.memory.divider, dpcompare.verify.replay.replay_ranges, dpcompare.verify.trajectory.trajectory_ranges and
dpcompare.verify.trajectory.reference_trajectory. Imports no adapter.

What a merge changes: a squared norm summed over pieces rounds apart from one pass over the whole by float64's
rounding; the largest error is exact; the largest relative error takes each piece's own max |o| as its scale (at most
the whole's), so it is never below the whole's (reported, never judged); a clipping norm of a cut parameter is the norm
of its pieces' norms, a few units of the dtype's rounding from one norm of the whole.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Iterable, Sequence

import torch
import torch.distributed as dist

from dpcompare.verify.ranks.range_plan import Plan
from dpcompare.verify.judgement.tolerance import _fmax, _Sums


def send(plan: Plan, name: str, value: torch.Tensor, group: Any, me: int = 0) -> None:
    """Each holder of `name` other than `me` sent its piece of `value`, in the holders' order."""
    for piece in plan.holders(name):
        if piece.rank != me:
            send_to(plan, name, value, piece.rank, group)


def send_to(plan: Plan, name: str, value: torch.Tensor, rank: int, group: Any) -> None:
    """`rank`'s piece of `value` (a value of `name`) sent to it."""
    dist.send(plan.take(name, rank, value).detach().to("cpu").contiguous(), dst=rank, group=group)


def receive_whole(plan: Plan, name: str, shape: Sequence[int], dtype: torch.dtype, own: torch.Tensor | None,
                  group: Any) -> torch.Tensor:
    """Rank 0: the whole value of `name` (of `shape`, in `dtype`) from its holders' pieces, `own` being rank 0's
    piece where it holds one."""
    parts = []
    for piece in plan.holders(name):
        if piece.rank == 0:
            parts.append(own.to(dtype))
            continue
        t = torch.empty(plan.shape(name, piece.rank, shape), dtype=dtype)
        dist.recv(t, src=piece.rank, group=group)
        parts.append(t)
    return plan.join(name, parts, shape)


def by_parameter(parts: Iterable[dict]) -> dict[str, list]:
    """Per-parameter figures from each rank, in rank order (so a cut parameter's pieces in their order): by
    parameter, the list of its pieces' figures."""
    out: dict[str, list] = {}
    for part in parts:
        for name, figure in part.items():
            out.setdefault(name, []).append(figure)
    return out


def merge_figures(op: str, parts: list) -> Any:
    """One parameter's `range_figures` `op` from those of its pieces, in their order (see the module docstring)."""
    if len(parts) == 1:
        return parts[0]
    if op == "finite":
        return all(parts)
    if op == "norm":
        return math.sqrt(sum(x * x for x in parts))
    if op == "fro":
        return tuple(math.sqrt(sum(p[i] ** 2 for p in parts)) for i in range(2))
    if op == "sums":
        sums = [p[0] for p in parts]
        rels = [s.max_rel for s in sums if not math.isnan(s.max_rel)]
        merged = _Sums(*(sum(getattr(s, f) for s in sums) for f in ("o2", "a2", "go2", "ga2", "fo2", "oa2")),
                       functools.reduce(_fmax, (s.max_abs for s in sums)), max(rels) if rels else math.nan,
                       all(s.finite for s in sums), sum(s.g2 for s in sums))
        return merged, sum(p[1] for p in parts)
    raise ValueError(f"unknown reduction {op!r}")


def merge_drift(figures: list[tuple]) -> tuple[bool, float, float, bool, float]:
    """One parameter's reference-trajectory figures (finite, norm, distance, the run's finite, the floor's distance)
    from its pieces': finiteness combined, the norms from their squares added."""
    if len(figures) == 1:
        return figures[0]
    root = lambda i: math.sqrt(sum(f[i] ** 2 for f in figures))  # noqa: E731
    return (all(f[0] for f in figures), root(1), root(2), all(f[3] for f in figures), root(4))


def norm_of(norms: list[torch.Tensor]) -> torch.Tensor:
    """A parameter's gradient norm from its pieces' norms (itself where it is whole), in their dtype."""
    return norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))
