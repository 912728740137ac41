"""What `compare` prints: the verdict table (is it the same computation?) with the gradient matrix, the
unused-parameter lines and the fp16 loss scaler's skipped steps under it, the cost table (what does it cost?),
and the one-knob table (--sweep, and deepspeed's engine recipe under --amp).
"""

from __future__ import annotations

from typing import Any

from rich.table import Table
from rich.text import Text

from dpcompare import verdict_words as words
from dpcompare.commands.compare.plan import Job, declared_launcher
from dpcompare.measure import consistency
from dpcompare.result_view import STATE_COMPONENTS, Figure, RunResult, state_ties

STATUS_STYLE = words.STYLE
"""A job's status (its verdict, or failed / timeout) in colour."""
EMPTY = RunResult({})
"""What a job that wrote no result reads as: every figure missing."""


def _fmt(x: Figure | float | None, spec: str = words.REL_ERR) -> str:
    value = x.value if isinstance(x, Figure) else x
    return "-" if value is None else format(value, spec)


def _note(job: Job) -> str:
    """The last column of the verdict table: the first divergence, else why the run could not be checked,
    else the job's error, else a pass-through note."""
    e = (job.result or EMPTY).equivalence
    said = words.note(e)
    if said:
        return said
    if job.error:
        return job.error
    if e.has_note("no_parallelism"):
        return "no parallelism on CPU (pass-through)"
    return ""


def render(console, jobs: list[Job], unavailable: list[dict], matrix: dict[str, Any],
           unused: list[dict[str, Any]] | None = None, skipped: list[dict[str, Any]] | None = None) -> None:
    """The verdict table, the gradient matrix at its first step, one line per unused-parameter group, and one
    line per world size with fp16 runs: the steps their loss scalers skipped (red where the backends differ)."""
    console.print(_verdict_table(jobs, unavailable))
    if matrix["steps"]:
        table, reasons = _matrix_table(matrix, console.width)
        console.print(table)
        for reason in reasons:
            console.print(f"n/a: {reason}", highlight=False)
    for entry in unused or []:
        console.print(entry["line"], highlight=False)
    for entry in skipped or []:
        console.print(Text(entry["line"], style="" if entry["agree"] else "bold red"))


def _verdict_table(jobs: list[Job], unavailable: list[dict]) -> Table:
    table = Table(title="dpcompare: is it the same computation?", show_lines=False)
    # Two-line headers keep the figures narrow enough for the note to have room at width 160.
    # x floor: the worst judged error in multiples of its floor; norm: ||update|| / ||reference update||; catches: the
    # verdict's min_detectable_rel.
    for col in ("backend", "ws", "launcher", "verdict", "grad\nrel err", "grad\nfloor", "grad\nx floor",
                "update\nx floor", "update\nnorm", "traj\nx floor", "catches", "replicas", "s"):
        table.add_column(col, no_wrap=True)
    table.add_column("first divergence / note", overflow="fold", min_width=24)
    for j in jobs:
        r = j.result or EMPTY
        e = r.equivalence
        table.add_row(j.entry, str(j.world_size), r.launcher or j.launcher,
                      f"[{STATUS_STYLE.get(j.status, 'white')}]{j.status}[/]", _fmt(e.max_rel_fro_err),
                      _fmt(e.noise_floor_rel_fro), _fmt(e.noise_ratio, words.X_FLOOR),
                      _fmt(e.update.noise_ratio, words.X_FLOOR), _fmt(e.update.norm_ratio, words.NORM_RATIO),
                      _fmt(e.trajectory.noise_ratio, words.X_FLOOR), _fmt(e.min_detectable_rel, words.CATCHES),
                      words.replicas(e.replicas_identical),
                      _fmt(j.wall_s, ".0f"), Text(_note(j)))  # Text: a log line's [brackets] are not markup
    for u in unavailable:
        launcher = u.get("launcher") or declared_launcher(u["backend"])
        table.add_row(u["backend"], "-", launcher, "[yellow]unavailable[/]", "-", "-", "-", "-", "-", "-", "-", "-", "-",
                      u["reason"])
    return table


