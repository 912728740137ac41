"""The harness's own cost on a GPU: dpcompare's step p50 against experiments/plain_ddp.py's on the same model, data,
precision and world size, run side by side by experiments/gpu_check.sh (part overhead).

    python experiments/gpu_overhead.py PLAIN_JSON DPCOMPARE_DIR [--most R]

Prints one line, `step p50 plain X ms, dpcompare Y ms: ratio R`, and exits 0 when R <= --most (default 1.10), 1 when
it is larger or a figure is missing (naming it), 2 on bad usage.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def ratio(plain: dict, result: dict) -> tuple[float, float, float]:
    p, d = plain["step_ms_p50"], (result.get("metrics") or {}).get("step_ms_p50")
    if not isinstance(d, (int, float)):
        raise KeyError("the dpcompare result has no metrics.step_ms_p50")
    return p, d, d / p


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("plain", type=Path)
    ap.add_argument("dpcompare", type=Path, help="the directory holding the dpcompare run's result")
    ap.add_argument("--most", type=float, default=1.10)
    ns = ap.parse_args(argv)
    try:
        plain = json.loads(ns.plain.read_text())
        (path,) = [p for p in ns.dpcompare.glob("*.json") if not p.name.startswith(".")]
        p, d, r = ratio(plain, json.loads(path.read_text()))
    except (OSError, ValueError, KeyError) as exc:
        print(f"gpu_overhead: a figure is missing: {type(exc).__name__}: {exc}")
        return 1
    line = f"step p50 plain {p:.2f} ms, dpcompare {d:.2f} ms: ratio {r:.3f}"
    print(line if r <= ns.most else f"{line}, more than {ns.most:g}")
    return 0 if r <= ns.most else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
