"""Checkpoints in a backend's own formats: their names, and the save and load of a module with its optimizer through
torch.distributed.checkpoint's state-dict API, which reads and writes a plain module's, DDP's and FSDP2's state alike.

Owns: the formats a run can save and load (FORMATS), each written and read by the library that owns it, never by a
format of dpcompare's own:
  torch      the full state (the model and its optimizer, keyed by parameter name: `get_state_dict` with
             `full_state_dict=True`) in one file, written by rank 0 with torch.save; every rank reads it;
  dcp        torch.distributed.checkpoint (`dcp.save` / `dcp.load` of `get_state_dict`'s sharded state dicts): each rank
             writes its own part, and a load at another world size reshards;
  deepspeed  DeepSpeed's `engine.save_checkpoint` / `load_checkpoint`: ZeRO's partitions, one file per rank;
  universal  DeepSpeed's universal checkpoint (`ds_to_universal`), loadable at another world size or ZeRO stage.
The conversions between them are the libraries' own tools too (dpcompare.commands.checkpoint).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a checkpoint is saved or loaded: a command's --help never needs it
    import torch
    from torch import nn

FORMATS = ("torch", "dcp", "deepspeed", "universal")
TORCH_FILE = "state.pt"
"""The torch format's one file, in the checkpoint's directory."""


def _options(full: bool):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=full, cpu_offload=full)


def save_state(module: nn.Module, optimizer: torch.optim.Optimizer, directory: str, fmt: str, rank: int) -> None:
    """Write `module` and `optimizer` to `directory` in `fmt` (torch or dcp); called on every rank."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(module, optimizer, options=_options(fmt == "torch"))
    state = {"model": model_sd, "optim": optim_sd}
    Path(directory).mkdir(parents=True, exist_ok=True)
    if fmt == "torch":
        if rank == 0:
            path = Path(directory) / TORCH_FILE
            part = path.with_name(f".{path.name}.part")
            torch.save(state, part)
            os.replace(part, path)
        return
    if fmt != "dcp":
        raise ValueError(f"format {fmt!r} is not written through torch.distributed.checkpoint")
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=directory)


def load_state(module: nn.Module, optimizer: torch.optim.Optimizer, directory: str, fmt: str) -> None:
    """Load `directory` (torch or dcp) into `module` and `optimizer`, as they are wrapped; called on every rank."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    if fmt == "torch":
        state = torch.load(Path(directory) / TORCH_FILE, map_location="cpu", weights_only=False)
        options = _options(True)
    elif fmt == "dcp":
        import torch.distributed.checkpoint as dcp

        model_sd, optim_sd = get_state_dict(module, optimizer)  # the shapes and sharding to load into
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=directory)
        options = _options(False)
    else:
        raise ValueError(f"format {fmt!r} is not read through torch.distributed.checkpoint")
    set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=options)
