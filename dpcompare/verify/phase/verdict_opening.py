"""What the verdict says before the first step is checked.

Owns: the verdict's opening: the oracle coverage where the oracle checks part of the model (note `oracle_coverage`),
the precision recipe and its loss scaler (`PrecisionReport`, note `mixed_precision`), the frozen and the unused
parameters, the forward's randomness (dpcompare.verify.model_facts.model_probe's account: replayed, or `unverifiable` and why), --compile,
and an optimizer whose state cannot be read. Returns why nothing can be checked, where that is known before the first
step. Imports no adapter.
"""

from __future__ import annotations

from dpcompare.contract import Adapter
from dpcompare.verify.instruments.run_instruments import Bench
from dpcompare.verify.instruments.check_context import CheckContext
from dpcompare.verify.judgement.precision_recipe import PrecisionReport
from dpcompare.verify.model_facts.model_probe import judge_randomness
from dpcompare.verify.judgement.verdict import Verdict


def open_verdict(ctx: CheckContext, bench: Bench, backend: Adapter) -> str | None:
    """State in `bench.verdict` what is known before the first step; returns why the run cannot be checked at all
    (None: it can)."""
    verdict, settings, recipe = bench.verdict, ctx.settings, ctx.recipe
    _note_oracle_coverage(ctx, verdict)
    scaler = backend.scaler_state()
    verdict.precision = PrecisionReport(settings.amp, recipe.kind, recipe.describe(), ctx.wire,
                                        scaler.method if scaler else None, scaler.scale if scaler else None)
    if recipe.active:
        scaled = (f"; the loss is scaled ({scaler.method}, {scaler.scale:.9g} at the start) and the floor is taken "
                  "at each step's scale, where its overflow predicts the steps the backend must skip"
                  if scaler is not None else "")
        verdict.note("mixed_precision",
                     f"--amp {settings.amp}, {recipe.kind} recipe: {recipe.describe()}; the noise floor is this "
                     f"recipe's, recomputed rank by rank from the parameters the optimizer holds{scaled}")
    _note_parameters(ctx, bench, verdict)
    refusal = judge_randomness(ctx.facts, ctx.replay_reason, verdict)
    if refusal is None and settings.compile and ctx.facts.stochastic:
        refusal = (f"--compile with a forward that draws random numbers ({', '.join(ctx.facts.random_modules)}): the "
                   "oracle replays the numbers the ranks' random ops drew, recorded at the eager dispatcher, but "
                   "compiled dropout draws its masks inside Inductor's kernels from a generator of its own (and the "
                   "recording breaks the graph); add --no-dropout")
    if settings.compile:
        verdict.note("compile", "--compile: the float64 oracle and the float32 reference run eagerly; the floor's "
                     "regrouped twin runs a compiled copy of the model, so the compiled kernels' rounding (fused and "
                     "reordered reductions, decomposed BatchNorm) is measured in the floor")
    if bench.optimizer is None and ctx.shards == "none":
        verdict.note("optimizer_state_unreadable", "no torch optimizer holding the model's parameters was found behind "
                     "the backend's optimizer: its state cannot be read")
    return refusal


def _note_oracle_coverage(ctx: CheckContext, verdict: Verdict) -> None:
    coverage = ctx.oracle_coverage
    if coverage is None or coverage.full:
        return
    verdict.oracle_coverage = coverage.to_dict()
    verdict.note("oracle_coverage", f"the float64 oracle checks {coverage.fraction:.1%} of the parameters "
                 f"({coverage.checked_parameters:,} of {coverage.parameters:,}: {', '.join(coverage.units_checked)}); "
                 f"{coverage.reason}. The others ({', '.join(coverage.units_unchecked)}) enter every forward at the "
                 "run's values, but their gradients, updates and drift are not compared")


def _note_parameters(ctx: CheckContext, bench: Bench, verdict: Verdict) -> None:
    facts = ctx.facts
    verdict.parameters = {"unused": list(facts.unused), "frozen": list(facts.frozen), "unused_grad": {}}
    if facts.frozen:
        carried = [n for n in facts.frozen if n in bench.trajectory.carried]
        verdict.note("frozen_parameters", f"frozen parameters (requires_grad=False) left out of every check: "
                     f"{', '.join(facts.frozen)}" + (
                         f"; but the non-float ones ({', '.join(carried)}) keep their dtype in every copy and are "
                         "compared bitwise before step 0 and after every step" if carried else ""))
    if facts.unused:
        verdict.note("unused_parameters", f"parameters that take no part in the loss: {', '.join(facts.unused)}; their "
                     "gradient must be None or zero on every rank")
