"""bench-collectives: an all-reduce microbenchmark for the transports under dpcompare's backends, in the
manner of nccl-tests' `all_reduce_perf -c 1`.

Owns: the message-size sweep; timing a float32 sum all-reduce at each size through torch.distributed
(gloo on CPU, NCCL on CUDA), mpi4py (Open MPI), Horovod and deepspeed.comm; checking every size's result
exactly; nccl-tests' bandwidth definitions; the collectives JSON; and `busbw_at`, which other modules use
to quote the microbenchmark's bus bandwidth at a run's message size. Imports no adapter; each transport's
runtime is imported only inside the worker that uses it.

Orchestrator (default): for each transport and world size, start this module under the transport's own
launcher (torch: torchrun, mpi: mpirun, horovod: horovodrun --gloo, deepspeed: the deepspeed launcher),
print a table and write one JSON file (--out, default results/collectives-<timestamp>.json).
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
import importlib.util
import json
import math
import os
import re
import signal
import statistics
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, get_args

import numpy as np

from dpcompare import results
from dpcompare.measure.bandwidth import algbw_gbps, busbw_at, busbw_gbps  # noqa: F401 (re-exported for the worker)
from dpcompare.run import launch
from dpcompare.run import registry
from dpcompare.commands.compare import native_command

Transport = Literal["torch", "mpi", "horovod", "deepspeed"]
TRANSPORTS: tuple[Transport, ...] = get_args(Transport)

# The launcher each transport's users start it with (names understood by compare.native_command).
NATIVE_LAUNCHER: dict[Transport, str] = {
    "torch": "torchrun",
    "mpi": "mpirun",
    "horovod": "horovodrun",
    "deepspeed": "deepspeed",
}

PATTERN_PERIOD = 251
"""Prime period of the fill pattern, so a chunk reduced at the wrong offset shows up as wrong values."""

BYTES_PER_ELEMENT = 4  # float32
MIN_TIMED_ITERS = 3


_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_bytes(text: str) -> int:
    """'1024', '1K', '1KiB', '256MiB', '1G' -> bytes (binary multiples, like nccl-tests' -b/-e). 'KB' and 'MB'
    are refused: they mean 1000 to some readers and 1024 to others."""
    match = re.fullmatch(r"\s*(\d+)\s*(?:([kKmMgG])(?:i[bB])?|[bB])?\s*", str(text))
    if not match:
        raise ValueError(f"size {text!r} is not understood: give bytes as a whole number with an optional "
                         "binary suffix, e.g. 4096, 4K, 4KiB, 256MiB, 1G")
    return int(match.group(1)) * _UNITS[(match.group(2) or "").lower()]


def human_bytes(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


@dataclass(frozen=True, slots=True, kw_only=True)
class Sweep:
    min_bytes: int = 1 << 10
    """Smallest message, bytes (a multiple of 4: float32 elements)."""
    max_bytes: int = 256 << 20
    """Largest message, bytes; sizes are min_bytes * factor**k up to this."""
    factor: int = 4
    """Ratio between consecutive sizes."""
    iters: int = 50
    """Timed iterations per size at most (small sizes); large sizes run fewer, at least 3."""
    warmup: int = 5
    """Untimed iterations per size at most; large sizes run 2 (1 when --warmup 1)."""
    target_s: float = 0.2
    """About this much timed all-reduce work per size decides how many iterations large sizes get."""

    def __post_init__(self) -> None:
        if self.min_bytes < BYTES_PER_ELEMENT or self.min_bytes % BYTES_PER_ELEMENT:
            raise ValueError(f"--min-bytes={self.min_bytes} is invalid: use a positive multiple of "
                             f"{BYTES_PER_ELEMENT} (float32 elements), e.g. 1KiB")
        if self.max_bytes < self.min_bytes:
            raise ValueError(f"--max-bytes={self.max_bytes} is smaller than --min-bytes={self.min_bytes}: "
                             "raise --max-bytes or lower --min-bytes")
        if self.factor < 2 and self.max_bytes != self.min_bytes:
            raise ValueError(f"--factor={self.factor} is invalid: use a whole number of at least 2, e.g. 4")
        if self.iters < 1:
            raise ValueError(f"--iters={self.iters} is invalid: use at least 1 (3 or more for a median)")
        if self.warmup < 1:
            raise ValueError(f"--warmup={self.warmup} is invalid: use at least 1 (the first iteration sizes "
                             "the run and is never timed)")
        if not self.target_s > 0:
            raise ValueError(f"--target-s={self.target_s} is invalid: use a positive number of seconds, e.g. 0.2")

    def sizes(self) -> list[int]:
        out, size = [], self.min_bytes
        while size <= self.max_bytes:
            out.append(size)
            if self.factor < 2:
                break
            size *= self.factor
        return out

    def plan(self, estimate_s: float, phase: Literal["warmup", "timed"]) -> int:
        """Iterations for one phase of a size whose all-reduce takes about `estimate_s` (the slowest rank's).
        Small sizes get --warmup / --iters; large ones enough for ~target_s (a quarter of it for warm-up)."""
        if phase == "warmup":
            wanted = math.ceil(0.25 * self.target_s / max(estimate_s, 1e-9))
            return min(self.warmup, max(2, wanted))
        wanted = math.ceil(self.target_s / max(estimate_s, 1e-9))
        return min(self.iters, max(MIN_TIMED_ITERS, wanted))


def pattern(count: int, scale: int = 1) -> np.ndarray:
    """scale * ((i mod 251) + 1) as float32: rank r sends pattern(count, r+1), and the sum over n ranks is
    pattern(count, n(n+1)/2), exact. Built by repeating one period: no int64 index array of the full size."""
    return np.resize(np.arange(1, PATTERN_PERIOD + 1, dtype=np.float32) * np.float32(scale), count)


def check_sum(reduced: np.ndarray, world_size: int) -> bool:
    """True when `reduced` is exactly n(n+1)/2 * pattern, compared in chunks to bound the extra memory."""
    scale = world_size * (world_size + 1) // 2
    if PATTERN_PERIOD * scale >= 1 << 24:
        raise ValueError(f"world size {world_size} is too large for an exact float32 check: the sum would "
                         "exceed 2**24; use at most 350 ranks")
    chunk = PATTERN_PERIOD * 4096  # a multiple of the period, so every chunk starts at pattern value 1
    expected = pattern(chunk, scale)
    for start in range(0, reduced.size, chunk):
        part = reduced[start:start + chunk]
        if not np.array_equal(part, expected[:part.size]):
            return False
    return True


# -- transports (worker side) -------------------------------------------------------------------------
class _TorchComm:
    """torch.distributed tensors; the data op is torch's all_reduce or deepspeed.comm's (same process group)."""

    def __init__(self, transport: Transport, env: launch.LaunchEnv, device_choice: str, timeout_s: float) -> None:
        import torch
        import torch.distributed as dist

        self.torch = torch
        launch.ensure_rendezvous(env)
        self.device = launch.pick_device(device_choice, env.local_rank)
        self.is_cuda = self.device.type == "cuda"
        self.backend = "nccl" if self.is_cuda else "gloo"
        if transport == "deepspeed":
            import deepspeed
            import deepspeed.comm as dscomm

            deepspeed.init_distributed(dist_backend=self.backend, timeout=timedelta(seconds=timeout_s),
                                       rank=env.rank, world_size=env.world_size, verbose=False)
            op = dscomm.ReduceOp.SUM
            self._all_reduce = lambda t: dscomm.all_reduce(t, op=op)
            self._barrier, self._gather = dscomm.barrier, dscomm.all_gather_object
        else:
            dist.init_process_group(self.backend, rank=env.rank, world_size=env.world_size,
                                    timeout=timedelta(seconds=timeout_s),
                                    device_id=self.device if self.is_cuda else None)
            op = dist.ReduceOp.SUM
            self._all_reduce = lambda t: dist.all_reduce(t, op=op)
            self._barrier, self._gather = dist.barrier, dist.all_gather_object
        self.dist = dist

    def buffers(self, source: np.ndarray):
        src = self.torch.from_numpy(source).to(self.device)
        return self.torch.empty_like(src), src

    def refill(self, buf, src) -> None:
        buf.copy_(src)

    def barrier(self) -> None:
        self._barrier()
        if self.is_cuda:
            self.torch.cuda.synchronize()

    def allreduce_s(self, buf) -> float:
        if self.is_cuda:
            # NCCL returns once the kernel is queued: time on the stream with events.
            start, end = self.torch.cuda.Event(enable_timing=True), self.torch.cuda.Event(enable_timing=True)
            start.record()
            self._all_reduce(buf)
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        self._all_reduce(buf)  # gloo on CPU: returns when the result is in buf
        return time.perf_counter() - t0

    def allgather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.dist.get_world_size()
        self._gather(out, obj)
        return out

    def to_numpy(self, buf) -> np.ndarray:
        return buf.cpu().numpy() if self.is_cuda else buf.numpy()

    def corrupt(self, buf) -> None:
        buf[-1] += 1

    def close(self) -> None:
        if self.dist.is_initialized():
            self.dist.destroy_process_group()


class _MpiComm:
    """mpi4py's buffer interface on numpy arrays (host memory), MPI_Allreduce in place."""

    backend = "mpi"
    device = "cpu"

    def __init__(self, env: launch.LaunchEnv) -> None:
        from mpi4py import MPI

        self.MPI, self.comm = MPI, MPI.COMM_WORLD
        if self.comm.Get_size() != env.world_size or self.comm.Get_rank() != env.rank:
            raise RuntimeError(f"MPI sees rank {self.comm.Get_rank()} of {self.comm.Get_size()} but {env.launcher} "
                               f"started rank {env.rank} of {env.world_size}: start the mpi transport with mpirun -np N")

    def buffers(self, source: np.ndarray):
        return np.empty_like(source), source

    def refill(self, buf, src) -> None:
        np.copyto(buf, src)

    def barrier(self) -> None:
        self.comm.Barrier()

    def allreduce_s(self, buf) -> float:
        t0 = time.perf_counter()
        self.comm.Allreduce(self.MPI.IN_PLACE, buf, op=self.MPI.SUM)
        return time.perf_counter() - t0

    def allgather(self, obj: Any) -> list[Any]:
        return self.comm.allgather(obj)

    def to_numpy(self, buf) -> np.ndarray:
        return buf

    def corrupt(self, buf) -> None:
        buf[-1] += 1

    def close(self) -> None:
        pass


class _HorovodComm:
    """horovod.torch in place (hvd.allreduce_, op=hvd.Sum), as DistributedOptimizer reduces gradients."""

    def __init__(self, env: launch.LaunchEnv, device_choice: str, timeout_s: float) -> None:
        import horovod.torch as hvd
        import torch

        os.environ.setdefault("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", str(int(timeout_s)))
        os.environ.setdefault("HOROVOD_GLOO_TIMEOUT_SECONDS", str(int(timeout_s)))
        hvd.init()
        # hvd.init() with no launcher silently runs as size 1.
        if hvd.size() != env.world_size or hvd.rank() != env.rank:
            raise RuntimeError(f"Horovod sees rank {hvd.rank()} of {hvd.size()} but {env.launcher} started rank "
                               f"{env.rank} of {env.world_size}: start it with horovodrun -np N")
        self.hvd, self.torch = hvd, torch
        device = launch.pick_device(device_choice, env.local_rank)
        # A build without NCCL would stage CUDA tensors through host memory: measure host memory instead.
        self.device = device if device.type == "cpu" or hvd.nccl_built() else torch.device("cpu")
        self.is_cuda = self.device.type == "cuda"
        self.backend = "nccl" if self.is_cuda else ("gloo" if hvd.gloo_enabled() else "mpi")
        self.name = "dpcompare.bench"

    def buffers(self, source: np.ndarray):
        src = self.torch.from_numpy(source).to(self.device)
        # One fixed name per size: Horovod's response cache then skips renegotiation, as it does for named
        # gradients in training (unnamed ops get a fresh name each call and never hit the cache).
        self.name = f"dpcompare.bench.{source.size}"
        return self.torch.empty_like(src), src

    def refill(self, buf, src) -> None:
        buf.copy_(src)

    def barrier(self) -> None:
        self.hvd.barrier()

    def allreduce_s(self, buf) -> float:
        t0 = time.perf_counter()
        self.hvd.allreduce_(buf, op=self.hvd.Sum, name=self.name)  # waits for the result
        if self.is_cuda:
            self.torch.cuda.synchronize()
        return time.perf_counter() - t0

    def allgather(self, obj: Any) -> list[Any]:
        return self.hvd.allgather_object(obj)

    def to_numpy(self, buf) -> np.ndarray:
        return buf.cpu().numpy() if self.is_cuda else buf.numpy()

    def corrupt(self, buf) -> None:
        buf[-1] += 1

    def close(self) -> None:
        self.hvd.shutdown()


def _connect(transport: Transport, env: launch.LaunchEnv, device: str, timeout_s: float):
    if transport in ("torch", "deepspeed"):
        return _TorchComm(transport, env, device, timeout_s)
    if transport == "mpi":
        return _MpiComm(env)
    return _HorovodComm(env, device, timeout_s)


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


def run_worker(ns: argparse.Namespace, sweep: Sweep) -> int:
    env = launch.detect()
    transport: Transport = ns.transport
    comm = _connect(transport, env, ns.device, ns.timeout_s)
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
                 "device": str(comm.device), "launcher": env.launcher, "sizes": sizes}
        if env.is_rank0 and ns.result_file:
            results.write_atomic(Path(ns.result_file), entry)
    finally:
        comm.close()
    return 0 if all(s["correct"] for s in sizes) else 1


# -- orchestrator -------------------------------------------------------------------------------------
@dataclass(slots=True)
class Launch:
    transport: Transport
    world_size: int
    command: list[str]
    status: str = "pending"
    """ok | incorrect | failed | timeout"""
    entry: dict[str, Any] | None = None
    wall_s: float | None = None
    error: str | None = None
    log_tail: list[str] = field(default_factory=list)


def availability(transport: Transport) -> tuple[bool, str]:
    """(available, reason) without importing the transport's runtime into this process."""
    if transport == "torch":
        if importlib.util.find_spec("torch") is None:
            return False, "torch is not installed: bash scripts/setup.sh"
    elif transport == "mpi":
        if importlib.util.find_spec("mpi4py") is None:
            return False, "mpi4py is not installed: pip install mpi4py (needs an MPI library, e.g. apt install libopenmpi-dev)"
    else:
        ok, reason = registry.availability(transport)
        if not ok:
            return ok, reason
    try:
        native_command(NATIVE_LAUNCHER[transport], 1, [])
    except RuntimeError as exc:
        return False, str(exc)
    return True, ""


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


def _parse_list(text: str, option: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise ValueError(f"{option}={text!r} is empty: give a comma-separated list")
    return list(dict.fromkeys(items))


def _world_sizes(text: str) -> list[int]:
    try:
        sizes = sorted({int(w) for w in _parse_list(text, "--world-sizes")})
    except ValueError:
        raise ValueError(f"--world-sizes={text!r} is invalid: use comma-separated whole numbers, e.g. 2,4") from None
    if sizes[0] < 1:
        raise ValueError(f"--world-sizes={text!r} is invalid: use positive whole numbers, e.g. 2,4")
    return sizes


def _out_path(out: str | None) -> Path:
    name = f"collectives-{time.strftime('%Y%m%d-%H%M%S')}.json"
    if out is None:
        return Path("results") / name
    path = Path(out)
    return path if path.suffix == ".json" else path / name


def _worker_args(ns: argparse.Namespace, transport: Transport, result_file: Path) -> list[str]:
    args = ["bench-collectives", "--worker", "--transport", transport, "--min-bytes", ns.min_bytes,
            "--max-bytes", ns.max_bytes, "--factor", str(ns.factor), "--iters", str(ns.iters),
            "--warmup", str(ns.warmup), "--target-s", str(ns.target_s), "--device", ns.device,
            "--timeout-s", str(ns.timeout_s), "--result-file", str(result_file)]
    return args + (["--corrupt"] if ns.corrupt else [])


def launch_command(transport: Transport, world_size: int, args: list[str]) -> list[str]:
    """compare.native_command for the transport's launcher. The deepspeed launcher is told --no_local_rank:
    it would put --local_rank=N before the subcommand, where the command line expects `bench-collectives`
    (LOCAL_RANK, which it also sets, is read instead)."""
    command = native_command(NATIVE_LAUNCHER[transport], world_size, args)
    if NATIVE_LAUNCHER[transport] == "deepspeed":
        command.insert(1, "--no_local_rank")
    return command


def execute(job: Launch, result_file: Path, log: Path, timeout_s: float) -> None:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONUNBUFFERED="1")
    start = time.monotonic()
    code: int | None
    with log.open("w") as out:
        out.write("$ " + " ".join(job.command) + "\n")
        out.flush()
        # A session of its own, so a launcher that hangs is ended with every rank it started.
        proc = subprocess.Popen(job.command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
    job.wall_s = time.monotonic() - start
    job.log_tail = log.read_text(errors="replace").splitlines()[-15:]
    if result_file.exists():
        job.entry = json.loads(result_file.read_text())
    if code is None:
        job.status, job.error = "timeout", f"no result within {timeout_s:g} s"
    elif job.entry is not None and not all(s["correct"] for s in job.entry["sizes"]):
        job.status = "incorrect"
        wrong = [human_bytes(s["bytes"]) for s in job.entry["sizes"] if not s["correct"]]
        job.error = f"wrong all-reduce result at {', '.join(wrong)}"
    elif code != 0 or job.entry is None:
        # Our own one-line errors first; launchers' [ERROR] lines mostly repeat the command line.
        ours = [ln for ln in job.log_tail if ln.startswith("dpcompare: error")]
        errors = ours or [ln for ln in job.log_tail if "error" in ln.lower()]
        job.status = "failed"
        job.error = (errors[-1].strip()[:300] if errors else "") + f" (exit status {code})"
    else:
        job.status = "ok"


def render(console, jobs: list[Launch], unavailable: list[dict[str, str]]) -> None:
    from rich.table import Table

    table = Table(title="all-reduce, float32 sum (busbw = algbw x 2(n-1)/n; GB/s = 1e9 B/s)")
    for col, justify in (("transport", "left"), ("backend", "left"), ("N", "right"), ("size", "right"),
                         ("time_us", "right"), ("p50_us", "right"), ("algbw GB/s", "right"),
                         ("busbw GB/s", "right"), ("correct", "left")):
        table.add_column(col, justify=justify, no_wrap=True)
    for job in jobs:
        if job.entry is None:
            table.add_row(job.transport, "-", str(job.world_size), "-", "-", "-", "-", "-",
                          f"[red]{job.status}[/] (see above)", end_section=True)
            continue
        for i, s in enumerate(job.entry["sizes"]):
            first = i == 0
            table.add_row(job.transport if first else "", job.entry["backend"] if first else "",
                          str(job.world_size) if first else "", human_bytes(s["bytes"]),
                          f"{s['time_us_mean']:.1f}", f"{s['time_us_p50']:.1f}", f"{s['algbw_gbps']:.3f}",
                          f"{s['busbw_gbps']:.3f}", "[green]yes[/]" if s["correct"] else "[red]NO[/]",
                          end_section=i == len(job.entry["sizes"]) - 1)
    for u in unavailable:
        table.add_row(u["transport"], "-", "-", "-", "-", "-", "-", "-", "[yellow]unavailable[/] (see above)")
    console.print(table)


def _loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:  # not available on this platform
        return None


def run_orchestrator(ns: argparse.Namespace, sweep: Sweep) -> int:
    from rich.console import Console

    requested = _parse_list(ns.transports, "--transports")
    unknown = [t for t in requested if t not in TRANSPORTS]
    if unknown:
        raise ValueError(f"--transports: unknown {', '.join(unknown)}; choose from {', '.join(TRANSPORTS)}")
    world_sizes = _world_sizes(ns.world_sizes)
    out_path = _out_path(ns.out)

    console = Console()
    if not console.is_terminal:
        console = Console(width=140)
    unavailable: list[dict[str, str]] = []
    transports: list[Transport] = []
    for t in requested:
        ok, reason = availability(t)
        if ok:
            transports.append(t)
        else:
            unavailable.append({"transport": t, "reason": reason})
            console.print(f"[yellow]{t} unavailable:[/] {reason}")

    started = time.monotonic()
    # Other work on the host shows up as latency outliers (mean >> p50): keep the evidence with the figures.
    load_before = _loadavg()
    jobs: list[Launch] = []
    with tempfile.TemporaryDirectory(prefix="dpcompare-collectives-") as tmp:
        for transport in transports:
            for ws in world_sizes:
                result_file = Path(tmp) / f"{transport}-ws{ws}.json"
                job = Launch(transport, ws, launch_command(transport, ws, _worker_args(ns, transport, result_file)))
                jobs.append(job)
                with console.status(f"{transport} at N={ws} ({NATIVE_LAUNCHER[transport]}) ..."):
                    execute(job, result_file, Path(tmp) / f"{transport}-ws{ws}.log", ns.timeout_s)
                style = {"ok": "green", "incorrect": "red"}.get(job.status, "red")
                console.print(f"{transport} N={ws}: [{style}]{job.status}[/] in {job.wall_s:.1f} s"
                              + (f" - {job.error}" if job.error else ""))
                if job.status in ("failed", "timeout"):
                    console.print("\n".join("  | " + ln for ln in job.log_tail), markup=False, highlight=False)

    payload = results.base_payload(
        kind="collectives",
        created_unix=time.time(),
        wall_s=time.monotonic() - started,
        host_load_avg_1m={"before": load_before, "after": _loadavg()},
        sweep=asdict(sweep),
        definitions={
            "time_us_mean": "mean over timed iterations of the slowest rank (highest mean); each iteration is "
                            "refilled, then barrier, then one in-place all-reduce",
            "time_us_p50": "median over timed iterations of that rank",
            "algbw_gbps": "bytes / time_us_mean, 1 GB = 1e9 bytes",
            "busbw_gbps": "algbw * 2(n-1)/n (nccl-tests doc/PERFORMANCE.md)",
            "correct": "every rank holds exactly n(n+1)/2 * ((i mod 251) + 1) after the last iteration",
        },
        env=results.environment(),
        entries=[{**(j.entry or {"transport": j.transport, "backend": None, "world_size": j.world_size,
                                 "device": None, "sizes": []}),
                  "status": j.status, "error": j.error, "wall_s": j.wall_s, "command": j.command,
                  **({"log_tail": j.log_tail} if j.status in ("failed", "timeout") else {})} for j in jobs],
        unavailable=unavailable,
    )
    results.write_atomic(out_path, payload)
    render(console, jobs, unavailable)
    load = payload["host_load_avg_1m"]
    if load["before"] is not None and max(load["before"], load["after"]) > 0.5 * (os.cpu_count() or 1):
        console.print(f"[yellow]note:[/] host load average {load['before']:.1f} -> {load['after']:.1f} on "
                      f"{os.cpu_count()} CPUs: other work competed with the ranks; expect outliers (mean >> p50)")
    console.print(f"results: {out_path}  ({payload['wall_s']:.0f} s)")
    return 0 if all(j.status == "ok" for j in jobs) else 1


def main(ns: argparse.Namespace) -> int:
    sweep = sweep_from_args(ns)
    if ns.worker:
        if ns.transport is None:
            raise ValueError("--worker needs --transport: one of " + ", ".join(TRANSPORTS))
        return run_worker(ns, sweep)
    if ns.transport is not None:
        raise ValueError(f"--transport={ns.transport} is for worker mode: use --transports {ns.transport} instead")
    return run_orchestrator(ns, sweep)
