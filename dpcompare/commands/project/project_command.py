"""The `project` command: its flags, and projecting a compare folder, printing the projection and writing its
JSON (by default beside the runs, as projection.json)."""

from __future__ import annotations

import argparse
from pathlib import Path

from dpcompare.commands.project.fit import DEVICES
from dpcompare.commands.project.model import ALGORITHMS, PRESETS
from dpcompare.commands.project.projection import project
from dpcompare.commands.project.projection_output import print_projection
from dpcompare.json_files import write_atomic


def _sizes(text: str) -> list[int]:
    try:
        sizes = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers, got {text!r}") from None
    if not sizes or sizes[0] < 1:
        raise argparse.ArgumentTypeError(f"expected world sizes of at least 1, got {text!r}")
    return sizes


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", help="a compare result folder (searched recursively for run results)")
    p.add_argument("--world-sizes", type=_sizes, default="8,64,512", help="comma-separated world sizes to predict")
    p.add_argument("--link", required=True,
                   help=f"{', '.join(PRESETS)}, measured (the folder's microbenchmark) or a bench-collectives JSON")
    p.add_argument("--fit-world-sizes", type=_sizes, default=None,
                   help="world sizes whose runs the fit uses; the others are held out and validated "
                        "(default: every measured world size)")
    p.add_argument("--validate", action="store_true",
                   help="fit on the two smallest measured world sizes only and validate against the rest")
    p.add_argument("--algorithm", choices=ALGORITHMS, default="auto",
                   help="all-reduce algorithm: auto = ring on a measured link (gloo and MPI run rings), the faster "
                        "of ring and tree on a preset (as NCCL's tuner picks)")
    p.add_argument("--slots", type=int, default=None,
                   help="ranks that can run at once (default: the CPU count of the box on a measured link with CPU "
                        "runs, else one device per rank: unlimited)")
    p.add_argument("--device", choices=sorted(DEVICES), default=None,
                   help="move the measured compute to this GPU at the same MFU: scaled by the runs' measured matmul "
                        "peak over the device's datasheet peak in the runs' compute dtype (default: as measured)")
    p.add_argument("--out", default=None, help="the projection JSON (default: DIR/projection.json)")


def main(ns: argparse.Namespace) -> int:
    in_dir = Path(ns.dir)
    if not in_dir.is_dir():
        raise ValueError(f"result folder {str(in_dir)!r} does not exist or is not a directory")
    payload = project(in_dir, ns.world_sizes, ns.link, ns.fit_world_sizes, ns.validate, ns.algorithm, ns.slots,
                      ns.device)
    out = Path(ns.out) if ns.out else in_dir / "projection.json"
    print_projection(payload)
    write_atomic(out, payload)
    print(f"projection: {out}", flush=True)
    return 0
