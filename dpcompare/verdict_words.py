"""The verdict's words: how a run's verdict, its first divergence and its checks' figures are phrased, for the run's
line (dpcompare.run.line), compare's tables and its questions (dpcompare.commands.compare) and report.md
(dpcompare.commands.report) alike.

Owns: the phrase of a first divergence and of the note beside a verdict (the divergence, else why the run is
unverifiable), the verdicts that are not a clean pass and their colours, the replicas' word, the checks' phrases in
the run's line, and the number formats of the checks' figures wherever they are shown. Imports only the result reader:
it sits in the bottom layer, so the run, compare and report all may import it.
"""

from __future__ import annotations

from typing import Callable, Mapping

from dpcompare.result_view import Check, Divergence, Equivalence, Figure

X_FLOOR = ".2f"
"""An error as a multiple of its floor."""
REL_ERR = ".2e"
"""A relative error, or a floor."""
NORM_RATIO = ".4f"
"""||update|| / ||reference update||: 1 is the same step length."""
CATCHES = ".2g"
"""The power: the smallest relative change of the gradient or the update every checked step flags."""

STYLE = {"equivalent": "green", "different": "red", "failed": "red", "timeout": "red", "unverifiable": "yellow"}
"""A verdict's colour on a console (failed and timeout: a compare job that left no verdict)."""
NOT_A_PASS = ("different", "unverifiable", "failed", "timeout")
"""Verdicts that are not a clean pass: report.md shows them in bold, where the reader's eye goes first."""


def divergence(d: Divergence, parameter: Callable[[str], str] = str) -> str:
    """`step 1 (update check), fc1.weight: the update is twice the reference's` (`parameter`: how the parameter's
    name is set, e.g. as Markdown code)."""
    return f"step {d.step} ({d.check} check), {parameter(d.parameter)}: {d.reason}"


def note(e: Equivalence, parameter: Callable[[str], str] = str) -> str | None:
    """What stands beside a verdict: its first divergence, else why it is unverifiable, else None."""
    d = e.first_divergence
    return divergence(d, parameter) if d is not None else e.unverifiable_reason


def replicas(identical: bool | None) -> str:
    """Whether every rank held the same parameters after every step ('-': not recorded)."""
    return {True: "identical", False: "DIFFER"}.get(identical, "-")


def _f(figure: Figure, spec: str) -> str:
    """A figure of the run's line; a non-finite one is recorded as null."""
    return figure.text(spec, "non-finite")


def gradient_phrase(e: Equivalence, dtype: str, amp: str) -> str:
    """The gradient check: its worst error in multiples of its data-parallel floor (recorded by the verdict, the
    reduction's allowance included), and the distance from float64 beside the run-precision reference's."""
    g = e.gradient
    floor = g.floor_rel_fro if g.floor_rel_fro.value is not None else g.dp_floor_rel_fro
    recipe = dtype + (f" {amp}" if amp != "none" else "")
    return (f"gradient: {_f(e.noise_ratio, X_FLOOR)}x its data-parallel floor {_f(floor, REL_ERR)}, max rel fro err "
            f"{_f(e.max_rel_fro_err, REL_ERR)} from float64 (the {recipe} reference's "
            f"{_f(e.noise_floor_rel_fro, REL_ERR)})")


def update_phrase(update: Check) -> str:
    return (f"update: {_f(update.noise_ratio, X_FLOOR)}x floor, ||update||/||reference|| "
            f"{_f(update.norm_ratio, NORM_RATIO)}")


def trajectory_phrase(trajectory: Check) -> str:
    return f"trajectory: {_f(trajectory.noise_ratio, X_FLOOR)}x floor"


def grad_norm_phrase(norm: Check) -> str:
    clipped = norm.clipped_steps
    return (f"grad_norm: {_f(norm.noise_ratio, X_FLOOR)}x floor, clipped at {norm.clip.text('g', '?')} at "
            + (f"step(s) {', '.join(map(str, clipped))} (unclipped norm above it)" if clipped else
               "no checked step (the unclipped norm stayed below it)"))


def entry_phrase(check: Check) -> str:
    """A check of one's own that declares no words: its name and status, and its noise ratio where it records one."""
    ratio = f", {_f(check.noise_ratio, X_FLOOR)}x floor" if check.raw.get("noise_ratio") is not None else ""
    return f"{check.name}: {check.status}{ratio}"


PHRASES: dict[str, Callable[[Check], str]] = {"update": update_phrase, "trajectory": trajectory_phrase,
                                              "grad_norm": grad_norm_phrase}
"""The checks after the gradient with words of their own here, in the run line's order; any other check a result
records is phrased after them, in the result's order, by its own words (`check_phrases`' `own`) or from its entry
(`entry_phrase`)."""


def power_phrase(e: Equivalence) -> str:
    """The verdict's power, and how many parameters were judged one by one where some were too noisy alone."""
    coverage = e.gradient.coverage
    judged = (f", {coverage['parameters_judged']} of {coverage['parameters']} parameters judged one by one "
              f"({coverage['elements_judged']} of {coverage['elements']} elements; the rest too noisy alone, in the "
              "whole-model check)" if coverage.get("left_out") else "")
    return f"catches a change of {e.min_detectable_rel.text(CATCHES)} (relative) in the gradient or the update{judged}"


def check_phrases(e: Equivalence, dtype: str, amp: str,
                  own: Mapping[str, Callable[[Check], str]] | None = None) -> list[str]:
    """Each check that ran, in a phrase, and the verdict's power. `own`: the words of checks of one's own, by name
    (dpcompare.verify.checks.Check's optional `words`, handed by the run's line)."""
    parts = [gradient_phrase(e, dtype, amp)] if e.checked_steps else []
    parts += [phrase(e.check(name)) for name, phrase in PHRASES.items() if e.check(name).ran]
    parts += [(own or {}).get(name, entry_phrase)(e.check(name)) for name in e.check_names
              if name != "gradient" and name not in PHRASES and e.check(name).ran]
    if e.min_detectable_rel.value is not None:
        parts.append(power_phrase(e))
    return parts
