"""The run's optimizer and learning-rate schedule as the checks rebuild them, apart from the backend.

Owns: `OptimizerReference`, the user's optimizer factory (`optimizer(model)`, parameter groups and all) and scheduler
factory (`scheduler(optimizer)`) applied to a copy of the template model that no backend touches (its tensors on the
meta device where the factory allows, else a CPU copy): the optimizer's class, which group each parameter is in (by
name) and each group's hyper-parameters at every step, its scheduler stepped once per step in lockstep with the run.
The backend's own optimizer is never read for them, so a backend that steps a group with the wrong hyper-parameters is
caught. `ScheduledStep`, the reference at one step: what the update check replays (`replay`: the user's optimizer,
built by the user's factory, over given tensors with one group's hyper-parameters at that step). `over` and
`schedule`: the reference trajectory's optimizers over its copies, grouped as the run's, and their hyper-parameters
set for a step. A plain factory (`factory(params, **overrides)`: the built-in sgd and adamw) passes through both.
Imports no adapter.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, Callable, Iterable

import torch
from torch import nn

Hparams = dict[str, Any]
GROUP_KEY = "dpcompare_group"
"""The key a trajectory optimizer's group holds its reference group's index under (kept across its state_dict)."""


def hparams_of(group: dict) -> Hparams:
    """A parameter group's hyper-parameters (every entry but its tensors), copied."""
    return {k: (v.detach().clone() if torch.is_tensor(v) else copy.copy(v)) for k, v in group.items() if k != "params"}


def meta_copy(template: nn.Module) -> nn.Module:
    """`template` with every parameter and buffer on the meta device (nothing allocated, ties kept)."""
    memo: dict[int, Any] = {}
    for t in (*template.parameters(), *template.buffers()):
        if id(t) not in memo:
            meta = torch.empty_like(t.detach(), device="meta")
            memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(template, memo)


def built_over_copy(build: Callable[[nn.Module], Any], template: nn.Module) -> tuple[nn.Module, Any]:
    """(a copy of `template`, `build(copy)`): on a meta copy, else (the factory needs real values or devices: a fused
    optimizer) on a CPU copy. `build`'s own exception, from the CPU copy, is raised as it is."""
    try:
        model = meta_copy(template)
        return model, quietly(build, model)
    except Exception:  # noqa: BLE001 - tried again on real tensors, where the user's error shows as it is
        model = copy.deepcopy(template).cpu()
        return model, quietly(build, model)


def quietly(fn: Callable, *args: Any) -> Any:
    """`fn(*args)` with warnings silenced (a scheduler stepped before any optimizer step warns that it is)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args)


class OptimizerReference:
    """The run's optimizer and schedule, rebuilt over a copy of the template (see the module docstring)."""

    def __init__(self, build: Callable[[nn.Module], torch.optim.Optimizer], scheduler: Callable[[Any], Any] | None,
                 template: nn.Module, lr: float | None = None) -> None:
        """`build(model)`: the run's optimizer over a model; `scheduler(optimizer)`: its schedule (None: none); `lr`: the
        run's --lr, which an `lr=` override is relative to (the diagnosis's "learning rate x N")."""
        self.build, self.scheduler_factory, self.lr = build, scheduler, lr
        self.model, optimizer = built_over_copy(build, template)
        self.type = type(optimizer)
        names = {id(p): n for n, p in self.model.named_parameters()}
        self.groups: list[list[str]] = [[names[id(p)] for p in g["params"] if id(p) in names]
                                        for g in optimizer.param_groups]
        """Each group's parameters, by name, in the optimizer's order."""
        self._group_of = {n: gid for gid, group in enumerate(self.groups) for n in group}
        self._optimizer = optimizer
        self._scheduler = None if scheduler is None else quietly(scheduler, optimizer)
        self.tables: list[list[Hparams]] = [[hparams_of(g) for g in optimizer.param_groups]]
        """Each step's hyper-parameters, by group (step k: after k steps of the reference scheduler)."""

    @property
    def scheduled(self) -> bool:
        return self._scheduler is not None

    def group_of(self, name: str) -> int:
        return self._group_of[name]

    def hparams(self, gid: int, step: int) -> Hparams:
        """Group `gid`'s hyper-parameters at `step` (0-based: before the step's update), the reference scheduler
        stepped up to it once per step."""
        if self._scheduler is None:
            return self.tables[0][gid]
        while len(self.tables) <= step:
            quietly(self._scheduler.step)
            self.tables.append([hparams_of(g) for g in self._optimizer.param_groups])
        return self.tables[step][gid]

    def fresh(self) -> torch.optim.Optimizer:
        """A new optimizer from the user's factory over the copy (its instance as the factory makes it: every setting
        its constructor keeps), with no scheduler."""
        return quietly(self.build, self.model)

    def at(self, step: int) -> "ScheduledStep":
        return ScheduledStep(self, step)

    def __call__(self, params: Iterable[torch.Tensor], **overrides: Any) -> torch.optim.Optimizer:
        """The old use, `factory(params, **overrides)`: the optimizer over `params` with the first group's
        hyper-parameters at step 0."""
        return self.at(0)(params, **overrides)

    def describe(self) -> str:
        """The optimizer's class, its groups and what differs between them as built (before any schedule), and the
        schedule, in words."""
        built = [hparams_of(g) for g in self.fresh().param_groups]
        return describe(self.type.__name__, built, [len(g) for g in self.groups],
                        type(self._scheduler).__name__ if self._scheduler is not None else None)


