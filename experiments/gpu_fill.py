"""Hold most of the GPU's free memory so that `--check-coverage auto` plans against a small free figure: the part of
experiments/gpu_check.sh that shows the oracle's coverage planned from torch.cuda.mem_get_info.

    python experiments/gpu_fill.py --leave-gib G --ready FILE

Allocates (free - G GiB) on the current CUDA device in plain allocations (no managed memory), writes FILE with the
GiB it holds and the GiB it left, then sleeps until it is ended. Exits 2 in one line where there is no CUDA device or
less than G GiB is free.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

GIB = 2**30


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--leave-gib", type=float, required=True, help="GiB of the device to leave free")
    p.add_argument("--ready", type=Path, required=True, help="file written once the memory is held")
    ns = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_fill: no CUDA device: run it on a GPU machine", file=sys.stderr)
        return 2
    free, total = torch.cuda.mem_get_info()
    take = free - ns.leave_gib * GIB
    if take <= 0:
        print(f"gpu_fill: only {free / GIB:.1f} GiB free, less than the {ns.leave_gib} GiB to leave", file=sys.stderr)
        return 2
    held = [torch.empty(int(min(take - i * GIB, GIB)), dtype=torch.uint8, device="cuda")
            for i in range(int(-(-take // GIB)))]
    torch.cuda.synchronize()
    left, _ = torch.cuda.mem_get_info()
    ns.ready.write_text(f"held {sum(t.numel() for t in held) / GIB:.1f} GiB of {total / GIB:.1f}; "
                        f"free {left / GIB:.1f} GiB\n")
    while True:
        time.sleep(1)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
