"""The verifier's checks, one module each, and the list they run in.

Owns: the `Check` protocol (the one interface of a check) and `CHECKS`, every check of a run in the order it runs at its
point of a step (dpcompare.verify.instruments.check_context.Point). At `reduced` (after the reduce): the ranks' generators, the loss
scaler's overflow, the gradient, the buffers; at `updated` (after the optimizer step): the total norm clipped by, the
loss scaler's skip, the update, the power of the step, the trajectory. The order is the verdict's: of two failed checks
at one step, the one listed first is the run's first divergence. A new check is a module with a class that follows
`Check`, and one entry in the list (docs/extending.md#a-check-of-your-own): the verifier reads the list when a run
starts, and the verdict's JSON holds each listed check's entry (its `summary`, its `step_record`) in the list's order
(dpcompare.verify.judgement.verdict.record_order). Imports no adapter.
"""

from __future__ import annotations

from typing import ClassVar, Protocol

from dpcompare.verify.judgement import verdict as _verdict
from dpcompare.verify.instruments.run_instruments import Bench
from dpcompare.verify.checks.buffers_check import Buffers
from dpcompare.verify.checks.generators_check import Generators
from dpcompare.verify.checks.grad_norm_check import GradNorm
from dpcompare.verify.checks.gradient_check import Gradient
from dpcompare.verify.checks.loss_scale_check import OverflowSeen, SkipJudged
from dpcompare.verify.checks.power_check import Power
from dpcompare.verify.checks.trajectory_check import Trajectory
from dpcompare.verify.checks.update_check import Update
from dpcompare.verify.instruments.check_context import CheckContext, Finding, Point
from dpcompare.verify.instruments.step_evidence import StepEvidence


class Check(Protocol):
    """One check of dpcompare.verify.checks.CHECKS: built once per run where it `applies`, handed the evidence of every
    step at its point (`at`), in the list's order. It keeps its records in `bench.verdict` (what it measured, its notes)
    and returns what it concluded; the verifier records the findings in the order the checks run, so of two failures at
    one step the earlier check's is the run's first divergence."""

    name: ClassVar[str]
    """What it checks (a failure's Divergence.check)."""
    at: ClassVar[Point]
    reads_oracle: ClassVar[bool]
    """It runs at checked steps only, after the oracle computed the step (StepEvidence.oracle is set)."""
    after_stop: ClassVar[bool]
    """It runs even after a finding stopped the checks that use rank 0's copies (it reads only what the ranks sent)."""
    # The two below: every check here declares them; a check of one's own that does not is read as False.
    reads_references_after_update: ClassVar[bool]
    """At `updated`, it reads the step's float64 oracle gradient and run-precision references (StepEvidence.oracle's
    oracle, floor, spread): the verifier holds them over the optimizer step only where a check of the run does (the
    grad_norm check), and lets them go at the reduce otherwise."""
    last_to_read_step: ClassVar[bool]
    """It is the last check to read the step's reads (the reduced gradient, the optimizer state), its snapshot of the
    parameters and the oracle's copy of the gradient: the verifier lets them go once it has judged (the update check:
    not held through the trajectory's steps)."""

    @classmethod
    def applies(cls, ctx: CheckContext) -> bool:
        """Whether this run has this check at all (the grad_norm check: only under --clip-grad-norm)."""
        ...

    def __init__(self, ctx: CheckContext, bench: Bench) -> None: ...

    def judge(self, ctx: CheckContext, step: StepEvidence) -> Finding | None: ...

    # Optional: `on_reads(ctx, step)`, called at a checked step's reduce before the oracle computes, with the step's
    # reads: what a check of a later point takes from them early, so as not to hold more at the oracle's peak (the
    # update check compares the optimizer state the step starts from there, and lets the expected one go).
    # Optional: `ahead(ctx, step, private)`, called at a checked step's reduce after the checks that read the oracle,
    # before its gradients are let go: what a check of a later point takes from them rather than compute again (the
    # trajectory's first step); `private`: they are read after this, so they must not be changed in place.
    # Optional: `resume(saved)`, for a run continued from a checkpoint (dpcompare.verify.starting_state.loaded_state):
    # what the check expects from the saved run (the update check: the optimizer state it held after its last step).
    # Optional: `reused()`, what the check took rather than compute again (`Verdict.oracle_reuse`).
    # Optional, its record in the verdict's JSON (dpcompare.verify.judgement.verdict.Verdict.to_dict), class methods
    # (a check that did not run this time still has its entry, status `off`):
    #   `summary(verdict, policy) -> dict`: its entry in `equivalence.checks`, a `status` (Verdict.check_status) and
    #   its figures (what it kept in the verdict: its own in `verdict.records[name]`);
    #   `step_record(step_check) -> dict | None`: its entry beside each checked step's gradient (`per_step`: its own
    #   in `step_check.records[name]`);
    #   `recorded_after: ClassVar[str]`: the check whose entries its own follow, where not in the list's order.
    # Optional: `words(entry) -> str`, static: its phrase in the run's line, from its entry as the result reader reads
    # it (dpcompare.result_view.Check); without it, its name, status and noise ratio (dpcompare.verdict_words).



CHECKS: list[type[Check]] = [
    # after the reduce, before the optimizer step
    Generators,
    OverflowSeen,
    Gradient,
    Buffers,
    # after the optimizer step
    GradNorm,
    SkipJudged,
    Update,
    Power,
    Trajectory,
]
"""The checks of every run, in order: the list the verifier reads when a run starts and the verdict records (add a
check of one's own to it: `CHECKS.append(MyCheck)`, or insert it where it runs)."""

_verdict.hand_over(CHECKS)  # a verdict that no verifier built records these too (judgement imports no check)

__all__ = ["CHECKS", "Check"]
