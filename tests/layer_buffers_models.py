"""Workloads whose layers keep buffers their forward updates without drawing a random number, and workloads whose
forward raises during the run, for tests/test_layer_buffers.py, loaded like a user's `--model package.module:function`:

- small GAN discriminators with spectral normalisation: each spectral-normed layer's power iteration moves its `_u`
  and `_v` buffers (`weight_u`, `weight_v` in the older hook form) in every training-mode forward, under no_grad, from
  the weight alone (not the data), so two forwards of one input differ though nothing is drawn;
- the same discriminator with a forward that draws NumPy noise besides (randomness no torch op records: it must stay
  `unverifiable`);
- a model whose forward raises at step 2 on rank 1 alone, one whose forward raises at step 2 on every rank, and one
  whose forward cannot run at all (a shape error in torch: it raises in rank 0's probe, before wrapping);
- a DDP whose optimizer step raises at step 2 (a crash inside the backend, not the model's, with no peer lost).

Not a test module (no `test_` prefix): pytest does not collect it.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.utils import parametrizations

from dpcompare.adapters.ddp import DDPAdapter
from dpcompare.contract.launch_env import detect
from dpcompare.run.workloads import Workload

FEATURES, HIDDEN, CLASSES = 16, 32, 2


def _batch(seed: int, features: int = FEATURES, image: bool = False):
    direction = torch.randn(features, generator=torch.Generator().manual_seed(seed * 7 + 1))

    def make_batch(step: int, global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        shape = (global_batch, 1, 6, 6) if image else (global_batch, features)
        x = torch.randn(shape, generator=g)
        return x, (x.reshape(global_batch, -1)[:, :features] @ direction > 0).long()

    return make_batch


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, target)


def _linear_discriminator(norm) -> nn.Module:
    return nn.Sequential(norm(nn.Linear(FEATURES, HIDDEN)), nn.LeakyReLU(0.2), norm(nn.Linear(HIDDEN, HIDDEN)),
                         nn.LeakyReLU(0.2), norm(nn.Linear(HIDDEN, CLASSES)))


def sn_discriminator(seed: int) -> Workload:
    """Three spectral-normed Linear layers (torch.nn.utils.parametrizations.spectral_norm) and LeakyReLU."""
    torch.manual_seed(seed)
    return Workload("sn-discriminator", _linear_discriminator(parametrizations.spectral_norm), _batch(seed), _loss)


def sn_conv_discriminator(seed: int) -> Workload:
    """A DCGAN-shaped discriminator: two spectral-normed convolutions (one strided) and a spectral-normed head."""
    torch.manual_seed(seed)
    sn = parametrizations.spectral_norm
    model = nn.Sequential(sn(nn.Conv2d(1, 8, 3, padding=1)), nn.LeakyReLU(0.2),
                          sn(nn.Conv2d(8, 8, 3, padding=1, stride=2)), nn.LeakyReLU(0.2), nn.Flatten(),
                          sn(nn.Linear(8 * 3 * 3, CLASSES)))
    return Workload("sn-conv-discriminator", model, _batch(seed, image=True), _loss)


def sn_hook_discriminator(seed: int) -> Workload:
    """The older hook form, torch.nn.utils.spectral_norm: weight_orig a parameter, weight_u and weight_v buffers."""
    torch.manual_seed(seed)
    return Workload("sn-hook-discriminator", _linear_discriminator(nn.utils.spectral_norm), _batch(seed), _loss)


class _NumpyNoise(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rng = np.random.default_rng(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        noise = torch.from_numpy(self.rng.standard_normal(tuple(x.shape))).to(x.dtype)
        return x + 0.1 * noise


def sn_numpy_noise(seed: int) -> Workload:
    """The spectral-normed discriminator with NumPy noise after its first layer: a forward that does draw, where no
    torch random op sees it."""
    torch.manual_seed(seed)
    body = _linear_discriminator(parametrizations.spectral_norm)
    model = nn.Sequential(body[0], _NumpyNoise(), *body[1:])
    return Workload("sn-numpy-noise", model, _batch(seed), _loss)


# -- forwards that raise during the run ------------------------------------------------------------------
RAISE_AT_STEP = 2


class _RaisesAtStep(nn.Module):
    """An MLP whose training-mode forward raises ValueError at its RAISE_AT_STEP-th training forward (one forward a
    step: step RAISE_AT_STEP) on the ranks listed (None: every rank). Only the instance the workload built counts:
    the checks' copies (deep copies, other objects) never raise, so the error is the run's own forward's."""

    def __init__(self, ranks: tuple[int, ...] | None) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, CLASSES))
        self.ranks = ranks
        self.forwards = 0
        self.built_as = id(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and id(self) == self.built_as:
            if self.forwards == RAISE_AT_STEP and (self.ranks is None or detect().rank in self.ranks):
                raise ValueError(f"planted failure at step {RAISE_AT_STEP}: the discriminator saw a bad batch")
            self.forwards += 1
        return self.body(x)


def raises_on_rank1(seed: int) -> Workload:
    torch.manual_seed(seed)
    return Workload("raises-on-rank1", _RaisesAtStep((1,)), _batch(seed), _loss)


def raises_on_every_rank(seed: int) -> Workload:
    torch.manual_seed(seed)
    return Workload("raises-on-every-rank", _RaisesAtStep(None), _batch(seed), _loss)


class _ShapeError(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(FEATURES, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.reshape(x.shape[0], 2, -1))  # half the features: torch's matmul refuses the shapes


def raises_in_every_forward(seed: int) -> Workload:
    torch.manual_seed(seed)
    return Workload("raises-in-every-forward", _ShapeError(), _batch(seed), _loss)


class CrashingDDP(DDPAdapter):
    """DDP whose optimizer step raises RuntimeError at step RAISE_AT_STEP on rank CRASH_RANK (every rank where
    CRASH_RANK is None): torch or the backend failing on its own, nothing stalled and no peer lost."""

    name = "crashing-ddp"
    CRASH_RANK: int | None = 1

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._steps = 0

    def step(self) -> None:
        if self._steps == RAISE_AT_STEP and self.CRASH_RANK in (None, self.env.rank):
            raise RuntimeError("planted backend failure: the optimizer's step found a bad state")
        self._steps += 1
        super().step()


class CrashingEveryRankDDP(CrashingDDP):
    name = "crashing-every-rank-ddp"
    CRASH_RANK = None


class CrashingEveryRankRank0LateDDP(CrashingEveryRankDDP):
    """Every rank fails, rank 0 a second after the others: rank 0 must still say the line, and the others nothing."""

    name = "crashing-every-rank-rank0-late-ddp"

    def step(self) -> None:
        if self._steps == RAISE_AT_STEP and self.env.rank == 0:
            time.sleep(1.0)
        super().step()
