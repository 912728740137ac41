"""The run's learning-rate scheduler stepped once per training step, whatever a backend's `step()` override does.

Owns: `then_scheduler`, a backend's `step` followed, on its outermost call only, by one step of the adapter's
scheduler (as a training loop calls scheduler.step() after optimizer.step(), also where a loss scaler skipped the
update), unless the backend's own step takes it (`Adapter.scheduler_steps_in_step`: DeepSpeed's engine.step()); and
`wrap_step_override`, which `Adapter.__init_subclass__` applies to every subclass that defines `step`. So an override
that calls the base's step twice (a double optimizer step) or not at all (a step of its own) still leaves the schedule
one step further per training step. Imports no adapter.
"""

from __future__ import annotations

import functools
from typing import Any, Callable


def then_scheduler(step: Callable[[Any], None]) -> Callable[[Any], None]:
    """`step`, then (outermost call only) the adapter's scheduler's step (see the module docstring)."""
    if getattr(step, "schedules", False):
        return step

    @functools.wraps(step)
    def stepped(adapter: Any) -> None:
        adapter._step_depth = getattr(adapter, "_step_depth", 0) + 1
        try:
            step(adapter)
        finally:
            adapter._step_depth -= 1
        scheduler = getattr(adapter, "scheduler", None)
        if adapter._step_depth == 0 and scheduler is not None and not adapter.scheduler_steps_in_step:
            scheduler.step()

    stepped.schedules = True  # type: ignore[attr-defined]
    return stepped


def wrap_step_override(cls: type) -> None:
    """`cls.step`, where `cls` defines its own, wrapped by `then_scheduler`."""
    if "step" in cls.__dict__:
        cls.step = then_scheduler(cls.__dict__["step"])
