"""Module boundaries as a backend's hooks draw them in the autograd graph.

Owns: `module_boundaries(model)`, which wraps every tensor that enters or leaves any module of `model` in an identity
autograd function, as DeepSpeed ZeRO-3 does (its parameter fetch and release hooks: PostBackwardFunctionModule on
each module's inputs, PreBackwardFunctionForModule on its outputs). The values are unchanged, but the graph gains a
node at every boundary, and where a tensor feeds several consumers (a residual stream into a block) autograd then sums
its gradient in another order. In float32 that moves the last bit of a few sums; a bf16 op downstream can round
them apart, and the rank's gradient then differs from a plain model's by more than the wire ever would. The
run-precision reference draws the same boundaries, so it computes what the rank computes. Imports no adapter.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn


class _Boundary(torch.autograd.Function):
    @staticmethod
    def forward(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        return grads


def _through(value: Any) -> Any:
    """Every tensor in `value` (nested tuples, lists and dicts, a dict changed in place as the hooks do) through a
    boundary."""
    if isinstance(value, (tuple, list)):
        touched = [_through(v) for v in value]
        if isinstance(value, tuple) and hasattr(value, "_fields"):
            return type(value)(*touched)
        return type(value)(touched)
    if isinstance(value, dict):
        for key in value.keys():
            value[key] = _through(value[key])
        return value
    if isinstance(value, torch.Tensor):
        return _Boundary.apply(value)
    return value


@contextlib.contextmanager
def module_boundaries(model: nn.Module, enabled: bool = True) -> Iterator[None]:
    """While open, `model`'s every module passes its positional inputs and its outputs through a boundary."""
    if not enabled:
        yield
        return
    handles = []
    for module in model.modules():
        handles.append(module.register_forward_pre_hook(lambda _m, inputs: _through(inputs)))
        handles.append(module.register_forward_hook(lambda _m, _inputs, output: _through(output)))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
