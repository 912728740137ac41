"""checkpoint: state moved between backends and world sizes, through each library's own formats and conversions,
judged against one uninterrupted float64 run (the command's module docstring: dpcompare.commands.checkpoint.checkpoint_command)."""

from __future__ import annotations

from dpcompare.commands.checkpoint.checkpoint_command import add_arguments, main

__all__ = ["add_arguments", "main"]
