"""The torch and DCP checkpoints `convert` reads and writes: `get_state_dict`'s state keyed by parameter name, as
torch.distributed.checkpoint saves it (`dcp.save`, each rank's part) or as one file (`torch.save` of the full state).

Owns: reading either into a `Portable` and writing a `Portable` as either, offline on one process: a DCP checkpoint
is read whole and written by DCP's own no-process-group path (as its format_utils do). A torch checkpoint is one file:
{"model": the model's state dict, "optim": the optimizer's keyed by parameter name} (what `get_state_dict` with
`full_state_dict` returns; "optimizer" is read as well). What a DeepSpeed source keeps and torch has no place for
(its loss scaler, its step counters, its scheduler) is carried under EXTRA, which a load through
torch.distributed.checkpoint's state-dict API does not read.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import torch

from dpcompare.commands.convert.portable import Portable, Refused, same_bits
from dpcompare.contract.checkpoint_io import TORCH_FILE

EXTRA = "dpcompare_convert"
"""The key of what the source kept beyond the model and the optimizer (the loss scaler, the step counters, the
scheduler, where the parameters were read from)."""


def read_torch(path: Path) -> Portable:
    """A torch checkpoint: `path` the file, or a directory holding TORCH_FILE."""
    file = path / TORCH_FILE if path.is_dir() else path
    try:
        state = torch.load(file, map_location="cpu", weights_only=False)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is one line
        raise Refused(f"{file}: not a torch checkpoint torch.load reads ({type(exc).__name__}: "
                      f"{str(exc).splitlines()[0][:200] if str(exc) else ''})") from None
    return from_state(state, f"torch {file}")


def read_dcp(path: Path) -> Portable:
    """A DCP checkpoint directory, read whole on this process."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    try:
        _load_state_dict(state, storage_reader=FileSystemReader(str(path)), planner=_EmptyStateDictLoadPlanner(),
                         no_dist=True)
    except Exception as exc:  # noqa: BLE001 - DCP's CheckpointException names each rank's failure
        raise Refused(f"{path}: DCP could not read it ({type(exc).__name__}: "
                      f"{(str(exc).strip().splitlines() or [''])[0][:200]})") from None
    return from_state(state, f"dcp {path}")


def from_state(state: Any, source: str) -> Portable:
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
        raise Refused(f"{source}: no model state in it (a torch or DCP checkpoint here holds {{'model': ..., 'optim': "
                      "...}}, as torch.distributed.checkpoint.state_dict.get_state_dict returns them)")
    optim = state.get("optim", state.get("optimizer")) or {"state": {}, "param_groups": []}
    keys = list(optim.get("state", {})) + [n for g in optim.get("param_groups", []) for n in g.get("params", [])]
    if any(not isinstance(k, str) for k in keys):
        raise Refused(f"{source}: its optimizer state is keyed by position, not by parameter name: save it with "
                      "torch.distributed.checkpoint.state_dict.get_state_dict (or name the parameters), so each "
                      "moment can be matched to its parameter")
    stepped = {n for g in optim.get("param_groups", []) for n in g["params"]}
    model = {k: v for k, v in state["model"].items() if torch.is_tensor(v)}
    params = {n: t for n, t in model.items() if n in stepped}
    extra = state.get(EXTRA) or {}
    portable = Portable(params=params, buffers={n: t for n, t in model.items() if n not in stepped},
                        optimizer={n: _own(s) for n, s in optim.get("state", {}).items()},
                        groups=[dict(g, params=list(g["params"])) for g in optim.get("param_groups", [])],
                        scaler=scaler_object(extra.get("scaler")), counters=dict(extra.get("counters") or {}),
                        scheduler=extra.get("scheduler"), source=source)
    if extra.get("params"):  # the model's own low-precision copy, where the weights were the masters
        portable.masters, portable.params = portable.params, {n: extra["params"].get(n, t) for n, t in params.items()}
    portable.check_names()
    return portable


def _own(state: dict[str, Any]) -> dict[str, Any]:
    """A parameter's optimizer state with a step count of its own: torch's optimizers count in place, and a checkpoint
    may hold one count for many parameters."""
    return {k: v.clone() if k == "step" and torch.is_tensor(v) else v for k, v in state.items()}


def to_state(p: Portable) -> dict[str, Any]:
    """`p` as a torch or DCP checkpoint's state: the model's state dict holding the weights the optimizer steps."""
    weights = p.weights
    model = {**weights, **p.buffers}
    optim = {"state": {n: dict(s) for n, s in p.optimizer.items()},
             "param_groups": [dict(g, params=list(g["params"])) for g in p.groups]}
    extra: dict[str, Any] = {"source": p.source}
    if p.scaler is not None:
        extra["scaler"] = scaler_state(p.scaler)
    if p.counters:
        extra["counters"] = dict(p.counters)
    if p.scheduler is not None:
        extra["scheduler"] = p.scheduler
    low = {n: t for n, t in p.params.items() if t is not weights[n] and not same_bits(t, weights[n])}
    if low:
        extra["params"] = low
    return {"model": model, "optim": optim, EXTRA: extra}


def write_torch(p: Portable, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    torch.save(to_state(p), directory / TORCH_FILE)


def write_dcp(p: Portable, directory: Path) -> None:
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import _save_state_dict

    directory.mkdir(parents=True, exist_ok=True)
    _save_state_dict(to_state(p), storage_writer=FileSystemWriter(str(directory)), no_dist=True)


def scaler_state(scaler: Any) -> dict[str, Any] | None:
    """A loss scaler object (DeepSpeed's) as plain values: its class and its attributes."""
    if scaler is None or isinstance(scaler, dict):
        return scaler
    cls = type(scaler)
    return {"class": f"{cls.__module__}.{cls.__qualname__}", "state": dict(vars(scaler))}


def scaler_object(state: dict[str, Any] | None) -> Any:
    """The loss scaler `scaler_state` described, as the object its library loads (None: none)."""
    if state is None:
        return None
    module, _, name = state["class"].rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    obj = cls.__new__(cls)
    obj.__dict__.update(state["state"])
    return obj


def is_dcp(path: Path) -> bool:
    return path.is_dir() and (path / ".metadata").is_file()


def is_torch(path: Path) -> bool:
    """A directory holding TORCH_FILE (a file given as SRC is read as torch's, whatever its name)."""
    return path.is_dir() and (path / TORCH_FILE).is_file()
