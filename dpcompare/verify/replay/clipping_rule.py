"""Gradient clipping by the global norm as the references apply it.

Owns: the clipping rule every reference step applies under --clip-grad-norm, torch.nn.utils.clip_grad_norm_'s
arithmetic (the 2-norm of the per-tensor 2-norms, in the gradients' own dtype; every gradient multiplied by
min(1, max_norm / (norm + 1e-6))). The grad_norm check, which holds the norm a backend reports clipping by against the
oracle's, is dpcompare.verify.checks.grad_norm_check. Imports no adapter.
"""

from __future__ import annotations

from typing import Iterable

import torch

CLIP_EPS = 1e-6
"""torch.nn.utils.clip_grad_norm_'s (and DeepSpeed's) guard in max_norm / (norm + eps)."""


def total_norm(grads: Iterable[torch.Tensor]) -> torch.Tensor:
    """The global 2-norm of `grads` as clip_grad_norm_ computes it: the norm of the per-tensor norms."""
    norms = [torch.linalg.vector_norm(g) for g in grads]
    if not norms:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack(norms))


def clip_coefficient(norm: float, max_norm: float) -> float:
    """What clipping multiplies every gradient by: min(1, max_norm / (norm + 1e-6))."""
    return min(1.0, max_norm / (norm + CLIP_EPS))


def clip_scale(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """What clipping multiplies every gradient by, as a tensor in the norm's dtype (clip_grad_norm_'s arithmetic)."""
    return torch.clamp(max_norm / (norm + CLIP_EPS), max=1.0)


def clip_(grads: list[torch.Tensor], max_norm: float) -> float:
    """Clip `grads` in place by their global norm (torch.nn.utils.clip_grad_norm_'s arithmetic, in their dtype);
    returns the norm before clipping."""
    if not grads:
        return 0.0
    norm = total_norm(grads)
    coefficient = clip_scale(norm, max_norm)
    for g in grads:
        g.mul_(coefficient.to(g.dtype))
    return float(norm)
