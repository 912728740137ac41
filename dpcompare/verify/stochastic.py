"""Randomness in the forward pass: find it, give every rank its own stream, fingerprint each rank's state.

Owns: which modules of a model draw random numbers in training (dropout and its kin), the per-rank seed
(seed 000: the same seed for the weights, a different one per replica for dropout and augmentation), and
the capture of a rank's generator state before its forward, whose digest tells ranks that would draw the
same masks (the masks themselves are captured by dpcompare.verify.masks). Also `isolated()`: rank 0's
verification work runs on a forked generator, so checking a run never changes the random numbers the run
itself draws. Imports no adapter.
"""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch
from torch import nn

_DROPOUT_TYPES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def rank_seed(seed: int, rank: int) -> int:
    """The generator seed of `rank` for everything after the weights are built: distinct per rank."""
    return int(np.random.SeedSequence([seed, rank, 0x5EED]).generate_state(1, dtype=np.uint32)[0])


def seed_rank(seed: int, rank: int) -> None:
    torch.manual_seed(rank_seed(seed, rank))  # seeds the CPU generator and every CUDA device's


@dataclass(frozen=True, slots=True)
class RngState:
    """A rank's generator state right before its forward: the CPU generator, and its CUDA device's."""

    cpu: bytes
    cuda: bytes | None = None

    @property
    def digest(self) -> str:
        return hashlib.blake2b(self.cpu + (self.cuda or b""), digest_size=8).hexdigest()


def capture(device: torch.device) -> RngState:
    cuda = torch.cuda.get_rng_state(device).numpy().tobytes() if device.type == "cuda" else None
    return RngState(torch.get_rng_state().numpy().tobytes(), cuda)


def _devices(device: torch.device) -> list[int]:
    return [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []


@contextlib.contextmanager
def isolated(device: torch.device) -> Iterator[None]:
    """Random numbers drawn inside do not advance the run's generators."""
    with torch.random.fork_rng(devices=_devices(device)):
        yield


def random_modules(module: nn.Module) -> list[str]:
    """Names of the modules that draw random numbers in training mode (dropout with p > 0)."""
    names = []
    for name, m in module.named_modules():
        if isinstance(m, _DROPOUT_TYPES) and m.p > 0:
            names.append(name or type(m).__name__)
        elif isinstance(m, nn.MultiheadAttention) and m.dropout > 0:
            names.append(f"{name} (attention dropout)")
        elif isinstance(m, nn.RReLU):
            names.append(name)
    return names


def switch_off_dropout(module: nn.Module) -> list[str]:
    """Set every dropout probability to 0 (what --no-dropout does); returns the modules changed."""
    changed = random_modules(module)
    for m in module.modules():
        if isinstance(m, _DROPOUT_TYPES):
            m.p = 0.0
        elif isinstance(m, nn.MultiheadAttention):
            m.dropout = 0.0
    return changed
