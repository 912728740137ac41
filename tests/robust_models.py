"""Models nobody here would write for dpcompare, loaded with `--model tests.robust_models:NAME` (each a function
(seed) -> Workload), for the robustness tests (test_robust.py):

- `routed`: a mixture of experts whose router sends each sample to one expert by the sample's content, with a
  Python branch that skips an expert no sample of the batch chose (as Mixtral's eager expert loop does). Which
  experts take part changes with the data, from step to step and from rank to rank, while the computation of each
  sample is its own (the forward does not depend on how the batch is split). The rare expert is missed by some
  ranks at some steps and used by them at others.
- `routed_always_used`: the same experts, every one used by every batch, but the forward still reads tensor values
  into Python (`.item()` on a statistic): a data-dependent read that does not change which parameters are used.
- `per_sample_branch`: each sample goes through one of two heads by an `if` on its own first feature (the rare head
  for about one sample in eight): a value read in the model's own code, no tensor sized by the data.
- `extra_head_until_planted`: an MLP with an extra head that the forward skips for a batch holding the sample planted
  in step 2's global batch (rank 1's shard at 2 ranks): every part of the first batch uses every parameter, so only
  the run itself can find the step that leaves the extra head out.
- `raises_at_step2`, `raises_at_step2_rank1`: an MLP whose forward raises a ValueError when it meets the sample
  planted in step 2's global batch (in every rank's shard; in rank 1's alone at 2 ranks).
- `torch_raises_at_step2`: the same, but the forward's own torch call raises (a shape error, a RuntimeError), as a
  user's model with a bug in one branch would.
- `four_elements`: a linear regression of 3 features (4 trainable elements): at 8 ranks, fewer elements than ranks.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from dpcompare import Workload

DIM, EXPERTS, CLASSES = 16, 4, 5
RARE_SHARE = 0.12
"""The share of samples the last expert takes: at 8 samples a rank it is missed by a rank about 36 % of the steps."""
PLANTED = 1e6
"""The value planted in a sample that makes the raising models raise."""


def _generator(seed: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 7919 + step)


class Routed(nn.Module):
    """Each sample goes to the expert its first feature's bucket names (the last bucket rare); the output is the
    expert's, scaled by the learned gate of that expert."""

    def __init__(self, skip_unchosen: bool = True) -> None:
        super().__init__()
        self.skip_unchosen = skip_unchosen
        self.gate = nn.Linear(DIM, EXPERTS)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(DIM, 32), nn.GELU(), nn.Linear(32, CLASSES))
                                     for _ in range(EXPERTS))
        normal = torch.distributions.Normal(0.0, 1.0)
        common = (1.0 - RARE_SHARE) / (EXPERTS - 1)
        edges = [normal.icdf(torch.tensor(common * k)) for k in range(1, EXPERTS)]
        self.register_buffer("edges", torch.stack(edges))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        route = torch.bucketize(x[:, 0].detach().to(self.edges.dtype).contiguous(), self.edges)
        weight = F.softmax(self.gate(x), dim=-1)
        out = torch.zeros(x.shape[0], CLASSES, dtype=x.dtype, device=x.device)
        for e, expert in enumerate(self.experts):
            chosen = (route == e).nonzero().flatten()
            if self.skip_unchosen and chosen.numel() == 0:
                continue  # the branch that makes this expert's parameters unused on this batch
            out = out.index_add(0, chosen, expert(x[chosen]) * weight[chosen, e:e + 1])
        if not self.skip_unchosen:
            # A read of a tensor value into Python that changes nothing (a statistic logged, a sanity check).
            if float(out.detach().abs().max().item()) < 0:
                raise AssertionError("unreachable")
        return out


def _routed_batch(seed: int):
    teacher = torch.randn(DIM, CLASSES, generator=_generator(seed, -1))

    def make_batch(step: int, global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(global_batch, DIM, generator=_generator(seed, step))
        return x, (x @ teacher).argmax(dim=1)

    return make_batch


def _cross_entropy(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y)


def routed(seed: int) -> Workload:
    torch.manual_seed(seed)
    return Workload("routed", Routed(), _routed_batch(seed), _cross_entropy, source="tests.robust_models")


def routed_always_used(seed: int) -> Workload:
    torch.manual_seed(seed)
    return Workload("routed-always-used", Routed(skip_unchosen=False), _routed_batch(seed), _cross_entropy,
                    source="tests.robust_models")


class PerSampleBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.common = nn.Linear(DIM, CLASSES)
        self.rare = nn.Linear(DIM, CLASSES)
        self.threshold = float(torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(1.0 - RARE_SHARE)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([self.rare(xi) if xi[0] > self.threshold else self.common(xi) for xi in x])


def per_sample_branch(seed: int) -> Workload:
    torch.manual_seed(seed)
    return Workload("per-sample-branch", PerSampleBranch(), _routed_batch(seed), _cross_entropy)


class ExtraHeadUntilPlanted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(DIM, 32), nn.GELU(), nn.Linear(32, CLASSES))
        self.extra = nn.Linear(DIM, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        planted = x.detach().abs() >= PLANTED
        out = self.body(x.masked_fill(planted, 0.0))
        return out if planted.any() else out + self.extra(x)


def extra_head_until_planted(seed: int) -> Workload:
    torch.manual_seed(seed)
    return Workload("extra-head-until-planted", ExtraHeadUntilPlanted(), _planted(seed, 2, 1), _cross_entropy)


class RaisesOnPlanted(nn.Module):
    """An MLP whose forward raises on a planted sample: ValueError from its own code, or (torch_op) a shape error
    from a torch call in a branch only that sample takes."""

    def __init__(self, torch_op: bool) -> None:
        super().__init__()
        self.torch_op = torch_op
        self.body = nn.Sequential(nn.Linear(DIM, 32), nn.GELU(), nn.Linear(32, CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool((x.detach().abs() >= PLANTED).any()):
            if not self.torch_op:
                raise ValueError("a planted sample reached the forward")
            return self.body(x[:, : DIM // 2])  # mat1 and mat2 shapes cannot be multiplied
        return self.body(x)


def _planted(seed: int, step_to_raise: int, rank: int | None):
    make = _routed_batch(seed)

    def make_batch(step: int, global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = make(step, global_batch)
        if step == step_to_raise:
            # Samples r, r+N, ... are rank r's (dpcompare's shard): sample 1 is rank 1's at 2 ranks.
            rows = slice(None) if rank is None else slice(rank, rank + 1)
            x = x.clone()
            x[rows, 0] = PLANTED
        return x, y

    return make_batch


def raises_at_step2(seed: int) -> Workload:
    torch.manual_seed(seed)
    return Workload("raises-at-step2", RaisesOnPlanted(torch_op=False), _planted(seed, 2, None), _cross_entropy)


def raises_at_step2_rank1(seed: int) -> Workload:
    torch.manual_seed(seed)
    return Workload("raises-at-step2-rank1", RaisesOnPlanted(torch_op=False), _planted(seed, 2, 1), _cross_entropy)


def torch_raises_at_step2(seed: int) -> Workload:
    torch.manual_seed(seed)
    return Workload("torch-raises-at-step2", RaisesOnPlanted(torch_op=True), _planted(seed, 2, None), _cross_entropy)


def four_elements(seed: int) -> Workload:
    torch.manual_seed(seed)
    model = nn.Linear(3, 1)
    truth = torch.randn(3, 1, generator=_generator(seed, -1))

    def make_batch(step: int, global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(global_batch, 3, generator=_generator(seed, step))
        return x, x @ truth + 0.5

    return Workload("four-elements", model, make_batch, F.mse_loss)
