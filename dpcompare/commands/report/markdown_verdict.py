"""The verdict section of report.md (is it the same computation?): one row per run with its three checks, each
as its worst judged error in multiples of its floor, the jobs that failed without a result, which runs ran under
which mixed-precision recipe, and what the backends compute beside the single process."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dpcompare import verdict_words as words
from dpcompare.commands.report.markdown import Footnotes, escape, table, verdict_cell
from dpcompare.result_view import STATE_COMPONENTS, Check, Equivalence, Figure, RunResult, state_ties

NO_CHECKS = ("this result has no equivalence.checks (written before dpcompare checked the update and the "
             "trajectory): rerun to check them")
VERDICT_INTRO = (
    "Three checks per checked step, each as its worst judged error in multiples of its floor (x floor): the reduced "
    "gradient against the run-precision reference split as the ranks split it (its floor: the same computation "
    "regrouped, what data parallelism alone changes; max rel fro err: its distance from the float64 oracle), the "
    "update against a float64 optimizer step from the same parameters, gradient and state (norm ratio: ||update|| / "
    "||reference update||, 1 = the same step length), and the trajectory, the parameters' distance to a float64 "
    "single process trained beside the run. catches: the smallest relative change of the gradient or the update "
    "that every checked step flags (`equivalent` needs 0.1 or less). **unverifiable**: part of the run could not be "
    "checked, or the checks had no power; the reason is in the last column.")
VERDICT_HEADER = ["backend", "ws", "launcher", "model", "verdict", "gradient (x floor)", "gradient max rel fro err",
                  "update (x floor)", "update norm ratio", "trajectory (x floor)", "catches (relative change)",
                  "first divergence / unverifiable reason / error"]


@dataclass(slots=True)
class _VerdictFigures:
    """The cells of one run's verdict row, each a figure or n/a with its reason."""
    e: Equivalence
    notes: Footnotes
    unchecked: str | None
    unverifiable: str | None

    def figure(self, figure: Figure, spec: str) -> str:
        if figure.value is not None:
            return format(figure.value, spec)
        return self.notes.na(self.unchecked or self.unverifiable or figure.reason or "no reason was recorded")

    def check_figure(self, check: Check, figure: Figure, spec: str) -> str:
        if not self.e.checks_recorded:
            return self.notes.na(self.unchecked or NO_CHECKS)
        if figure.value is not None:
            return format(figure.value, spec)
        if check.status == "unverifiable":
            return self.notes.na(self.unverifiable or f"the {check.name} check could not be made and no reason was "
                                                      "recorded")
        if check.status == "off":
            return self.notes.na(self.unchecked or f"the {check.name} check did not run (checks.{check.name}.status: "
                                                   "off)")
        return self.notes.na(figure.reason or "no reason was recorded")

    def divergence(self) -> str:
        d = self.e.first_divergence
        if d is None:
            return self.unverifiable or "none"
        return words.divergence(d, lambda parameter: f"`{parameter}`")


def _verdict_row(run: RunResult, notes: Footnotes) -> list[str]:
    e = run.equivalence
    verdict = e.verdict or "n/a"
    f = _VerdictFigures(e, notes, "no gradient check ran (verdict unchecked)" if verdict == "unchecked" else None,
                        e.unverifiable_reason if verdict == "unverifiable" else None)
    update, trajectory = e.update, e.trajectory
    return [run.backend, str(run.world_size), str(run.launcher or "?"), str(run.model or "?"),
            verdict_cell(verdict), f.figure(e.noise_ratio, words.X_FLOOR), f.figure(e.max_rel_fro_err, words.REL_ERR),
            f.check_figure(update, update.noise_ratio, words.X_FLOOR),
            f.check_figure(update, update.norm_ratio, words.NORM_RATIO),
            f.check_figure(trajectory, trajectory.noise_ratio, words.X_FLOOR),
            f.figure(e.min_detectable_rel, words.CATCHES), f.divergence()]


