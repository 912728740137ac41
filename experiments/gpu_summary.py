"""The summary of `bash experiments/gpu_check.sh`: one Markdown table of every run result under OUT_DIR and
one of every step the script ran (from OUT_DIR/steps.tsv), printed to stdout.

    python experiments/gpu_summary.py OUT_DIR
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path
from typing import Any


def _fmt(value: Any, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _cell(text: str) -> str:
    """`text` as one Markdown table cell: a `|` in it (a quoted reason's ||update||, say) would end the cell."""
    return " ".join(text.split()).replace("|", "\\|")


def run_rows(out: Path) -> list[str]:
    """One row per result, named by the step that made it (its directory, OUT_DIR/[lanes/N/]runs/PART/STEP). A result
    the script copied beside the run that wrote it (compare's, the checkpointing pair's) is one result: a row once."""
    rows = ["| step | model | backend | ws | device | verdict | step p50 ms | samples/s | tokens/s | peak MiB | "
            "exposed / total comm ms | clock (by device type) | memory |", "|" + " --- |" * 13]
    results: dict[str, tuple[str, dict]] = {}
    # The file the run wrote first: the script's copies are younger (cp sets their time).
    for path in sorted(out.rglob("*.json"), key=lambda p: (p.stat().st_mtime_ns, len(p.parts), str(p))):
        try:
            payload = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(payload, dict) and "backend" in payload and "equivalence" in payload:
            results.setdefault(path.name, (path.parent.name, payload))
    for step, r in sorted(results.values(), key=lambda sr: (sr[1]["model"], sr[1]["world_size"], sr[1]["backend"],
                                                            sr[0])):
        m = r.get("metrics") or {}
        e = r["equivalence"]
        verdict = e["verdict"]
        why = e.get("unverifiable_reason") or e.get("first_divergence")
        if verdict != "equivalent" and why:
            verdict += f" ({why if isinstance(why, str) else json.dumps(why)})"[:200]
        rows.append(
            f"| {step} | {r['model']} | {r['backend']} | {r['world_size']} | {r['device']} | {_cell(verdict)} | "
            f"{_fmt(m.get('step_ms_p50'), '.1f')} | {_fmt(m.get('samples_per_s'), '.1f')} | "
            f"{_fmt(m.get('tokens_per_s'), '.0f')} | {_fmt(m.get('peak_mem_mib'), '.0f')} | "
            f"{_fmt(m.get('comm_exposed_ms'), '.2f')} / {_fmt(m.get('comm_total_ms'), '.2f')} | "
            f"{m.get('timing_method', 'cuda events' if str(r['device']).startswith('cuda') else 'perf_counter')} | "
            f"{m.get('mem_method', 'n/a')} |")
    return rows


def step_rows(out: Path) -> list[str]:
    rows = ["| step | exit | seconds | result | command |", "| --- | --- | --- | --- | --- |"]
    tsv = out / "steps.tsv"
    if tsv.exists():
        for name, rc, seconds, verdict, command in csv.reader(tsv.open(), delimiter="\t", quoting=csv.QUOTE_NONE):
            rows.append(f"| {name} | {rc} | {seconds} | {_cell(verdict)} | `{_cell(command)}` |")
    return rows


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print("usage: python experiments/gpu_summary.py OUT_DIR (the directory gpu_check.sh wrote)", file=sys.stderr)
        return 2
    out = Path(argv[0])
    env = (out / "env.txt").read_text() if (out / "env.txt").exists() else "(no env.txt)\n"
    print("# dpcompare GPU check\n\n```\n" + env + "```\n\n## Runs\n")
    print("\n".join(run_rows(out)))
    print("\n## Steps\n")
    print("\n".join(step_rows(out)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
