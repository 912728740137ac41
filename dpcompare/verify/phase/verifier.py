"""The verification phase on rank 0: the checks of every step, run in order, and the verdict they add up to.

Owns: the `Verifier`, which runs the list of checks (dpcompare.verify.checks.CHECKS, read when the run starts: a check
added to it runs, and the verdict records it) at the two points of every step of the verification phase, by what
each declares (its point, what it reads and when: `Check`; it holds no check's name), hands each the run's frozen
context (dpcompare.verify.instruments.check_context, built by the run layer) and the step's evidence, and records what
they find in the verdict, in the list's order:
  - after the reduce: the ranks' generators, the loss scaler's overflow, the gradient against the float64 oracle of the
    global-batch loss, the module buffers (the oracle's side of the step computed once for them:
    dpcompare.verify.instruments.step_evidence);
  - after the optimizer step: under --clip-grad-norm the total norm clipped by, the loss scaler's skip, the update,
    the power the step must have for `equivalent`, the trajectory.
What the verdict says before the first step is dpcompare.verify.phase.verdict_opening's; the instruments the checks share (the
oracle's copies, the references) are dpcompare.verify.instruments.run_instruments's. The model probe before wrapping is
dpcompare.verify.model_facts.model_probe's, `probe` importable from here too. A check that cannot be made is recorded as such and the
verdict says `unverifiable` with the reason, never `equivalent`; one that finds nothing can be checked from there on
(the training diverged, the draws cannot be replayed) stops every check that uses rank 0's copies. Every check runs on
generators forked from the run's, so checking never changes the random numbers the run draws. Imports no adapter.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from dpcompare.contract import Adapter, Wrapped
from dpcompare.verify.oracle import float64_paths
from dpcompare.verify.randomness import random_modules
from dpcompare.verify.instruments.run_instruments import Bench
from dpcompare.verify import checks as listed
from dpcompare.verify.checks import Check
from dpcompare.verify.instruments.check_context import CheckContext, Finding
from dpcompare.verify.memory.divider import Divider
from dpcompare.verify.phase.verdict_opening import open_verdict
from dpcompare.verify.memory.oracle_coverage import unchecked_frozen
from dpcompare.verify.instruments.step_evidence import StepEvidence, compute, note_forwards, params_in_ranges
from dpcompare.verify.model_facts.model_probe import probe
from dpcompare.verify.instruments.backend_reads import Reads

__all__ = ["Reads", "Verifier", "probe"]


class Verifier:
    """Rank 0's checks of one run, described by `ctx`; `template` is the workload's model as built (its weights are
    the run's initial ones), `wrapped` the backend's wrapping of it."""

    def __init__(self, ctx: CheckContext, *, template: nn.Module, loss_fn: Callable, wrapped: Wrapped,
                 backend: Adapter, divider: Divider | None = None) -> None:
        unchecked_frozen(template, ctx.unchecked)  # before any copy: no gradient, state or check for them
        self.ctx, self.backend = ctx, backend
        self.bench = Bench(ctx, template=template, loss_fn=loss_fn, wrapped=wrapped, backend=backend, divider=divider)
        self.verdict = self.bench.verdict
        self.stopped = False
        """No check that uses rank 0's copies runs from here on: the run diverged, or its randomness cannot be
        captured."""
        refusal = open_verdict(ctx, self.bench, backend)
        run = tuple(listed.CHECKS)  # the list as it is when the run starts
        self.verdict.recorded = run
        self.checks: list[Check] = [check(ctx, self.bench) for check in run if check.applies(ctx)]
        self.dumps: dict[str, np.ndarray] = {}
        """--dump-grads: every compared step's reduced, oracle and floor gradients, by "step/kind/parameter"."""
        self._reduced: StepEvidence | None = None
        self._references_after_update = any(getattr(c, "reads_references_after_update", False)
                                             for c in self.checks)
        """Whether a check reads the step's oracle and references after the optimizer step (grad_norm does)."""
        self.part_s: dict[str, float] = {}
        """Seconds spent in each part of the checks, summed over the steps (CUDA synchronised at both ends of each):
        'oracle' (the float64 oracle's and the run-precision references' forwards and backwards of a checked step) and
        each check by its name (what it computes and compares itself: the update check's replay, the trajectory's
        steps)."""
        if refusal is not None:
            self._record(Finding(unverifiable=refusal, stop=True))

    def resume(self, saved: dict[str, Any]) -> None:
        """A run continued from a checkpoint (dpcompare.verify.starting_state.loaded_state): the reference trajectory
        goes on from the saved run's, and each check that expects something of the saved run is handed it
        (`Check.resume`: the update check expects the optimizer state the saved run held after its last step)."""
        self.bench.trajectory.resume(saved["oracle"])
        for check in self.checks:
            if (resume := getattr(check, "resume", None)) is not None:
                resume(saved)

    # -- per step ----------------------------------------------------------------------------------
    def after_reduce(self, step: int, batch: Any, ranks: list[dict], reads: Reads | None) -> None:
        """After `reduce()` and `unscale()`, before the optimizer step, with what every rank sent (`ranks`) and, at a
        checked step, what every rank read (`reads`)."""
        records = [i.get("masks") for i in ranks] if self.ctx.facts.stochastic else None
        evidence = StepEvidence(step=step, at="reduced", checked=reads is not None, batch=batch, ranks=ranks,
                                records=records, masters=reads.masters if reads is not None else {},
                                scaler_before=self.backend.scaler_state(), reads=reads)
        if evidence.checked and not self.stopped:
            if self.bench.divider is not None and reads.state is not None:
                # The optimizer state the step started from, as read (a copy of the whole): held in ranges by the
                # parameters' owners at once (each owner replays its range of the update from it: update_ranges).
                reads.state = self.bench.divider.hold_state(reads.state, list(self.ctx.names))
            for check in self.checks:  # what a check takes from the reads before the oracle's peak (Check.on_reads)
                if (on_reads := getattr(check, "on_reads", None)) is not None:
                    with self._part(check.name):
                        on_reads(self.ctx, evidence)
            if (forget := getattr(reads.state, "forget", None)) is not None:
                forget()  # the last parameter's state the checks read, sent by its owner: not held over the oracle
        self._reduced = evidence = self._run(evidence)
        if evidence.oracle is not None and not self._references_after_update:
            # Nothing reads the step's float64 oracle and run-precision references after the optimizer step (but the
            # grad_norm check under --clip-grad-norm): not held over the update check.
            self._reduced = dataclasses.replace(evidence, oracle=dataclasses.replace(
                evidence.oracle, oracle={}, floor={}, spread={}))
        if evidence.oracle is not None and not evidence.oracle.overflow and not self.stopped:
            with random_modules.isolated(self.ctx.device), self._part("oracle"):
                note_forwards(self.ctx, self.bench, evidence)
            if self.ctx.settings.dump_grads:
                for kind, grads in (("reduced", evidence.oracle.grads), ("oracle", evidence.oracle.oracle),
                                    ("floor", evidence.oracle.floor)):
                    for name, t in grads.items():
                        self.dumps[f"{step}/{kind}/{name}"] = t.numpy()
            for check in self.checks:  # what a check takes from the oracle's side before it is let go (Check.ahead)
                if (ahead := getattr(check, "ahead", None)) is not None:
                    with random_modules.isolated(self.ctx.device), self._part(check.name):
                        ahead(self.ctx, evidence, self._references_after_update or bool(self.ctx.settings.dump_grads))
            if not self._references_after_update:
                params_in_ranges(self.bench, self._reduced)

    def after_update(self, step: int, masters: dict[str, torch.Tensor], reported_norm: float | None) -> None:
        """After the optimizer step, with the values it stepped as every rank read them (`Adapter.master_params()`) and
        the total norm the backend reports clipping by (None: none, or no --clip-grad-norm)."""
        reduced, self._reduced = self._reduced, None  # the step's gradients and references: not held into the next
        if reduced is None or reduced.step != step:
            raise RuntimeError(f"the verifier was handed step {step} after the optimizer step without its reduce")
        self._run(dataclasses.replace(reduced, at="updated", masters=masters, reported_norm=reported_norm))

    def _run(self, evidence: StepEvidence) -> StepEvidence:
        """Every check of `evidence.at`, in the list's order; the oracle's side of a checked step is computed before
        the first check that reads it. Returns the evidence as the checks saw it last."""
        for check in self.checks:
            if check.at != evidence.at or (self.stopped and not check.after_stop):
                continue
            if check.reads_oracle:
                if not evidence.checked:
                    continue
                if evidence.oracle is None and evidence.at == "reduced":
                    with random_modules.isolated(self.ctx.device), self._part("oracle"):
                        computed = compute(self.ctx, self.bench, evidence)
                    if isinstance(computed, Finding):
                        self._record(computed)
                        continue
                    evidence = dataclasses.replace(evidence, oracle=computed)
                if evidence.oracle is None:
                    continue
            with random_modules.isolated(self.ctx.device), self._part(check.name):
                finding = check.judge(self.ctx, evidence)
            if finding is not None:
                self._record(finding)
            if getattr(check, "last_to_read_step", False):
                _let_go(evidence)
                if self.bench.divider is not None:  # their ranges too, before the trajectory's step
                    self.bench.divider.let_go()
        return evidence

    @contextlib.contextmanager
    def _part(self, name: str):
        """Time the work inside as part `name` of the checks (`part_s`)."""
        cuda = self.ctx.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.ctx.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            if cuda:
                torch.cuda.synchronize(self.ctx.device)
            self.part_s[name] = self.part_s.get(name, 0.0) + time.perf_counter() - start

    def _record(self, finding: Finding) -> None:
        finding.record_in(self.verdict)
        self.stopped = self.stopped or finding.stop

    def _ranges(self, divider) -> dict | None:
        """How the checks' ranges were cut (dpcompare.verify.ranks.range_plan), for the result; a note where the ranks could not
        be given even shares (more ranks than elements, or a parameter the optimizer steps whole above a share)."""
        if divider.planned is None:
            return None
        plans = {"checks": divider.owner}
        if self.bench.trajectory.ranges is not None:
            plans["trajectory"] = self.bench.trajectory.ranges.plan
        out = {}
        for what, plan in plans.items():
            counts = [plan.elements(r) for r in range(plan.world_size)]
            out[what] = {"elements": sum(plan.sizes.values()), "even_share": plan.share(), "most": max(counts),
                         "empty_ranks": sum(1 for c in counts if c == 0),
                         "cut": [n for n in plan.sizes if plan.is_cut(n)]}
        plan = divider.owner
        most = max(plan.elements(r) for r in range(plan.world_size))
        if most == 0 or any(plan.elements(r) == 0 for r in range(plan.world_size)) or most > 1.25 * plan.share():
            self.verdict.note("ranges_uneven", f"the checks' ranges could not be cut evenly: {divider.owner.describe()}"
                              " (a rank holding none still takes part in every collective)")
        return out

    def finish(self) -> None:
        """After the last step: `equivalent` needs at least one step whose gradient was compared. A run whose every
        checked step overflowed its loss scale (and was rightly skipped) compared none: the trajectory alone, which
        saw no update, cannot stand for the verdict."""
        self.verdict.oracle_precision = float64_paths.report(self.bench.oracle.model64, self.bench.trajectory.model64)
        divider = self.bench.divider
        if divider is not None:
            self.verdict.oracle_division = {"ranks": divider.peers.world_size, "divided": divider.requests,
                                            "handed": divider.handed, "alone": divider.alone,
                                            "updates": divider.updates, "joined": list(self.bench.joined),
                                            "ranges": self._ranges(divider)}
        reuse = {"regrouped_floor": dict(self.bench.reference.recomputed)} if self.bench.reference.recomputed else {}
        for check in self.checks:
            if (reused := getattr(check, "reused", None)) is not None:
                reuse.update(reused())
        self.verdict.oracle_reuse = reuse or None
        if self.verdict.checks or self.stopped or not self.ctx.settings.check_every:
            return
        skipped = self.verdict.precision.skipped_steps if self.verdict.precision is not None else []
        self.verdict.unverifiable.append(
            f"every checked step's scaled gradients overflowed and the step was skipped (steps "
            f"{', '.join(map(str, skipped))}), so no gradient or update was compared: run more --steps (the loss "
            "scaler halves the scale at each overflow) or start from a smaller --loss-scale" if skipped else
            "no checked step compared a gradient: run more --steps")


def _let_go(evidence: StepEvidence) -> None:
    """After the check that is the last to read them (`Check.last_to_read_step`: the update check): the step's reads (the reduced gradient, the optimizer state), its
    snapshot of the parameters and the oracle's copy of the gradient are emptied in the step's records (the verifier's
    own by then: the run layer has let go of its reads), so that they are not held through the trajectory's steps."""
    if evidence.reads is not None:
        evidence.reads.grads, evidence.reads.state = {}, None
    if evidence.oracle is not None:
        evidence.oracle.grads, evidence.oracle.state, evidence.oracle.pending = {}, {}, None
