"""Random draws in transit: the form in which the random numbers a rank's forward drew travel to rank 0.

Owns: PackedDraw, the output of one random op's call (dpcompare.verify.randomness.random_ops) with the replica and the forward (the
micro-batch) that drew it, packed
at one bit per element where it is a 0/1 mask (bernoulli, dropout) and kept as it is otherwise (rand, randn,
randint, ...), and MaskRecord, every draw one rank made in one training step (key "module|op" -> draws in call
order), with the modules whose draws cannot be replayed and those a recomputation in backward redrew, picklable for
all_gather_object. The capture and the replay are dpcompare.verify.randomness.draw_recording'. Imports no adapter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(slots=True)
class PackedDraw:
    """One call's random numbers. A 0/1 mask travels at one bit per element: a float mask would cost 32 to 64 times as
    much to ship to rank 0. Other values travel as the op returned them (their bytes, in their dtype)."""

    shape: tuple[int, ...]
    replica: int  # device index of the draw on CUDA (nn.DataParallel replicas run on several devices), else 0
    bits: np.ndarray | None  # np.packbits of the flattened 0/1 values (uint8), for a mask
    raw: np.ndarray | None = None  # the values' bytes (uint8), for anything else
    dtype: str = "bool"  # the values' torch dtype (without "torch."), for `raw`
    forward: int = 0  # which of the step's forwards of the model (on this replica) drew it: its micro-batch

    @classmethod
    def of(cls, values: torch.Tensor, replica: int = 0, *, mask: bool = False, forward: int = 0) -> PackedDraw:
        """`mask`: the values are 0/1 by construction (bernoulli, a dropout mask): packed to bits, unpacked as bool."""
        values = values.detach()
        if mask:
            flat = values.reshape(-1).to(torch.bool).cpu().numpy()
            return cls(tuple(values.shape), replica, np.packbits(flat), forward=forward)
        raw = values.reshape(-1).contiguous().cpu().view(torch.uint8).numpy().copy()
        return cls(tuple(values.shape), replica, None, raw, str(values.dtype).removeprefix("torch."), forward)

    @property
    def nbytes(self) -> int:
        return int(self.bits.nbytes if self.bits is not None else self.raw.nbytes)

    def unpack(self) -> torch.Tensor:
        """The values of `shape`, on CPU: bool for a mask, else in the dtype they were drawn in."""
        if self.bits is not None:
            bits = np.unpackbits(self.bits, count=math.prod(self.shape)).view(np.bool_)
            return torch.from_numpy(bits).reshape(self.shape)
        dtype = getattr(torch, self.dtype)
        return torch.from_numpy(self.raw.copy()).view(dtype).reshape(self.shape)

    def same(self, other: PackedDraw) -> bool:
        """The same numbers (bit for bit), of the same shape."""
        if self.shape != other.shape or (self.bits is None) != (other.bits is None):
            return False
        if self.bits is not None:
            return bool(np.array_equal(self.bits, other.bits))
        return self.dtype == other.dtype and bool(np.array_equal(self.raw, other.raw))


@dataclass(slots=True)
class MaskRecord:
    """What one rank drew in one training step (all its micro-batches), picklable (sent through all_gather_object)."""

    masks: dict[str, list[PackedDraw]]  # "module|op" -> draws in call order
    problems: dict[str, str]  # module name -> why its draws cannot be replayed
    redrawn: dict[str, str] = field(default_factory=dict)
    """Module name -> how a checkpointed block's recomputation in backward drew other numbers than its forward."""

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for calls in self.masks.values() for m in calls)

    @property
    def forwards(self) -> int:
        """How many forwards of the model drew (on the replica that ran the most)."""
        return 1 + max((m.forward for calls in self.masks.values() for m in calls), default=-1)

    def calls(self, replica: int | None = None, forward: int | None = None) -> dict[str, list[torch.Tensor]]:
        """Unpacked draws per key in call order (only those of `replica`, of the `forward`-th forward, when given)."""
        out = {name: [m.unpack() for m in calls if (replica is None or m.replica == replica)
                      and (forward is None or m.forward == forward)]
               for name, calls in self.masks.items()}
        return {name: calls for name, calls in out.items() if calls}
