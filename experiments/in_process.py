"""`python -m dpcompare` run in this process by an experiment's tool, with the tool's report made as the run leaves."""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Callable


def run_dpcompare(args: list[str], report: Callable[[], None]) -> None:
    """Run dpcompare with `args` as `python -m dpcompare` would, calling `report` before the process leaves: a run
    leaves by os._exit (under a launcher, once its result is written), which no `finally` outlives, so os._exit is
    wrapped to report first. `report` must be safe to call twice (a run that returns reaches the `finally` too)."""
    leave = os._exit

    def report_then_exit(code: int) -> None:
        report()
        leave(code)
    os._exit = report_then_exit
    sys.argv = ["dpcompare", *args]
    try:
        runpy.run_module("dpcompare", run_name="__main__")
    finally:
        report()
