"""The harness's own cost on a GPU: dpcompare's step p50 against experiments/plain_ddp.py's on the same model, data,
precision and world size, run side by side by experiments/gpu_check.sh (part overhead).

    python experiments/gpu_overhead.py PLAIN_JSON DPCOMPARE_DIR [--most R]

Prints one line, `step p50 plain X ms, dpcompare Y ms: ratio R` (--loop: the loop's wall clock per step, the figure
taken on the same clock on both sides: a synchronised host clock around the whole measured loop; dpcompare's step p50
is timed by CUDA events, plain_ddp's by the host clock around each step), with the other figure stated beside, and
exits 0 when R <= --most (default 1.10), 1 when it is larger or a figure is missing (naming it), 2 on bad usage.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def ratio(plain: dict, result: dict, field: str = "step_ms_p50") -> tuple[float, float, float]:
    """(plain's figure, dpcompare's, their ratio): the step p50, or with field loop_ms_per_step the measured loop's
    wall clock per step (the one figure a --no-instrument run keeps)."""
    p, d = plain[field], (result.get("metrics") or {}).get(field)
    if not isinstance(d, (int, float)):
        raise KeyError(f"the dpcompare result has no metrics.{field}")
    return p, d, d / p


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("plain", type=Path)
    ap.add_argument("dpcompare", type=Path, help="the directory holding the dpcompare run's result")
    ap.add_argument("--most", type=float, default=1.10)
    ap.add_argument("--loop", action="store_true", help="compare the loop's wall clock per step (loop_ms_per_step)")
    ns = ap.parse_args(argv)
    try:
        plain = json.loads(ns.plain.read_text())
        (path,) = [p for p in ns.dpcompare.glob("*.json") if not p.name.startswith(".")]
        field = "loop_ms_per_step" if ns.loop else "step_ms_p50"
        result = json.loads(path.read_text())
        p, d, r = ratio(plain, result, field)
    except (OSError, ValueError, KeyError) as exc:
        print(f"gpu_overhead: a figure is missing: {type(exc).__name__}: {exc}")
        return 1
    what = "loop per step" if ns.loop else "step p50"
    line = f"{what} plain {p:.2f} ms, dpcompare {d:.2f} ms: ratio {r:.3f}" + ("" if r <= ns.most else
                                                                            f", more than {ns.most:g}")
    other, other_what = ("step_ms_p50", "step p50") if ns.loop else ("loop_ms_per_step", "loop per step")
    try:  # the other figure, stated beside (not judged)
        po, do, ro = ratio(plain, result, other)
        line += f" (not judged: {other_what} {po:.2f} / {do:.2f} ms = {ro:.3f})"
    except (KeyError, TypeError):
        pass
    print(line)
    return 0 if r <= ns.most else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
