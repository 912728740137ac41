"""The `bench-collectives` command: its flags, the message-size sweep they describe, and the two modes: the
orchestrator (default), which launches every transport at every world size, and one worker rank (--worker)."""

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
