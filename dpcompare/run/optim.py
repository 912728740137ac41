"""The run's optimizer and learning-rate schedule: which ones (`choose`: --optimizer, --scheduler, or the workload's
own), refused before anything trains where they cannot run (`refusal`, on every rank alike: a factory that raises, a
scheduler that steps the optimizer itself, one a backend cannot take), built for the run (`build`) and for the checks'
references (`optimizer_factory`) from the same factories.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
from torch import nn

from dpcompare.run import registry
from dpcompare.run.config import RunConfig
from dpcompare.verify.replay.optimizer_rebuild import OptimizerReference, built_over_copy, quietly

SHORTCUTS = ("sgd", "adamw")
"""--optimizer's built-in names; anything else is `package.module:function`, a function (model) -> Optimizer."""


def make_optimizer(cfg: RunConfig, params) -> torch.optim.Optimizer:
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


@dataclass(frozen=True, slots=True)
class Choice:
    """The run's optimizer and schedule as given: the user's factories (None: --optimizer's shortcut, no schedule)
    and how the run names each in its lines."""

    optimizer: Callable[[nn.Module], torch.optim.Optimizer] | None
    scheduler: Callable[[torch.optim.Optimizer], Any] | None
    optimizer_said: str
    scheduler_said: str | None


def choose(cfg: RunConfig, workload: Any) -> Choice:
    """--optimizer package.module:function, else the workload's own optimizer, else --optimizer's shortcut; --scheduler
    package.module:function, else the workload's own, else none. Raises ValueError for a name that does not load, or
    for two choices of one thing."""
    build, build_said = None, f"--optimizer {cfg.optimizer}"
    if cfg.optimizer not in SHORTCUTS:
        build = registry.load(cfg.optimizer, {n: n for n in SHORTCUTS}, "optimizer")
    elif getattr(workload, "optimizer", None) is not None:
        if cfg.optimizer != "sgd":
            raise ValueError(f"--optimizer {cfg.optimizer} and the workload's own optimizer both choose the run's "
                             "optimizer: drop --optimizer (the workload's is used), or give the workload none")
        build, build_said = workload.optimizer, f"the workload's optimizer {_name(workload.optimizer)}"
    schedule, schedule_said = None, None
    if cfg.scheduler is not None:
        schedule, schedule_said = registry.load(cfg.scheduler, {}, "scheduler"), f"--scheduler {cfg.scheduler}"
        if getattr(workload, "scheduler", None) is not None:
            raise ValueError(f"--scheduler {cfg.scheduler} and the workload's own scheduler both choose the run's "
                             "schedule: drop --scheduler (the workload's is used), or give the workload none")
    elif getattr(workload, "scheduler", None) is not None:
        schedule, schedule_said = workload.scheduler, f"the workload's scheduler {_name(workload.scheduler)}"
    for fn, said in ((build, build_said), (schedule, schedule_said)):
        if fn is not None and not callable(fn):
            raise ValueError(f"{said}: {type(fn).__name__} is not callable; give a function")
    return Choice(build, schedule, build_said, schedule_said)


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def builder(cfg: RunConfig, choice: Choice) -> Callable[[nn.Module], torch.optim.Optimizer]:
    """optimizer(model): the user's factory, or --optimizer's shortcut over the model's trainable parameters alone
    (torch never steps a parameter without a gradient, and DeepSpeed's ZeRO 1/2 take their gradient buffers' dtype
    from the first parameter of the first group: an integer parameter listed first, an index kept as a parameter, would
    make them integer)."""
    if choice.optimizer is not None:
        return choice.optimizer
    return lambda model: make_optimizer(cfg, [p for p in model.parameters() if p.requires_grad])


def build(cfg: RunConfig, choice: Choice, module: nn.Module) -> torch.optim.Optimizer:
    """The run's optimizer over the module the backend wraps (after `refusal` found it buildable)."""
    return builder(cfg, choice)(module)


