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

from typing import Any, Mapping

import torch
from torch import nn

from dpcompare.contract.optim_state import OptimizerFactory, OptState, read_state
from dpcompare.verify.clipping import clip_scale
from dpcompare.verify.held import Difference, give_back_freed


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


class StepResult:
    """The optimizer step replayed from one start, one parameter at a time as it is read (`_Replay`): nothing of the
    whole model is held but the state after the step, where it is kept."""

    __slots__ = ("delta", "_replay")

    def __init__(self, replay: "_Replay") -> None:
        self._replay = replay
        self.delta: Mapping[str, torch.Tensor] = Difference(_Reached(replay), replay.params, round_to=replay.dtype)
        """theta_after - theta_before per parameter, read in float64 on the CPU (a `Difference`): each read steps that
        parameter then (the values it reached are not held)."""

    @property
    def state(self) -> OptState:
        """The optimizer state after the step (every parameter's; those not read yet are stepped now)."""
        return self._replay.state()


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
    with one optimizer whose only parameter is swapped, when that parameter's update is read (a comparison reads each
    once, so the replay holds one parameter's copy, gradient and state at a time, never the whole model's updates).
    Clipping's global norm is taken first, as clip_grad_norm_ takes it (the norm of the per-tensor norms, in `dtype`).
    The inputs are read when each parameter is stepped: they must not change while the result is read (the checks
    hand it snapshots)."""
    scale = None
    if clip is not None:
        norms = [torch.linalg.vector_norm(g.detach().to(device=device, dtype=dtype))
                 for n in params if (g := grads.get(n)) is not None]
        if norms:
            scale = clip_scale(torch.linalg.vector_norm(torch.stack(norms)), clip)
    return StepResult(_Replay(factory, params, grads, state, dtype, device, scale, times, keep_state, state_like,
                              overrides))


class _Replay:
    """`reference_step`'s optimizer, stepping a parameter when its update is read: the last one's values are kept for a
    second read of the same parameter (a comparison reads each once), the state after each where it is kept."""

    def __init__(self, factory: OptimizerFactory, params: Mapping[str, torch.Tensor],
                 grads: Mapping[str, torch.Tensor | None], state: OptState, dtype: torch.dtype, device: torch.device,
                 scale: torch.Tensor | None, times: int, keep_state: bool, state_like: OptState | None,
                 overrides: dict[str, Any]) -> None:
        self.factory, self.params, self.grads, self.start = factory, params, grads, state
        self.dtype, self.device, self.scale, self.times = dtype, device, scale, times
        self.keep_state, self.state_like, self.overrides = keep_state, state_like, overrides
        self.optimizer: torch.optim.Optimizer | None = None
        self.after: OptState = {}
        self._last: tuple[str, torch.Tensor] | None = None

    def reached(self, n: str) -> torch.Tensor:
        """The value parameter `n` reaches (in the replay's dtype, on the CPU)."""
        if self._last is not None and self._last[0] == n:
            return self._last[1]
        dtype, device = self.dtype, self.device
        live = nn.Parameter(self.params[n].detach().to(device=device, dtype=dtype, copy=True))  # one copy, not two
        if self.optimizer is None:
            self.optimizer = self.factory([live], **self.overrides)
        else:
            self.optimizer.param_groups[0]["params"] = [live]
            self.optimizer.state.clear()
        optimizer = self.optimizer
        if n in self.start:
            optimizer.state[live] = {
                k: (v.to(device=device, dtype=dtype if v.is_floating_point() and v.dim() > 0 else v.dtype, copy=True)
                    if torch.is_tensor(v) else v)
                for k, v in self.start[n].items()
            }
        g = self.grads.get(n)
        live.grad = None if g is None else g.detach().to(device=device, dtype=dtype, copy=True)
        with torch.no_grad():
            if self.scale is not None and live.grad is not None:
                live.grad.mul_(self.scale.to(live.grad.dtype))
            for _ in range(self.times):
                optimizer.step()
        reached = live.detach().to("cpu")
        if self.keep_state:
            read = read_state(optimizer, {n: live})
            self.after.update(held_as(read, self.state_like, _held_dtype(self.params, n))
                              if self.state_like is not None else read)
        optimizer.state.clear()
        self._last = (n, reached)
        # the parameter's copy, gradient and state in the replay's dtype, freed as the next is stepped
        give_back_freed(reached.numel() * reached.element_size() * (2 + len(self.start.get(n, {}))))
        return reached

    def state(self) -> OptState:
        if self.keep_state:
            for n in self.params:
                if n not in self.after:
                    self.reached(n)
        return {n: self.after[n] for n in self.params if n in self.after}


class _Reached(Mapping[str, torch.Tensor]):
    """The values each parameter reaches, by name, stepped as read."""

    __slots__ = ("_replay",)

    def __init__(self, replay: _Replay) -> None:
        self._replay = replay

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._replay.reached(name)

    def __iter__(self):
        return iter(self._replay.params)

    def __len__(self) -> int:
        return len(self._replay.params)


def held_as(expected: OptState, backend: OptState, otherwise: torch.dtype | None = None) -> OptState:
    """`expected` in the dtype of the backend's own entries (float32 moments stay 4 bytes an element between steps): it
    is compared to 1e-4 of its largest value (dpcompare.verify.state_comparison), which float32's rounding of a
    float64 replay (6e-8) cannot move. An entry the backend does not hold yet (a fresh optimizer's, before step 0) is
    held in `otherwise` (the dtype of the parameter the optimizer steps, which its state takes), else in its own."""
    out: OptState = {}
    for name, entries in expected.items():
        have = backend.get(name, {})
        out[name] = {k: _as(v, have.get(k), otherwise) for k, v in entries.items()}
    return out


def _as(value: Any, have: Any, otherwise: torch.dtype | None) -> Any:
    if not (torch.is_tensor(value) and value.is_floating_point() and value.dim() > 0):
        return value
    if torch.is_tensor(have) and have.is_floating_point():
        return value.to(have.dtype)
    return value.to(otherwise) if have is None and otherwise is not None and otherwise.is_floating_point else value


def _held_dtype(params: Mapping[str, torch.Tensor], name: str) -> torch.dtype:
    """The dtype `params[name]` is held in (a Compact's own, not the float64 it is read in)."""
    held = getattr(params, "held", None)
    return (held(name) if held is not None else params[name]).dtype
