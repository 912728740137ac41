"""The cells of a checkpoint matrix: a save under backend A at world size N, a load under backend B at world size M,
and the route between them: the libraries' own conversion where it carries the whole state, else dpcompare convert
(which refuses, in one line, a state its target cannot hold).

Owns: `Side` (a backend, a world size, a format), `Cell` (two sides and the route), `parse_cell` ("ddp:2>fsdp:4",
"fsdp:2:dcp>horovod:1"), `route` (the tool), and the matrices `MATRICES` (default: a covering subset
of every backend, world size and conversion; all: every pair of {ddp, fsdp, zero1, zero2, zero3, horovod} at world
sizes {1, 2, 4}).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

BACKENDS = {"ddp": ("ddp", None), "fsdp": ("fsdp", None), "horovod": ("horovod", None),
            "zero1": ("deepspeed", 1), "zero2": ("deepspeed", 2), "zero3": ("deepspeed", 3)}
"""A cell's backend names: the backend, and the ZeRO stage of DeepSpeed's."""


@functools.cache
def reads(name: str) -> tuple[str, ...]:
    """The formats the cell backend `name`'s adapter writes and reads, its own first (Adapter.checkpoint_formats)."""
    from dpcompare.run import registry  # the adapters import torch: not for --help

    return tuple(registry.load(BACKENDS[name][0], registry.BACKENDS, "backend").checkpoint_formats())


def native(name: str) -> str:
    """The format `name` saves in unless a cell names another: its adapter's own."""
    return reads(name)[0]


def _deepspeed_family(name: str) -> bool:
    """Does `name` save DeepSpeed's own checkpoints (which only DeepSpeed reads, and which leave it only lossily)?"""
    return "deepspeed" in reads(name)


CONVERT = "dpcompare convert"
"""dpcompare's own converter (dpcompare.commands.convert), where no library's carries the whole state: out of
DeepSpeed's partitions into DCP or torch, into a DeepSpeed universal checkpoint from them, and between ZeRO-3 and
ZeRO-1/2 (whose universal checkpoints neither loads of the other)."""
TOOLS = {("dcp", "torch"): "torch.distributed.checkpoint.format_utils.dcp_to_torch_save",
         ("torch", "dcp"): "torch.distributed.checkpoint.format_utils.torch_save_to_dcp",
         ("deepspeed", "universal"): "deepspeed.checkpoint.ds_to_universal",
         ("deepspeed", "dcp"): CONVERT, ("deepspeed", "torch"): CONVERT,
         ("dcp", "deepspeed"): CONVERT, ("torch", "deepspeed"): CONVERT}
"""The converter from one format to another: the library's own where it carries the whole state."""


@dataclass(frozen=True, slots=True)
class Side:
    name: str
    world_size: int
    fmt: str

    @property
    def backend(self) -> str:
        return BACKENDS[self.name][0]

    @property
    def stage(self) -> int | None:
        return BACKENDS[self.name][1]

    @property
    def label(self) -> str:
        return f"{self.name}/{self.world_size} ({self.fmt})"


@dataclass(frozen=True, slots=True)
class Cell:
    save: Side
    load: Side
    tool: str | None
    """The conversion between the two formats (None: the load reads what was saved)."""

    @property
    def label(self) -> str:
        return f"{self.save.name}:{self.save.world_size}>{self.load.name}:{self.load.world_size}"


def parse_cell(text: str) -> Cell:
    """"A:N[:FMT]>B:M[:FMT]" (ValueError naming what is wrong)."""
    parts = text.split(">")
    if len(parts) != 2:
        raise ValueError(f"--cells {text!r}: write SAVE>LOAD, each BACKEND:WORLD_SIZE[:FORMAT], e.g. ddp:2>fsdp:4")
    return route(_side(parts[0], text, None), _side(parts[1], text, parts[0]))


def _side(text: str, cell: str, saved: str | None) -> tuple[str, int, str | None]:
    bits = text.strip().split(":")
    if len(bits) not in (2, 3) or bits[0] not in BACKENDS or not bits[1].isdigit() or int(bits[1]) < 1:
        raise ValueError(f"--cells {cell!r}: {text!r} is not BACKEND:WORLD_SIZE[:FORMAT] with BACKEND one of "
                         f"{', '.join(BACKENDS)} and a positive world size")
    fmt = bits[2] if len(bits) == 3 else None
    if fmt is not None and fmt not in reads(bits[0]):
        raise ValueError(f"--cells {cell!r}: {bits[0]} writes and reads {', '.join(reads(bits[0]))}, not {fmt}")
    return bits[0], int(bits[1]), fmt


def route(a: tuple[str, int, str | None], b: tuple[str, int, str | None]) -> Cell:
    """The cell from a save `a` to a load `b` (name, world size, format or None: its own)."""
    fa = a[2] or native(a[0])
    save = Side(a[0], a[1], fa)
    da, db = _deepspeed_family(a[0]), _deepspeed_family(b[0])
    if da != db:  # out of DeepSpeed into the other backend's format, or into a universal checkpoint from theirs
        fb = "universal" if db else b[2] or native(b[0])
        return Cell(save, Side(b[0], b[1], fb), TOOLS[("deepspeed", fb) if da else (fa, "deepspeed")])
    if da:  # ZeRO to ZeRO: its own checkpoint where nothing changes, else a universal one
        same = a[0] == b[0] and a[1] == b[1] and b[2] in (None, "deepspeed")
        if same:
            return Cell(save, Side(b[0], b[1], "deepspeed"), None)
        across = (a[0] == "zero3") != (b[0] == "zero3")  # ds_to_universal's output loads within a stage family
        return Cell(save, Side(b[0], b[1], "universal"), CONVERT if across else TOOLS[("deepspeed", "universal")])
    fb = b[2] or (fa if fa in reads(b[0]) else native(b[0]))
    return Cell(save, Side(b[0], b[1], fb), None if fb == fa else TOOLS[(fa, fb)])


DEFAULT = ("ddp:1>ddp:2", "ddp:2>fsdp:4:dcp", "fsdp:2>ddp:1", "fsdp:4>fsdp:2", "fsdp:2>horovod:2", "horovod:2>fsdp:1",
           "zero2:2>zero2:2", "zero1:2>zero2:1", "zero3:2>zero3:4", "zero2:2>zero3:2", "zero2:2>ddp:2", "ddp:2>zero1:2")
"""A covering subset: every backend saves and loads, at world sizes 1, 2 and 4 on both sides, through every
conversion (torch_save_to_dcp, dcp_to_torch_save, ds_to_universal, and dpcompare convert across ZeRO-3, out of
DeepSpeed and into it), DeepSpeed's own format kept."""


def matrix(name: str, world_sizes: tuple[int, ...] = (1, 2, 4)) -> list[Cell]:
    if name == "default":
        return [parse_cell(c) for c in DEFAULT]
    sides = [(b, n, None) for b in BACKENDS for n in world_sizes]
    return [route(a, b) for a, b in itertools.product(sides, sides)]


MATRICES = ("default", "all")
