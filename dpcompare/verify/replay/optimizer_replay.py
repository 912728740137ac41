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

import math

from typing import Any, Mapping

import torch
from torch import nn
from torch.optim import optimizer as torch_optimizer

from dpcompare.contract.optim_state import OptimizerFactory, OptState, per_element, read_state
from dpcompare.verify.replay.clipping_rule import clip_scale
from dpcompare.verify.judgement.held_values import Difference, give_back_freed


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
    sink: Any = None,
    scale: torch.Tensor | None = None,
    multiple: float = 1.0,
    **overrides: Any,
) -> StepResult:
    """Take `times` plain optimizer steps from `params` (in `dtype`) with `grads` (None: no gradient, the
    optimizer skips the parameter as it does in a single process) starting from `state`; with `clip`, the gradients
    clipped by their global norm first (--clip-grad-norm, clip_grad_norm_'s arithmetic in `dtype`). `keep_state`
    False: the state after the step is not read (a floor replay needs only the update); `state_like`: the state read in
    the dtype of that state's entries (the backend's), parameter by parameter as it is read; `sink`: where each
    parameter's state after the step goes once it is complete (`add(name, entries)`; `result()` is the state: a
    dpcompare.verify.ranks.verifier_group.StateHolder sends it to its owner), instead of being held here; `scale`: clipping's
    coefficient given (a range replayed apart from the others: dpcompare.verify.replay.replay_ranges), not taken from `grads`;
    `multiple`: the step taken as if each gradient were `multiple` times larger (a power of two, so the product is
    exact: the same values, to the bit, as a replay handed the gradients so multiplied, where none overflows), applied
    to each piece as it is stepped, so no multiplied copy of a gradient is made.

    The optimizers replayed (SGD, AdamW) step every parameter on its own: the replay steps one parameter at a time,
    with one optimizer per parameter group whose only parameter is swapped (a scheduled reference's: the user's
    optimizer at that group's hyper-parameters of the step, dpcompare.verify.replay.optimizer_rebuild), when that parameter's
    update is read (a comparison reads each
    once, so the replay holds one parameter's copy, gradient and state at a time, never the whole model's updates).
    Clipping's global norm is taken first, as clip_grad_norm_ takes it (the norm of the per-tensor norms, in `dtype`).
    The inputs are read when each parameter is stepped: they must not change while the result is read (the checks
    hand it snapshots)."""
    if multiple != 1.0:
        scale = _multiplied(scale, multiple, clip, params, grads, dtype, device)
    elif clip is not None and scale is None:
        scale = scale_of(list(grad_norms(params, grads, dtype, device).values()), clip)
    return StepResult(_Replay(factory, params, grads, state, dtype, device, scale, times, keep_state, state_like,
                              overrides, sink))


def _multiplied(scale: torch.Tensor | None, multiple: float, clip: float | None, params, grads, dtype: torch.dtype,
                device: torch.device) -> torch.Tensor | None:
    """What `reference_step` multiplies each gradient by for gradients `multiple` times larger: `multiple`, times
    clipping's coefficient where it clips. A power of two scales each norm exactly, so the coefficient is the one the
    multiplied gradients give, and `multiple` times it is exact: g x (multiple x c) rounds as (multiple x g) x c."""
    if math.frexp(multiple)[0] != 0.5:
        raise ValueError(f"a gradient multiple must be a power of two (its product exact), not {multiple!r}")
    if scale is None and clip is not None:
        scale = scale_of([n * multiple for n in grad_norms(params, grads, dtype, device).values()], clip)
        if scale is None:  # no gradient: nothing to multiply
            return None
    return torch.tensor(multiple, dtype=dtype, device=device) if scale is None else scale * multiple


