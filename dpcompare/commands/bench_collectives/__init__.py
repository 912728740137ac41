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

from dpcompare.commands.bench_collectives.bench_collectives_command import add_arguments, main, sweep_from_args

__all__ = ["add_arguments", "main", "sweep_from_args"]
