"""What sharing the box's cores costs a rank's compute, with no backend and no communication.

    OMP_NUM_THREADS=1 .venv/bin/python -m experiments.core_sharing --procs 1,2,3,4 --batch 513

k processes start together and each runs the same forward + backward of the default workload (mlp-wide) on its
own batch, `--steps` times, with a barrier before every step (as a collective would hold a synchronised step);
the step time of a round is the slowest process's. Against the time of one process alone, a fair share of
`cpu_count` cores predicts max(1, k / cores) and a rank kept on its core's run queue predicts ceil(k / cores); the
rest is what switching between the ranks of a core costs. Prints one JSON line per k.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import statistics
import time

import torch


def _worker(barrier, steps: int, batch: int, out) -> None:
    torch.set_num_threads(1)
    from dpcompare.run import workloads

    w = workloads.mlp_wide(0)
    x, y = w.make_batch(0, batch)
    for _ in range(3):  # warm-up
        w.loss_fn(w.model(x), y).backward()
    times = []
    for _ in range(steps):
        barrier.wait()
        started = time.perf_counter()
        w.loss_fn(w.model(x), y).backward()
        w.model.zero_grad()
        times.append(time.perf_counter() - started)
    out.put(times)


def measure(k: int, steps: int, batch: int) -> list[float]:
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(k), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(barrier, steps, batch, out)) for _ in range(k)]
    for p in procs:
        p.start()
    per_proc = [out.get() for _ in procs]
    for p in procs:
        p.join()
    return [max(t[i] for t in per_proc) * 1e3 for i in range(steps)]  # the slowest process per step, ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--procs", default="1,2,3,4")
    parser.add_argument("--batch", type=int, default=513, help="per-process batch (default: 2052 / 4)")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    base = None
    for k in (int(s) for s in args.procs.split(",")):
        ms = statistics.median(measure(k, args.steps, args.batch))
        base = base if base is not None else ms
        print(json.dumps({"procs": k, "cores": cores, "batch": args.batch, "step_ms_p50": round(ms, 2),
                          "over_one": round(ms / base, 3), "fair_share": max(1.0, k / cores),
                          "ceil": float(math.ceil(k / cores))}), flush=True)


if __name__ == "__main__":
    main()