def grad_norms(names, grads: Mapping[str, torch.Tensor | None], dtype: torch.dtype, device: torch.device
               ) -> dict[str, torch.Tensor]:
    """Each gradient's norm in `dtype` on `device` (none where it is None), as clipping takes them."""
    return {n: torch.linalg.vector_norm(g.detach().to(device=device, dtype=dtype))
            for n in names if (g := grads.get(n)) is not None}


def scale_of(norms: list[torch.Tensor], clip: float) -> torch.Tensor | None:
    """Clipping's coefficient from the per-tensor norms in the parameters' order (None: no gradient)."""
    return clip_scale(torch.linalg.vector_norm(torch.stack(norms)), clip) if norms else None


ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)
"""Optimizers whose step acts on each element of a parameter alone (no norm or sum over the tensor): a replay steps
them a piece of a parameter at a time, as a comparison reads it (`_Replay.piece`). Any other, a subclass included, is
stepped a whole parameter at a time."""


def elementwise(factory: OptimizerFactory) -> bool:
    """Whether `factory`'s optimizer steps each element of a parameter alone (ELEMENTWISE, not fused): its step of a
    piece of a parameter is the same, to the bit, as that piece of its step of the whole."""
    probe = factory([nn.Parameter(torch.zeros(1))])
    return type(probe) in ELEMENTWISE and not any(g.get("fused") for g in probe.param_groups)


def in_one_kernel(optimizer: torch.optim.Optimizer, dtype: torch.dtype, device: torch.device) -> bool:
    """Set a float64 replay of SGD, Adam or AdamW (ELEMENTWISE, exactly) to step in torch's fused kernel for `device`,
    where torch has one: one pass over a parameter, its gradient and its state, where the single-tensor loop makes
    one for each of its 4 (SGD) to 9 (AdamW) ops. The float64 replay is the reference, not a process's computation:
    the fused kernel computes the same update in float64, within one unit in the last place of the value reached
    (tests/test_fused_replay.py; SGD's was the loop's to the bit on the CPUs it ran on). The run-dtype replay, the
    floor, stays the loop a single process runs. Returns whether it was set (not for another dtype or class, a
    differentiable or capturable group, or a device torch has no fused kernel for)."""
    if dtype != torch.float64 or type(optimizer) not in ELEMENTWISE or device.type not in _fused_devices():
        return False
    if any(g.get("differentiable") or g.get("capturable") for g in optimizer.param_groups):
        return False
    for group in optimizer.param_groups:
        group["fused"], group["foreach"] = True, False
    return True


def _fused_devices() -> tuple[str, ...]:
    """The device types torch's optimizers have fused kernels for."""
    supported = getattr(torch_optimizer, "_get_fused_kernels_supported_devices", None)
    return tuple(supported()) if supported is not None else ("cuda",)


def uncut(model: nn.Module, factory: OptimizerFactory | None) -> list[str]:
    """The trainable parameters of `model` the checks' ranges may not cut (dpcompare.verify.ranks.range_plan): every one where the
    run's optimizer steps a parameter as a whole (a factored or normalised update: a piece would step apart from the
    rest, as no single process does), none where it steps each element alone (SGD, Adam, AdamW: the update check's
    replay, the copies' steps and their states are the same on a piece; None: the run's default, SGD). The same on
    every rank: it depends on the optimizer's type alone."""
    if factory is None or elementwise(factory):
        return []
    return [n for n, p in model.named_parameters() if p.requires_grad]


