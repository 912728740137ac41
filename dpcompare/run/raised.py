"""The model raised, or the backend failed: which, for an exception that left a step's forward, loss or backward.

Owns: `model_raised(exc, ...)` and `ModelRaised`, the line the run says for it. The model's code is the files of its
modules' classes, its loss function's file and torch's layers (torch.nn's modules and functional); communication is
torch.distributed, torch.nn.parallel, DeepSpeed, Horovod and the adapter's own classes. An exception is the model's
when a frame of the model's code is deeper in its traceback than any frame of communication: a shape error in a user's
branch raises under DDP's forward (shallower), while an all-gather that lost its peer under FSDP's or ZeRO-3's hooks
raises under the model's forward (deeper). torch.distributed's own errors and running out of memory are never the
model's. Also `collective_failed(exc)`: whether an error that is not the model's is a collective that lost its peer or
timed out (then a stalled or lost rank is named: the culprit) rather than this rank's own failure in torch or the
backend (said in its own line, with no culprit: nothing stalled). Imports no adapter.
"""

from __future__ import annotations

import inspect
import os
import re
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from dpcompare.contract import batches
from dpcompare.contract.adapter import CONTRACT_MODULES

_TORCH = Path(torch.__file__).resolve().parent
_TORCH_LAYERS = (str(_TORCH / "nn" / "modules") + os.sep, str(_TORCH / "nn" / "functional.py"),
                 str(_TORCH / "functional.py"))
_COMMUNICATION = (str(_TORCH / "distributed") + os.sep, str(_TORCH / "nn" / "parallel") + os.sep,
                  f"{os.sep}deepspeed{os.sep}", f"{os.sep}horovod{os.sep}")
_NEVER_THE_MODELS = (torch.OutOfMemoryError, MemoryError)
_LOST_PEER = re.compile(r"connection (reset|closed|refused|lost)|(reset|closed) by peer|broken pipe|timed? ?out|"
                        r"socket|nccl|communicator|shut ?down|heartbeat|no response", re.IGNORECASE)
"""What gloo, NCCL and Horovod say when a collective lost its peer or waited past its timeout (gloo raises a plain
RuntimeError: "[.../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:8886. ...")."""


def _file_of(obj: Any) -> str | None:
    try:
        name = inspect.getsourcefile(obj)
    except (TypeError, OSError):
        return None
    return str(Path(name).resolve()) if name else None


def model_files(model: nn.Module, loss_fn: Callable) -> frozenset[str]:
    """The files holding the model's code: its modules' classes and their bases (FSDP2 swaps a module's class for a
    subclass of its own; torch's own layers aside, see _TORCH_LAYERS) and its loss function."""
    files = {_file_of(cls) for m in model.modules() for cls in type(m).__mro__
             if cls is not object and not cls.__module__.startswith("torch.")}
    loss_fn = inspect.unwrap(loss_fn)  # the workload's own, inside dpcompare's normalisation (Counted)
    files.add(_file_of(getattr(loss_fn, "func", loss_fn)))  # a functools.partial's function
    if (forward := batches.current().forward) is not None:  # the workload's own forward(model, inputs)
        files.add(_file_of(getattr(forward, "func", forward)))
    return frozenset(f for f in files if f)


def communication_files(adapter: Any) -> frozenset[str]:
    """The files of the adapter's classes (a user's own backend included), the contract's base class and its parts
    left out: its backward() calls the model's backward."""
    skipped = ("builtins", *CONTRACT_MODULES)
    return frozenset(f for cls in type(adapter).__mro__ if cls.__module__ not in skipped if (f := _file_of(cls)))


def model_raised(exc: BaseException, model_code: frozenset[str], communication: frozenset[str]) -> bool:
    """Whether `exc` was raised by the model's code rather than by communication (see the module's docstring)."""
    if not isinstance(exc, Exception) or isinstance(exc, _NEVER_THE_MODELS):
        return False
    if isinstance(exc, getattr(torch.distributed, "DistError", ())):
        return False
    deepest_model = deepest_comm = -1
    for depth, frame in enumerate(traceback.extract_tb(exc.__traceback__)):
        name = str(Path(frame.filename).resolve()) if frame.filename and not frame.filename.startswith("<") else ""
        if name in communication or name.startswith(_COMMUNICATION):
            deepest_comm = depth
        elif name in model_code or name.startswith(_TORCH_LAYERS):
            deepest_model = depth
    return deepest_model > deepest_comm


def collective_failed(exc: BaseException) -> bool:
    """Whether `exc` is a collective that failed on a lost or silent peer: torch.distributed's own errors (DistError:
    NCCL's, the store's, a timeout), Horovod's HorovodInternalError, or what gloo says of a lost connection or a
    timeout. Any other error (torch's, the backend's own, a check's) is this rank's own failure."""
    if isinstance(exc, getattr(torch.distributed, "DistError", ())):
        return True
    if any(cls.__name__ == "HorovodInternalError" for cls in type(exc).__mro__):
        return True
    return bool(_LOST_PEER.search(str(exc)))


def part_of(exc: BaseException) -> str:
    """The part of a forward-and-backward `exc` left: "backward" where autograd's engine ran it, else "forward"."""
    frames = traceback.extract_tb(exc.__traceback__)
    return "backward" if any(f.name == "_engine_run_backward" for f in frames) else "forward"


class ModelRaised(Exception):
    """The model's code raised inside a step: the original exception (its traceback is the user's), and where."""

    def __init__(self, original: Exception, *, step: int, phase: str, part: str, rank: int, world_size: int) -> None:
        super().__init__(str(original))
        self.original, self.step, self.phase, self.part = original, step, phase, part
        self.rank, self.world_size = rank, world_size

    def line(self, spec: str, yours: bool) -> str:
        """The run's line: the build-time line's shape (registry.UserCodeError), the traceback follows it."""
        message = (str(self.original).strip().splitlines() or [""])[0]
        where = f"in its {self.part} at step {self.step} ({self.phase})"
        if self.world_size > 1 and self.rank == 0:  # another rank's line carries its rank already ("[rank 1] ...")
            where += f" on rank {self.rank}"
        return (f"--model {spec}: {'your' if yours else 'the'} model raised {type(self.original).__name__} {where}"
                + (f": {message}" if message else "") + " (its traceback follows)")

