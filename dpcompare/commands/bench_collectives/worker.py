"""One rank of bench-collectives, started by a launcher (--worker).

Owns: timing one message size on every rank (warm-up, then timed iterations, each refilled and preceded
by a barrier), reducing the per-rank times to the slowest rank's, checking the sum, and writing the
rank-0 result file the orchestrator reads.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from dpcompare import json_files
from dpcompare.commands.bench_collectives.sweep import BYTES_PER_ELEMENT, Sweep, check_sum, human_bytes, pattern
from dpcompare.commands.bench_collectives.transports import Transport, connect
from dpcompare.measure import link
from dpcompare.measure.bandwidth import algbw_gbps, busbw_gbps
from dpcompare.contract import launch_env as launch


def bench_size(comm, nbytes: int, sweep: Sweep, rank: int, world_size: int, corrupt: bool = False) -> dict[str, Any]:
    """One message size on every rank; returns the same record on every rank."""
    count = nbytes // BYTES_PER_ELEMENT
    buf, src = comm.buffers(pattern(count, rank + 1))

    def once() -> float:
        comm.refill(buf, src)  # untimed: an in-place sum would otherwise grow by n every iteration
        comm.barrier()  # every rank starts the timed op together: rank skew is not measured as latency
        return comm.allreduce_s(buf)

    first = once()
    estimate = max(comm.allgather(first))  # all ranks must agree on the iteration counts
    n_warmup = sweep.plan(estimate, "warmup")
    warm = [once() for _ in range(n_warmup - 1)]
    if warm:
        estimate = max(comm.allgather(statistics.fmean(warm)))
    n_iters = sweep.plan(estimate, "timed")
    times_s = [once() for _ in range(n_iters)]
    if corrupt and rank == min(1, world_size - 1):
        comm.corrupt(buf)  # the planted wrong result of the negative test
    ok = check_sum(comm.to_numpy(buf), world_size)
    per_rank = comm.allgather((times_s, ok))
    means = [statistics.fmean(t) for t, _ in per_rank]
    slowest = max(range(world_size), key=means.__getitem__)
    mean_s = means[slowest]
    algbw = algbw_gbps(nbytes, mean_s)
    return {
        "bytes": nbytes,
        "time_us_mean": mean_s * 1e6,
        "time_us_p50": statistics.median(per_rank[slowest][0]) * 1e6,
        "algbw_gbps": algbw,
        "busbw_gbps": busbw_gbps(algbw, world_size),
        "correct": all(good for _, good in per_rank),
        "incorrect_ranks": [r for r, (_, good) in enumerate(per_rank) if not good],
        "slowest_rank": slowest,
        "iters": n_iters,
        "warmup_iters": n_warmup,
    }


def _on_cuda(ns: argparse.Namespace, transport: Transport) -> bool:
    if transport == "mpi" or ns.device == "cpu":
        return False
    import torch

    return ns.device == "cuda" or torch.cuda.is_available()


def run_worker(ns: argparse.Namespace, sweep: Sweep) -> int:
    env = launch.detect()
    transport: Transport = ns.transport
    # NCCL names the algorithm and protocol it chose only in its log, read once at its start: asked for before it
    nccl_log = (link.ask_nccl_tuning(Path(ns.result_file).parent / "nccl") if ns.result_file and _on_cuda(ns, transport)
                else (None, "NCCL's choices are read where bench-collectives runs on CUDA"))
    comm = connect(transport, env, ns.device, ns.timeout_s)
    try:
        sizes = []
        for nbytes in sweep.sizes():
            record = bench_size(comm, nbytes, sweep, env.rank, env.world_size, corrupt=ns.corrupt)
            sizes.append(record)
            if env.is_rank0:
                print(f"{transport} n={env.world_size} {human_bytes(nbytes):>8}: {record['time_us_mean']:12.1f} us  "
                      f"algbw {record['algbw_gbps']:8.3f}  busbw {record['busbw_gbps']:8.3f} GB/s  "
                      f"{'ok' if record['correct'] else 'WRONG on ranks ' + str(record['incorrect_ranks'])}",
                      flush=True)
        entry = {"transport": transport, "backend": comm.backend, "world_size": env.world_size,
                 "device": str(comm.device), "launcher": env.launcher, "sizes": sizes,
                 "link": link.facts(comm.backend if env.world_size > 1 else None, nccl_log)}
        if env.is_rank0 and ns.result_file:
            json_files.write_atomic(Path(ns.result_file), entry)
    finally:
        comm.close()
    return 0 if all(s["correct"] for s in sizes) else 1
