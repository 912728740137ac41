"""A hand-written DDP training loop in the torch documentation's pattern: the baseline of the
harness-overhead benchmark (benchmarks/test_honesty.py).

    torchrun --standalone --nproc_per_node=2 experiments/plain_ddp.py --model benchmarks.workloads:wide_mlp \
        --global-batch 64 --warmup-steps 5 --measure-steps 40 --first-step 1 --out plain.json

Owns: nothing dpcompare uses. It builds the same workload (`dpcompare.run.workloads.<model>(seed)` or a
`package.module:function`), the same optimizer as dpcompare's default (SGD, lr 0.05, momentum 0.9) and
the same data (the batches of steps first_step.. of the workload's stream, shard = batch[rank::world]),
and times them with the same rule as dpcompare's measured phase (dpcompare/run/trainer.py `_measure`):

  - W warm-up steps, untimed;
  - the M measured batches are built (and sharded) before the loop;
  - the ranks line up (a barrier), then per step perf_counter around forward + backward + optimizer.step
    + zero_grad; a step's time is the slowest rank's (the per-rank lists are all_gathered after the loop);
  - loop_ms_per_step: each rank's wall clock over the whole measured loop / M, the slowest rank's. Like
    dpcompare, no barrier closes the loop: DDP's all-reduce already lines the ranks up every step.

Nothing of dpcompare runs in the loop: no adapter, no watchdog, no DDP runtime-stats sampling. The only
dpcompare import is the workload definition. Writes {step_ms_p50, step_ms_p90, step_ms_mean,
loop_ms_per_step, ...} as JSON to --out (rank 0); `run(parse_args([...]))` returns the same dict on rank 0.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def load_workload(spec: str, seed: int):
    module_name, _, function = spec.partition(":") if ":" in spec else ("dpcompare.run.workloads", ":", spec)
    return getattr(importlib.import_module(module_name), function)(seed)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = (len(ordered) - 1) * q  # linear interpolation, numpy.percentile's default
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="mlp", help="dpcompare built-in workload name or package.module:function")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--global-batch", type=int, default=24)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--measure-steps", type=int, default=20)
    p.add_argument("--first-step", type=int, default=0,
                   help="data stream offset; dpcompare's measured phase starts at its --steps")
    p.add_argument("--amp", choices=("none", "bf16"), default="none",
                   help="bf16: forward and loss under torch.autocast(bfloat16), as dpcompare's --amp bf16")
    p.add_argument("--out", default=None, help="JSON file written by rank 0")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> dict | None:
    """One run: process group up, warm-up, measured loop, process group down. The result on rank 0."""
    # torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT: init from the environment.
    use_cuda = torch.cuda.is_available()
    local_rank = int(os.environ["LOCAL_RANK"])
    if use_cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")

    workload = load_workload(args.model, args.seed)
    model = DDP(workload.model.to(device), device_ids=[local_rank] if use_cuda else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    loss_fn = workload.loss_fn
    if args.global_batch % world_size:
        raise ValueError(f"--global-batch={args.global_batch} is not divisible by world size {world_size}")

    def my_shard(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = workload.make_batch(step, args.global_batch)
        return x[rank::world_size].to(device), y[rank::world_size].to(device)

    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.amp == "bf16")

    def train_step(x: torch.Tensor, y: torch.Tensor) -> None:
        with autocast:
            loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    model.train()
    for i in range(args.warmup_steps):
        train_step(*my_shard(args.first_step + i))

    batches = [my_shard(args.first_step + args.warmup_steps + i) for i in range(args.measure_steps)]
    step_ms: list[float] = []
    dist.barrier()
    loop_start = time.perf_counter()
    for x, y in batches:
        t0 = time.perf_counter_ns()
        train_step(x, y)
        step_ms.append((time.perf_counter_ns() - t0) / 1e6)
    if use_cuda:
        torch.cuda.synchronize()
    loop_ms = (time.perf_counter() - loop_start) * 1e3 / args.measure_steps

    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, (step_ms, loop_ms))
    result = None
    if rank == 0:
        slowest = [max(per_step) for per_step in zip(*(g[0] for g in gathered), strict=True)]
        result = {
            "kind": "plain_ddp",
            "model": args.model,
            "world_size": world_size,
            "device": str(device),
            "global_batch": args.global_batch,
            "amp": args.amp,
            "warmup_steps": args.warmup_steps,
            "measured_steps": args.measure_steps,
            "step_ms_p50": percentile(slowest, 0.5),
            "step_ms_p90": percentile(slowest, 0.9),
            "step_ms_mean": statistics.fmean(slowest),
            "loop_ms_per_step": max(g[1] for g in gathered),
            "loop_ms_per_step_per_rank": [g[1] for g in gathered],
        }
        if args.out:
            out = Path(args.out)
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = out.with_name(f".{out.name}.tmp")
            tmp.write_text(json.dumps(result, indent=2))
            os.replace(tmp, out)
    dist.barrier()  # nobody leaves before rank 0 has written (torchrun may kill stragglers)
    dist.destroy_process_group()
    return result


def main() -> None:
    run(parse_args())


if __name__ == "__main__":
    main()
