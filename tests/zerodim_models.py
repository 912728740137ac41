"""Models with 0-dim (shape []) parameters and buffers, loaded with `--model tests.zerodim_models:NAME` (each a
function (seed) -> Workload), for tests/test_zerodim.py (issue 62: any layer that runs in plain PyTorch runs here):

- `clip_towers`: a CLIP-style two-tower model. An image tower embeds each sample's features; a text tower embeds a
  fixed prompt per class (token ids held in a buffer); both are L2-normalised and each image's logits are its cosine
  similarity with every class prompt, scaled by `exp(logit_scale)`, where `logit_scale` is CLIP's own 0-dim
  parameter (`nn.Parameter(torch.ones([]) * math.log(1 / 0.07))`), clamped at a 0-dim float buffer
  (`logit_scale_max`, CLIP's log(100)). The loss is the cross-entropy of each image against its class, a mean over
  the samples: no in-batch negatives, so the gradient does not depend on how the batch is split. A 0-dim float
  buffer that a training forward updates (`similarity_ema`, an EMA of the mean similarity of the local batch) and a
  0-dim integer one (`steps_seen`) cover buffers the forward writes.
- `clip_towers_one_element`: the same with `logit_scale` of shape [1] (the buffers still 0-dim): what the refusals of
  the backends that cannot take a 0-dim parameter (DeepSpeed, FSDP2) tell the user to do instead.

And two backends that get the 0-dim parameter wrong, for the negative tests: `ScalarUpdateDoubledReference` (its
update doubled) and `ScalarStateDroppedReference` (its momentum or moments lost after every step).

Not a test module (no `test_` prefix): pytest does not collect it.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from dpcompare import Workload
from dpcompare.adapters.reference import ReferenceAdapter

FEATURES, EMBED, CLASSES, VOCAB, PROMPT = 24, 16, 6, 20, 5


def _generator(seed: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 104_729 + step)


class ClipTowers(nn.Module):
    """Two towers and CLIP's learned temperature (0-dim), scored against each class's prompt."""

    def __init__(self, prompts: torch.Tensor, scale_shape: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.image = nn.Sequential(nn.Linear(FEATURES, 32), nn.GELU(), nn.Linear(32, EMBED))
        self.token = nn.Embedding(VOCAB, 16)
        self.text = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, EMBED))
        self.logit_scale = nn.Parameter(torch.ones(scale_shape) * math.log(1 / 0.07))
        self.register_buffer("prompts", prompts)
        self.register_buffer("logit_scale_max", torch.tensor(math.log(100.0)))
        self.register_buffer("similarity_ema", torch.zeros([]))
        self.register_buffer("steps_seen", torch.zeros([], dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        image = F.normalize(self.image(x), dim=-1)
        text = F.normalize(self.text(self.token(self.prompts).mean(dim=1)), dim=-1)
        similarity = image @ text.t()
        if self.training:
            with torch.no_grad():
                self.similarity_ema.mul_(0.9).add_(similarity.mean().to(self.similarity_ema.dtype), alpha=0.1)
                self.steps_seen.add_(1)
        scale = torch.clamp(self.logit_scale, max=self.logit_scale_max.to(self.logit_scale.dtype)).exp()
        return scale * similarity


def clip_towers(seed: int, scale_shape: tuple[int, ...] = ()) -> Workload:
    torch.manual_seed(seed)
    prompts = torch.randint(0, VOCAB, (CLASSES, PROMPT), generator=_generator(seed, -2))
    model = ClipTowers(prompts, scale_shape)
    centres = torch.randn(CLASSES, FEATURES, generator=_generator(seed, -1))

    def make_batch(step: int, global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = _generator(seed, step)
        labels = torch.randint(0, CLASSES, (global_batch,), generator=g)
        return centres[labels] + 0.8 * torch.randn(global_batch, FEATURES, generator=g), labels

    return Workload("clip-towers" if not scale_shape else "clip-towers-1", model, make_batch, F.cross_entropy)


def clip_towers_one_element(seed: int) -> Workload:
    return clip_towers(seed, (1,))


# -- a backend that gets the 0-dim parameter wrong (the negative tests) ------------------------------------------
class ScalarUpdateDoubledReference(ReferenceAdapter):
    """The reference whose step doubles the update of every 0-dim parameter (CLIP's logit_scale) and of nothing else:
    loaded with `--backend tests.zerodim_models:ScalarUpdateDoubledReference`."""

    name = "scalar-update-doubled"

    def step(self) -> None:
        assert self.wrapped is not None
        scalars = [p for p in self.wrapped.module.parameters() if p.dim() == 0]
        before = [p.detach().clone() for p in scalars]
        super().step()
        with torch.no_grad():
            for p, b in zip(scalars, before):
                p.add_(p - b)


class ScalarStateDroppedReference(ReferenceAdapter):
    """The reference whose optimizer loses the per-element state of every 0-dim parameter after each step (a state
    handler that keeps only the entries of more than 0 dims, taking a 0-dim momentum for a count): from step 1 on
    logit_scale steps as a fresh optimizer's (no momentum, no moments, AdamW's step count 0) where the last step left
    one."""

    name = "scalar-state-dropped"

    def step(self) -> None:
        assert self.wrapped is not None
        super().step()
        state = self.wrapped.optimizer.state
        for p in self.wrapped.module.parameters():
            if p.dim() == 0 and p in state:
                state[p] = {k: v for k, v in state[p].items() if not torch.is_tensor(v) or v.dim() > 0}
