"""Dropout masks in transit: the form in which a rank's masks travel to rank 0.

Owns: PackedMask, one call's mask at one bit per element with the replica that drew it, and MaskRecord, every
mask one rank drew in one training step (module name -> masks in call order) with the modules whose mask could
not be captured and those a recomputation in backward redrew, picklable for all_gather_object. The capture and the replay are dpcompare.verify.masks'.
Imports no adapter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(slots=True)
class PackedMask:
    """One call's mask, one bit per element: a float mask would cost 32 to 64 times as much to ship to rank 0."""

    shape: tuple[int, ...]
    replica: int  # device index of the input on CUDA (nn.DataParallel replicas run on several devices), else 0
    bits: np.ndarray  # np.packbits of the flattened bool mask (uint8): 1 bit per element in transit

    @classmethod
    def of(cls, mask: torch.Tensor, replica: int = 0) -> PackedMask:
        flat = mask.detach().reshape(-1).to(torch.bool).cpu().numpy()
        return cls(tuple(mask.shape), replica, np.packbits(flat))

    def unpack(self) -> torch.Tensor:
        """The bool mask of `shape`, on CPU."""
        bits = np.unpackbits(self.bits, count=math.prod(self.shape)).view(np.bool_)
        return torch.from_numpy(bits).reshape(self.shape)


@dataclass(slots=True)
class MaskRecord:
    """What one rank drew in one training step (all its micro-batches), picklable (sent through all_gather_object)."""

    masks: dict[str, list[PackedMask]]  # module name -> masks in call order
    problems: dict[str, str]  # module name -> why its mask could not be captured
    redrawn: dict[str, str] = field(default_factory=dict)
    """Module name -> how a checkpointed block's recomputation in backward drew another mask than its forward."""

    @property
    def nbytes(self) -> int:
        return sum(m.bits.nbytes for calls in self.masks.values() for m in calls)

    def calls(self, replica: int | None = None) -> dict[str, list[torch.Tensor]]:
        """Unpacked bool masks per module in call order (only those of `replica` when given)."""
        out = {name: [m.unpack() for m in calls if replica is None or m.replica == replica]
               for name, calls in self.masks.items()}
        return {name: calls for name, calls in out.items() if calls}
