"""Workloads whose semantics differ from a plain model's, for tests/test_semantics.py, loaded like a user's
`--model package.module:function`:

- ranks that build different models (a parameter's shape, dtype or presence decided by the rank), which the run
  must refuse before wrapping;
- ranks that build some weights differently (an MoE expert seeded by the rank, as MoE test suites do), which every
  backend must name;
- forwards whose result depends on how the batch is split (control flow on the local batch's size or content),
  which the check must name and judge as data parallelism computes them;
- a model that computes its norms in float32 inside whatever dtype it is run in (Gemma's RMSNorm does), whose
  float64 copy therefore rounds like float32 there.

Not a test module (no `test_` prefix): pytest does not collect it.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from dpcompare.contract.launch_env import detect
from dpcompare.run.workloads import Workload, mlp


def _rank() -> int:
    return detect().rank


# -- ranks that build different models -----------------------------------------------------------------
def rank_shaped_mlp(seed: int) -> Workload:
    """The hidden width depends on the rank: rank 0 builds 64 units, rank 1 65."""
    base = mlp(seed)
    width = 64 + _rank()
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, width), nn.GELU(), nn.Linear(width, 10))
    return Workload("rank-shaped-mlp", model, base.make_batch, base.loss_fn)


def rank_dtype_mlp(seed: int) -> Workload:
    """Rank 1 builds its last layer in float64."""
    base = mlp(seed)
    if _rank() == 1:
        base.model[4].double()
    return Workload("rank-dtype-mlp", base.model, base.make_batch, base.loss_fn)


class _WithExtra(nn.Module):
    def __init__(self, body: nn.Module, extra: bool) -> None:
        super().__init__()
        self.body = body
        if extra:
            self.extra_scale = nn.Parameter(torch.ones(1))

    def forward(self, x):
        out = self.body(x)
        return out * self.extra_scale if hasattr(self, "extra_scale") else out


def rank_extra_param_mlp(seed: int) -> Workload:
    """Rank 0 alone builds a parameter `extra_scale`."""
    base = mlp(seed)
    return Workload("rank-extra-mlp", _WithExtra(base.model, _rank() == 0), base.make_batch, base.loss_fn)


# -- ranks that build some weights differently -----------------------------------------------------------
class TinyMoE(nn.Module):
    """A router and two experts; the output mixes the experts by the router's softmax (every expert gets a gradient
    from every sample). `seed_expert_by_rank`: expert 1 is initialised from seed + rank, as MoE test suites seed
    expert-parallel experts, so each rank builds its own values of it."""

    def __init__(self, seed: int, seed_expert_by_rank: bool) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(32, 32)
        self.router = nn.Linear(32, 2)
        self.experts = nn.ModuleList([nn.Linear(32, 32) for _ in range(2)])
        self.head = nn.Linear(32, 10)
        if seed_expert_by_rank:
            generator = torch.Generator().manual_seed(seed + 1000 * (_rank() + 1))
            with torch.no_grad():
                for p in self.experts[1].parameters():
                    p.copy_(torch.randn(p.shape, generator=generator) * 0.1)

    def forward(self, x):
        h = F.gelu(self.inp(x))
        gate = torch.softmax(self.router(h), dim=-1)
        mixed = sum(gate[:, i:i + 1] * F.gelu(expert(h)) for i, expert in enumerate(self.experts))
        return self.head(mixed)


def moe(seed: int) -> Workload:
    base = mlp(seed)
    return Workload("tiny-moe", TinyMoE(seed, False), base.make_batch, base.loss_fn)


def rank_seeded_moe(seed: int) -> Workload:
    base = mlp(seed)
    return Workload("rank-seeded-moe", TinyMoE(seed, True), base.make_batch, base.loss_fn)


# -- forwards that depend on how the batch is split ----------------------------------------------------------
class _BySize(nn.Module):
    """Control flow on the local batch's size: a batch of more than 12 samples is squashed with tanh, a smaller one
    passes through GELU (a shape-specialised fast path)."""

    def forward(self, x):
        return torch.tanh(x) if x.shape[0] > 12 else F.gelu(x)


class _ByContent(nn.Module):
    """Control flow on the local batch's content: capacity routing, as MoE layers drop tokens over an expert's
    capacity. Only the half of the batch with the largest activations passes; the rest is zeroed. Which samples pass
    depends on which others share their batch."""

    def forward(self, x):
        score = x.detach().norm(dim=1)
        keep = torch.zeros_like(score, dtype=torch.bool)
        keep[score.topk(max(x.shape[0] // 2, 1)).indices] = True
        return x * keep.unsqueeze(1).to(x.dtype)


class _ByMagnitude(nn.Module):
    """Control flow on the local batch's content that agrees with the global batch's at some steps only: tanh where
    the batch's mean magnitude is above a level, GELU below. With the mlp's data at seed 1234 the ranks' batches and
    the global batch fall on the same side at steps 0-2, and on different sides at step 3."""

    LEVEL = 0.465

    def forward(self, x):
        return torch.tanh(x) if float(x.detach().abs().mean()) > self.LEVEL else F.gelu(x)


def split_later_mlp(seed: int) -> Workload:
    base = mlp(seed)
    layers = list(base.model.children())
    model = nn.Sequential(layers[0], _ByMagnitude(), *layers[2:])
    return Workload("split-later-mlp", model, base.make_batch, base.loss_fn)


class _ByMagnitudeInTensors(_ByMagnitude):
    """_ByMagnitude's choice made by tensor ops alone (`torch.where` on the batch's mean magnitude): no value is read
    into Python, so the probe sees no branch on the data, and only the global batch's own forward shows that the ranks'
    batches part from it at step 3."""

    def forward(self, x):
        return torch.where(x.detach().abs().mean() > self.LEVEL, torch.tanh(x), F.gelu(x))


def split_later_in_tensors_mlp(seed: int) -> Workload:
    base = mlp(seed)
    layers = list(base.model.children())
    model = nn.Sequential(layers[0], _ByMagnitudeInTensors(), *layers[2:])
    return Workload("split-later-in-tensors-mlp", model, base.make_batch, base.loss_fn)


def split_by_size_mlp(seed: int) -> Workload:
    base = mlp(seed)
    layers = list(base.model.children())
    model = nn.Sequential(layers[0], _BySize(), *layers[2:])
    return Workload("split-by-size-mlp", model, base.make_batch, base.loss_fn)


def split_by_content_mlp(seed: int) -> Workload:
    base = mlp(seed)
    layers = list(base.model.children())
    model = nn.Sequential(layers[0], layers[1], _ByContent(), *layers[2:])
    return Workload("split-by-content-mlp", model, base.make_batch, base.loss_fn)


# -- float32 computed inside the model -------------------------------------------------------------------------
class Float32RMSNorm(nn.Module):
    """Gemma's RMSNorm: computed in float32, the weight applied as (1 + w) in float32, the result cast back. `forced`
    (the default): cast to the dtype of a float32 tensor the forward makes, which a float64 copy cannot tell from a
    computation that must be float32, so these ops still round like float32 there. Otherwise the upcast written for
    half precision (`x.float()`, as Gemma writes it), which the float64 copies keep in float64."""

    def __init__(self, dim: int, eps: float = 1e-6, forced: bool = True) -> None:
        super().__init__()
        self.eps, self.forced = eps, forced
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        if self.forced:
            anchor = torch.empty((), dtype=torch.float32, device=x.device)
            h, w = x.to(anchor), self.weight.to(anchor)
        else:
            h, w = x.float(), self.weight.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + w)).type_as(x)


class NormedMLP(nn.Module):
    def __init__(self, seed: int, forced: bool = True) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(32, 64)
        self.blocks = nn.ModuleList([nn.Sequential(Float32RMSNorm(64, forced=forced), nn.Linear(64, 64), nn.GELU())
                                     for _ in range(3)])
        self.norm = Float32RMSNorm(64, forced=forced)
        self.head = nn.Linear(64, 10)
        with torch.no_grad():  # norms that are not the identity, so their float32 rounding reaches every gradient
            for module in self.modules():
                if isinstance(module, Float32RMSNorm):
                    module.weight.normal_(0.0, 0.1)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(self.norm(h))


def float32_norm_mlp(seed: int) -> Workload:
    base = mlp(seed)
    return Workload("float32-norm-mlp", NormedMLP(seed), base.make_batch, base.loss_fn)


def upcast_norm_mlp(seed: int) -> Workload:
    """The same norms upcast as written for half precision (`x.float()`): float64 in the float64 copies."""
    base = mlp(seed)
    return Workload("upcast-norm-mlp", NormedMLP(seed, forced=False), base.make_batch, base.loss_fn)