def render_state(console, jobs: list[Job]) -> None:
    """Where each run keeps its model's state, one row per run, read from its backend's live objects after the first
    step (dpcompare.run.state_table). A cell that differs from another run's at the same world size is marked."""
    rows = [(j, (j.result or EMPTY).state_cells) for j in jobs]
    rows = [(j, cells) for j, cells in rows if cells]
    if not rows:
        return
    table = Table(title="where each backend keeps the model's state (after the first step; * differs from another "
                        "backend at that world size)")
    table.add_column("run", no_wrap=True)
    table.add_column("ws", no_wrap=True)
    for title in STATE_COMPONENTS.values():
        table.add_column(title, overflow="fold")
    for j, cells in rows:
        peers = [c for k, c in rows if k.world_size == j.world_size]
        marked = []
        for component in STATE_COMPONENTS:
            text = cells.get(component, "-")
            differs = any(c.get(component, "-") != text for c in peers)
            marked.append(Text(f"{text} *", style="bold yellow") if differs else Text(text))
        table.add_row(j.label, str(j.world_size), *marked)
    console.print(table)
    for label, titles, text in state_ties([(j.label, j.result) for j, _ in rows]):
        console.print(f"  [yellow]*[/] {label} ({', '.join(titles)}): {text}", highlight=False)


def _matrix_table(matrix: dict[str, Any], width: int = 160) -> tuple[Table, list[str]]:
    """The matrix at its first step in noise floors, and the reasons behind its n/a cells (each once). Where the
    runs' labels as column headers would not fit the width (a --suite's dozen runs), the columns are numbered and
    each row says its number."""
    step = str(matrix["steps"][0])
    labels = matrix["labels"]
    needed = 4 + max(map(len, ["run", *labels])) + sum(max(len(label), 6) + 3 for label in ["oracle", *labels])
    numbered = needed > width
    title = f"gradient matrix at step {step}, in noise floors (0 = bitwise equal)"
    table = Table(title=title + (": column N is the run in row N" if numbered else ""))
    table.add_column("run", no_wrap=True)
    for i, label in enumerate(["oracle", *labels]):
        table.add_column(str(i) if numbered and i else label, justify="right", no_wrap=True)
    reasons: list[str] = []
    for n, a in enumerate(labels, 1):
        row = matrix["per_step"][step][a]
        cells = []
        for b in ["oracle", *matrix["labels"]]:
            reason = (row.get("not_comparable") or {}).get(b)
            if reason is not None:
                if reason not in reasons:
                    reasons.append(reason)
                cells.append("n/a")
            else:
                cells.append("0" if row["rel_err"][b] == 0 else _fmt(row["in_noise_floors"][b], ".2f"))
        table.add_row(f"{n} {a}" if numbered else a, *cells)
    return table, reasons


_FLAG_STYLE = {"!": "bold yellow", "~": "dim", "+": "dim"}
"""A contradiction stands out; a figure above the total within its noise (older results), or the interference the
ablation found beyond the total, is shown, quietly."""


def _marked(text: str, flag: tuple[str, str] | None, label: str, flagged: list[tuple[str, str]]) -> str | Text:
    """A cell with its numbered flag mark, the flag's line appended to `flagged`; the text alone when unflagged."""
    if not flag:
        return text
    mark = f"{flag[0]}{len(flagged) + 1}"
    flagged.append((mark, f"{label}: {flag[1]}"))
    return Text(f"{text} ({mark})", style=_FLAG_STYLE[flag[0]])


