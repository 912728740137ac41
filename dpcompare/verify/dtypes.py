"""A model's dtypes as the verification copies keep them.

Owns: the floating dtype a model computes in (`float_dtype`: its first floating parameter's, else its first floating
buffer's), the cast of a model input to it (`as_input`), and the comparison of two values of state by kind
(`state_distance`: integer and bool tensors bitwise, floating ones by relative distance). A model's integer and
bool parameters and buffers (an index, a count, a mask) keep the dtype the model built them with in every copy the
checks make: `nn.Module.to(dtype)` converts floating tensors alone, and nothing here converts the others.
Imports no adapter.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from dpcompare.verify.tolerance import rel_fro

__all__ = ["as_input", "float_dtype", "is_float", "state_distance"]


def is_float(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def float_dtype(model: nn.Module, default: torch.dtype = torch.float32) -> torch.dtype:
    """The dtype the model computes in: its first floating parameter's, else its first floating buffer's, else
    `default` (a model of integer parameters alone). An integer parameter listed first (an index kept as a
    parameter) says nothing about it."""
    for t in (*model.parameters(), *model.buffers()):
        if t.is_floating_point():
            return t.dtype
    return default


def as_input(x: torch.Tensor, model: nn.Module, device: torch.device) -> torch.Tensor:
    """A model input on `device`, floating inputs in the dtype the model computes in (integer inputs, token ids,
    as they are), as the run's step feeds them."""
    x = x.to(device)
    return x.to(float_dtype(model)) if x.is_floating_point() else x


def state_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """How far apart two values of the same state are: relative Frobenius distance for floating tensors; for
    integer and bool ones 0 when bitwise equal (dtype included), else inf. Different shapes: inf."""
    if a.shape != b.shape:
        return math.inf
    if is_float(a) and is_float(b):
        return rel_fro(a.detach().double().cpu(), b.detach().double().cpu())
    return 0.0 if a.dtype == b.dtype and torch.equal(a.detach().cpu(), b.detach().cpu()) else math.inf
