"""A training state with no backend's layout: what `convert` reads out of one format and writes into another, keyed by
parameter name, and the bitwise comparison of two such states.

Owns: `Portable` (parameters, fp32 master weights, buffers, the optimizer state and its groups by parameter name, the
loss scaler, the step counters and the scheduler), `Refused` (a state the target cannot hold, or a source that is not
one: said in one line), and `differences` (every part of one state that is not bitwise the other's, by name).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


class Refused(ValueError):
    """A checkpoint `convert` cannot read, or a state its target cannot hold without loss: one line, what to do."""


@dataclass
class Portable:
    params: dict[str, torch.Tensor]
    """Every parameter's full value, as the source's model holds it (its own dtype and shape)."""
    masters: dict[str, torch.Tensor] = field(default_factory=dict)
    """The fp32 master weights the optimizer steps, where the source keeps them apart from the model's (DeepSpeed's
    partitions); empty: the parameters are what the optimizer steps."""
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    optimizer: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per parameter name, its optimizer state (AdamW: exp_avg, exp_avg_sq, step; SGD: momentum_buffer)."""
    groups: list[dict[str, Any]] = field(default_factory=list)
    """The optimizer's parameter groups: each group's hyper-parameters and, under "params", its parameters' names."""
    scaler: Any = None
    """The loss scaler's state as the source keeps it (DeepSpeed's LossScaler object), or None: none kept."""
    counters: dict[str, Any] = field(default_factory=dict)
    """The engine's step counters (global_steps, global_samples, skipped_steps) where the source keeps them."""
    scheduler: Any = None
    """The learning-rate scheduler's state_dict, or None."""
    source: str = ""
    """What it was read from, for the one line `convert` says."""

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        """What the optimizer steps: the fp32 masters where kept, else the parameters."""
        return {n: self.masters.get(n, p) for n, p in self.params.items()}

    def check_names(self) -> None:
        """Every name the optimizer state and its groups use is a parameter (Refused naming the first that is not)."""
        named = set(self.params)
        for where, names in (("the optimizer state", list(self.optimizer)),
                             ("the optimizer's parameter groups", [n for g in self.groups for n in g["params"]])):
            stray = [n for n in names if n not in named]
            if stray:
                raise Refused(f"{where} names {len(stray)} entries that match no parameter ({stray[0]!r} first; the "
                              f"parameters are {', '.join(list(self.params)[:4])}{', ...' if len(self.params) > 4 else ''})"
                              ": the checkpoint's model and optimizer were not saved together")


def differences(a: Portable, b: Portable, parts: tuple[str, ...] = ("weights", "buffers", "optimizer", "groups",
                                                                     "counters", "scheduler")) -> list[str]:
    """Every entry of `parts` where `b` is not bitwise `a`, as 'part name[.key]: why' (empty: the same state)."""
    found: list[str] = []
    for part in parts:
        if part == "weights":
            _tensors(found, "weights", a.weights, b.weights)
        elif part == "buffers":
            _tensors(found, "buffers", a.buffers, b.buffers)
        elif part == "optimizer":
            for name in sorted(set(a.optimizer) | set(b.optimizer)):
                sa, sb = a.optimizer.get(name, {}), b.optimizer.get(name, {})
                for key in sorted(set(sa) | set(sb)):
                    why = _apart(sa.get(key), sb.get(key))
                    if why:
                        found.append(f"optimizer {name}.{key}: {why}")
        elif part == "groups":
            ga = [{k: v for k, v in g.items()} for g in a.groups]
            gb = [{k: v for k, v in g.items()} for g in b.groups]
            if len(ga) != len(gb):
                found.append(f"groups: {len(ga)} parameter groups, then {len(gb)}")
            for i, (x, y) in enumerate(zip(ga, gb)):
                for key in sorted(set(x) | set(y)):
                    if _plain(x.get(key)) != _plain(y.get(key)):
                        found.append(f"groups {i}.{key}: {x.get(key)!r}, then {y.get(key)!r}")
        elif part in ("counters", "scheduler"):
            if _plain(getattr(a, part)) != _plain(getattr(b, part)):
                found.append(f"{part}: {getattr(a, part)!r}, then {getattr(b, part)!r}")
    return found


def _tensors(found: list[str], part: str, a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    for name in list(a) + [n for n in b if n not in a]:
        why = _apart(a.get(name), b.get(name))
        if why:
            found.append(f"{part} {name}: {why}")


def _apart(x: Any, y: Any) -> str | None:
    """Why `y` is not bitwise `x` (None: it is)."""
    if x is None or y is None:
        return None if x is None and y is None else ("missing" if y is None else "not in the source")
    if torch.is_tensor(x) or torch.is_tensor(y):
        tx, ty = torch.as_tensor(x), torch.as_tensor(y)
        if tx.dtype != ty.dtype:
            return f"{tx.dtype} became {ty.dtype}"
        if tx.shape != ty.shape:
            return f"shape {tuple(tx.shape)} became {tuple(ty.shape)}"
        if torch.equal(_bytes(tx), _bytes(ty)):
            return None
        return f"{int((tx != ty).sum())} of {tx.numel()} values differ" if (tx != ty).any() else "differs in its bits"
    return None if _plain(x) == _plain(y) else f"{x!r} became {y!r}"


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` and `b` hold the same dtype, shape and bits (NaNs alike)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bytes(a), _bytes(b))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def _plain(v: Any) -> Any:
    """A hyper-parameter or a counter as a comparable value (tuples and lists alike, tensors as their values)."""
    if torch.is_tensor(v):
        return ("tensor", str(v.dtype), tuple(v.shape), v.detach().cpu().reshape(-1).tolist())
    if isinstance(v, (list, tuple)):
        return tuple(_plain(x) for x in v)
    if isinstance(v, dict):
        return tuple(sorted((str(k), _plain(x)) for k, x in v.items()))
    return v
