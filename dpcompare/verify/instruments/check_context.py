"""What every check of a run is judged with, and what a check concludes.

Owns: `CheckSettings` (the run's settings the checks read, typed: built from the run's config by the run layer,
dpcompare.run.verification, since verify imports nothing above it), `CheckContext` (the facts of the run the checks
share, frozen and built once before the first step: dtype, depth and world size, the floors they set (the unit
roundoffs of the dtype and of the wire), the split of the batch, the parameters judged, the precision recipe, the
oracle coverage), the points of a step a check judges at, and `Finding` (what a check concludes beyond the records it
writes: a failure, a part it could not check). What a check is handed at a step is dpcompare.verify.instruments.step_evidence's;
the `Check` protocol, dpcompare.verify.checks'. Judges nothing itself. Imports no adapter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from dpcompare.contract import ModelFacts
from dpcompare.contract.optim_state import OptimizerFactory
from dpcompare.verify.oracle.gradient_oracle import Layout
from dpcompare.verify.memory.oracle_coverage import OracleCoverage
from dpcompare.verify.judgement.precision_recipe import Recipe
from dpcompare.verify.judgement.tolerance import UNIT_ROUNDOFF, wire_roundoff
from dpcompare.verify.judgement.verdict import Divergence, Verdict

Point = Literal["reduced", "updated"]
"""Where in a step a check judges: `reduced`, after `reduce()` and `unscale()`, before the optimizer step (the
reduced gradient is readable); `updated`, after the optimizer step (the update is)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckSettings:
    """The run's settings the checks read (its flags, typed), and nothing else of its config."""

    dtype: str
    """--dtype: float32, float64 or bfloat16."""
    amp: str = "none"
    """--amp: none, bf16 or fp16."""
    sync_bn: bool = False
    compile: bool = False
    clip_grad_norm: float | None = None
    """--clip-grad-norm (None: no clipping; the grad_norm check runs only with it)."""
    grad_accum: int = 1
    lr: float = 0.0
    weight_decay: float = 0.0
    check_every: int = 1
    """0: no check at all (the verifier is not built)."""
    dump_grads: str | None = None
    """Where the reduced, oracle and floor gradients of every checked step go (an .npz), or None."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckContext:
    """The facts every check of one run shares, built once on rank 0 before the first step."""

    settings: CheckSettings
    world_size: int
    depth: int
    """Layers with parameters (dpcompare.verify.oracle.gradient_oracle.depth_of): rounding compounds along as many."""
    names: tuple[str, ...]
    """The parameters judged: trainable and within the oracle coverage, in the model's order."""
    all_names: tuple[str, ...]
    """Every parameter, trainable or not, in the order the ranks' digests list them."""
    factory: OptimizerFactory
    """The run's optimizer, built over given parameters (the reference steps)."""
    device: torch.device = torch.device("cpu")
    """Where rank 0's copies compute (the run's device)."""
    layout: Layout = Layout()
    """How the backend split the global batch into forwards (ranks, micro-batches, device replicas)."""
    facts: ModelFacts = ModelFacts()
    """What the probe found out about the model before wrapping (unused, frozen, random parts)."""
    batchnorms: tuple[str, ...] = ()
    """The model's BatchNorm modules."""
    oracle_coverage: OracleCoverage | None = None
    """What the float64 oracle checks (--check-coverage; None: every parameter)."""
    recipe: Recipe = Recipe()
    """The mixed-precision recipe that runs, as the reference recomputes it."""
    wire: str = "none"
    """The gradients' dtype on the wire: --compression, or what the backend's precision recipe sends."""
    wired: frozenset[str] | None = None
    """The parameters whose gradients travel on that wire where only some do (None: all of them)."""
    prestep: str | None = None
    """The optimizer step the backend's recipe takes on zero gradients before step 0 by design (None: none)."""
    shards: str = "none"
    """What each rank holds a part of (Capabilities.shards)."""
    replay_reason: str | None = None
    """Why the backend's random numbers are drawn where no recorded draw reaches (None: they are replayed)."""

    @property
    def dtype(self) -> str:
        return self.settings.dtype

    @property
    def u(self) -> float:
        """The run dtype's unit roundoff."""
        return UNIT_ROUNDOFF[self.settings.dtype]

    @property
    def u_wire(self) -> float:
        """The unit roundoff of the reduction: the run dtype's, or the wire's where it is coarser."""
        return wire_roundoff(self.settings.dtype, self.wire)

    @property
    def floor_min(self) -> float:
        """The smallest floor a check allows: depth x the run dtype's unit roundoff."""
        return self.depth * self.u

    @property
    def unchecked(self) -> frozenset[str]:
        """The parameters the oracle coverage leaves out (enter every forward, judged nowhere)."""
        return self.oracle_coverage.unchecked if self.oracle_coverage is not None else frozenset()

    @property
    def has_batchnorm(self) -> bool:
        return bool(self.batchnorms)

    @property
    def floor_name(self) -> str:
        """What the floor is computed in, in words: the --amp recipe, or the run dtype."""
        return f"{self.settings.amp} {self.recipe.kind}" if self.recipe.active else self.settings.dtype


@dataclass(frozen=True, slots=True)
class Finding:
    """What a check concluded at a step beyond the records it keeps in the verdict: a failure (the run's first
    divergence if none came before it) and a part it could not check (the verdict is then `unverifiable`); `stop`:
    nothing can be checked from here on (the training diverged numerically, the draws cannot be replayed)."""

    divergence: Divergence | None = None
    unverifiable: str | None = None
    stop: bool = False

    def record_in(self, verdict: Verdict) -> None:
        """The failure (kept where it is the first) and the part not checked, in `verdict`."""
        if self.divergence is not None:
            verdict.diverge(self.divergence)
        if self.unverifiable is not None:
            verdict.unverifiable.append(self.unverifiable)
