"""What the verification phase reads from the backend at a checked step, and what it keeps over the optimizer step.

Owns: `Reads`, the values every rank read from the backend after the reduce and before the optimizer step, and
`Pending`, the snapshot a step's update check starts from, taken at its gradient check (the parameters, the reduced
gradient, the backend's optimizer state and hyper-parameters, the loss scaler's step and its skips so far).
Imports no adapter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dpcompare.contract.optim_state import OptState
from dpcompare.contract.sparse import densified, densified_state
from dpcompare.verify.oracle.gradient_oracle import Grads
from dpcompare.verify.judgement.precision_recipe import ScaleStep


@dataclass(slots=True)
class Reads:
    """What every rank read from the backend at a checked step, after the reduce and before the optimizer step
    (`Adapter.reduced_grads()`, `master_params()`, `optimizer_state()`: full values, assembled from the ranks'
    parts where the backend shards them); rank 0's verifier judges them."""

    grads: dict[str, torch.Tensor | None]
    masters: dict[str, torch.Tensor]
    state: OptState | None

    def __post_init__(self) -> None:
        # A sparse gradient (nn.Embedding(sparse=True)), and SGD's momentum of one, read densified: the checks compare
        # them with the dense ones of the oracle's copies (dpcompare.contract.sparse); the run's own stay sparse.
        self.grads, self.state = densified(self.grads), densified_state(self.state)


@dataclass(slots=True)
class Pending:
    """What the update check of a step needs from before the optimizer step."""

    step: int
    params: Grads
    grads: dict[str, torch.Tensor | None]
    """The backend's reduced gradient (None where it left none), float64 on the CPU."""
    none: frozenset[str]
    """The parameters a single process gives no gradient (not in the loss)."""
    backend_state: OptState | None
    backend_hparams: list[dict[str, Any]]
    scale: ScaleStep | None = None
    """The loss scaler at this step (None: the loss is not scaled)."""
    skipped_before: int = 0
    """The backend's count of skipped steps before this step's optimizer step."""
