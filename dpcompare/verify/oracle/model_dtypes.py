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
from typing import Any, Mapping

import torch
from torch import nn

from dpcompare.contract import batches
from dpcompare.verify.judgement.tolerance import rel_fro
from dpcompare.verify.judgement.verdict import CheckName, Divergence

__all__ = ["ROUNDING_DTYPES", "as_input", "float_dtype", "is_float", "non_float_change", "non_float_divergence",
           "state_distance"]


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


def as_input(x: Any, model: nn.Module, device: torch.device) -> Any:
    """A model input (a tensor or any structure of tensors) on `device`, floating inputs in the dtype the model computes
    in (integer inputs, token ids, as they are), as the run's step feeds them."""
    return batches.to(x, device, float_dtype(model))


def state_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """How far apart two values of the same state are: relative Frobenius distance for floating tensors; for
    integer and bool ones 0 when bitwise equal (dtype included), else inf. Different shapes: inf."""
    if a.shape != b.shape:
        return math.inf
    if is_float(a) and is_float(b):
        return rel_fro(a.detach().double(), b.detach().to(device=a.device, dtype=torch.float64))
    return 0.0 if a.dtype == b.dtype and torch.equal(a.detach(), b.detach().to(a.device)) else math.inf


ROUNDING_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The floating buffers a backend may send a non-float tensor through (a flattened collective promotes mixed dtypes)."""


def non_float_change(name: str, have: torch.Tensor, want: torch.Tensor) -> tuple[str, str]:
    """(cause, phrase) for a non-float tensor `have` that should be bitwise `want`: converted to another dtype,
    rounded through a floating dtype and cast back, or changed otherwise."""
    have, want = have.detach(), want.detach().to(have.device)
    kind = str(want.dtype).removeprefix("torch.")
    if have.dtype != want.dtype:
        got = str(have.dtype).removeprefix("torch.")
        return "non_float_converted", f"{name} is {got} where the model holds it as {kind}: the backend converted it"
    if have.shape != want.shape:
        return "non_float_changed", f"{name} has shape {tuple(have.shape)} where the model's is {tuple(want.shape)}"
    differ = have != want
    count, first = int(differ.sum()), int(differ.reshape(-1).nonzero()[0])
    example = f"{want.reshape(-1)[first].item()} became {have.reshape(-1)[first].item()}"
    what = f"{count} of {want.numel()} elements of {name} ({kind}) differ from the single process's ({example})"
    for dtype in ROUNDING_DTYPES:
        if want.dtype != torch.bool and torch.equal(want.to(dtype).to(want.dtype), have):
            low = str(dtype).removeprefix("torch.")
            return "non_float_rounded", (f"{what}, each the value rounded to {low}: the backend sent this {kind} "
                                         f"parameter through a {low} buffer and cast it back (a flattened all-reduce, "
                                         "broadcast or parameter average that packs mixed dtypes into one tensor)")
    return "non_float_changed", f"{what}: the backend changed a parameter that no gradient or optimizer step changes"


def non_float_divergence(step: int, check: CheckName, have: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor],
                         names: list[str], when: str) -> Divergence | None:
    """The first of `names` whose value in `have` is not bitwise its value in `want` (dtype included), as a
    divergence of `check` at `step` naming every one that differs; None where all agree. `when`: the phrase that
    opens the reason ("after step 3")."""
    wrong = [n for n in names if n in have and n in want and state_distance(have[n], want[n]) != 0.0]
    if not wrong:
        return None
    a, b = have[wrong[0]], want[wrong[0]]
    cause, why = non_float_change(wrong[0], a, b)
    distance = rel_fro(a.detach().double(), b.detach().to(device=a.device, dtype=torch.float64)) if a.shape == b.shape \
        else math.inf
    return Divergence(step, wrong[0], distance, 0.0, math.nan,
                      f"{when}, {why}; a non-float parameter must match bitwise",
                      check=check, cause=cause, parameters=wrong)