def _failed_job_rows(runs: list[RunResult], compare: dict[str, Any] | None) -> list[list[str]]:
    """Jobs the compare summary lists as failed or timed out that left no result behind."""
    # A job is its label (`deepspeed:zero2/2`, which its run carries as its tag); older summaries: backend and world size.
    have = {r.tag for r in runs} | {(r.backend, r.world_size) for r in runs}
    return [[str(job.get("entry") or job.get("backend")), str(job.get("world_size")), "-", "-",
             verdict_cell(job["status"]), "-", "-", "-", "-", "-", "-", job.get("error") or "no result written"]
            for job in (compare or {}).get("runs") or []
            if job.get("status") in ("failed", "timeout")
            and (job["label"] not in have if job.get("label") else (job.get("backend"), job.get("world_size")) not in have)]


SEMANTIC_NOTES = ("per_replica_batchnorm", "split_dependent_forward", "split_normalisation", "buffers_per_rank", "initial_weights_built_apart")
"""Notes that say what a backend computes that a single process does not: listed under the verdicts."""


def _semantic_lines(runs: list[RunResult]) -> list[str]:
    lines = []
    for run in runs:
        for note in run.equivalence.notes:
            if note.code in SEMANTIC_NOTES:
                lines.append(f"- {run.backend} ws={run.world_size} {run.model or '?'} (`{note.code}`): {note.text}")
    return ["What the backends compute beside the single process (equivalent, and stated):", "", *lines] if lines else []


def _precision_lines(runs: list[RunResult]) -> list[str]:
    """Which runs ran under which mixed-precision recipe (their floors are that recipe's), and what fp16's loss
    scaler skipped."""
    groups: dict[tuple[str, str, str], list[str]] = {}
    for run in runs:
        p = run.equivalence.section("precision")
        if p.get("amp", "none") == "none":
            continue
        shown = f"{run.backend} ws={run.world_size}"
        if p.get("loss_scaler"):
            skipped = p.get("skipped_steps") or []
            shown += f" (skipped {', '.join(map(str, skipped))})" if skipped else " (no step skipped)"
        groups.setdefault((p["amp"], p.get("recipe", "?"), p.get("description", "")), []).append(shown)
    if not groups:
        return []
    lines = [f"- `--amp {amp}`, {recipe} recipe ({description}): {', '.join(names)}"
             for (amp, recipe, description), names in groups.items()]
    return ["Mixed precision (each run judged on its own recipe's floor, recomputed rank by rank):", "", *lines]


def verdict_section(runs: list[RunResult], compare: dict[str, Any] | None, notes: Footnotes) -> list[str]:
    rows = [_verdict_row(run, notes) for run in runs] + _failed_job_rows(runs, compare)
    extra = [block for block in (_precision_lines(runs), _semantic_lines(runs)) if block]
    return [VERDICT_INTRO, "", *table(VERDICT_HEADER, rows), *[line for block in extra for line in ["", *block]]]


def state_section(runs: list[RunResult]) -> list[str]:
    """Where each run kept its model's state after the first step (the result's `state`, read from the backend's live
    objects), runs side by side; a cell that differs from another run's at the same world size in bold."""
    rows = [(run, run.state_cells) for run in runs if run.state_cells]
    if not rows:
        return []
    out = []
    for run, cells in rows:
        peers = [c for r, c in rows if r.world_size == run.world_size]
        out.append([escape(_label(run)), str(run.world_size), *(
            f"**{escape(cells.get(k, '-'))}**" if any(c.get(k, "-") != cells.get(k, "-") for c in peers)
            else escape(cells.get(k, "-")) for k in STATE_COMPONENTS)])
    return ["### Where each backend keeps the model's state", "",
            "Read from each backend's live objects after the first step's update (rank 0's, \"sharded\" where each rank "
            "holds a part); in bold, what differs from another backend at the same world size.", "",
            *table(["backend", "ws", *STATE_COMPONENTS.values()], out), "",
            *[f"- {escape(label)} ({', '.join(titles)}): {escape(text)}" for label, titles, text in state_ties(
                [(_label(run), run) for run, _ in rows])], ""]


def _label(run: RunResult) -> str:
    return run.backend + (f":{run.variant}" if run.variant else "") + "".join(
        f" {k}={v}" for k, v in (run.knobs or {}).items())
