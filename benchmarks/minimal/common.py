"""What every minimal loop shares, so that only the backend's documented calls differ between them.

Owns: the model of issue 23 (Linear 512-1024, GELU, 1024-1024, GELU, 1024-10: ~1.6 M parameters) in
dpcompare's workload contract (`--model benchmarks.minimal.common:mlp_512_1024` loads the same weights and
data in dpcompare), the command line, and the timing rule of dpcompare's measured phase
(dpcompare/run/measurement.py `_timed`): warm-up steps untimed, the measured batches built before the loop,
the ranks lined up, perf_counter around each step, and the loop's wall clock / steps (`loop_ms_per_step`);
a step's time and the loop's time are the slowest rank's. Prints one line `MINIMAL_RESULT {json}` on rank 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.nn import functional as F

from dpcompare.contract.workload import Workload, shard

SEED = 1234
LR, MOMENTUM = 0.05, 0.9  # dpcompare's default optimizer: SGD(lr=0.05, momentum=0.9)


def mlp_512_1024(seed: int) -> Workload:
    """512 -> 1024 -> 1024 -> 10 with GELU: the model of issue 23's measurement."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(512, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 10))
    teacher = torch.randn(512, 10, generator=torch.Generator().manual_seed(seed * 1_000_003 - 1))

    def make_batch(step: int, global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(global_batch, 512, generator=torch.Generator().manual_seed(seed * 1_000_003 + step))
        return x, (x @ teacher).argmax(dim=1)

    return Workload("mlp_512_1024", model, make_batch, F.cross_entropy)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument("--measure-steps", type=int, default=50)
    p.add_argument("--first-step", type=int, default=1, help="data stream offset (dpcompare's measured phase starts at --steps)")
    args, _ = p.parse_known_args(argv)  # launchers may append their own (--local_rank)
    return args


def batches(workload: Workload, args: argparse.Namespace, rank: int, world_size: int, first: int, count: int):
    return [shard(workload.make_batch(first + i, args.global_batch), rank, world_size) for i in range(count)]


def measure(train_step: Callable[[torch.Tensor, torch.Tensor], None], workload: Workload, args: argparse.Namespace,
            rank: int, world_size: int, barrier: Callable[[], None],
            gather: Callable[[object], list]) -> dict | None:
    """Warm-up, then the timed loop; returns the figures on rank 0 (None elsewhere) and prints them."""
    for x, y in batches(workload, args, rank, world_size, args.first_step, args.warmup_steps):
        train_step(x, y)
    timed = batches(workload, args, rank, world_size, args.first_step + args.warmup_steps, args.measure_steps)
    step_ms: list[float] = []
    barrier()
    loop_start = time.perf_counter()
    for x, y in timed:
        t0 = time.perf_counter()
        train_step(x, y)
        step_ms.append((time.perf_counter() - t0) * 1e3)
    loop_ms = (time.perf_counter() - loop_start) * 1e3 / args.measure_steps
    gathered = gather((step_ms, loop_ms))
    if rank != 0:
        return None
    slowest = [max(s) for s in zip(*(g[0] for g in gathered), strict=True)]
    result = {"world_size": world_size, "global_batch": args.global_batch, "measured_steps": args.measure_steps,
              "step_ms_p50": statistics.median(slowest), "loop_ms_per_step": max(g[1] for g in gathered)}
    print("MINIMAL_RESULT " + json.dumps(result), flush=True)
    return result


def dist_gather(obj: object) -> list:
    """torch.distributed's all_gather_object over the default group: every rank's `obj`, in rank order."""
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def leave() -> None:
    """Exit without interpreter finalisation once the result is printed, as dpcompare's own runs do
    (dpcompare/run/leave.py `exit_if_held`): gloo's and DeepSpeed's C++ threads sometimes abort in static
    destructors ("terminate called without an active exception", SIGABRT), which would fail a launch whose figures
    are already out. Not part of the timed loop."""
    import os
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
