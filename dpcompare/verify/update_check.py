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
from typing import Any, Mapping

import torch
from torch import nn

from dpcompare.contract.optim_state import OptimizerFactory, OptState, Tensors, read_state
from dpcompare.verify.clipping import clip_scale
from dpcompare.verify.held import Difference


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
    delta: Mapping[str, torch.Tensor]
    """theta_after - theta_before per parameter, read in float64 on the CPU (a `Difference`)."""
    state: OptState
    """The optimizer state after the step."""


def reference_step(
    factory: OptimizerFactory,
    params: Mapping[str, torch.Tensor],
    grads: Mapping[str, torch.Tensor | None],
    state: OptState,
    dtype: torch.dtype,
    device: torch.device,
    *,
    times: int = 1,
    clip: float | None = None,
    keep_state: bool = True,
    state_like: OptState | None = None,
    **overrides: Any,
) -> StepResult:
    """Take `times` plain optimizer steps from `params` (in `dtype`) with `grads` (None: no gradient, the
    optimizer skips the parameter as it does in a single process) starting from `state`; with `clip`, the gradients
    clipped by their global norm first (--clip-grad-norm, clip_grad_norm_'s arithmetic in `dtype`). `keep_state`
    False: the state after the step is not read (a floor replay needs only the update); `state_like`: the state read in
    the dtype of that state's entries (the backend's), parameter by parameter as it is read.

    The optimizers replayed (SGD, AdamW) step every parameter on its own: the replay steps one parameter at a time,
    with one optimizer whose only parameter is swapped, so it holds one parameter's copy, gradient and state at a
    time beside the updates it returns, never the whole model's. Clipping's global norm is taken first, as
    clip_grad_norm_ takes it (the norm of the per-tensor norms, in `dtype`)."""
    names = list(params)
    scale = None
    if clip is not None:
        norms = [torch.linalg.vector_norm(g.detach().to(device=device, dtype=dtype))
                 for n in names if (g := grads.get(n)) is not None]
        if norms:
            scale = clip_scale(torch.linalg.vector_norm(torch.stack(norms)), clip)
    optimizer: torch.optim.Optimizer | None = None
    reached: Tensors = {}
    after: OptState = {}
    for n in names:
        live = nn.Parameter(params[n].detach().to(device=device, dtype=dtype, copy=True))  # one copy, not two
        if optimizer is None:
            optimizer = factory([live], **overrides)
        else:
            optimizer.param_groups[0]["params"] = [live]
            optimizer.state.clear()
        if n in state:
            optimizer.state[live] = {
                k: (v.to(device=device, dtype=dtype if v.is_floating_point() and v.dim() > 0 else v.dtype, copy=True)
                    if torch.is_tensor(v) else v)
                for k, v in state[n].items()
            }
        g = grads.get(n)
        live.grad = None if g is None else g.detach().to(device=device, dtype=dtype, copy=True)
        with torch.no_grad():
            if scale is not None and live.grad is not None:
                live.grad.mul_(scale.to(live.grad.dtype))
            for _ in range(times):
                optimizer.step()
        reached[n] = live.detach().to("cpu")
        if keep_state:
            read = read_state(optimizer, {n: live})
            after.update(held_as(read, state_like) if state_like is not None else read)
        del live
    # The update: what each parameter reached less its start, `params` rounded to `dtype` as `live` started; held as
    # the values reached (in `dtype`), the float64 difference computed where it is read.
    return StepResult(Difference(reached, params, round_to=dtype), after)


def held_as(expected: OptState, backend: OptState) -> OptState:
    """`expected` in the dtype of the backend's own entries (float32 moments stay 4 bytes an element between steps): it
    is compared to 1e-4 of its largest value (dpcompare.verify.state_comparison), which float32's rounding of a
    float64 replay (6e-8) cannot move. An entry the backend does not hold keeps its dtype."""
    out: OptState = {}
    for name, entries in expected.items():
        have = backend.get(name, {})
        out[name] = {k: (v.to(have[k].dtype) if torch.is_tensor(v) and v.is_floating_point() and v.dim() > 0
                         and torch.is_tensor(have.get(k)) and have[k].is_floating_point() else v)
                     for k, v in entries.items()}
    return out
