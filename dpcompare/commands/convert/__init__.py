"""convert: a checkpoint carried between DeepSpeed ZeRO 1-3, DCP and torch with its whole training state, verified
bitwise (the command's module docstring: dpcompare.commands.convert.convert_command)."""

from __future__ import annotations

from dpcompare.commands.convert.convert_command import add_arguments, convert, main

__all__ = ["add_arguments", "convert", "main"]
