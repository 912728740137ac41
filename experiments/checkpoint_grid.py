"""The checkpoint matrix of one `dpcompare checkpoint` invocation as a grid for a record: a row a saving side, a
column a loading side, each cell its continuation's verdict and how its state loaded, then the counts by route.

    python -m experiments.checkpoint_grid OUT/<timestamp>/checkpoint.json
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

ORDER = ("ddp", "fsdp", "horovod", "zero1", "zero2", "zero3")


def _mark(cell: dict) -> str:
    """E: the save and the continuation `equivalent`, every loaded part as saved; else what it was."""
    if cell["status"] != "ran":
        return cell["status"]
    load, save = cell["load_run"], cell["save_run"]
    parts = ((load.get("checkpoint") or {}).get("loaded") or {}).get("parts", {})
    differs = [k for k, v in parts.items() if str(v).startswith("differs")]
    if load["verdict"] == "equivalent" and save["verdict"] == "equivalent" and parts and not differs:
        return "E"
    return f"{load['verdict']} ({load.get('cause') or ', '.join(differs) or 'no parts'})"


def grid(record: dict) -> str:
    cells = {c["cell"]: c for c in record["cells"]}
    sides = sorted({c["cell"].split(">")[0] for c in record["cells"]} | {c["cell"].split(">")[1] for c in record["cells"]},
                   key=lambda s: (ORDER.index(s.split(":")[0]), int(s.split(":")[1])))
    lines = ["| saved \\ loaded | " + " | ".join(sides) + " |", "|---" * (len(sides) + 1) + "|"]
    for a in sides:
        lines.append(f"| **{a}** | " + " | ".join(_mark(cells[f"{a}>{b}"]) if f"{a}>{b}" in cells else ""
                                             for b in sides) + " |")
    by_route = collections.Counter((c.get("tool") or "none").rsplit(".", 1)[-1] for c in record["cells"])
    marks = collections.Counter(_mark(c) for c in record["cells"])
    walls = [c.get("wall_s") or 0.0 for c in record["cells"] if c["status"] == "ran"]
    lines += ["", f"cells: {len(record['cells'])}; " + ", ".join(f"{k}: {v}" for k, v in sorted(marks.items())),
              "routes: " + ", ".join(f"{k}: {v}" for k, v in sorted(by_route.items())),
              f"cell wall (its save and conversion counted in the first cell that needed them): "
              f"median {sorted(walls)[len(walls) // 2]:.0f} s, most {max(walls):.0f} s" if walls else ""]
    return "\n".join(lines)


if __name__ == "__main__":
    print(grid(json.loads(Path(sys.argv[1]).read_text())))
