"""The update check of a checked step, judged, and the optimizer state the next step is expected to start from.

Owns: the backend's parameter update held against the optimizer replayed in float64 on the backend's own parameters,
reduced gradient and optimizer state, its floor the same replay in the run dtype (the replay itself is
dpcompare.verify.replay.optimizer_replay's `reference_step`); the optimizer state the step started from held against the one the
previous step left (a fresh optimizer's before step 0, or the one after the pre-step the backend's recipe declares):
a wrong step count or state is a fault whatever the update's noise; the notes on that declared pre-step and on unused
parameters the backend steps with a zero gradient, and on its power against a wrong gradient divisor where the
optimizer is scale-invariant (dpcompare.verify.replay.divisor_power); the diagnosis of a failed update
(dpcompare.verify.diagnosis.diagnose); and the state the next checked step is expected to start from. The optimizer replayed
at a step is the run's at that step: a user's optimizer with each parameter's group hyper-parameters and the
schedule's values (dpcompare.verify.replay.optimizer_rebuild). A step whose loss scale overflowed is the loss_scale
check's. Imports no adapter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import torch

from dpcompare.contract.optim_state import OptState
from dpcompare.verify.instruments.run_instruments import Bench
from dpcompare.verify.checks.loss_scale_check import skipped_since
from dpcompare.verify.instruments.check_context import CheckContext, Finding
from dpcompare.verify.instruments.step_evidence import StepEvidence
from dpcompare.verify.diagnosis.diagnose import (UpdateEvidence, diagnose_update, reason_of, state_difference,
                                        step_count_mismatch, FRESH_STEPPED_TRAP)
from dpcompare.verify.oracle.gradient_oracle import DTYPES, Grads
from dpcompare.verify.instruments.backend_reads import Pending
from dpcompare.verify.judgement.held_values import Compact, Difference
from dpcompare.verify.replay import divisor_power
from dpcompare.verify.replay import replay_ranges
from dpcompare.verify.ranks.verifier_group import Remote, RemoteState
from dpcompare.verify.judgement.tolerance import UNIT_ROUNDOFF, compare, coverage, judge_figures, norm_of
from dpcompare.verify.replay.optimizer_replay import StepResult, reference_step
from dpcompare.verify.judgement.verdict import Divergence, StepCheck, UpdateCheck, Verdict, finite, worst


class Update:
    """Judges the update of every checked step of a run into the verdict, and carries the optimizer state expected from
    one step to the next (forgotten at an unchecked step: then it cannot be predicted)."""

    name = "update"
    at = "updated"
    reads_oracle = False  # every step: an unchecked one forgets the expected state
    after_stop = False
    reads_references_after_update = False
    last_to_read_step = True  # the step's reads and the oracle's gradient are let go after it, before the trajectory's

    @classmethod
    def applies(cls, ctx: CheckContext) -> bool:
        return True

    @classmethod
    def summary(cls, verdict: Verdict, policy: dict) -> dict:
        """The check's entry in the verdict's `checks`: the worst of the checked steps' updates (the norm ratio the one
        farthest from 1)."""
        updates = [c.update for c in verdict.checks if c.update is not None]
        ratio = max((u.norm_ratio for u in updates), key=lambda r: abs(math.log(r)) if r > 0 and math.isfinite(r)
                    else math.inf, default=None)
        power = worst([u.min_detectable_rel for u in updates])
        return {"status": verdict.check_status(cls.name, bool(updates)),
                "noise_ratio": worst([u.noise_ratio for u in updates]),
                "max_rel_fro_err": worst([u.max_rel_fro_err for u in updates]),
                "noise_floor_rel_fro": worst([u.floor for u in updates]),
                "norm_ratio": ratio,
                "min_detectable_rel": finite(power) if power is not None else None,
                "coverage": coverage(updates[-1].params).to_dict() if updates else None}

    @staticmethod
    def step_record(check: StepCheck) -> dict | None:
        """The check's record beside a step's gradient (None: no update was judged at it)."""
        return check.update.to_dict() if check.update is not None else None

    def resume(self, saved: dict) -> None:
        """A run continued from a checkpoint: the optimizer state the first step starts from is the one the saved run
        held after its last step."""
        if saved.get("optimizer") is not None:
            self.expected_state = saved["optimizer"]

    def __init__(self, ctx: CheckContext, bench: Bench) -> None:
        self.factory, self.device, self.names, self.prestep = ctx.factory, ctx.device, list(ctx.names), ctx.prestep
        self.backend, self.verdict, self.divider = bench.backend, bench.verdict, bench.divider
        self.dtype = DTYPES[ctx.dtype]
        self.clip: float | None = ctx.settings.clip_grad_norm
        """--clip-grad-norm: every reference step clips the gradient it is handed by its global norm."""
        self.expected_state: OptState | None = {}  # a fresh optimizer's (after the declared pre-step, at step 0)
        self._power_said = False
        """Whether the update check's power against a wrong gradient divisor was measured (divisor_power: once)."""
        self._compared: tuple[int, _StateCompared | None] | None = None
        """The step on_reads compared last, and what it found (None: nothing was expected)."""
        self.expected_from = ("a fresh optimizer's" if self.prestep is None else
                              "a fresh optimizer's after one step on zero gradients")

    def judge(self, ctx: CheckContext, step: StepEvidence) -> Finding | None:
        """After the optimizer step, with the values it stepped as every rank read them (`Adapter.master_params()`): the
        update of a step whose gradient was checked (a step whose loss scale overflowed is the loss_scale check's)."""
        pending = step.oracle.pending if step.oracle is not None else None
        if pending is None:
            self.expected_state = None  # an unchecked step: the next step's state cannot be predicted
            return None
        if pending.scale is not None and pending.scale.predicted_overflow:
            # A skipped step leaves the state as it was: the next step starts from the expected one (the backend's
            # own where it was found to be that one).
            compared = self._taken(step.step)
            self.expected_state = None if compared is None else (
                compared.expected if compared.expected is not None else _whole(pending.backend_state))
            return None
        state = pending.backend_state
        if state is None:
            return Finding(unverifiable=f"the update check at step {step.step} cannot know the optimizer state: the "
                                        "backend's optimizer_state() gave none (no torch optimizer holding the model's "
                                        "parameters was found behind the backend's optimizer)", stop=True)
        # A parameter a single process gives no gradient is not stepped there: the reference replays it with none.
        single = _without(pending.grads, pending.none)
        ref, divergence = self._judged(ctx, step.step, pending, state, single, step.masters)
        self.advance(step.step, pending, state, single, ref)
        if divergence is None and not self._power_said and not len(state):  # from a fresh optimizer's state
            self._note_divisor_power(ctx, step.step, pending, single)
        return Finding(divergence) if divergence is not None else None

    def _note_divisor_power(self, ctx: CheckContext, step: int, pending: Pending,
                            single: Mapping[str, torch.Tensor | None]) -> None:
        """Once, at the first checked step from a fresh optimizer state: where the run's optimizer hides the gradient's
        scale (Adam-like, sign-based), the update check's power against a wrong gradient divisor, measured
        (dpcompare.verify.replay.divisor_power), said in a note beside the gradient check's power, which carries it."""
        self._power_said = True
        # the gradient k times larger taken as each piece is stepped (k a power of two: exact), never copied whole
        replay = lambda k, dtype=torch.float64: self._replay(  # noqa: E731
            pending, single, {}, dtype, keep_state=False, multiple=k).delta
        power = divisor_power.divisor_power(replay, replay(1), replay(1, self.dtype), self.names, dtype=ctx.dtype,
                                            depth=ctx.depth)
        if power is not None:
            kind = getattr(self.factory, "type", None) or type(self.factory([torch.nn.Parameter(torch.zeros(1))]))
            self.verdict.note("scale_invariant_update", divisor_power.note(
                kind.__name__, step, power, self.verdict.checks[-1].min_detectable_rel))

    def on_reads(self, ctx: CheckContext, step: StepEvidence) -> None:
        """At a checked step's reduce, before the oracle runs: the optimizer state the step starts from (as every rank
        read it) against the one expected, parameter by parameter; the expected state is let go unless some parameter
        differs (the replay after the step builds the next one), so the oracle's peak does not hold it too."""
        self._compared = None
        if step.reads is None or step.reads.state is None:
            return
        expected, self.expected_state = self.expected_before(step.step, step.masters), None
        if expected is None:
            self._compared = (step.step, None)
            return
        state = step.reads.state
        counts, values = {}, {}
        for n in self.names:  # a parameter at a time: an expected state held in ranges sends each parameter's once
            if (c := step_count_mismatch(state, expected, [n])) is not None:
                counts[n] = c[1]
            if (d := state_difference(state, expected, [n])) is not None:
                values[n] = d[1]
        self._compared = (step.step, _StateCompared(counts, values, expected if counts or values else None))

    def _taken(self, step: int) -> "_StateCompared | None":
        """What on_reads found at this step's reduce (None: nothing was expected), taken once."""
        taken, self._compared = self._compared, None
        return taken[1] if taken is not None and taken[0] == step else None

    def expected_before(self, step: int, params: Mapping[str, torch.Tensor]) -> OptState | None:
        """The optimizer state the step is expected to start from: the one the previous step left, and before step 0,
        where the backend's recipe declares a pre-step, a fresh optimizer's after one step on zero gradients."""
        expected = self.expected_state
        if step == 0 and self.prestep is not None and expected == {}:
            params = {n: params[n] for n in self.names}
            zeros = {n: torch.zeros_like(t) for n, t in params.items()}
            expected = reference_step(self._at(0), params, zeros, {}, torch.float64, self.device, clip=self.clip).state
        return expected

    def _at(self, step: int):
        """The run's optimizer as replayed at `step`: a scheduled reference's hyper-parameters of that step, each
        parameter's group's (dpcompare.verify.replay.optimizer_rebuild); a plain factory as it is."""
        at = getattr(self.factory, "at", None)
        return at(step) if at is not None else self.factory

    def _replay(self, pending: Pending, single: dict[str, torch.Tensor | None], state: OptState,
                dtype: torch.dtype, keep_state: bool = True, multiple: float = 1.0) -> StepResult:
        return reference_step(self._at(pending.step), pending.params, single, state, dtype, self.device,
                              clip=self.clip, keep_state=keep_state, multiple=multiple)

    def _judged(self, ctx: CheckContext, step: int, pending: Pending, state: OptState,
                single: dict[str, torch.Tensor | None], masters: dict[str, torch.Tensor]
                ) -> tuple[StepResult, Divergence | None]:
        """`state` against the state expected before the step (compared first, and let go unless it differs: the
        replay below builds the next); then the update from `pending.params` to `masters` against the optimizer
        replayed from the backend's `state` with `single` (the reduced gradient, None where a single process gives
        none), recorded on the step's check. Returns the float64 replay and the failure, if any."""
        compared = self._taken(step)
        # The state the step started from, against what the previous step left (a fresh optimizer's before step 0,
        # or the one the backend's recipe declares), compared at the reduce (on_reads). A step count is a whole
        # number: a wrong one is a fault whatever the update's noise. An unused parameter the backend hands a zero
        # gradient (ZeRO's flat partitions step as a whole) counts steps a single process does not take.
        zero_stepped = [n for n in ctx.facts.unused if self.verdict.parameters["unused_grad"].get(n) == "zero"]
        judged_names = [n for n in self.names if n not in zero_stepped]
        differs = compared.differs(judged_names) if compared is not None and self.verdict.first_divergence is None \
            else None
        expected = compared.expected if differs is not None else None
        delta = Difference(masters, pending.params)
        norms: dict[str, tuple[float, float]] = {}  # (||delta||, ||reference||), read in compare's own pass
        if self._divided(pending, single, state):
            # each owner replays and reduces its range (dpcompare.verify.replay.replay_ranges); the state left stays with it
            leaves = None if _none_of(single) == _none_of(pending.grads) else pending.grads
            figures, left = replay_ranges.divided(self.divider, self._at(step), self.device, self.names,
                                                  pending.params, masters, single, state, self.dtype,
                                                  UNIT_ROUNDOFF[ctx.dtype], self.clip, leaves, at=step)
            ref = replay_ranges.Replayed(left, lambda: self._replay(pending, single, state, torch.float64, False))
            params, model = judge_figures(figures, self.names, dtype=ctx.dtype, world_size=1, depth=ctx.depth,
                                          norms=norms)
        else:
            # The float64 replay's state is the next step's expected state: read in the backend's dtype (held_as).
            ref = reference_step(self._at(step), pending.params, single, state, torch.float64, self.device,
                                 clip=self.clip, state_like=_like(state), sink=self._holder())
            floor = self._replay(pending, single, state, self.dtype, keep_state=False)
            params, model = compare(delta, ref.delta, floor.delta, dtype=ctx.dtype, world_size=1,
                                    depth=ctx.depth, names=self.names, norms=norms)
        ratios = {n: _norm_ratio(*norms[n]) for n in self.names}
        whole = _norm_ratio(math.sqrt(sum(a * a for a, _ in norms.values())),
                            math.sqrt(sum(b * b for _, b in norms.values())))
        self.verdict.checks[-1].update = UpdateCheck(params, ratios, whole, model)
        failing = [p for p in params if not p.ok]
        if not model.ok and not failing:
            failing = list(params)
        self._note_unused_stepped(step, state, zero_stepped)
        divergence = None
        if differs is not None:
            divergence = self._state_divergence(ctx, step, pending, differs, expected, single, delta)
        if step == 0 and self.prestep is not None and compared:
            self._note_prestep(pending, single, delta)
        if failing and divergence is None and self.verdict.first_divergence is None:
            evidence = UpdateEvidence(
                step=step, names=self.names, delta=delta, reference=ref.delta,
                tolerance={p.parameter: p.tolerance_rel_fro for p in params}, params=pending.params,
                grads=single, expected_state=state, backend_state=state,
                factory=self._at(step), device=self.device, world_size=ctx.world_size, lr=ctx.settings.lr,
                weight_decay=ctx.settings.weight_decay, backend_hparams=pending.backend_hparams,
                expected_from=self.expected_from, skipped=skipped_since(self.backend, pending), clip=self.clip)
            found = diagnose_update(evidence, [p.parameter for p in failing])
            first = next((p for p in failing if not p.ok), failing[0])
            divergence = Divergence(
                step, first.parameter, first.rel_fro_err, first.tolerance_rel_fro, first.noise_ratio,
                f"the gradient passed but the update did not: {reason_of(found)}", check="update",
                cause=found[0].cause, parameters=[p.parameter for p in failing])
        return ref, divergence

    def _state_divergence(self, ctx: CheckContext, step: int, pending: Pending, differs: tuple[list[str], str],
                          expected: OptState, single: dict[str, torch.Tensor | None], delta: Grads) -> Divergence:
        """The optimizer state the step started from is not `expected` (`differs`: the parameters whose state differs
        and a phrase on the first): the divergence, with what it costs the update."""
        wrong, text = differs
        # What the state costs the update: the backend's update against the one the expected state gives.
        had = compare(delta, self._replay(pending, single, expected, torch.float64, keep_state=False).delta,
                      self._replay(pending, single, expected, self.dtype, keep_state=False).delta,
                      dtype=ctx.dtype, world_size=1, depth=ctx.depth, names=self.names)[0]
        first = next(p for p in had if p.parameter == wrong[0])
        return Divergence(
            step, first.parameter, first.rel_fro_err, first.tolerance_rel_fro, first.noise_ratio,
            f"the gradient passed but the update did not: the optimizer state before step {step} is not "
            f"{self.expected_from}: {text}{FRESH_STEPPED_TRAP if step == 0 else ''}", check="update",
            cause="optimizer_state", parameters=wrong)

    def advance(self, step: int, pending: Pending, state: OptState, single: dict[str, torch.Tensor | None],
                ref: StepResult) -> None:
        """The next step's expected state: the one this step leaves, the optimizer replayed from the backend's own
        state with the gradient it was handed (zeros included, where the backend gave zeros)."""
        leaves = ref if getattr(ref, "leaves", False) or _none_of(single) == _none_of(pending.grads) else \
            reference_step(self._at(step), pending.params, pending.grads, state, torch.float64, self.device,
                           clip=self.clip, state_like=_like(state), sink=self._holder())
        # where the ranks share the checks, held in ranges by the owners (each parameter's sent as the replay completed
        # it) until the next checked step's reduce reads it
        self.expected_state = leaves.state
        self.expected_from = f"the state step {step} left"

    def _divided(self, pending: Pending, single: Mapping[str, torch.Tensor | None], state: OptState) -> bool:
        """Whether each owner replays its range of the update: the ranks share the checks, and the gradient and the
        state the step started from are held in ranges by them."""
        return (self.divider is not None and isinstance(pending.params, (Compact, Remote))
                and isinstance(state, RemoteState)
                and all(isinstance(g, Remote) and g.divided_by is self.divider for g in (single, pending.grads)))

    def _holder(self):
        """Where a replay's state after the step goes, a parameter at a time: to the owners of the ranges
        (dpcompare.verify.ranks.verifier_group.StateHolder) where the ranks share the checks; None: held here."""
        return self.divider.state_holder(self.names) if self.divider is not None else None

    def _note_unused_stepped(self, step: int, state: OptState, zero_stepped: list[str]) -> None:
        if not zero_stepped or any(n.code == "unused_stepped" for n in self.verdict.notes):
            return
        have = float(state.get(zero_stepped[0], {}).get("step", 0))
        if have:
            self.verdict.note("unused_stepped",
                              f"the backend steps the parameters that take no part in the loss with a zero "
                              f"gradient ({', '.join(zero_stepped)}): their optimizer step count advances "
                              f"({zero_stepped[0]}: {have:g} before step {step}) where a single process keeps "
                              "none; their values are still held to the reference update (with Adam and no "
                              "weight decay a zero gradient moves nothing; with --weight-decay they decay, "
                              "and the update check fails, cause unused_zero_grad)")

    def _note_prestep(self, pending: Pending, single: dict[str, torch.Tensor | None], delta: Grads) -> None:
        """The backend's recipe steps its optimizer on zero gradients before the first step, by design: its state
        before step 0 was held to that, and what it does to the first update is measured against a fresh optimizer's."""
        fresh = reference_step(self._at(0), pending.params, single, {}, torch.float64, self.device, clip=self.clip).delta
        ratio = _norm_ratio(norm_of(delta, self.names), norm_of(fresh, self.names))
        self.verdict.note("optimizer_prestep",
                          f"{self.prestep}: its optimizer state before step 0 is that step's, as expected, not a fresh "
                          f"optimizer's; the first update is {ratio:.4g}x a fresh optimizer's (||update|| ratio; with "
                          "Adam the bias correction runs one step ahead, with SGD a zero momentum buffer steps like none)")


