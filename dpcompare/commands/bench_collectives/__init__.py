"""bench-collectives: an all-reduce microbenchmark for the transports under dpcompare's backends, in the
manner of nccl-tests' `all_reduce_perf -c 1`.

Owns: the message-size sweep; timing a float32 sum all-reduce at each size through torch.distributed
(gloo on CPU, NCCL on CUDA), mpi4py (Open MPI), Horovod and deepspeed.comm; checking every size's result
exactly; and the collectives JSON. The bandwidth definitions, and `busbw_at`, which quotes the
microbenchmark's bus bandwidth at a run's message size, are measurement (dpcompare.measure.bandwidth).
Each transport's runtime is imported only inside the worker that uses it.

Orchestrator (default): for each transport and world size, start this module under the transport's own
launcher, the native launcher of the backend whose link it measures (torch: torchrun, as ddp; mpi: mpirun;
horovod: horovodrun --gloo; deepspeed: the deepspeed launcher), print a table and write one JSON file
(--out, default results/collectives-<timestamp>.json).
Worker (--worker): one rank of one transport; rank and world size come from the launcher.

Per size: warm-up iterations (untimed), then timed iterations, each one refilled with a rank-dependent
pattern, barrier, all-reduce. Large sizes run fewer iterations (about --target-s of timed work per size,
at least 3). A size's time is the slowest rank's mean; p50 is that rank's median.
  algbw = bytes / time           (GB/s, 1 GB = 1e9 bytes)
  busbw = algbw * 2(n-1)/n       (nccl-tests doc/PERFORMANCE.md, all-reduce)
correct: after the last iteration every rank holds exactly sum over ranks of (rank+1) * pattern, with
pattern = (i mod 251) + 1, all integers below 2**24, so exact in float32 in any summation order. A wrong
result on any rank makes the size correct=false and the command exit 1.
"""

from __future__ import annotations

import argparse

from dpcompare.commands.bench_collectives.orchestrate import run_orchestrator
from dpcompare.commands.bench_collectives.sweep import Sweep, human_bytes, parse_bytes
from dpcompare.commands.bench_collectives.transports import TRANSPORTS
from dpcompare.commands.bench_collectives.worker import run_worker


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = Sweep()
    p.add_argument("--transports", default=",".join(TRANSPORTS),
                   help=f"comma-separated, from {', '.join(TRANSPORTS)} (default: all; unavailable ones are listed)")
    p.add_argument("--world-sizes", default="2", help="comma-separated rank counts (default: 2)")
    p.add_argument("--min-bytes", default=human_bytes(d.min_bytes).replace(" ", ""), help="smallest message, e.g. 1KiB")
    p.add_argument("--max-bytes", default=human_bytes(d.max_bytes).replace(" ", ""), help="largest message, e.g. 256MiB")
    p.add_argument("--factor", type=int, default=d.factor, help="ratio between consecutive sizes")
    p.add_argument("--iters", type=int, default=d.iters, help="timed iterations per size at most (large sizes: fewer, >= 3)")
    p.add_argument("--warmup", type=int, default=d.warmup, help="untimed iterations per size at most")
    p.add_argument("--target-s", type=float, default=d.target_s, help="timed work per size that sets large sizes' iterations")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="torch, deepspeed and horovod buffers; mpi always uses host memory")
    p.add_argument("--out", default=None, help="JSON file, or a directory for collectives-<timestamp>.json (default: results/)")
    p.add_argument("--timeout-s", type=float, default=600.0, help="per launch; also the process-group timeout")
    p.add_argument("--transport", choices=TRANSPORTS, default=None, help="worker mode: this rank's transport")
    p.add_argument("--worker", action="store_true", help="run as one rank under a launcher (started by the orchestrator)")
    p.add_argument("--result-file", default=None, help=argparse.SUPPRESS)
    p.add_argument("--corrupt", action="store_true", help=argparse.SUPPRESS)  # negative test: a planted wrong sum
    # The deepspeed launcher appends --local_rank=N; LOCAL_RANK is read instead.
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)


def sweep_from_args(ns: argparse.Namespace) -> Sweep:
    return Sweep(min_bytes=parse_bytes(ns.min_bytes), max_bytes=parse_bytes(ns.max_bytes), factor=ns.factor,
                 iters=ns.iters, warmup=ns.warmup, target_s=ns.target_s)


def main(ns: argparse.Namespace) -> int:
    sweep = sweep_from_args(ns)
    if ns.worker:
        if ns.transport is None:
            raise ValueError("--worker needs --transport: one of " + ", ".join(TRANSPORTS))
        return run_worker(ns, sweep)
    if ns.transport is not None:
        raise ValueError(f"--transport={ns.transport} is for worker mode: use --transports {ns.transport} instead")
    return run_orchestrator(ns, sweep)
