"""Backends whose backward uses other random numbers than the forward drew, on one rank, for the random models of
tests/random_models.py (functional dropout, drop path, attention dropout in scaled_dot_product_attention).

Under --activation-checkpointing each checkpoints the run's blocks claiming to restore the forward's generator state
(as `dpcompare.checkpoint_blocks(preserve_rng_state=True)` does), but on rank 1 the recomputation in backward starts
one random number further on: every random op of the recomputed block draws shifted numbers, so rank 1's gradient is
that of masks its forward never applied. The kind of fault of checkpointing with a generator tracker of its own
(Megatron's and DeepSpeed's CudaRNGStatesTracker restored to the wrong state), kept to one rank so that no ranks'
agreement can hide it. Loaded the way a user's adapter is:
`--backend tests.faulty_random:ShiftedRecomputeDDP --activation-checkpointing`.

Not a test module (no `test_` prefix): pytest does not collect it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from dpcompare import block_modules, checkpoint_blocks
from dpcompare.adapters.ddp import DDPAdapter
from dpcompare.adapters.fsdp import FSDPAdapter

SHIFTED_RANK = 1


def _shifted_class(cls: type) -> type:
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return cls.forward(self, *args, **kwargs)

        def run(*inputs: Any) -> Any:
            if torch._C._current_graph_task_id() != -1:  # recomputing in backward
                torch.rand(1)  # the generator one number past the state the checkpoint restored
            return cls.forward(self, *inputs, **kwargs)

        return checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True)

    # claims what checkpoint_blocks(preserve_rng_state=True) claims (dpcompare.contract.activation_checkpointing's mark)
    return type(f"Shifted{cls.__name__}", (cls,), {"forward": forward, "_dpcompare_checkpoint_preserves_rng": True,
                                                   "__module__": cls.__module__})


def _checkpoint_shifted(module: nn.Module) -> list[str]:
    if not (dist.is_initialized() and dist.get_rank() == SHIFTED_RANK):
        return checkpoint_blocks(module)  # the other ranks checkpoint as the run does
    blocks = block_modules(module)
    for _, block in blocks:
        block.__class__ = _shifted_class(type(block))
    return [name for name, _ in blocks]


class ShiftedRecomputeDDP(DDPAdapter):
    """DDP whose checkpointed blocks, on rank 1, recompute from a generator one number past the forward's state."""

    name = "shifted-recompute-ddp"

    def checkpoint_activations(self, module: nn.Module) -> list[str]:
        return _checkpoint_shifted(module)


class ShiftedRecomputeFSDP(FSDPAdapter):
    """FSDP2 whose checkpointed blocks, on rank 1, recompute from a generator one number past the forward's state."""

    name = "shifted-recompute-fsdp"

    def checkpoint_activations(self, module: nn.Module) -> list[str]:
        return _checkpoint_shifted(module)