class ScheduledStep:
    """The reference at one step, as the update check replays it (`reference_step`'s factory), with hyper-parameters
    changed for some groups (`changed`: a hypothesis of the diagnosis)."""

    __slots__ = ("reference", "step", "changes")

    def __init__(self, reference: OptimizerReference, step: int, changes: dict[int, Hparams] | None = None) -> None:
        self.reference, self.step, self.changes = reference, step, changes or {}

    def hparams(self, gid: int) -> Hparams:
        return {**self.reference.hparams(gid, self.step), **self.changes.get(gid, {})}

    def group_of(self, name: str) -> int:
        return self.reference.group_of(name)

    def replay(self, gid: int, params: Iterable[torch.Tensor], **overrides: Any) -> torch.optim.Optimizer:
        """The user's optimizer over `params` alone, with group `gid`'s hyper-parameters at this step (`overrides`:
        `lr=` relative to the run's --lr, any other key set where the group has it)."""
        optimizer = self.reference.fresh()
        hp = dict(self.hparams(gid))
        for key, value in overrides.items():
            if key == "lr" and self.reference.lr:
                hp["lr"] = hp["lr"] * value / self.reference.lr
            elif key in hp:
                hp[key] = value
        optimizer.param_groups = [{**hp, "params": list(params)}]
        optimizer.state.clear()
        return optimizer

    def __call__(self, params: Iterable[torch.Tensor], **overrides: Any) -> torch.optim.Optimizer:
        return self.replay(0, params, **overrides)

    def at(self, step: int) -> "ScheduledStep":
        return ScheduledStep(self.reference, step)

    def changed(self, gid: int, **hp: Any) -> "ScheduledStep":
        return ScheduledStep(self.reference, self.step, {**self.changes, gid: {**self.changes.get(gid, {}), **hp}})


def over(factory: Any, named: list[tuple[str, torch.Tensor]]) -> torch.optim.Optimizer:
    """The run's optimizer over `named` tensors (name, tensor: a parameter's copy, or a piece of it): grouped as the
    reference groups their parameters, with the groups' hyper-parameters at step 0 (a plain factory: one group)."""
    if not isinstance(factory, OptimizerReference):
        return factory([t for _, t in named])
    by_group: dict[int, list[torch.Tensor]] = {}
    for n, t in named:
        by_group.setdefault(factory.group_of(n), []).append(t)
    optimizer = factory.fresh()
    optimizer.param_groups = [{**factory.hparams(gid, 0), "params": ts, GROUP_KEY: gid}
                              for gid, ts in sorted(by_group.items())]
    optimizer.state.clear()
    return optimizer


def schedule(factory: Any, optimizers: Iterable[Any], step: int) -> None:
    """Set the groups of `optimizers` (built by `over`) to their hyper-parameters at `step` (a plain factory, or no
    schedule: nothing changes)."""
    if not isinstance(factory, OptimizerReference) or not factory.scheduled:
        return
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            if GROUP_KEY in group:
                group.update(factory.hparams(group[GROUP_KEY], step))


def differing(tables: list[Hparams]) -> dict[str, list[Any]]:
    """The hyper-parameters whose values differ between groups: key -> each group's value."""
    keys = [k for k in tables[0] if k != "initial_lr"] if tables else []
    return {k: [t.get(k) for t in tables] for k in keys if len({repr(t.get(k)) for t in tables}) > 1}


def describe(cls: str, tables: list[Hparams], sizes: list[int], scheduler: str | None) -> str:
    """`cls`, N groups (the values that differ between them), and the schedule, in words."""
    text = cls
    if len(tables) > 1:
        shown = "; ".join(f"{k} {' / '.join(_value(v) for v in vs)}" for k, vs in differing(tables).items())
        text += f", {len(tables)} groups of {' / '.join(map(str, sizes))} tensors" + (f" ({shown})" if shown else "")
    return text + (f", scheduled by {scheduler}" if scheduler else "")


def _value(v: Any) -> str:
    if torch.is_tensor(v) and v.numel() == 1:
        v = float(v)
    return f"{v:g}" if isinstance(v, float) else str(v)
