"""Communication volume by kind: the ZeRO paper's prediction of what a step sends, and the figures a run's
collective records (dpcompare.measure.collectives.CollectiveRecorder) turn into, with nccl-tests' bus factors.

Owns: `analytic_bytes_per_step`, `analytic_method`, `kind_ranks`, `comm_by_kind`, `union_ms`, and the run's
metrics.comm_by_kind (`record_by_kind`). Imports numpy only (the report reads these figures on machines without
torch's backends).

  comm by kind   bytes, calls and time per step of all-reduce, reduce-scatter, all-gather (broadcast, reduce) where
                 Python dispatched them, beside the analytic volume; busbw with nccl-tests' factor per kind
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dpcompare.measure.bandwidth import BUS_FACTOR_DOC, algbw_gbps, bus_factor
from dpcompare.measure.samples import Metrics, RankSample

KINDS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce")

NOT_IN_PYTHON = ("no collective went through torch.distributed's Python functions in the measured window: this "
                 "backend communicates outside them (DDP's C++ Reducer, Horovod's own runtime), so only the analytic "
                 "volume is known")


def union_ms(spans: list[tuple[float, float]]) -> float:
    """The length of the union of [start, end) intervals (overlapping calls counted once)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


# -- the prediction -------------------------------------------------------------------------------------------
def _shard_ranks(world_size: int, replicas: int) -> int:
    if replicas < 1 or world_size % replicas:
        raise ValueError(f"replicas must divide the world size, got {replicas} replicas of world size {world_size}")
    return world_size // replicas


def analytic_bytes_per_step(shards: str, grad_bytes: int, param_bytes: int, world_size: int,
                            reshard: bool = True, replicas: int = 1) -> dict[str, int]:
    """Bytes per optimizer step (one micro-batch) by kind, in nccl-tests' count (the full buffer), as the ZeRO paper
    accounts them: replicas (shards none: DDP, Horovod, ZeRO-0) all-reduce the gradients; ZeRO-1 and ZeRO-2
    reduce-scatter the gradients and all-gather the updated parameters (the same bus traffic as the all-reduce);
    ZeRO-3 and FSDP reduce-scatter the gradients and all-gather the parameters before the forward and again before
    the backward when they were resharded after the forward (reshard), 1.5x the all-reduce's bus traffic. `grad_bytes`
    in the dtype they are sent in, `param_bytes` in the dtype they are gathered in. {} at world size 1.

    `replicas` > 1 (HSDP, shards parameters only: capabilities.shard_replicas): the reduce-scatter and the
    all-gathers run within a shard group of world_size / replicas ranks, as above, and each rank then all-reduces its
    gradient shard (1/(world_size / replicas) of the gradients) with the other replica groups."""
    if world_size < 2:
        return {}
    shard_ranks = _shard_ranks(world_size, replicas)
    if replicas > 1 and shards != "parameters":
        raise ValueError(f"replicas > 1 (HSDP) shards the parameters, got shards={shards!r}")
    if shards == "none":
        return {"all_reduce": grad_bytes}
    if shards in ("optimizer", "gradients"):
        return {"reduce_scatter": grad_bytes, "all_gather": param_bytes}
    if shards == "parameters":
        gathers = 2 if reshard else 1
        out = {} if shard_ranks == 1 else {"reduce_scatter": grad_bytes, "all_gather": gathers * param_bytes}
        if replicas > 1:
            out["all_reduce"] = grad_bytes // shard_ranks
        return out
    raise ValueError(f"shards must be none, optimizer, gradients or parameters, got {shards!r}")


def analytic_method(shards: str, reshard: bool, replicas: int = 1) -> str:
    what = {"none": "all-reduce of the gradients (replicas)",
            "optimizer": "reduce-scatter of the gradients + all-gather of the parameters (ZeRO-1)",
            "gradients": "reduce-scatter of the gradients + all-gather of the parameters (ZeRO-2)",
            "parameters": "reduce-scatter of the gradients + " + ("2 all-gathers of the parameters (forward and "
                          "backward, resharded after the forward)" if reshard else "1 all-gather of the parameters "
                          "(kept after the forward)") + " (ZeRO-3 / FSDP)"}
    hsdp = (f"; HSDP, {replicas} replica groups: the reduce-scatter and the all-gathers within a shard group "
            f"(world_size / {replicas} ranks), then an all-reduce of each rank's gradient shard across the {replicas} "
            "groups" if replicas > 1 else "")
    return f"analytic from capabilities.shards={shards}: {what.get(shards, shards)}{hsdp}, one micro-batch per step"


