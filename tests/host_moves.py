"""What the checks move to the host: a torch function mode that counts every call which takes a tensor of at least
`least` elements to the CPU or into Python (`.cpu()`, `.to("cpu")`, `.to(device="cpu")`, `.tolist()`). `.numpy()` is
not counted: it refuses a tensor that is not on the CPU already, so on a GPU it is reached only after a counted call
or on a branch for a tensor already on the host.

On a CPU box such a call moves nothing, so it cannot be seen by where the data lands: it is seen by what the call names.
A check that keeps to the model's device takes its device from the tensors it reads (`.to(p.device)`, a
`torch.device` object), never the host by name, and so is not counted; on a GPU every counted call is a copy over
PCIe of a parameter-sized tensor. (A `torch.device("cpu")` built by hand escapes it: the code is read for those.)
"""

from __future__ import annotations

import traceback
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

_TO_HOST = {torch.Tensor.cpu, torch.Tensor.tolist}


def _names_the_host(args: tuple, kwargs: dict) -> bool:
    """Whether a `.to(...)` call names the CPU as a string (`"cpu"`), the way a check sends a tensor to the host."""
    device = kwargs.get("device")
    if device is None:
        device = next((a for a in args[1:] if isinstance(a, str)), None)
    return isinstance(device, str) and device.split(":")[0] == "cpu"


class HostMoves(TorchFunctionMode):
    """Counts, by the line of dpcompare that made it, each call that takes a tensor of >= `least` elements to the host."""

    def __init__(self, least: int) -> None:
        super().__init__()
        self.least = least
        self.sites: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = args[0] if args else None
        if isinstance(first, torch.Tensor) and first.numel() >= self.least:
            if func in _TO_HOST or (func is torch.Tensor.to and _names_the_host(args, kwargs)):
                self.sites[_site()] += 1
        return func(*args, **kwargs)


def _site() -> str:
    """The innermost frame in dpcompare's own code (file:line function)."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/dpcompare/" in frame.filename.replace("\\", "/"):
            return f"{frame.filename.split('/dpcompare/')[-1]}:{frame.lineno} {frame.name}"
    return "outside dpcompare"
