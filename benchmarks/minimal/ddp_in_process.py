"""dpcompare's per-step bookkeeping under ddp, measured in one process where launch noise cannot reach it.

    python -m benchmarks.minimal.ddp_in_process [ROUNDS]

One rank (gloo, world size 1), the model of issue 23 on a 32-row shard (one rank's half of the global batch 64).
Prints one line `IN_PROCESS_RESULT {json}` with:

  harness_over_bare   the documented DDP step (forward, backward, optimizer.step, zero_grad) against what
                      dpcompare's measured loop runs per step (dpcompare/run/measurement.py `_timed`): the segment
                      clock, StepRunner.step (adapter calls, heartbeats), the native counter's and the collective
                      recorder's step(); both on the same DDP instance (its logging sample rate as dpcompare sets it)
  rate1_over_default  the documented step with DDP's runtime logging sampled every iteration (what the ddp adapter
                      sets when instrumented) against DDP's default sampling
  items_us            each piece of the bookkeeping alone, microseconds per step (wall clock, 5000 calls)

Both ratios are paired (decide_paired, as `dpcompare regress`) over ROUNDS rounds of 20 steps, in thread CPU time
(time.thread_time): the other processes on the machine change the wall clock, much less this thread's CPU time.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import numpy as np
import torch

from benchmarks.minimal.common import LR, MOMENTUM, SEED, mlp_512_1024

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
if "MASTER_PORT" not in os.environ:
    from dpcompare.run.launchers import free_port

    os.environ["MASTER_PORT"] = str(free_port())
os.environ.setdefault("DPCOMPARE_HEARTBEAT_DIR", tempfile.mkdtemp(prefix="dpcompare-hb-"))

from dpcompare.contract import Settings  # noqa: E402
from dpcompare.measure import clocks  # noqa: E402
from dpcompare.measure.collectives import CollectiveRecorder  # noqa: E402
from dpcompare.measure.comm import CommWindow  # noqa: E402
from dpcompare.measure.gate import decide_paired  # noqa: E402
from dpcompare.run import registry  # noqa: E402
from dpcompare.contract.launch_env import LaunchEnv  # noqa: E402
from dpcompare.run.step import StepRunner  # noqa: E402
from dpcompare.run.watchdog import Watchdog  # noqa: E402

STEPS_PER_ROUND = 20
DDP_DEFAULT_SAMPLE_RATE = 100  # torch's kDDPRuntimeLoggingSampleRate


def paired(fns: dict, rounds: int) -> dict:
    """Alternate the two callables (order turning every round); thread CPU seconds per step for each."""
    names = list(fns)
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in (names if r % 2 else names[::-1]):
            started = time.thread_time()
            for _ in range(STEPS_PER_ROUND):
                fns[name]()
            out[name].append((time.thread_time() - started) / STEPS_PER_ROUND)
    return out


def per_call_us(fn, n: int = 5000) -> float:
    started = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - started) / n * 1e6


def figures(base: list[float], current: list[float], name: str) -> dict:
    d = decide_paired(base, current, name=name)
    return {"ratio": d.ratio, "ci90": list(d.ci90), "p_value": d.p_value, "pairs": d.n_current,
            "baseline_ms": float(np.median(base)) * 1e3, "current_ms": float(np.median(current)) * 1e3}


def main(rounds: int) -> dict:
    env = LaunchEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, launcher="python", job_id="in-process")
    cls = registry.load("ddp", registry.BACKENDS, "backend")
    device = torch.device("cpu")
    adapter = cls(env, device, Settings(instrument=True, options={o.name: o.default for o in cls.OPTIONS}))
    adapter.setup(60)
    workload = mlp_512_1024(SEED)
    optimizer = torch.optim.SGD(workload.model.parameters(), lr=LR, momentum=MOMENTUM)
    wrapped = adapter.wrap(workload.model, optimizer, 32, 32)
    watchdog = Watchdog(rank=0, world_size=1, job_id="in-process", timeout_s=3600)  # its thread not started
    runner = StepRunner(adapter=adapter, workload=workload, device=device, dtype=torch.float32, grad_accum=1,
                        watchdog=watchdog, rank=0, world_size=1, global_batch=32)
    x, y = workload.make_batch(1, 32)
    clock = clocks.SegmentClock(device, enabled=True)
    window = CommWindow(adapter.comm_counter(), device, tempfile.mkdtemp(prefix="dpcompare-"))
    recorder = CollectiveRecorder(device)
    window.begin()
    recorder.begin()

    def bare() -> None:
        loss = workload.loss_fn(wrapped.model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    def harness() -> None:
        clock.start()
        runner.step(1, x, y, phase="measured")
        clock.stop()
        clock.end_step()
        window.step()
        recorder.step()

    try:
        for _ in range(20):
            bare()
            harness()
        h = paired({"bare": bare, "harness": harness}, rounds)
        items = {
            "segment_clock": per_call_us(lambda: (clock.start(), clock.stop(), clock.end_step())),
            "native_counter_step": per_call_us(window.step),
            "recorder_step": per_call_us(recorder.step),
            "heartbeats_4": per_call_us(lambda: [watchdog.beat("measured: forward", 1) for _ in range(4)]),
            "adapter_sync_autocast_unscale_reduce": per_call_us(
                lambda: (adapter.sync(True).__enter__(), adapter.autocast(), adapter.unscale(), adapter.reduce())),
        }
    finally:
        recorder.close()

    def at(rate: int):
        def step() -> None:
            wrapped.model._set_ddp_runtime_logging_sample_rate(rate)
            bare()
        return step

    s = paired({"default": at(DDP_DEFAULT_SAMPLE_RATE), "rate1": at(1)}, rounds)
    watchdog.stop()
    result = {"rounds": rounds, "steps_per_round": STEPS_PER_ROUND, "clock": "thread CPU time",
              "harness_over_bare": figures(h["bare"], h["harness"], "harness"),
              "rate1_over_default": figures(s["default"], s["rate1"], "sample rate"),
              "items_us": items, "items_total_us": sum(items.values())}
    print("IN_PROCESS_RESULT " + json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 30)
    sys.stdout.flush()
    os._exit(0)  # the process group and gloo threads need no orderly teardown here
