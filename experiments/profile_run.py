"""Where a run's time goes: one single-process `dpcompare run` under cProfile, in this process.

    python experiments/profile_run.py OUT.prof [--top N] [--only REGEX] -- RUN_ARGS...

e.g. `python experiments/profile_run.py /tmp/run.prof --only dpcompare/verify -- --backend reference
--model hf:DIR --seq-len 16 --global-batch 2 --steps 2 --measure-steps 2`. A rank leaves by os._exit once its result is
written (dpcompare.run.leave: no destructor can keep it alive), so `python -m cProfile -m dpcompare` never writes its
profile; here the run is called in-process, held from leaving, and the profile is written to OUT.prof (pstats, snakeviz)
and its top N entries by cumulative time printed (--only: those whose file and function match REGEX). One process
(world size 1, no launcher): the checks' own cost at one rank, the figure the verification-cost records compare.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    if "--" not in argv:
        print("profile_run: give the run's arguments after '--' (python experiments/profile_run.py OUT.prof -- "
              "--backend reference --model mlp)", file=sys.stderr)
        return 2
    split = argv.index("--")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="the profile written (pstats format)")
    p.add_argument("--top", type=int, default=40, help="entries printed, by cumulative time (default 40)")
    p.add_argument("--only", default=None, metavar="REGEX", help="print only the entries matching REGEX")
    ns = p.parse_args(argv[:split])
    from dpcompare import cli
    from dpcompare.run import leave

    leave.exit_if_held = lambda status: None  # stay, to write the profile
    profile = cProfile.Profile()
    profile.enable()
    try:
        status = cli._main(["run", *argv[split + 1:]])
    finally:
        profile.disable()
        profile.dump_stats(ns.out)
    stats = pstats.Stats(str(ns.out)).sort_stats("cumulative")
    stats.print_stats(*([ns.only] if ns.only else []), ns.top)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
