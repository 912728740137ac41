"""Reading a torch optimizer's state by parameter name: the one reader, used by the adapter contract's default
`optimizer_state()` and by the update check."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from dpcompare.contract.sparse import dense

OptState = dict[str, dict[str, Any]]
"""Parameter name -> that parameter's optimizer state (tensors as CPU copies in their own dtype)."""
Tensors = dict[str, torch.Tensor]
OptimizerFactory = Callable[..., torch.optim.Optimizer]
"""`factory(params, **overrides)`: the run's optimizer over `params`, with hyper-parameters overridden."""
COUNT_KEYS = frozenset({"step"})
"""Optimizer state entries that count steps (torch's SGD-family and Adam-family `step`, a 0-dim tensor or a number):
one value for the whole parameter, not one per element."""


def per_element(key: str, value: Any) -> bool:
    """Whether optimizer state entry `key` holds one value per element of its parameter (a momentum, a moment) rather
    than a count: decided by the entry's role (its key), not its shape. A 0-dim parameter's momentum is 0-dim like
    AdamW's step count, and is still stepped, cast and cut like the parameter."""
    return torch.is_tensor(value) and key not in COUNT_KEYS


def read_state(optimizer: torch.optim.Optimizer, params: nn.Module | dict[str, nn.Parameter]) -> OptState:
    """The optimizer's state by parameter name (`params`: a module, or name -> parameter); a sparse tensor in it (SGD's
    momentum of a sparse gradient) densified (dpcompare.contract.sparse)."""
    named = dict(params.named_parameters()) if isinstance(params, nn.Module) else params
    by_id = {id(p): n for n, p in named.items()}
    return {by_id[id(p)]: {k: (dense(v.detach().to("cpu", copy=True)) if torch.is_tensor(v) else v)
                           for k, v in e.items()}
            for p, e in optimizer.state.items() if id(p) in by_id}


def read_hparams(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params" and isinstance(v, (int, float, tuple, bool))}
            for g in optimizer.param_groups]