def render_cost(console, jobs: list[Job], scaling: list[dict[str, Any]]) -> None:
    eff = {row["label"]: row["efficiency"] for row in scaling}
    table = Table(title="what does it cost? (measured steps; a step is as slow as its slowest rank)")
    # Two-line headers keep a dozen runs' labels (a --suite, deepspeed:zero0/2) and every figure within 160 columns.
    for col in ("run", "samples/s", "scaling\neff", "step p50\nms", "compute\nms", "exposed\ncomm ms", "total\ncomm ms",
                "overlap", "busbw\nGB/s", "vs micro-\nbench", "MFU", "peak\nMiB", "model\nstate MiB"):
        table.add_column(col, justify="right", no_wrap=True)
    flagged: list[tuple[str, str]] = []
    for j in jobs:
        m = (j.result or EMPTY).metrics
        breakdown = consistency.breakdown_flag(m)
        compute = _marked(_fmt(m.compute_ms_p50, ".2f"), ("!", breakdown) if breakdown else None, j.label, flagged)
        interference = consistency.interference_flag(m)
        exposed = _marked(_fmt(m.comm_exposed_ms, ".2f"),
                          consistency.exposed_flag(m) or (("+", interference) if interference else None), j.label, flagged)
        table.add_row(j.label, _fmt(m.samples_per_s, ".0f"), _fmt(eff.get(j.label), ".2f"),
                      _fmt(m.step_ms_p50, ".2f"), compute, exposed, _fmt(m.comm_total_ms, ".2f"),
                      _fmt(m.overlap_fraction, ".2f"), _fmt(m.busbw_gbps, ".3f"),
                      _fmt(m.busbw_vs_microbench, ".2f"), _fmt(m.mfu, ".1%"), _fmt(m.peak_mem_mib, ".0f"),
                      _fmt(m.state_total(), ".1f"))  # what sharding shrinks
    console.print(table)
    for mark, line in flagged:
        console.print(Text(f"({mark}) {line}", style=_FLAG_STYLE[mark[0]]))
    for j in jobs:  # the slowest rank, where one rank is the slowest in most steps (metrics.straggler_rank)
        m = (j.result or EMPTY).metrics
        if m.straggler_rank.value is not None:
            console.print(Text(f"{j.label}: straggler rank {m.straggler_rank.value:.0f}, "
                               f"{_fmt(m.straggler_excess_ms, '+.2f')} ms per step over the median rank", style="yellow"))
        chosen = (m.comm_link.value or {}).get("chosen")
        if chosen:  # NCCL's algorithm and protocol (its tuning log, --profile on CUDA): read busbw against nccl-tests'
            console.print(Text(f"{j.label}: NCCL chose " + "; ".join(
                f"{kind} {', '.join(f'{choice} x{calls}' for choice, calls in by.items())}" for kind, by in chosen.items())))
        if m.comm_exposed_trace_ms.value is not None:  # --profile: the trace's exposed communication beside the ablation's
            console.print(Text(f"{j.label}: exposed comm from the trace {_fmt(m.comm_exposed_trace_ms, '.2f')} ms "
                               f"(ablation {_fmt(m.comm_exposed_ms, '.2f')} ms): trust {m.comm_exposed_trust.value}, "
                               f"{m.comm_exposed_trust_why.value}"))


def _sweep_note(job: Job) -> str:
    """The job's error, else the run's own notes that the knob does not apply to its backend."""
    notes = (job.result or EMPTY).equivalence.notes
    return job.error or "; ".join(n.text for n in notes if n.code == "knob_not_applicable")


def render_sweep(console, jobs: list[Job], skipped: list[dict]) -> None:
    table = Table(title="one knob at a time: --sweep, and deepspeed's engine recipe under --amp")
    for col in ("backend", "ws", "knob", "verdict", "rel err", "step p50 ms", "exposed comm ms", "busbw GB/s", "note"):
        table.add_column(col, no_wrap=col != "note", overflow="fold")
    for j in jobs:
        r = j.result or EMPTY
        e, m = r.equivalence, r.metrics
        table.add_row(j.entry, str(j.world_size), j.knob, j.status, _fmt(e.max_rel_fro_err),
                      _fmt(m.step_ms_p50, ".2f"), _fmt(m.comm_exposed_ms, ".2f"),
                      _fmt(m.busbw_gbps, ".3f"), _sweep_note(j))
    for k in skipped:
        table.add_row(k["backend"], "-", k["knob"], "n/a", "-", "-", "-", "-", k["reason"])
    console.print(table)


def render_questions(console, answered: list[dict[str, Any]], unavailable: list[dict]) -> None:
    """--suite questions: a table per question (what it asks, the threads that ask it), a row per run with its
    verdict, the question's figure and the first divergence or error."""
    for q in answered:
        table = Table(title=f"{q['name']}: {q['asks']}", caption=f"asked in {', '.join(q['threads'])}; every row: "
                      f"{' '.join(q['run_flags'])}", caption_justify="left")
        notes = [row["first_divergence"] or row["error"] or "" for row in q["rows"]]
        for col in ("run", "ws", "with", "verdict", "figure", *(["note"] if any(notes) else [])):
            table.add_column(col, no_wrap=col in ("ws", "verdict"), overflow="fold")
        for row, note in zip(q["rows"], notes):
            table.add_row(row["entry"], str(row["world_size"]), row["knob"],
                          Text(row["status"], style=STATUS_STYLE.get(row["status"], "")), row["figure"] or "-",
                          *([note] if any(notes) else []))
        console.print(table)
    for u in unavailable:
        console.print(f"not asked: {u['backend']}: {u['reason']}", highlight=False)
