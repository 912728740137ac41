"""What a backend holds for the model's state, read from its live objects after the first step: a result's `state`.

Owns: one rank's reading and the section rank 0 writes from every rank's. Each component is read where the backend
keeps it, never from what dpcompare asked for:

  forward      the parameters as the forward used them: each parameter's dtype, device and elements on this rank the
               first time a module holding it was called in the step (after the backend's own pre-forward hooks: FSDP's
               gathered parameters), and the autocast dtype that forward ran under, if any;
  masters      the weights the optimizer steps: the copies the backend keeps apart from the parameters where it lists
               them (Adapter.model_state_tensors: DeepSpeed's fp32 partitions), else the tensors the torch optimizer
               behind it steps (its param_groups: FSDP's shards, the parameters themselves under DDP);
  grads        the gradients the backend holds after the reduce, where it accumulates them (Adapter.model_state_tensors:
               the parameters' .grad, DeepSpeed's partitioned buffers);
  wire         the dtype the gradients are reduced in (Adapter.gradient_wire: DeepSpeed reads its engine's
               communication_data_type; none: the gradients' own), and for how many parameters where only some
               travel in it (Adapter.gradient_wire_parameters: DeepSpeed's lower_precision_safe_modules);
  optimizer    the optimizer's state entries (each key's dtype and elements on this rank), and the torch optimizer's
               class and parameter groups (how many, and the hyper-parameters that differ between them);
  loss_scale   the loss scaler's scale and whose scaler it is (Adapter.scaler_state), or none.

A component is summarised as {dtype: elements} with the device and the tensor count, per rank; `cell` is the one
phrase compare and report print for it. Imports no adapter module: it reads the adapter contract's methods.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from dpcompare.contract.optim_state import per_element, read_hparams
from dpcompare.result_view import STATE_COMPONENTS
from dpcompare.verify.replay.optimizer_rebuild import differing

COMPONENTS = tuple(STATE_COMPONENTS)
"""The rows of the table, in the order they are printed (titles: dpcompare.result_view.STATE_COMPONENTS)."""


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def summary(tensors: Iterable[torch.Tensor]) -> dict[str, Any]:
    """Tensors as {dtypes: {dtype: elements}, devices: [...], tensors: n}, each tensor counted once (its local part
    where it is a DTensor). Elements by dtype, not bytes by storage: the model state's bytes are
    dpcompare.measure.memory.census_bytes's."""
    dtypes: dict[str, int] = {}
    devices: set[str] = set()
    seen: set[int] = set()
    held = []  # each local part kept alive while counting: a freed one's id can be the next one's
    count = 0
    for t in tensors:
        if t is None or not torch.is_tensor(t):
            continue
        if id(t) in seen:
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        seen.add(id(t))
        held.append((t, local))
        count += 1
        dtypes[_name(local.dtype)] = dtypes.get(_name(local.dtype), 0) + local.numel()
        devices.add(local.device.type)
    return {"dtypes": dtypes, "devices": sorted(devices), "tensors": count}


