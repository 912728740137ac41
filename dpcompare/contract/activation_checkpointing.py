"""Activation checkpointing (--activation-checkpointing): a model's blocks keep no activations for backward and
recompute their forward there instead.

Owns: `checkpoint_blocks`, which makes each block of a model (`dpcompare.contract.workload.block_modules`, the units
FSDP shards) run its forward under `torch.utils.checkpoint.checkpoint(use_reentrant=False)`, and
`checkpointed_blocks`, which names the modules of a model that do. A block keeps its input; everything its forward
saves for backward is dropped and recomputed when the backward reaches the block. With `preserve_rng_state=True`
(the default, and what the run does) the recomputation starts from the generator state the forward started from, so
its dropout draws the very masks of the forward; False redraws them (the fault of allenai/OLMo-core PR #828, kept
for the twin that proves the checks see it).

How: the block's class is swapped for a subclass whose `forward` calls the original one through the checkpoint (as
FSDP2's `fully_shard` swaps classes). Module names, parameters, hooks and state dicts stay as they were: the
verification matches dropout masks and gradients by name, `fully_shard` wraps the block's `__call__` outside the
checkpoint, and `nn.DataParallel`'s replicas (which copy a module's `__dict__` into an object of its class) recompute
with their own parameters. Imports nothing above the contract.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dpcompare.contract.workload import block_modules

_MARK = "_dpcompare_checkpoint_preserves_rng"
"""Class attribute of a checkpointed block's class: whether its recomputation restores the generator state."""

_CLASSES: dict[tuple[type, bool], type] = {}


def _checkpointed_class(cls: type, preserve_rng_state: bool) -> type:
    key = (cls, preserve_rng_state)
    if key not in _CLASSES:
        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():  # nothing is saved for a backward that will not come
                return cls.forward(self, *args, **kwargs)
            return checkpoint(functools.partial(cls.forward, self), *args, use_reentrant=False,
                              preserve_rng_state=preserve_rng_state, **kwargs)

        forward.__doc__ = f"{cls.__name__}.forward, its activations recomputed in backward (torch.utils.checkpoint)"
        _CLASSES[key] = type(f"Checkpointed{cls.__name__}", (cls,),
                             {"forward": forward, _MARK: preserve_rng_state, "__module__": cls.__module__})
    return _CLASSES[key]


def checkpoint_blocks(model: nn.Module, *, preserve_rng_state: bool = True,
                      blocks: list[tuple[str, nn.Module]] | None = None) -> list[str]:
    """Make every block of `model` recompute its forward in backward (non-reentrant torch.utils.checkpoint), in place;
    returns the blocks' names in module order (empty when the model names no block: nothing is checkpointed). A block
    already checkpointed is left as it is. `preserve_rng_state=False` lets the recomputation draw new random numbers:
    its dropout masks differ from the forward's (a fault; the run never asks for it). `blocks`: these (name, module)
    pairs instead of `block_modules(model)`."""
    blocks = block_modules(model) if blocks is None else blocks
    for _, block in blocks:
        if not hasattr(type(block), _MARK):
            block.__class__ = _checkpointed_class(type(block), preserve_rng_state)
    return [name for name, _ in blocks]


def checkpointed_blocks(model: nn.Module) -> dict[str, bool]:
    """`model`'s modules whose forward `checkpoint_blocks` made recompute in backward, by name, each with whether its
    recomputation restores the forward's generator state."""
    return {name: getattr(type(m), _MARK) for name, m in model.named_modules() if hasattr(type(m), _MARK)}


def record(model: nn.Module) -> dict[str, Any] | None:
    """What the result says of the model's checkpointed blocks (None: none is checkpointed)."""
    blocks = checkpointed_blocks(model)
    if not blocks:
        return None
    return {"blocks": len(blocks), "names": list(blocks), "preserve_rng_state": all(blocks.values())}


def describe(model: nn.Module) -> str:
    """The verdict's note on the model's checkpointed blocks."""
    blocks = checkpointed_blocks(model)
    shown = ", ".join(list(blocks)[:6]) + (f" and {len(blocks) - 6} more" if len(blocks) > 6 else "")
    redraws = [name for name, preserved in blocks.items() if not preserved]
    rng = (f"; {len(redraws)} of them recompute WITHOUT restoring the generator state, so their dropout draws new masks "
           "in backward" if redraws else "; each recomputation restores the generator state of its forward, so its "
           "dropout draws the forward's masks")
    return (f"--activation-checkpointing: {len(blocks)} block(s) ({shown}) keep only their input and recompute their "
            f"forward in backward (non-reentrant torch.utils.checkpoint){rng}")


def summary_phrase(recorded: Mapping[str, Any] | None, peak: float | None, above: float | None) -> str:
    """The run line's phrase on its checkpointed blocks (`record`'s) and the memory the measured steps took (peak and
    above the step's start, MiB; '' when no block was checkpointed)."""
    if not recorded:
        return ""
    phrase = f"; {recorded['blocks']} block(s) recomputed in backward (--activation-checkpointing"
    phrase += ")" if recorded["preserve_rng_state"] else ", WITHOUT the forward's generator state)"
    if peak is not None:
        phrase += f", peak memory {peak:.1f} MiB" + (f" ({above:.1f} MiB above the step's start)" if above is not None else "")
    return phrase
