"""project: predict step time, scaling efficiency and exposed communication per backend at larger world sizes.

`python -m dpcompare project RESULT_DIR --world-sizes 8,64,512 --link ib-ndr` fits each backend of a compare
folder (its runs at the fit world sizes) and predicts it at the world sizes named, on the link named:

  --link nvlink4 | ib-ndr | 100gbe   a preset (beta from the vendor's figure, alpha an assumption: each is printed)
  --link measured                    alpha and beta fitted to the folder's own microbenchmark (collectives.json)
  --link FILE.json                   alpha and beta fitted to a bench-collectives JSON (busbw per message size)

Per backend (dpcompare/commands/project/fit.py; the method and its limits: docs/projection.md):

  compute(N)  = (c0 + c1 * per-rank batch) * ceil(N / slots)        fitted to the measured compute
  T_comm(N)   = k * sum over the step's messages (buckets, fusion buffer, per-kind collectives) of
                ring all-reduce 2(N-1) alpha + 2(N-1)/N * S / beta, or tree 2 ceil(log2 N) alpha + 2 S / beta
                (--algorithm auto takes the faster); reduce-scatter / all-gather (N-1) alpha + (N-1)/N * S / beta
  exposed(N)  = max(0, T_comm(N) - min(f * T_comm(N), 2/3 * compute(N)))   f: overlap measured at the fit sizes
  step(N)     = compute(N) + exposed(N)

k is 1 on a preset link and, on a measured link, the backend's measured communication over the model at the fit
sizes. slots (ranks that run at once) is the CPU count of the box on a measured link with CPU runs, else unlimited.

Validation: the runs at world sizes outside --fit-world-sizes are held out; each is predicted on the measured link
(--link FILE or the folder's microbenchmark, itself fitted without the held-out sizes) and the error printed
(goal: within 15 % of the measured step). --validate fits on the two smallest world sizes only.

Writes OUT (default RESULT_DIR/projection.json, kind: projection), which `dpcompare report` draws as
projected_scaling.png. Exit status: 0 done (whatever the errors), 2 bad input (unknown link, no such folder,
no usable results).
"""

from __future__ import annotations

from dpcompare.commands.project.project_command import add_arguments, main

__all__ = ["add_arguments", "main"]