@dataclass(slots=True)
class _StateCompared:
    """The optimizer state a step started from against the expected one, per parameter (Update.on_reads)."""

    counts: dict[str, str]
    """Parameter -> the phrase on its step count, where it is not the expected one."""
    values: dict[str, str]
    """Parameter -> the phrase on its first entry that differs, where one does."""
    expected: OptState | None
    """The expected state, kept only where some parameter differs (what it costs the update is measured with it)."""

    def differs(self, names: list[str]) -> tuple[list[str], str] | None:
        """(the parameters of `names` whose state is not the expected one, the phrase on the first), step counts
        first (a whole number: no rounding excuses one), or None."""
        for found in (self.counts, self.values):
            wrong = [n for n in names if n in found]
            if wrong:
                return wrong, found[wrong[0]]
        return None


def _norm_ratio(na: float, nb: float) -> float:
    if nb == 0.0:
        return 1.0 if na == 0.0 else math.inf
    return na / nb


def _without(grads: Mapping[str, torch.Tensor | None], names: frozenset[str]) -> Mapping[str, torch.Tensor | None]:
    """`grads` with `names` given no gradient (held compactly where `grads` is)."""
    if isinstance(grads, Compact) or hasattr(grads, "without"):
        return grads.without(names)
    return {n: (None if n in names else g) for n, g in grads.items()}


def _none_of(grads: Mapping[str, torch.Tensor | None]) -> frozenset[str]:
    if isinstance(grads, Compact) or hasattr(grads, "without"):
        return grads.none
    return frozenset(n for n, g in grads.items() if g is None)


def _like(state: OptState) -> OptState:
    """What `state`'s entries are, for reading a replay's state in their dtypes: a state held in ranges
    (dpcompare.verify.ranks.verifier_group.RemoteState) gives meta tensors, nothing sent."""
    like = getattr(state, "like", None)
    return like() if like is not None else state


def _whole(state: OptState) -> OptState:
    """`state` held here: one held in ranges is read whole (a skipped step's, expected at the next step)."""
    return state if isinstance(state, dict) else {n: dict(state[n]) for n in state}
