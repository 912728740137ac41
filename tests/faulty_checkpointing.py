"""Deliberately broken activation checkpointing under --activation-checkpointing, for
tests/test_activation_checkpointing.py.

Each adapter checkpoints the same blocks as the run (`Adapter.checkpoint_activations`), but without restoring the
generator state for the recomputation (`preserve_rng_state=False`): dropout redraws its masks in backward, so the
gradient is that of a function the forward never computed — the fault of allenai/OLMo-core PR #828 (cross-entropy
2.495 against 2.195). Loaded the way a user's adapter is:
`--backend tests.faulty_checkpointing:RedrawingDDP --activation-checkpointing`.

Not a test module (no `test_` prefix): pytest does not collect it.
"""

from __future__ import annotations

from torch import nn

from dpcompare import checkpoint_blocks
from dpcompare.adapters.ddp import DDPAdapter
from dpcompare.adapters.fsdp import FSDPAdapter


class RedrawingDDP(DDPAdapter):
    """DDP whose checkpointed blocks redraw their dropout masks when recomputed in backward."""

    name = "redrawing-ddp"

    def checkpoint_activations(self, module: nn.Module) -> list[str]:
        return checkpoint_blocks(module, preserve_rng_state=False)


class RedrawingFSDP(FSDPAdapter):
    """FSDP2 whose checkpointed blocks redraw their dropout masks when recomputed in backward."""

    name = "redrawing-fsdp"

    def checkpoint_activations(self, module: nn.Module) -> list[str]:
        return checkpoint_blocks(module, preserve_rng_state=False)


def no_blocks(seed: int):
    """A workload whose model names no block (one Linear layer, no container): nothing to checkpoint."""
    import torch

    from dpcompare import Workload

    torch.manual_seed(seed)

    def make_batch(step: int, global_batch: int):
        g = torch.Generator().manual_seed(seed * 1000 + step)
        return torch.randn(global_batch, 4, generator=g), torch.randn(global_batch, 2, generator=g)

    return Workload("no-blocks", nn.Linear(4, 2), make_batch, nn.functional.mse_loss)
