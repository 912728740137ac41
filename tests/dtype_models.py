"""Models whose dtypes or kernels are not the float32/float64 pair the oracle assumes, and a backend fault on them,
for tests/test_dtypes.py, loaded like a user's `--model tests.dtype_models:FUNCTION` and `--backend
tests.dtype_models:CLASS`.

  index_mlp      an MLP holding an int64 `nn.Parameter` (requires_grad=False: hashed ids it gathers its hidden units
                 by, as PyTorch's own DDP tests keep integer parameters), a bool parameter (a mask of hidden units) and
                 an int64 buffer the forward counts in; `int_index_mlp`: the same without the bool parameter (Horovod
                 cannot broadcast a bool tensor)
  grouped_moe    a mixture of experts written with `torch._grouped_mm` (tokens routed top-1, experts as one 3-D
                 weight), an op with no float64 kernel on the CPU or CUDA
  AveragingDDP   DDP that also averages every parameter after each optimizer step with torch's own
                 `average_parameters` (post-local SGD's model averaging): it flattens the parameters into one tensor,
                 which promotes an int64 parameter to float32 and rounds every id above 2**24 when it casts back

Not a test module (no `test_` prefix): pytest does not collect it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.model_averaging.utils import average_parameters
from torch.nn import functional as F

from dpcompare import Workload
from dpcompare.adapters.ddp import DDPAdapter

DIM, HIDDEN, CLASSES = 16, 32, 4
ID_BASE = 2**40
"""Hashed ids well above 2**24: float32 cannot hold them, so a trip through float32 changes them."""


def _batches(seed: int, dim: int):
    true = torch.randn(dim, CLASSES, generator=torch.Generator().manual_seed(seed))

    def make_batch(step: int, global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        x = torch.randn(global_batch, dim, generator=g)
        return x, (x @ true).argmax(dim=1)

    return make_batch


class IndexMLP(nn.Module):
    def __init__(self, mask: bool = True) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, CLASSES)
        ids = ID_BASE + torch.randperm(HIDDEN) * 1_000_003 + torch.arange(HIDDEN)
        self.ids = nn.Parameter(ids, requires_grad=False)
        self.keep = nn.Parameter(torch.arange(HIDDEN) % 5 != 0, requires_grad=False) if mask else None
        self.register_buffer("forwards", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.forwards += 1
        h = torch.tanh(self.fc1(x))[:, self.ids % HIDDEN]  # a permutation while the ids are intact
        return self.fc2(h * self.keep if self.keep is not None else h)


def index_mlp(seed: int) -> Workload:
    torch.manual_seed(seed)
    return Workload("index-mlp", IndexMLP(), _batches(seed, DIM), F.cross_entropy)


def int_index_mlp(seed: int) -> Workload:
    torch.manual_seed(seed)
    return Workload("int-index-mlp", IndexMLP(mask=False), _batches(seed, DIM), F.cross_entropy)


class GroupedMoE(nn.Module):
    """Top-1 routed experts computed by `torch._grouped_mm` over the tokens sorted by expert."""

    def __init__(self, experts: int = 4) -> None:
        super().__init__()
        self.experts = experts
        self.router = nn.Linear(DIM, experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(experts, DIM, HIDDEN) * DIM**-0.5)
        self.w_out = nn.Parameter(torch.randn(experts, HIDDEN, DIM) * HIDDEN**-0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = F.softmax(self.router(x), dim=-1)
        gate, expert = probs.max(dim=-1)
        order = expert.argsort(stable=True)
        offs = torch.bincount(expert, minlength=self.experts).cumsum(0).to(torch.int32)
        h = F.gelu(torch._grouped_mm(x[order], self.w_in, offs=offs))
        out = torch._grouped_mm(h, self.w_out, offs=offs)
        y = torch.zeros_like(out).index_copy(0, order, out)
        return x + gate.unsqueeze(-1) * y


def grouped_moe(seed: int) -> Workload:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(DIM, DIM), GroupedMoE(), nn.Tanh(), nn.Linear(DIM, CLASSES))
    return Workload("grouped-moe", model, _batches(seed, DIM), F.cross_entropy)


class AveragingDDP(DDPAdapter):
    """DDP plus torch's `average_parameters` over every parameter after each step (see the module docstring)."""

    name = "averaging-ddp"

    def step(self) -> None:
        super().step()
        with torch.no_grad():
            average_parameters(iter(self.wrapped.module.parameters()), dist.group.WORLD)
