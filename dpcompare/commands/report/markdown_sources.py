"""Where the numbers in report.md come from: the environment of the newest run (and a note where the runs come from
more than one host or torch), the backends that could not run, and the inputs left out."""

from __future__ import annotations

from typing import Any

from dpcompare.commands.report.markdown import escape, table
from dpcompare.result_view import RunResult

ENV_ORDER = ["dpcompare", "python", "torch", "cuda", "nccl", "gloo", "deepspeed", "horovod", "mpi", "mpi4py", "host",
             "platform", "cpu_count", "device_names"]


def _show_env(v: Any) -> str:
    if v is None:
        return "not installed / not found"
    return ", ".join(map(str, v)) if isinstance(v, list) else str(v)


def environment_section(runs: list[RunResult]) -> list[str]:
    newest = max(runs, key=lambda r: r.created_unix)
    env = newest.env
    keys = [k for k in ENV_ORDER if k in env] + sorted(k for k in env if k not in ENV_ORDER)
    lines = [f"From the newest run ({newest.label}, {newest.source}).", "",
             *table(["component", "version / value"], [[k, _show_env(env[k])] for k in keys]), ""]
    for key in ("host", "torch"):
        seen = sorted({str(r.env.get(key)) for r in runs})
        if len(seen) > 1:
            lines += [f"Note: the reported runs come from more than one {key}: {', '.join(seen)}.", ""]
    return lines


def unavailable_section(compare: dict[str, Any] | None) -> list[str]:
    unavailable = (compare or {}).get("unavailable") or []
    if not unavailable:
        return []
    return ["## Unavailable backends", "",
            *table(["backend", "reason"], [[str(u.get("backend")), str(u.get("reason"))] for u in unavailable]), ""]


def inputs_not_used_section(skipped: list[str], ignored: int) -> list[str]:
    if not skipped and not ignored:
        return []
    lines = ["## Inputs not used", "", *[f"- skipped {escape(s)}" for s in skipped]]
    if ignored:
        lines += [f"- {ignored} JSON file(s) that are not dpcompare results were ignored"]
    return lines + [""]
