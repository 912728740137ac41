"""The update check: is the backend's parameter update the optimizer step a single process would take?

Owns: the reference optimizer step (a plain torch
optimizer built like the run's, float64 from the oracle gradient; in the run dtype from the float32
gradient for the floor), the expected optimizer state, and the update hypotheses the diagnosis tests.
Imports no adapter: it receives the module, the backend's optimizer object and the run's optimizer factory.

How the optimizer state is mirrored, so the check stays step-local and cannot drift by itself:
  - before step 0 the expected state is a fresh optimizer's (empty);
  - before step k > 0 it is one reference step taken from the backend's own state before step k-1 with
    the oracle gradient of step k-1 (when k-1 was checked), else the backend's own state before step k.
  The reference update of step k starts from that expected state; it never inherits more than one step of
  the reference's own arithmetic, so the reference and the backend cannot walk apart over a long run,
  while a state that is not what the previous step made (a fresh optimizer that already stepped: Horovod's
  broadcast_optimizer_state trap, horovod/horovod#3743) changes the update and is caught.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dpcompare.contract.optim_state import OptimizerFactory, OptState, Tensors, read_state
from dpcompare.verify.clipping import clip_


def state_summary(state: OptState) -> str:
    """A few words on what an optimizer state holds (for a diagnosis)."""
    if not state:
        return "no state (a fresh optimizer)"
    first = next(iter(state.values()))
    parts = []
    if "step" in first:
        step = first["step"]
        parts.append(f"step count {float(step):g}")
    for key, v in first.items():
        if key != "step" and torch.is_tensor(v):
            parts.append(f"{key} of norm {float(torch.linalg.vector_norm(v.double())):.3g}")
    return ", ".join(parts) or "entries " + ", ".join(first)


@dataclass(slots=True)
class StepResult:
    delta: Tensors
    """theta_after - theta_before per parameter, float64 on the CPU."""
    state: OptState
    """The optimizer state after the step."""


def reference_step(
    factory: OptimizerFactory,
    params: Tensors,
    grads: dict[str, torch.Tensor | None],
    state: OptState,
    dtype: torch.dtype,
    device: torch.device,
    *,
    times: int = 1,
    clip: float | None = None,
    **overrides: Any,
) -> StepResult:
    """Take `times` plain optimizer steps from `params` (in `dtype`) with `grads` (None: no gradient, the
    optimizer skips the parameter as it does in a single process) starting from `state`; with `clip`, the gradients
    clipped by their global norm first (--clip-grad-norm, clip_grad_norm_'s arithmetic in `dtype`)."""
    names = list(params)
    live = {n: nn.Parameter(params[n].detach().to(device=device, dtype=dtype).clone()) for n in names}
    optimizer = factory(list(live.values()), **overrides)
    for n, entries in state.items():
        if n in live:
            optimizer.state[live[n]] = {
                k: (v.to(device=device, dtype=dtype if v.is_floating_point() and v.dim() > 0 else v.dtype).clone()
                    if torch.is_tensor(v) else v)
                for k, v in entries.items()
            }
    for n in names:
        g = grads.get(n)
        live[n].grad = None if g is None else g.detach().to(device=device, dtype=dtype).clone()
    with torch.no_grad():
        if clip is not None:
            clip_([p.grad for p in live.values() if p.grad is not None], clip)
        for _ in range(times):
            optimizer.step()
    # The step's start is `params` rounded to `dtype`, as `live` was: recomputed here rather than kept, so a
    # large model's check holds one copy of its parameters less.
    delta = {n: live[n].detach().double().cpu() - params[n].detach().to(dtype=dtype).double().cpu() for n in names}
    return StepResult(delta, read_state(optimizer, live))