def kind_ranks(world_size: int, replicas: int = 1) -> dict[str, int]:
    """The ranks one call of each kind spans, for its bus factor: every rank, but under HSDP (`replicas` > 1) the
    reduce-scatter and the all-gather span a shard group (world_size / replicas ranks) and the all-reduce a replicate
    group (`replicas` ranks)."""
    if replicas == 1:
        return {kind: world_size for kind in KINDS}
    shard_ranks = _shard_ranks(world_size, replicas)
    return {**{kind: world_size for kind in KINDS}, "all_reduce": replicas, "reduce_scatter": shard_ranks,
            "all_gather": shard_ranks}


# -- the figures ----------------------------------------------------------------------------------------------
def _rank_kind(record: dict[str, Any] | None, kind: str) -> dict[str, list] | None:
    if not isinstance(record, dict):
        return None
    return (record.get("kinds") or {}).get(kind)


def comm_by_kind(records: list[dict[str, Any] | None], analytic: dict[str, int], world_size: int,
                 measured_reason: str | None, analytic_how: str, replicas: int = 1) -> dict[str, dict[str, Any]]:
    """{kind: {bytes_per_step, calls_per_step, ms_per_step, ms_per_step_max, busbw_gbps, bus_bytes_per_step, method,
    analytic_bytes_per_step, analytic_bus_bytes_per_step, analytic_method, group_ranks}} for every kind predicted or
    seen (method: how the measured figures were taken, or why there are none; group_ranks: the ranks one call spans,
    kind_ranks(world_size, replicas), whose bus factor the bus figures take).

    Bytes and calls are rank 0's means over the measured steps; ms_per_step is the median per-step time (union of
    the kind's calls) of the rank that spent least in that kind (the others waited for it: as comm_transfer_ms),
    ms_per_step_max the rank that spent most; busbw = bytes / ms x nccl-tests' factor. A measured figure is None
    when nothing was recorded (`measured_reason`: instrumentation off, one rank) or when no collective at all
    passed the wrappers (NOT_IN_PYTHON): then only the analytic volume stands."""
    seen = [r for r in records if isinstance(r, dict) and any(
        sum(k.get("calls") or ()) for k in (r.get("kinds") or {}).values())]
    reason = measured_reason or (None if seen else NOT_IN_PYTHON)
    kinds = [k for k in KINDS if k in analytic or any(_rank_kind(r, k) for r in seen)]
    rank0 = records[0] if records else None
    ranks = kind_ranks(world_size, replicas)
    out: dict[str, dict[str, Any]] = {}
    for kind in kinds:
        factor = bus_factor(kind, ranks[kind])
        predicted = analytic.get(kind, 0)
        row: dict[str, Any] = {"analytic_bytes_per_step": predicted, "analytic_bus_bytes_per_step": predicted * factor,
                               "analytic_method": analytic_how, "group_ranks": ranks[kind]}
        if reason:
            row.update(bytes_per_step=None, calls_per_step=None, ms_per_step=None, ms_per_step_max=None,
                       busbw_gbps=None, bus_bytes_per_step=None, method=f"not measured: {reason}")
            out[kind] = row
            continue
        mine = _rank_kind(rank0, kind) or _rank_kind(seen[0], kind)
        nbytes = float(np.mean(mine["bytes"])) if mine else 0.0
        calls = float(np.mean(mine["calls"])) if mine else 0.0
        times = [float(np.median(k["ms"])) for k in (_rank_kind(r, kind) for r in seen) if k]
        ms = min(times) if times else None
        busbw = None
        if ms and nbytes and ranks[kind] > 1:
            busbw = algbw_gbps(nbytes, ms / 1e3) * factor
        method = (seen[0].get("method") or "") + f"; bus factor {BUS_FACTOR_DOC}"
        if any(r.get("unwaited") for r in seen):
            method += (f"; {max(r.get('unwaited', 0) for r in seen)} async call(s) never waited through their Work: "
                       "timed to their return")
        row.update(bytes_per_step=nbytes, calls_per_step=calls, ms_per_step=ms, ms_per_step_max=max(times) if times else None,
                   busbw_gbps=busbw, bus_bytes_per_step=nbytes * factor, method=method)
        out[kind] = row
    return out


def record_by_kind(m: Metrics, samples: list[RankSample], world_size: int, analytic: dict[str, int] | None,
             analytic_method: str, measured_reason: str | None, replicas: int = 1) -> None:
    """Communication by kind (dpcompare.measure.volume.comm_by_kind): measured where Python dispatched the
    collectives, beside the analytic volume. None (with `measured_reason`) where there is no analytic volume either
    (one rank: no communication)."""
    if analytic is None:
        m.set("comm_by_kind", None, measured_reason or "no communication volume for this run")
        return
    records = [s.collectives for s in samples]
    reason = measured_reason
    if reason is None and not any(isinstance(r, dict) for r in records):
        reason = "no rank recorded its collectives"
    m.set("comm_by_kind", comm_by_kind(records, analytic, world_size, reason, analytic_method, replicas))