class ForwardDtypes:
    """Forward pre-hooks on every module of the wrapped model for one step: the dtype, device and elements of each
    parameter the first time a module holding it directly is called, and the autocast dtype that call ran under."""

    def __init__(self, module: nn.Module, hooked: bool = True) -> None:
        """`hooked` False: nothing is recorded (a compiled forward, which a hook would recompile); `close` gives None."""
        self.hooked = hooked
        self.seen: dict[str, tuple[str, str, int]] = {}
        """(dtype, device type, elements) by parameter name: a description, never the tensor (FSDP's gathered
        parameters are freed after their forward)."""
        self.autocast: set[str] = set()
        self._handles = []
        for prefix, m in module.named_modules() if hooked else ():
            own = list(m.named_parameters(recurse=False))
            if own:
                self._handles.append(m.register_forward_pre_hook(self._hook(prefix, own)))

    def _hook(self, prefix: str, own: list[tuple[str, nn.Parameter]]):
        def hook(module: nn.Module, args) -> None:
            for name, _ in own:
                full = f"{prefix}.{name}" if prefix else name
                if full not in self.seen:
                    p = getattr(module, name, None)  # as the module holds it now (FSDP: gathered)
                    if torch.is_tensor(p):
                        local = p.to_local() if hasattr(p, "to_local") else p
                        self.seen[full] = (_name(local.dtype), local.device.type, local.numel())
            device = next((p.device.type for _, p in own if torch.is_tensor(p)), "cpu")
            if torch.is_autocast_enabled(device):
                self.autocast.add(_name(torch.get_autocast_dtype(device)))
        return hook

    def close(self) -> dict[str, Any] | None:
        for h in self._handles:
            h.remove()
        self._handles = []
        if not self.hooked:
            return None
        dtypes: dict[str, int] = {}
        for dtype, _, numel in self.seen.values():
            dtypes[dtype] = dtypes.get(dtype, 0) + numel
        out = {"dtypes": dtypes, "devices": sorted({d for _, d, _ in self.seen.values()}),
               "tensors": len(self.seen), "autocast": sorted(self.autocast)}
        self.seen = {}
        return out


def _inner_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    obj = optimizer
    for _ in range(8):  # through wrappers that keep theirs in `.optimizer` (Horovod's, DeepSpeed's)
        if obj is None:
            return None
        if isinstance(obj, torch.optim.Optimizer):
            return obj
        obj = getattr(obj, "optimizer", None)
    return None


def read(adapter: Any, forward: dict[str, Any] | None, grads: dict[str, Any] | None = None) -> dict[str, Any]:
    """This rank's reading, after a step's update (`forward`: what ForwardDtypes saw in that step's forward; `grads`:
    the `summary` of the gradients it held after that step's reduce, else they are read now). A component the
    backend cannot give (an adapter whose reads raise) is None, with why in `unread`: the run goes on."""
    unread: dict[str, str] = {}

    def safely(component: str, fn):
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - a reading never ends the run
            unread[component] = f"{type(exc).__name__}: {exc}"[:200]
            return None

    optimizer = _inner_optimizer(adapter.wrapped.optimizer)
    held = safely("held", adapter.model_state_tensors) or {"params": [], "grads": [], "master_params": []}
    # The copies the backend keeps apart from the parameters where it lists them (DeepSpeed's fp32 partitions), else
    # what the torch optimizer behind it steps, else the parameters.
    stepped = [p for g in optimizer.param_groups for p in g["params"]] if optimizer is not None else []
    masters = held.get("master_params") or stepped or held.get("params") or []

    def state() -> dict[str, Any]:
        entries: dict[str, list[torch.Tensor]] = {}
        for per_param in (optimizer.state.values() if optimizer is not None else []):
            for key, value in per_param.items():
                if per_element(key, value):  # a 0-dim parameter's momentum too, not a step count
                    entries.setdefault(key, []).append(value)
        return {key: summary(tensors) for key, tensors in entries.items()}

    wire = safely("wire", adapter.gradient_wire)
    subset = safely("wire", adapter.gradient_wire_parameters)  # None: every parameter's gradient travels so
    scaler = safely("loss_scale", adapter.scaler_state)
    out = {
        "forward": forward,
        "masters": summary(masters) if masters else None,
        "grads": grads if grads is not None else summary(held.get("grads") or []),
        "wire": None if wire in (None, "none") else {"fp16": "float16", "bf16": "bfloat16"}.get(wire, wire),
        "optimizer": safely("optimizer", state) or {},
        "optimizer_class": type(optimizer).__name__ if optimizer is not None else None,
        "optimizer_groups": safely("optimizer", lambda: _groups(optimizer)),
        "loss_scale": None if scaler is None else {"scale": float(scaler.scale), "method": scaler.method},
    }
    if subset is not None and out["wire"] is not None:
        out["wire_parameters"] = len(subset)
    if unread:
        out["unread"] = unread
    return out