class _Replay:
    """`reference_step`'s optimizer, stepping a parameter when its update is read: the last one's values are kept for a
    second read of the same parameter (a comparison reads each once), the state after each where it is kept. An
    ELEMENTWISE optimizer is stepped a piece at a time where a comparison reads pieces (`piece`), in buffers reused from
    piece to piece: no whole-parameter copy is allocated (on the CPU each fresh one costs its page faults, several times
    the arithmetic)."""

    def __init__(self, factory: OptimizerFactory, params: Mapping[str, torch.Tensor],
                 grads: Mapping[str, torch.Tensor | None], state: OptState, dtype: torch.dtype, device: torch.device,
                 scale: torch.Tensor | None, times: int, keep_state: bool, state_like: OptState | None,
                 overrides: dict[str, Any], sink: Any = None) -> None:
        self.factory, self.params, self.grads, self.start = factory, params, grads, state
        self.dtype, self.device, self.scale, self.times = dtype, device, scale, times
        self.keep_state, self.state_like, self.overrides = keep_state, state_like, overrides
        self.optimizer: torch.optim.Optimizer | None = None
        """The optimizer stepped last (or the probe of `elementwise`)."""
        self._optimizers: dict[int | None, torch.optim.Optimizer] = {}
        """By parameter group (None: a plain factory's one), the optimizer replayed, swapped to each parameter."""
        self.after: OptState = {}
        self.sink = sink
        """Where each parameter's state after the step goes once complete, instead of `after` (None: kept here)."""
        self._last: tuple[str, torch.Tensor] | None = None
        self._read: tuple[str, torch.Tensor, torch.Tensor | None, dict[str, Any] | None] | None = None
        """The parameter whose pieces are being stepped, and its inputs (`_sources`)."""
        self._buffers: dict[str, torch.Tensor] = {}
        """Reused piece buffers, by role: the parameter, its gradient and each state entry."""
        self._filling: dict[str, tuple[dict[str, Any], dict[int, int]]] = {}
        """The state after the step of a parameter read in pieces: its entries, and the pieces written (start: size)."""

    def reached(self, n: str) -> torch.Tensor:
        """The value parameter `n` reaches (in the replay's dtype, on its device)."""
        if self._last is not None and self._last[0] == n:
            return self._last[1]
        dtype, device = self.dtype, self.device
        live = nn.Parameter(self.params[n].detach().to(device=device, dtype=dtype, copy=True))  # one copy, not two
        start = None if n not in self.start else {
            k: (v.to(device=device, dtype=dtype if v.is_floating_point() and per_element(k, v) else v.dtype, copy=True)
                if torch.is_tensor(v) else v)
            for k, v in self.start[n].items()}
        g = self.grads.get(n)
        optimizer = self._step(n, live, start, None if g is None else g.detach().to(device=device, dtype=dtype,
                                                                                   copy=True))
        reached = live.detach()
        self._filling.pop(n, None)
        if self.keep_state:
            read = read_state(optimizer, {n: live})
            self._keep(n, (held_as(read, self.state_like, _held_dtype(self.params, n))
                           if self.state_like is not None else read).get(n))
        optimizer.state.clear()
        self._last = (n, reached)
        # the parameter's copy, gradient and state in the replay's dtype, freed as the next is stepped
        give_back_freed(reached.numel() * reached.element_size() * (2 + len(self.start.get(n, {}))))
        return reached

    def _step(self, n: str, live: nn.Parameter, start: dict[str, Any] | None, grad: torch.Tensor | None
              ) -> torch.optim.Optimizer:
        """Parameter `n`'s group's optimizer, swapped to `live` alone, from `start` (its state entries on the device;
        None: none), with `grad` (clipped by the replay's scale): stepped `times` times."""
        optimizer = self._optimizer(n, live)
        if start is not None:
            optimizer.state[live] = start
        live.grad = grad
        with torch.no_grad():
            if self.scale is not None and grad is not None:
                grad.mul_(self.scale.to(grad.dtype))
            for _ in range(self.times):
                optimizer.step()
        return optimizer

    def _optimizer(self, n: str, live: nn.Parameter) -> torch.optim.Optimizer:
        """The optimizer of parameter `n`'s group over `live` alone: built once per group (a scheduled reference's
        replay: the user's optimizer with that group's hyper-parameters at the step, dpcompare.verify.replay.optimizer_rebuild;
        a plain factory's: one for every parameter), then swapped from parameter to parameter."""
        group_of = getattr(self.factory, "group_of", None)
        key = group_of(n) if group_of is not None else None
        optimizer = self._optimizers.get(key)
        if optimizer is None:
            optimizer = (self.factory([live], **self.overrides) if key is None
                         else self.factory.replay(key, [live], **self.overrides))
            in_one_kernel(optimizer, self.dtype, self.device)
            self._optimizers[key] = optimizer
        else:
            optimizer.param_groups[0]["params"] = [live]
            optimizer.state.clear()
        self.optimizer = optimizer
        return optimizer

    def elementwise(self) -> bool:
        """Whether the replayed optimizer steps each element alone (ELEMENTWISE): then it can be read in pieces."""
        if self.optimizer is None:
            probe = nn.Parameter(torch.zeros(1, dtype=self.dtype, device=self.device))
            self.optimizer = self.factory([probe], **self.overrides)
        return type(self.optimizer) in ELEMENTWISE

    def numel(self, n: str) -> int:
        return _held(self.params, n).numel()

    def piece(self, n: str, part: slice) -> torch.Tensor:
        """Elements `part` of the flattened value parameter `n` reaches, in the replay's dtype on its device, valid until
        the next piece is read. An ELEMENTWISE optimizer steps just those elements (from the same inputs, so a piece
        read twice is the same); any other steps the whole parameter (`reached`)."""
        if not self.elementwise():
            return self.reached(n).reshape(-1)[part]
        size = part.stop - part.start
        param, g, start = self._sources(n)
        live = nn.Parameter(self._buffer("param", size).copy_(param[part]))
        if start is not None:
            start = {k: (self._buffer(k, size).copy_(v[part]) if per_element(k, v)
                         else v.to(device=self.device, copy=True) if torch.is_tensor(v) else v)
                     for k, v in start.items()}
        optimizer = self._step(n, live, start, None if g is None else self._buffer("grad", size).copy_(g[part]))
        if self.keep_state and not self._kept(n):
            self._fill(n, part, optimizer.state.get(live, {}))
        optimizer.state.clear()
        return live.detach()

    def _sources(self, n: str) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, Any] | None]:
        """Parameter `n`'s inputs as held, flattened (its value, its gradient, its state before the step), read once
        for all its pieces: a gradient held by another rank (dpcompare.verify.ranks.verifier_group.Remote) is sent once, not once a
        piece."""
        if self._read is None or self._read[0] != n:
            self._read = None  # the last parameter's let go before this one's is read
            g = _held(self.grads, n)
            start = self.start.get(n)
            self._read = (n, _held(self.params, n).detach().reshape(-1), None if g is None else g.detach().reshape(-1),
                          None if start is None else {k: v.detach().reshape(-1) if per_element(k, v) else v
                                                      for k, v in start.items()})
        return self._read[1:]

    def _buffer(self, role: str, size: int) -> torch.Tensor:
        """`size` elements of the buffer kept for `role` (grown to the largest piece asked for, never one a size)."""
        if role not in self._buffers or self._buffers[role].numel() < size:
            self._buffers[role] = torch.empty(size, dtype=self.dtype, device=self.device)
        return self._buffers[role][:size]

    def _fill(self, n: str, part: slice, entries: Mapping[str, Any]) -> None:
        """Write the state after the step of `part` into parameter `n`'s (held as `held_as` holds it); once every
        piece is written, it is the parameter's state after the step."""
        if n not in self._filling:
            shape, otherwise = _held(self.params, n).shape, _held_dtype(self.params, n)
            have = (self.state_like or {}).get(n, {})
            self._filling[n] = ({k: (torch.empty(shape, dtype=_as_dtype(v.dtype, have.get(k), otherwise)
                                                 if self.state_like is not None else v.dtype)
                                     if per_element(k, v) else v) for k, v in entries.items()}, {})
        held, written = self._filling[n]
        for k, v in entries.items():
            if per_element(k, v):
                held[k].view(-1)[part].copy_(v.detach())
            else:
                held[k] = v.detach().to("cpu", copy=True) if torch.is_tensor(v) else v
        written[part.start] = part.stop - part.start
        if sum(written.values()) == self.numel(n):
            del self._filling[n]
            self._keep(n, held)

    def _keep(self, n: str, entries: dict[str, Any] | None) -> None:
        """Parameter `n`'s state after the step, complete (None: the optimizer left it none); once (a parameter read
        whole after its pieces reaches the same state)."""
        if entries is None or self._kept(n):
            return
        if self.sink is not None:
            self.sink.add(n, entries)
        else:
            self.after[n] = entries

    def _kept(self, n: str) -> bool:
        return n in self.after or (self.sink is not None and n in self.sink)

    def state(self) -> OptState:
        if self.keep_state:
            for n in self.params:
                if not self._kept(n):
                    self.reached(n)
        if self.sink is not None:
            return self.sink.result()
        return {n: self.after[n] for n in self.params if n in self.after}