def refusal(cfg: RunConfig, choice: Choice, template: nn.Module, adapter: Any) -> str | None:
    """Why the run cannot train with this optimizer and schedule, in one line (None: it can): a factory that raises
    or returns no torch optimizer, an optimizer that leaves out a trainable parameter or holds a tensor that is not
    the model's, a scheduler whose step() raises or steps the optimizer itself, one the backend cannot take
    (Adapter.optimizer_refusal), a schedule across a checkpoint. Probed on throwaway builds over a copy of the model:
    the same answer on every rank."""
    said, what = choice.optimizer_said, "function(model) and must return a torch.optim.Optimizer"
    try:
        model, optimizer = built_over_copy(builder(cfg, choice), template)
    except Exception as exc:  # noqa: BLE001 - the user's function: its error in one line
        return f"{said}: your function raised {type(exc).__name__}: {exc} (it is called as {what})"
    if not isinstance(optimizer, torch.optim.Optimizer):
        return f"{said}: your function returned {type(optimizer).__name__}; it is called as {what}"
    held = [p for g in optimizer.param_groups for p in g["params"]]
    names = {id(p): n for n, p in model.named_parameters()}
    if foreign := [i for i, p in enumerate(held) if id(p) not in names]:
        return (f"{said}: the optimizer holds {len(foreign)} tensor(s) that are not the model's parameters: build it "
                "over the model it is given (its parameters or named_parameters)")
    steps = {id(p) for p in held}
    if left := [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in steps]:
        return (f"{said}: the optimizer leaves out trainable parameter(s) {', '.join(left[:4])}"
                f"{' and more' if len(left) > 4 else ''}: give them to it, or set requires_grad=False on them")
    if choice.scheduler is not None:
        if (cfg.save_checkpoint or cfg.load_checkpoint) is not None:
            return (f"{choice.scheduler_said}: a learning-rate schedule is not part of the checkpoints dpcompare saves "
                    "and loads: drop the scheduler, or --save-checkpoint/--load-checkpoint")
        if (refused := _scheduler_refusal(choice, optimizer)) is not None:
            return refused
    refused = adapter.optimizer_refusal(adapter.settings, optimizer, choice.scheduler is not None)
    if refused is not None:
        return f"--backend {cfg.backend} cannot take {said}{' with ' + choice.scheduler_said if choice.scheduler else ''}: {refused}"
    return None


def _scheduler_refusal(choice: Choice, optimizer: torch.optim.Optimizer) -> str | None:
    said, what = choice.scheduler_said, "function(optimizer) and must return a scheduler with step()"
    try:
        scheduler = quietly(choice.scheduler, optimizer)
    except Exception as exc:  # noqa: BLE001 - the user's function: its error in one line
        return f"{said}: your function raised {type(exc).__name__}: {exc} (it is called as {what})"
    if not callable(getattr(scheduler, "step", None)):
        return f"{said}: your function returned {type(scheduler).__name__}, which has no step(); it is called as {what}"
    stepped = []
    inner = optimizer.step
    optimizer.step = lambda *args, **kwargs: (stepped.append(1), inner(*args, **kwargs))[1]  # type: ignore[method-assign]
    try:
        quietly(scheduler.step)
    except Exception as exc:  # noqa: BLE001
        return (f"{said}: its step() raised {type(exc).__name__}: {exc}; the run calls scheduler.step() with no "
                "argument once after every optimizer step (a scheduler that needs a metric, ReduceLROnPlateau, "
                "cannot be given)")
    if stepped:
        return (f"{said}: its step() calls optimizer.step() itself, so every training step would take two optimizer "
                "steps: a scheduler only sets the groups' hyper-parameters (the run steps the optimizer)")
    return None


def optimizer_factory(cfg: RunConfig, template: nn.Module | None = None, workload: Any = None) -> Callable[..., Any]:
    """The run's optimizer for the checks' references. The built-in optimizer with no schedule: `factory(params,
    **overrides)` over any parameters, with hyper-parameters overridden (for the update check). A user's optimizer or a
    schedule: an OptimizerReference built over a copy of `template` (dpcompare.verify.replay.optimizer_rebuild), each parameter
    replayed with its group's hyper-parameters at the step."""
    choice = choose(cfg, workload)
    if choice.optimizer is None and choice.scheduler is None or template is None:
        return lambda params, **overrides: make_optimizer(replace(cfg, **overrides), params)
    return OptimizerReference(builder(cfg, choice), choice.scheduler, template, lr=cfg.lr)
