"""The questions section of report.md (compare --suite questions): each question, the threads that ask it, and a row
per run with its verdict, the question's own figure and the first divergence or error."""

from __future__ import annotations

from typing import Any

from dpcompare.commands.report.markdown import table, verdict_cell


def questions_section(compare: dict[str, Any] | None) -> list[str]:
    asked = (compare or {}).get("questions") or []
    if not asked:
        return []
    lines = ["## The questions", "",
             "Each question is posed by its rows (`compare --suite questions`), each run judged against the float64 "
             "oracle like any run; a `control` row is the same run without the feature, for the cost.", ""]
    for q in asked:
        threads = ", ".join(q.get("threads") or [])
        lines += [f"### {q['name']}: {q['asks']}", "", f"Asked in {threads}. Every row: `{' '.join(q['run_flags'])}`.",
                  ""]
        rows = [[str(r["entry"]), str(r["world_size"]), f"`{r['knob']}`" if r["knob"] else "",
                 verdict_cell(str(r["status"])), r.get("figure") or "-", r.get("first_divergence") or r.get("error") or ""]
                for r in q["rows"]]
        lines += [*table(["run", "ws", "with", "verdict", "figure", "note"], rows), ""]
    return lines
