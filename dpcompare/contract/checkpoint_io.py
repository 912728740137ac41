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
The conversions between them are the libraries' own tools too (dpcompare.commands.checkpoint). And `CheckpointIO`,
the part of the adapter contract `dpcompare.contract.adapter.Adapter` is composed of that saves and loads a backend's
checkpoints (`--save-checkpoint`, `--load-checkpoint`) through these functions by default. Imports no adapter.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a checkpoint is saved or loaded: a command's --help never needs it
    import torch
    from torch import nn

    from dpcompare.contract.launch_env import LaunchEnv
    from dpcompare.contract.training_protocol import Wrapped

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


class CheckpointIO:
    """The backend's checkpoints, with defaults that are right for a single-process backend (a module, wrapped or not,
    and a plain torch optimizer: torch.distributed.checkpoint's state-dict API reads and writes them whole, as it does
    DDP's and FSDP2's), so a backend overrides only where its library keeps its own (DeepSpeed's engine):

      checkpoint_formats   torch and dcp
      save_checkpoint      `save_state(wrapped.module, wrapped.optimizer, ...)`: the full state in one file (torch),
                           or each rank's part (dcp)
      load_checkpoint      `load_state` into the wrapped module and its optimizer

    It reads the state the training protocol's `__init__` and `wrap` set (`env`, `wrapped`).
    """

    env: LaunchEnv
    wrapped: Wrapped | None

    # -- checkpoints (--save-checkpoint, --load-checkpoint) -------------------------------------------
    @classmethod
    def checkpoint_formats(cls) -> tuple[str, ...]:
        """The checkpoint formats (dpcompare.contract.checkpoint_io.FORMATS) this backend writes and reads, its own
        first; empty: none. Default: torch and dcp, through torch.distributed.checkpoint's state-dict API."""
        return ("torch", "dcp")

    def save_checkpoint(self, directory: str, fmt: str) -> None:
        """Write the model's and the optimizer's state to `directory` in `fmt`, by the backend's library; called on
        every rank after a step. Default: dpcompare.contract.checkpoint_io.save_state."""
        assert self.wrapped is not None
        save_state(self.wrapped.module, self.wrapped.optimizer, directory, fmt, self.env.rank)

    def load_checkpoint(self, directory: str, fmt: str) -> None:
        """Load `directory` (in `fmt`) into the wrapped model and its optimizer; called on every rank after `wrap`,
        before the first step. Default: dpcompare.contract.checkpoint_io.load_state."""
        assert self.wrapped is not None
        load_state(self.wrapped.module, self.wrapped.optimizer, directory, fmt)