class _Reached(Mapping[str, torch.Tensor]):
    """The values each parameter reaches, by name, stepped as read (whole, or in pieces: `pieces`)."""

    __slots__ = ("_replay",)

    def __init__(self, replay: _Replay) -> None:
        self._replay = replay

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._replay.reached(name)

    def pieces(self, name: str) -> "_Pieces":
        return _Pieces(self._replay, name)

    def __iter__(self):
        return iter(self._replay.params)

    def __len__(self) -> int:
        return len(self._replay.params)


class _Pieces:
    """One parameter's values after a replayed step, flattened, stepped a piece at a time as a slice of it is read."""

    __slots__ = ("_replay", "_name")

    def __init__(self, replay: _Replay, name: str) -> None:
        self._replay, self._name = replay, name

    def __getitem__(self, part: slice) -> torch.Tensor:
        return self._replay.piece(self._name, part)

    def numel(self) -> int:
        return self._replay.numel(self._name)

    @property
    def dtype(self) -> torch.dtype:
        return self._replay.dtype


def held_as(expected: OptState, backend: OptState, otherwise: torch.dtype | None = None) -> OptState:
    """`expected` in the dtype of the backend's own entries (float32 moments stay 4 bytes an element between steps): it
    is compared to 1e-4 of its largest value (dpcompare.verify.diagnosis.state_comparison), which float32's rounding of a
    float64 replay (6e-8) cannot move. An entry the backend does not hold yet (a fresh optimizer's, before step 0) is
    held in `otherwise` (the dtype of the parameter the optimizer steps, which its state takes), else in its own."""
    out: OptState = {}
    for name, entries in expected.items():
        have = backend.get(name, {})
        out[name] = {k: _as(v, have.get(k), otherwise) if per_element(k, v) else v for k, v in entries.items()}
    return out


def _as(value: Any, have: Any, otherwise: torch.dtype | None) -> Any:
    if not value.is_floating_point():
        return value
    return value.to(_as_dtype(value.dtype, have, otherwise))


def _as_dtype(dtype: torch.dtype, have: Any, otherwise: torch.dtype | None) -> torch.dtype:
    """The dtype `held_as` holds a floating entry of `dtype` in."""
    if not dtype.is_floating_point:
        return dtype
    if torch.is_tensor(have) and have.is_floating_point():
        return have.dtype
    return otherwise if have is None and otherwise is not None and otherwise.is_floating_point else dtype


def _held(tensors: Mapping[str, Any], name: str) -> Any:
    """`tensors[name]` as held (a Compact's in its own dtype, not read in float64)."""
    held = getattr(tensors, "held", None)
    return held(name) if held is not None else tensors.get(name)


def _held_dtype(params: Mapping[str, torch.Tensor], name: str) -> torch.dtype:
    """The dtype `params[name]` is held in (a Compact's own, not the float64 it is read in)."""
    return _held(params, name).dtype