def _groups(optimizer: torch.optim.Optimizer | None) -> dict[str, Any] | None:
    """The optimizer's parameter groups: how many, and each hyper-parameter whose value differs between them (its value
    in every group, JSON-ready)."""
    if optimizer is None:
        return None
    tables = read_hparams(optimizer)
    return {"count": len(tables), "differing": {k: [list(v) if isinstance(v, tuple) else v for v in values]
                                                for k, values in differing(tables).items()}}


def grads_now(adapter: Any) -> dict[str, Any] | None:
    """The `summary` of the gradients this rank holds now (after the reduce), or None where it cannot list them."""
    try:
        return summary(adapter.model_state_tensors()["grads"])
    except Exception:  # noqa: BLE001 - a reading never ends the run
        return None


def section(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """The result's `state`: every rank's reading, and the cells (rank 0's, with the elements of every rank)."""
    return {"per_rank": per_rank, "cells": {c: cell(c, per_rank) for c in COMPONENTS}}


def _dtypes_text(entry: dict[str, Any] | None) -> str:
    if not entry or not entry.get("dtypes"):
        return "none"
    return " + ".join(sorted(entry["dtypes"], key=lambda d: -entry["dtypes"][d]))


def cell(component: str, per_rank: list[dict[str, Any]]) -> str:
    """The phrase for one component: its dtypes (by elements, largest first), its device, and where the ranks hold
    different numbers of elements, that it is sharded."""
    first = per_rank[0] if per_rank else {}
    value = first.get(component)
    if component == "wire":
        grads = _dtypes_text(first.get("grads"))
        if not value:
            return f"{grads} (as held)"
        some = first.get("wire_parameters")
        if some is None:
            return value
        total = (first.get("forward") or {}).get("tensors")
        if total is not None and some >= total:
            return value
        of = f" of {total}" if total is not None else ""
        return f"{value} ({some}{of} parameters' gradients; the rest {grads}, as held)"
    if component == "loss_scale":
        return "none" if not value else f"{value['scale']:g} ({value['method']})"
    if component == "optimizer":
        entries = ", ".join(f"{k} {_dtypes_text(v)}" for k, v in sorted(value.items())) if value else "none"
        return f"{_optimizer_text(first)}: {entries}" if first.get("optimizer_class") else entries
    if not value:
        return "not read" if component == "forward" else "none"
    text = _dtypes_text(value)
    if component == "forward" and value.get("autocast"):
        text += f" (autocast {'/'.join(value['autocast'])})"
    devices = "/".join(value.get("devices", []))
    sizes = [sum((r.get(component) or {}).get("dtypes", {}).values()) for r in per_rank]
    sharded = len(set(sizes)) > 1 or (len(per_rank) > 1 and component != "forward" and _sharded(per_rank, component))
    return f"{text}, {devices}" + (", sharded" if sharded else "")


def _optimizer_text(reading: dict[str, Any]) -> str:
    """The optimizer's class, and its groups where it has several (their count and the values that differ)."""
    groups = reading.get("optimizer_groups") or {}
    text = reading["optimizer_class"]
    if groups.get("count", 1) > 1:
        shown = "; ".join(f"{k} {' / '.join(f'{v:g}' if isinstance(v, float) else str(v) for v in vs)}"
                          for k, vs in groups.get("differing", {}).items())
        text += f", {groups['count']} groups" + (f" ({shown})" if shown else "")
    return text


def _sharded(per_rank: list[dict[str, Any]], component: str) -> bool:
    """Whether each rank holds part of the component (fewer elements than the forward's parameters)."""
    forward = sum(((per_rank[0].get("forward") or {}).get("dtypes") or {}).values())
    mine = sum(((per_rank[0].get(component) or {}).get("dtypes") or {}).values())
    return bool(forward) and mine < forward
