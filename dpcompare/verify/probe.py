"""What the model is, found before it is wrapped, and what the verdict says of the randomness its forward draws.

Owns: the model probe before wrapping (`probe`: one float64 forward/backward of the first global batch, for the
unused, frozen and random parts of the model, and whether the dropout masks a capture can take account for every
random number the forward draws), and the verdict's account of that randomness before the first step
(`judge_randomness`): captured, or the reason the run cannot be checked against an oracle. Everything here runs on
generators forked from the run's. Imports no adapter.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from dpcompare.contract import ModelFacts
from dpcompare.verify import masks as mk
from dpcompare.verify import stochastic
from dpcompare.verify.equivalence import verification_copy
from dpcompare.verify.verdict import Verdict

STOCHASTIC_REL_DIFF = 2.0**-30
"""Two float64 forwards of the same input that differ by more than this (relative) draw random numbers:
some 10^6 float64 roundings, far below what one changed dropout mask element does (~1e-3)."""


def _flat(output: torch.Tensor | tuple) -> torch.Tensor:
    """A forward's output as one float64 vector (a forward may return a tuple: logits and an auxiliary loss)."""
    parts = output if isinstance(output, (tuple, list)) else (output,)
    return torch.cat([t.detach().double().reshape(-1) for t in parts if isinstance(t, torch.Tensor)])


def probe(template: nn.Module, loss_fn: Callable, batch: tuple[torch.Tensor, torch.Tensor], device: torch.device) -> ModelFacts:
    """One float64 forward/backward of the first global batch (which parameters get no gradient), a second
    forward of the same input (does the forward draw random numbers?) and, when it does, whether capturing
    the dropout modules' masks accounts for all of it (which module draws where no mask can be captured)."""
    model = verification_copy(template, device, torch.float64).train()
    x, y = batch
    x = x.to(device)
    x = x.double() if x.is_floating_point() else x
    with stochastic.isolated(device):
        first = model(x)
        with torch.no_grad():
            second = model(x)
        loss_fn(first, y.to(device)).backward()
    diff = float(torch.linalg.vector_norm(_flat(first) - _flat(second)))
    norm = float(torch.linalg.vector_norm(_flat(first)))
    named = list(model.named_parameters())
    drawn = diff > STOCHASTIC_REL_DIFF * max(norm, 1e-300)
    uncaptured = None
    if drawn:
        with stochastic.isolated(device):
            uncaptured = mk.uncaptured(verification_copy(template, device, torch.float64), x)
    return ModelFacts(
        unused=tuple(n for n, p in named if p.requires_grad and p.grad is None),
        frozen=tuple(n for n, p in named if not p.requires_grad),
        random_modules=tuple(stochastic.random_modules(template)),
        stochastic=drawn,
        uncaptured=uncaptured,
    )


def judge_randomness(facts: ModelFacts, replay_reason: str | None, verdict: Verdict) -> str | None:
    """The verdict's account of the forward's randomness (`verdict.stochastic`, and the masks_captured note where
    every rank's masks are captured); returns why the run cannot be checked (None: it can). `replay_reason`: why the
    backend's random numbers are drawn where no captured mask reaches (`Adapter.rng_replay_reason()`), or None."""
    modules = ", ".join(facts.random_modules) or "an operation in forward"
    verdict.stochastic = {"stochastic": facts.stochastic, "modules": list(facts.random_modules),
                          "captured": False, "reason": None, "capture_bytes_per_step": None}
    if not facts.stochastic:
        return None
    blockers = []
    if facts.uncaptured:
        blockers.append(f"{facts.uncaptured} draws random numbers where no mask can be captured (dropout inside a "
                        "functional call or a fused kernel, such as scaled_dot_product_attention's dropout_p, or a "
                        "random operation other than dropout)")
    if replay_reason:
        blockers.append(replay_reason)
    if blockers:
        verdict.stochastic["reason"] = "; ".join(blockers)
        return (f"the forward draws random numbers ({modules}) and {'; '.join(blockers)}: comparing "
                "against an oracle that draws its own would measure randomness, not rounding; rerun "
                "with --no-dropout to check the computation deterministically")
    verdict.stochastic["captured"] = True
    verdict.note("masks_captured", f"the forward draws random numbers ({modules}): each rank's dropout masks are "
                                   "captured during its forward and applied in the oracle, the floor and the reference "
                                   "trajectory")
    return None
