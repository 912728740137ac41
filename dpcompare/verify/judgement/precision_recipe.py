"""The run's precision recipe, as the checks recompute it in one process, and the loss scaler's evidence.

Owns: `Recipe` (none, autocast or a backend's 16-bit engine with fp32 master weights), which tells the noise floor
and the run-recipe trajectory how to compute a gradient the way the run does; and `ScaleStep`, what a checked
step's loss scaler did (the scale, whether the oracle's emulation of the ranks overflows there, whether the
backend skipped) and the verdict on it. Imports no adapter.

How a recipe's gradient is computed (`equivalence.accumulate_gradient` with a recipe): each forward the backend ran
(rank, micro-batch, device replica) is run as that rank ran it: the forward and the loss under the recipe
(torch.autocast, or 16-bit weights loaded from the fp32 master values), the loss multiplied in the graph by what
that rank multiplies it by (the loss scale S and 1/grad_accum), the gradients summed over the ranks and only
then divided by the world size and by S. So an fp16 loss scale overflows in the floor exactly where it overflows
in a rank, and the floor of a mixed-precision run measures what its recipe costs on this model, as the
float32 floor measures float32's.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass, field
from typing import Callable, ContextManager, Iterator

import torch

from dpcompare.contract.amp import AMP_DTYPES, AMP_NAMES

Kind = str
"""none | autocast | engine"""


@dataclass(frozen=True, slots=True)
class Recipe:
    kind: Kind = "none"
    """none: the run dtype throughout; autocast: float32 weights, forward and loss under torch.autocast; engine:
    16-bit weights and gradients from fp32 master values (DeepSpeed's bf16/fp16 section)."""
    amp: str = "none"
    """bf16 or fp16 (none without mixed precision)."""
    device_type: str = "cpu"
    gathered: Callable[[], frozenset[str]] | None = None
    """The parameters the backend's latest forward saw gathered in the amp dtype, so that every op of it, not only
    those autocast narrows, saw them rounded (DeepSpeed ZeRO-3 under its torch_autocast section all-gathers its
    lower_precision_safe_modules' parameters in the autocast dtype): the recipe's forwards round them the same way,
    and the gradient is still taken with respect to the float32 parameter. Asked at each forward: it changes from
    step to step."""

    module_boundaries: bool = False
    """Whether the backend's hooks wrap every module's inputs and outputs in autograd functions (DeepSpeed ZeRO-3):
    the recipe's forwards draw the same boundaries (dpcompare.verify.oracle.module_boundaries), so their gradients are summed in
    the rank's order."""

    @property
    def active(self) -> bool:
        return self.kind != "none"

    @property
    def weights_dtype(self) -> torch.dtype | None:
        """The dtype of the weights the forward runs on, when the recipe sets it (engine), else None (the run
        dtype)."""
        return AMP_DTYPES[self.amp] if self.kind == "engine" else None

    def autocast(self) -> ContextManager[None]:
        if self.kind != "autocast":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=AMP_DTYPES[self.amp])

    @contextlib.contextmanager
    def gathering(self, model: torch.nn.Module) -> Iterator[None]:
        """`model`'s `gathered` parameters rounded to the amp dtype for the duration (a forward and its backward),
        their own values restored after."""
        names = self.gathered() if self.gathered is not None else frozenset()
        named = [(n, p) for n, p in model.named_parameters() if n in names] if names else []
        kept = [(p, p.data) for _, p in named]
        try:
            for p, data in kept:
                p.data = data.to(AMP_DTYPES[self.amp]).to(data.dtype)
            yield
        finally:
            for p, data in kept:
                p.data = data

    def describe(self) -> str:
        if not self.active:
            return "none"
        if self.kind == "autocast":
            return f"torch.autocast({AMP_NAMES[self.amp]}), float32 weights and optimizer"
        return f"{AMP_NAMES[self.amp]} weights and gradients, fp32 master weights and optimizer"


NONE = Recipe()


@dataclass(slots=True)
class ScaleStep:
    """What the loss scaler did at one step, held against what the ranks' recipe predicts."""

    step: int
    scale: float
    """The loss scale of this step's backward."""
    predicted_overflow: bool
    """The oracle's emulation of the ranks (the recipe at this scale, rank by rank) has inf or NaN: the step must be
    skipped."""
    reduced_non_finite: bool
    """The backend's reduced, unscaled gradient holds inf or NaN."""
    skipped: bool | None = None
    """The backend skipped the optimizer step (its own count went up and its master weights did not move); None
    until the step has run."""
    scale_after: float | None = None
    ok: bool | None = None
    reason: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(slots=True)
class PrecisionReport:
    """The run's precision recipe and its loss scaler, for the verdict."""

    amp: str = "none"
    recipe: str = "none"
    description: str = "none"
    wire: str = "none"
    loss_scaler: str | None = None
    initial_scale: float | None = None
    steps: list[ScaleStep] = field(default_factory=list)
    """The checked steps' loss-scaler evidence."""
    skipped_total: int | None = None
    """Steps the backend's scaler skipped in the verification phase, checked or not (None: no loss scale)."""
    tf32: dict | None = None
    """torch's TF32 and cuDNN settings as the user set them, and what the checked steps ran with."""

    @property
    def skipped_steps(self) -> list[int]:
        return [s.step for s in self.steps if s.skipped]

    def to_dict(self) -> dict:
        return {"amp": self.amp, "recipe": self.recipe, "description": self.description, "wire": self.wire,
                "loss_scaler": self.loss_scaler, "initial_scale": self.initial_scale,
                "skipped_steps": self.skipped_steps, "skipped_total": self.skipped_total,
                "steps": [s.to_dict() for s in self.steps], "tf32": self.tf32}
