"""compare: every installed backend at each world size, each under its native launcher, plus the
cross-backend gradient matrix.

Runs the reference and DataParallel (one process) and ddp / horovod / deepspeed at every world size asked
for, each as a subprocess of its real launcher (torchrun, horovodrun, the deepspeed launcher), with the
same model, seed, batch and steps. A --backends entry BACKEND:VARIANT runs a variant its adapter declares
(deepspeed:zero2: --opt zero_stage=2) as a backend of its own, labelled deepspeed:zero2/N; --suite NAME runs a
preset (sharding: ddp, ZeRO 0-3 and fsdp under AdamW). Every run checks itself against the float64 oracle and
dumps its checked-step gradients; this command then builds the backend x backend x oracle matrix from the dumps,
prints a table, and writes everything under OUT/<timestamp>/:

  runs/*.json      one result per run (schema: dpcompare/schema/result.schema.json)
  grads/*.npz      reduced, oracle and noise-floor gradients of every checked step
  logs/*.log       each launcher's output
  collectives.json the all-reduce microbenchmark run first (--collectives auto), quoted by every run
  compare.json     the summary: runs, unavailable backends with the reason, the matrix, how each
                   backend left the gradients of unused parameters (unused_parameter_grads), and under
                   --amp fp16 whether the backends at each world size skipped the same steps (skipped_steps)
  report.md, *.png the report and its plots (python -m dpcompare report OUT/<timestamp> rebuilds them; --no-report
                   skips them)

Exit status: 0 when every launch finished (whatever the verdicts), 1 when a launch failed or timed out, 2 for bad
input.
"""

from __future__ import annotations

from dpcompare.commands.compare.compare_command import add_arguments, main

__all__ = ["add_arguments", "main"]
