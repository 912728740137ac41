"""Evidence: what rank 0 knows at a failed gradient check and at a failed update check.

Owns: GradientEvidence (the backend's reduced gradient, the oracle's, the batch, its layout and masks, the ranks'
shard digests, and the candidate gradients computed in the run's own precision recipe) and UpdateEvidence (the
backend's update, the reference's, the gradient and optimizer states it was taken from, and the reference step
replayed with one setting changed), on which the hypotheses of dpcompare.verify.diagnosis.diagnose build their candidates.
Imports no adapter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from dpcompare.verify.oracle.gradient_oracle import Grads, Layout, Masks, Oracle, replica_pieces
from dpcompare.contract.optim_state import OptimizerFactory, OptState
from dpcompare.verify.replay.optimizer_replay import reference_step


@dataclass(slots=True)
class GradientEvidence:
    """What rank 0 knows at a failed gradient check."""

    step: int
    grads: Grads
    oracle_grads: Grads
    tolerance: dict[str, float]
    oracle: Oracle
    state: dict
    batch: tuple[torch.Tensor, torch.Tensor]
    world_size: int
    grad_accum: int
    shard_digests: list[str]
    has_batchnorm: bool
    sync_bn: bool
    compression: str
    dtype: str
    layout: Layout = Layout()
    """How the backend split the global batch into forwards."""
    per_replica: bool = False
    """The oracle was each replica's own forwards (BatchNorm without --sync-bn), not the global batch."""
    masks: list[Masks | None] | None = None
    """The dropout masks each forward of the layout drew, when the model draws random numbers."""
    previous: tuple[int, dict[str, str]] | None = None
    """(step, the reduced gradient's digest per parameter) of the previous step when it was checked."""
    digests: dict[str, str] | None = None
    """This step's reduced gradient, a digest per parameter (dpcompare.verify.oracle.gradient_oracle.grad_digests)."""
    loss_scale: float | None = None
    """The loss scale of this step's backward, when the run scales its loss (--amp fp16)."""
    judged_tolerance: dict[str, float] | None = None
    """The gradient check's own bounds (against the run-precision reference); `tolerance` is how close a candidate
    must come to be named."""
    missing: frozenset[str] = frozenset()
    """Parameters the backend's reduced_grads() gave no gradient at all (None) though the loss reaches them."""
    rank_norms: list[dict[str, float]] | None = None
    """Each rank's reduced gradient norm per parameter, when the ranks' reduced gradients differ."""
    redrawn: dict[str, str] = field(default_factory=dict)
    """Dropout modules a checkpointed block's recomputation in backward ran with other masks than its forward drew
    (dpcompare.verify.randomness.draw_recording), by name: "rank R: how"."""

    @property
    def stochastic(self) -> bool:
        return bool(self.masks)

    def compute(self, pieces: list) -> Grads:
        """A candidate's gradient in the run's own precision recipe (the reference the backend is judged against), so
        it shares the backend's rounding and only the fault tells them apart."""
        return self.oracle.floor_of(self.state, pieces, self.loss_scale or 1.0)

    def local(self) -> list[Grads]:
        """Each rank's own gradient of its shard (its micro-batches, the masks it drew), in the run's precision."""
        return [self.compute(replica_pieces(self.batch, self.layout, self.masks, ranks=[rank]))
                for rank in range(self.world_size)]


@dataclass(slots=True)
class UpdateEvidence:
    """What rank 0 knows at a failed update check."""

    step: int
    names: list[str]
    delta: Grads
    """The backend's update theta_after - theta_before."""
    reference: Grads
    tolerance: dict[str, float]
    params: Grads
    """theta_before."""
    grads: dict[str, torch.Tensor | None]
    """The backend's reduced gradient, None where a single process gives none (the parameter is not in the loss)."""
    expected_state: OptState
    backend_state: OptState | None
    factory: OptimizerFactory
    device: torch.device
    world_size: int
    lr: float
    weight_decay: float
    backend_hparams: list[dict[str, Any]] = field(default_factory=list)
    expected_from: str = "a fresh optimizer's"
    skipped: bool = False
    """The backend's loss scaler counted this step as skipped."""
    clip: float | None = None
    """--clip-grad-norm: the reference step clips the gradient by its global norm to this (None: no clipping)."""

    def step_with(self, grads: dict[str, torch.Tensor | None] | None = None, state: OptState | None = None,
                  times: int = 1, clip: float | None | str = "run", factory: OptimizerFactory | None = None,
                  **overrides: Any) -> Grads:
        """The reference step with one setting changed; `clip`: the run's clipping ("run"), or another (None: none);
        `factory`: another optimizer (a scheduled reference at another step, or with a group's hyper-parameters
        changed: dpcompare.verify.replay.optimizer_rebuild.ScheduledStep)."""
        return reference_step(factory or self.factory, self.params, self.grads if grads is None else grads,
                              self.expected_state if state is None else state, torch.float64, self.device,
                              times=times, clip=self.clip if clip == "run" else clip, **overrides).delta
