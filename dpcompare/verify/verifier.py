"""The verification phase on rank 0: three checks per step and the verdict they add up to.

Owns: the `Verifier`, which runs for every step of the verification phase
  - the gradient check: the reduced gradient against the float64 oracle of the global-batch loss, in
    multiples of the run dtype's own noise floor (dpcompare.verify.equivalence; the run-precision reference and
    its floor, the declared wire emulated or bounded: dpcompare.verify.run_reference);
  - under --clip-grad-norm, the grad_norm check: the total norm the backend clipped by against the oracle's global
    norm (dpcompare.verify.clipping), the reference step and the trajectory clipping as the run asks;
  - the update check: the parameter update against a plain optimizer step taken in float64 from the same
    parameters, the expected optimizer state and the oracle gradient (dpcompare.verify.update_judge, on
    dpcompare.verify.update_check), and the loss scaler's skips where the recipe overflows
    (dpcompare.verify.loss_scale);
  - the trajectory: the parameters after the step against a float64 single process trained beside the
    run (dpcompare.verify.trajectory);
  - the ranks' generators, when the forward draws random numbers: each rank must draw its own;
  - the module buffers (BatchNorm running statistics and any other): across ranks, and against what the
    oracle's forwards predict under each known semantics (dpcompare.verify.buffers);
and the power each checked step must have for the verdict to say `equivalent`. The model probe before wrapping
(unused, frozen and random parts of the model) is dpcompare.verify.probe's, `probe` importable from here too.
The oracle computes what data parallelism computes: the global batch in one forward, or, where the model
couples the samples of a batch (BatchNorm without --sync-bn) or its forward depends on how the batch is split
(dpcompare.verify.split), each replica's own forwards as the backend split them, its distance from the global batch
stated as a note (dpcompare.verify.forwards). What the ranks hold before step 0 is dpcompare.verify.initial's. Random
numbers are the ones the ranks drew, recorded during their forward (dpcompare.verify.masks), never redrawn.
A failed check is diagnosed (dpcompare.verify.diagnosis); a part that cannot be checked is recorded as such and
the verdict says `unverifiable` with the reason, never `equivalent`. Everything here runs on generators
forked from the run's, so checking never changes the random numbers the run draws. Imports no adapter.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch
from torch import nn

from dpcompare.verify import equivalence as eq
from dpcompare.verify import masks as mk
from dpcompare.verify import float64_paths, stochastic
from dpcompare.contract import Adapter, ModelFacts, Wrapped
from dpcompare.verify.buffers import BufferCheck
from dpcompare.verify.clipping import GradNormJudge
from dpcompare.verify.coverage import Coverage, unchecked_frozen
from dpcompare.verify.diagnosis import GradientEvidence, diagnose_gradient, reason_of
from dpcompare.verify.forwards import Forwards
from dpcompare.verify.loss_scale import LossScaleJudge
from dpcompare.verify.probe import judge_randomness, probe
from dpcompare.verify.reads import Pending, Reads
from dpcompare.verify.run_reference import RunReference
from dpcompare.verify.split import SplitCheck
from dpcompare.verify.tolerance import REQUIRED_POWER, classic_tolerance
from dpcompare.verify.stochastic import RngState
from dpcompare.verify.trajectory import Trajectory
from dpcompare.verify.precision import PrecisionReport, Recipe, ScaleStep
from dpcompare.contract.optim_state import OptimizerFactory, read_hparams
from dpcompare.verify.update_judge import UpdateJudge

__all__ = ["Reads", "Verifier", "probe"]


class Verifier:
    def __init__(self, *, cfg, world_size: int, template: nn.Module, loss_fn: Callable, facts: ModelFacts,
                 wrapped: Wrapped, device: torch.device, factory: OptimizerFactory, layout: eq.Layout,
                 replay_reason: str | None, backend: Adapter, coverage: Coverage | None = None) -> None:
        self.cfg, self.world_size, self.device = cfg, world_size, device
        self.coverage = coverage
        self.unchecked = coverage.unchecked if coverage is not None else frozenset()
        unchecked_frozen(template, self.unchecked)  # before any copy: no gradient, state or check for them
        self.template, self.facts, self.wrapped = template, facts, wrapped
        self.layout = layout
        self.batchnorms = [n for n, m in template.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        self.has_batchnorm = bool(self.batchnorms)
        # BatchNorm without --sync-bn: the oracle runs each replica's forwards, as the backend does (as it does where
        # the forward depends on the split, which dpcompare.verify.split finds at the first checked step).
        per_replica = self.has_batchnorm and not cfg.sync_bn and layout.splits_the_batch
        self.depth = eq.depth_of(template)
        self.backend = backend
        self.recipe = Recipe(backend.amp_recipe(), cfg.amp, device.type)
        self.wire = backend.gradient_wire()
        """The gradients' dtype on the wire: --compression, or what the backend's precision recipe sends."""
        self.oracle = eq.Oracle(template, loss_fn, cfg.dtype, device, self.recipe)
        self.names = self.oracle.names
        self.u_wire = eq.wire_roundoff(cfg.dtype, self.wire)
        self.trajectory = Trajectory(template, loss_fn, factory, cfg.dtype, device, self.depth, self.u_wire, self.recipe,
                                     prestep=backend.optimizer_prestep() is not None, clip=cfg.clip_grad_norm)
        self.buffers = BufferCheck(self.oracle, self.depth, cfg.dtype)
        self.verdict = eq.Verdict(notes=list(wrapped.notes))
        if coverage is not None and not coverage.full:
            self.verdict.oracle_coverage = coverage.to_dict()
            self.verdict.note("oracle_coverage", f"the float64 oracle checks {coverage.fraction:.1%} of the parameters "
                              f"({coverage.checked_parameters:,} of {coverage.parameters:,}: "
                              f"{', '.join(coverage.units_checked)}); {coverage.reason}. The others "
                              f"({', '.join(coverage.units_unchecked)}) enter every forward at the run's values, but "
                              "their gradients, updates and drift are not compared")
        self.forwards = Forwards(layout, self.oracle, batchnorms=self.batchnorms, per_replica=per_replica,
                                 stochastic=facts.stochastic, dtype=cfg.dtype, depth=self.depth, verdict=self.verdict)
        self.split = SplitCheck(self.oracle, self.forwards, depth=self.depth, verdict=self.verdict,
                                applies=layout.splits_the_batch and not self.has_batchnorm)
        self.reference = RunReference(self.oracle, layout, dtype=cfg.dtype, world_size=world_size, wire=self.wire,
                                      has_batchnorm=self.has_batchnorm, sync_bn=cfg.sync_bn, verdict=self.verdict,
                                      split=self.split, compiled=cfg.compile)
        self.loss_scale = LossScaleJudge(backend, self.verdict, cfg.amp, self.names)
        scaler = backend.scaler_state()
        self.verdict.precision = PrecisionReport(cfg.amp, self.recipe.kind, self.recipe.describe(), self.wire,
                                                 scaler.method if scaler else None, scaler.scale if scaler else None)
        self.optimizer = backend.optimizer_view()[0]  # its hyper-parameters; its state comes with each step's Reads
        self.masters: dict[str, torch.Tensor] = {}
        """The values the optimizer steps, full, as last read on every rank (`Adapter.master_params()`)."""
        self.all_names = [n for n, _ in template.named_parameters()]
        named = {id(p): n for n, p in reversed(list(template.named_parameters()))}
        self.state_keys = {k: named[id(t)] for k, t in template.state_dict(keep_vars=True).items() if id(t) in named}
        """State-dict key -> the parameter it holds, by name: a tied weight (an LM head sharing the embedding) has
        several keys and one name."""
        """Every parameter, trainable or not, in the order the ranks' digests list them."""
        if self.recipe.active:
            scaled = (f"; the loss is scaled ({scaler.method}, {scaler.scale:.9g} at the start) and the floor is taken "
                      "at each step's scale, where its overflow predicts the steps the backend must skip"
                      if scaler is not None else "")
            self.verdict.note("mixed_precision",
                              f"--amp {cfg.amp}, {self.recipe.kind} recipe: {self.recipe.describe()}; the noise floor "
                              f"is this recipe's, recomputed rank by rank from the parameters the optimizer holds"
                              f"{scaled}")
        self.grad_norms = GradNormJudge(clip=cfg.clip_grad_norm, dtype=cfg.dtype, depth=self.depth, world_size=world_size,
                                        u_wire=self.u_wire, names=self.names, verdict=self.verdict) \
            if cfg.clip_grad_norm is not None else None
        self.updates = UpdateJudge(cfg=cfg, factory=factory, device=device, depth=self.depth, names=self.names,
                                   world_size=world_size, unused=facts.unused, prestep=backend.optimizer_prestep(),
                                   backend=backend, verdict=self.verdict)
        self.pending: Pending | None = None
        self._scaler_before = None
        self.previous: tuple[int, eq.Grads] | None = None
        self.stopped = False
        """No further check: the run diverged, or its randomness cannot be captured."""
        self.dumps: dict[str, np.ndarray] = {}

        self.verdict.parameters = {"unused": list(facts.unused), "frozen": list(facts.frozen), "unused_grad": {}}
        if facts.frozen:
            carried = [n for n in facts.frozen if n in self.trajectory.carried]
            self.verdict.note("frozen_parameters", f"frozen parameters (requires_grad=False) left out of every check: "
                                      f"{', '.join(facts.frozen)}" + (
                                          f"; but the non-float ones ({', '.join(carried)}) keep their dtype in every "
                                          "copy and are compared bitwise before step 0 and after every step" if carried
                                          else ""))
        if facts.unused:
            self.verdict.note("unused_parameters", f"parameters that take no part in the loss: {', '.join(facts.unused)}; their "
                                      "gradient must be None or zero on every rank")
        if (reason := judge_randomness(facts, replay_reason, self.verdict)) is not None:
            self._unverifiable(reason)
        elif cfg.compile and facts.stochastic:
            self._unverifiable(f"--compile with a forward that draws random numbers ({', '.join(facts.random_modules)}): "
                               "the oracle replays the numbers the ranks' random ops drew, recorded at the eager "
                               "dispatcher, but compiled dropout draws its masks inside Inductor's kernels from a "
                               "generator of its own (and the recording breaks the graph); add --no-dropout")
        if cfg.compile:
            self.verdict.note("compile", "--compile: the float64 oracle and the float32 reference run eagerly; the "
                              "floor's regrouped twin runs a compiled copy of the model, so the compiled kernels' "
                              "rounding (fused and reordered reductions, decomposed BatchNorm) is measured in the floor")
        if self.optimizer is None and getattr(backend.capabilities, "shards", "none") == "none":
            self.verdict.note("optimizer_state_unreadable", "no torch optimizer holding the model's parameters was found behind the "
                                      "backend's optimizer: its state cannot be read")

    # -- before the first step -------------------------------------------------------------------
    def _unverifiable(self, reason: str) -> None:
        self.verdict.unverifiable.append(reason)
        self.stopped = True

    # -- per step ----------------------------------------------------------------------------------
    def observe_scaler(self, step: int) -> None:
        """Before every step's optimizer step: the loss scale its backward used and the skips counted so far, so the
        reference trajectory follows an unchecked step as the backend took it (checked steps are judged)."""
        scaler = self.backend.scaler_state()
        self._scaler_before = (step, scaler) if scaler is not None else None

    def observe_generators(self, step: int, rngs: list[RngState]) -> None:
        if not self.facts.stochastic:
            return
        seen: dict[str, int] = {}
        for rank, state in enumerate(rngs):
            if state.digest in seen:
                self.verdict.diverge(eq.Divergence(
                    step, "(generator state)", math.nan, 0.0, math.nan,
                    f"ranks {seen[state.digest]} and {rank} draw identical dropout masks: their generators are in the "
                    f"same state before the forward of step {step} (every rank seeded the same); each replica needs "
                    "its own seed for dropout and augmentation, and the same seed only for the weights",
                    check="rng", cause="same_seed"))
                return
            seen[state.digest] = rank

    def _run_state(self, module: nn.Module, before: dict) -> dict:
        """The state the step's forward ran from: the parameters the optimizer holds (fp32 master values where the
        backend keeps them apart) and the module buffers as they were before the forward."""
        state = {k: v.detach().clone() for k, v in module.state_dict().items()}
        for key, name in self.state_keys.items():  # a tied weight is in the state dict under each of its names
            if name in self.masters:
                state[key] = self.masters[name].detach().clone()
        # The forward ran from the buffers before it (it has updated them since): the oracle starts there too.
        state.update({k: v for k, v in before.items() if k in state})
        return state

    def check_gradient(self, step: int, batch, info: list[dict], reads: Reads) -> None:
        """After `reduce()` and `unscale()`, before the optimizer step: the gradient check (or, where the run's loss
        scale overflows, the skip it must make), the buffers, and the snapshot the update check of this step
        starts from."""
        self.pending = None
        self.masters = reads.masters
        if self.stopped:
            return
        module = self.wrapped.module
        records = [i["masks"] for i in info] if self.facts.stochastic else None
        n = batch[0].shape[0]
        try:
            pieces = self.forwards.pieces(batch, records)
            forward_masks = self.forwards.masks(n, records) if records is not None else None
        except mk.MaskMismatch as exc:
            self._mask_failure(step, exc)
            return
        if records is not None:
            self.verdict.stochastic["capture_bytes_per_step"] = max(r.nbytes for r in records)
        scaler = self.backend.scaler_state()
        loss_scale = scaler.scale if scaler is not None else 1.0
        with stochastic.isolated(self.device):
            state = self._run_state(module, info[0]["buffers"]["before"])
            reduced = reads.grads
            grads = {n: (reduced[n] if reduced.get(n) is not None else torch.zeros_like(self.masters[n])).detach().double().cpu()
                     for n in self.names}
            try:
                pieces, oracle = self.split.settle(step, state, batch, records, forward_masks, pieces,
                                                   self.oracle.oracle_of(state, pieces))
                none = self.oracle.none
                floor, spread, wire = self.reference.measure(state, batch, pieces, forward_masks, loss_scale)
                if (now := self.split.reconsider(step, state, batch, records, forward_masks, pieces, oracle, floor)):
                    pieces, oracle = now  # the split changes the gradient here, not at the first step: as the ranks ran
                    none = self.oracle.none
                    floor, spread, wire = self.reference.measure(state, batch, pieces, forward_masks, loss_scale)
            except mk.MaskMismatch as exc:
                self._mask_failure(step, exc)
                return
            # A run whose single process overflows too has diverged: that is no backend difference. Under a loss
            # scale, the recipe's overflow is the scaler's to handle: the step must be skipped.
            overflow = not all(bool(torch.isfinite(t).all()) for t in floor.values())
            for what, g, diverged in (("float64 oracle's gradient", oracle, True),
                                      (f"{self._floor_name()} single-process gradient", floor, scaler is None)):
                if diverged and not all(bool(torch.isfinite(t).all()) for t in g.values()):
                    self._unverifiable(f"the training diverged numerically at step {step}: the {what} is not finite "
                                       "at the run's parameters (the loss or the parameters overflowed), so nothing "
                                       "from there on can be compared; lower --lr")
                    return
            scale_step = None
            if scaler is not None:
                scale_step = ScaleStep(step, loss_scale, overflow,
                                       not all(bool(torch.isfinite(g).all()) for g in grads.values()))
                self.verdict.precision.steps.append(scale_step)
            failure = self.buffers.check(step, state, batch, self.layout, [i["buffers"] for i in info], forward_masks)
            self.verdict.buffers = self.buffers.entries()
            if (text := self.buffers.note()) is not None:
                self.verdict.notes = [n for n in self.verdict.notes if n.code != "buffers_per_rank"]
                self.verdict.note("buffers_per_rank", text)
            backend_state = reads.state
            if not all(bool(torch.isfinite(t).all()) for t in spread.values()):
                spread = floor  # the regrouped sum overflows where the ranks' does not: no measured spread
            pending = Pending(
                step, {n: self.masters[n].detach().double().cpu().clone() for n in self.names},
                {n: (None if reduced.get(n) is None else grads[n]) for n in self.names}, none,
                backend_state, read_hparams(self.optimizer) if self.optimizer is not None else [],
                scale_step, scaler.skipped_steps if scaler is not None else 0)
            if overflow:
                self.pending = pending
                self.loss_scale.expect_skip(scale_step)
                if failure is not None:
                    self.verdict.diverge(failure)
                return
            self.forwards.note_per_replica(step, state, batch, oracle, floor, pieces)
            self.split.note(max(eq.rel_fro(eq.flat(floor, self.names), eq.flat(oracle, self.names)),
                                self.depth * eq.UNIT_ROUNDOFF[self.cfg.dtype]))
            params, model = eq.compare(grads, oracle, floor, dtype=self.cfg.dtype, world_size=self.world_size,
                                       depth=self.depth, u_sum=self.u_wire if wire is None else None,
                                       names=self.names, spread=spread)
            digests = eq.first_mismatch([i["grads"] for i in info], self.all_names)
            check = eq.StepCheck(step, params, True, digests is None, model=model)
            self.verdict.checks.append(check)
            if self.grad_norms is not None:
                self.grad_norms.expect(step, oracle, floor, model, lambda: [  # each rank's local gradient, on demand
                    self.oracle.floor_of(state, eq.replica_pieces(batch, self.layout, forward_masks, ranks=[r]), loss_scale)
                    for r in range(self.world_size)], loss_scale if scaler is not None else None)
            self._record_unused(info)
            failing = [p for p in params if not p.ok]
            if not model.ok and not failing:  # spread thin over the parameters: all of them are the evidence
                failing = sorted(params, key=lambda p: -p.judged_rel_fro_err / max(p.tolerance_rel_fro, 1e-300))
            apart = self._ranks_apart(info)
            if not failing and apart:  # rank 0's gradient is right, another rank's is not: the same evidence
                failing = [p for p in params if p.parameter in apart]
            if failing and self.verdict.first_divergence is None:
                model_floor = eq.rel_fro(eq.flat(floor, self.names), eq.flat(oracle, self.names))
                evidence = GradientEvidence(
                    step=step, grads=grads, oracle_grads=floor, tolerance=classic_tolerance(
                        params, model_floor, self.depth, self.cfg.dtype, self.world_size, self.u_wire),
                    oracle=self.oracle, state=state, batch=batch, world_size=self.world_size,
                    grad_accum=self.cfg.grad_accum, shard_digests=[i["shard"] for i in info],
                    has_batchnorm=self.has_batchnorm, sync_bn=self.cfg.sync_bn, compression=self.wire,
                    dtype=self.cfg.dtype, layout=self.layout, per_replica=self.forwards.per_replica, masks=forward_masks,
                    previous=self.previous, loss_scale=loss_scale if scaler is not None else None,
                    judged_tolerance={p.parameter: p.tolerance_rel_fro for p in params},
                    missing=frozenset(n for n in self.names if reduced.get(n) is None and n not in none),
                    rank_norms=[i.get("grad_norms") or {} for i in info] if apart else None,
                    redrawn={name: f"rank {rank}: {how}" for rank, r in reversed(list(enumerate(records or [])))
                             for name, how in r.redrawn.items()})
                found = diagnose_gradient(evidence, [p.parameter for p in failing])
                first = next((p for p in failing if not p.ok), failing[0])
                self.verdict.diverge(eq.Divergence(
                    step, first.parameter, first.judged_rel_fro_err, first.tolerance_rel_fro, first.noise_ratio,
                    reason_of(found), check="gradient", cause=found[0].cause, parameters=[p.parameter for p in failing]))
            if failure is not None:  # after the gradient's: of two failed checks at one step, the gradient comes first
                self.verdict.diverge(failure)
            if self.cfg.dump_grads:
                for kind, g in (("reduced", grads), ("oracle", oracle), ("floor", floor)):
                    for n, t in g.items():
                        self.dumps[f"{step}/{kind}/{n}"] = t.numpy()
            self.previous = (step, grads)
            self.pending = pending

    def _ranks_apart(self, info: list[dict]) -> list[str]:
        """The parameters whose reduced gradient differs between ranks (by digest): every backend hands every rank the
        same reduced gradient."""
        per_rank = [i["grads"] for i in info]
        return [n for k, n in enumerate(self.all_names) if n in self.names
                and any(d[k] != per_rank[0][k] for d in per_rank[1:])]

    def _floor_name(self) -> str:
        return f"{self.cfg.amp} {self.recipe.kind}" if self.recipe.active else self.cfg.dtype

    def _mask_failure(self, step: int, exc: mk.MaskMismatch) -> None:
        self._unverifiable(f"the random numbers drawn in {exc.module or 'the model itself'} could not be replayed at "
                           f"step {step} ({exc.reason}): the oracle would measure randomness, not rounding; rerun with "
                           "--no-dropout")
        self.verdict.stochastic["captured"] = False
        self.verdict.stochastic["reason"] = f"{exc.module}: {exc}"

    def _record_unused(self, info: list[dict]) -> None:
        forms = self.verdict.parameters["unused_grad"]
        for name in self.facts.unused:
            seen = {i["unused"].get(name, "none") for i in info}
            forms[name] = seen.pop() if len(seen) == 1 else "mixed"

    def check_grad_norm(self, step: int, reported: float | None) -> None:
        """After the optimizer step, under --clip-grad-norm: the total norm the backend reported clipping by."""
        if self.grad_norms is not None and not self.stopped:
            self.grad_norms.judge(step, reported)

    def check_update(self, step: int, masters: dict[str, torch.Tensor]) -> None:
        """After the optimizer step, with the values it stepped as every rank read them (`Adapter.master_params()`):
        the update check of a step whose gradient was checked, or, where the loss scale overflowed, the skip."""
        self.masters = masters
        pending, self.pending = self.pending, None
        if pending is None or pending.step != step or self.stopped:
            self.updates.forget()
            return
        if pending.scale is not None and self.loss_scale.judge(pending, self.masters):
            return
        state = pending.backend_state
        if state is None:
            self._unverifiable(f"the update check at step {step} cannot know the optimizer state: the backend's "
                               "optimizer_state() gave none (no torch optimizer holding the model's parameters was "
                               "found behind the backend's optimizer)")
            return
        expected = self.updates.expected_before(step, pending)
        # A parameter a single process gives no gradient is not stepped there: the reference replays it with none.
        single = {n: (None if n in pending.none else g) for n, g in pending.grads.items()}
        with stochastic.isolated(self.device):
            ref = self.updates.judge(step, pending, state, expected, single, self.masters)
            self._judge_power(step)
            self.updates.advance(step, pending, state, single, ref)

    def finish(self) -> None:
        """After the last step: `equivalent` needs at least one step whose gradient was compared. A run whose every
        checked step overflowed its loss scale (and was rightly skipped) compared none: the trajectory alone, which
        saw no update, cannot stand for the verdict."""
        self.verdict.oracle_precision = float64_paths.report(self.oracle.model64, self.trajectory.model64)
        if self.verdict.checks or self.stopped or not self.cfg.check_every:
            return
        skipped = self.verdict.precision.skipped_steps if self.verdict.precision is not None else []
        self.verdict.unverifiable.append(
            f"every checked step's scaled gradients overflowed and the step was skipped (steps "
            f"{', '.join(map(str, skipped))}), so no gradient or update was compared: run more --steps (the loss "
            "scaler halves the scale at each overflow) or start from a smaller --loss-scale" if skipped else
            "no checked step compared a gradient: run more --steps")

    def _judge_power(self, step: int) -> None:
        """`equivalent` needs power: a checked step whose gradient or update check would not catch a REQUIRED_POWER
        change of its quantity makes the verdict `unverifiable`, naming why (recorded once; the checks go on)."""
        check = self.verdict.checks[-1]
        grad, update = check.min_detectable_rel, check.update.min_detectable_rel if check.update else 0.0
        if max(grad, update) <= REQUIRED_POWER or any("cannot catch" in u for u in self.verdict.unverifiable):
            return
        causes = []
        if grad > REQUIRED_POWER:
            worst = max((p for p in check.params), key=lambda p: p.judged_floor_rel_fro)
            causes.append(f"the gradient check detects only a {grad:.3g} change: at {self._floor_name()} the reference "
                          f"regrouped differs from itself by {check.judged_floor:.3g} ({worst.parameter}){self._tf32_cause()}"
                          "; a larger per-rank batch (BatchNorm over few samples amplifies rounding), float32 without "
                          "--amp, or --dtype float64 gives the check power")
        if update > REQUIRED_POWER:
            causes.append(f"the update check detects only a {update:.3g} change: the update is below what "
                          f"{self.cfg.dtype} storage of the weights resolves (its floor {check.update.floor:.3g}); a "
                          "larger --lr or --dtype float64 gives it power")
        self.verdict.unverifiable.append(f"at step {step} the checks cannot catch a {REQUIRED_POWER:.0%} change of the "
                                         f"gradient or the update: {'; '.join(causes)}")

    def _tf32_cause(self) -> str:
        tf32 = self.verdict.precision.tf32 if self.verdict.precision is not None else None
        if tf32 and (tf32.get("checked_matmul_allow_tf32") or tf32.get("checked_cudnn_allow_tf32")):
            return " (TF32 convolutions and matmuls: float32 inputs rounded to 10 mantissa bits)"
        return ""

    def trajectory_step(self, step: int, batch, records: list[mk.MaskRecord] | None,
                        masters: dict[str, torch.Tensor]) -> None:
        self.masters = masters
        if self.stopped:
            return
        steps = self.verdict.precision.steps
        scale_step = steps[-1] if steps and steps[-1].step == step else None
        before = self._scaler_before if self._scaler_before is not None and self._scaler_before[0] == step else None
        # the scale this step's backward used, read before the step (the scaler may have changed it since)
        loss_scale = before[1].scale if before is not None else 1.0
        after = self.backend.scaler_state()
        if after is not None:
            self.verdict.precision.skipped_total = after.skipped_steps
        if scale_step is not None:  # a checked step: skipped where the recipe overflows (the backend is judged on it)
            skip = scale_step.predicted_overflow
        else:  # an unchecked step: as the backend took it
            skip = before is not None and after is not None and after.skipped_steps > before[1].skipped_steps
        try:
            pieces = self.forwards.pieces(batch, records)
            with stochastic.isolated(self.device):
                self.trajectory.step(pieces, loss_scale, skip=skip)
        except mk.MaskMismatch as exc:
            self._mask_failure(step, exc)
            return
        entry = self.trajectory.judge(step, {n: t for n, t in self.masters.items()}, self.world_size)
        self.trajectory.follow(self.masters, self.unchecked)
        self.verdict.drift.append(entry)
        if (carried := self.trajectory.carried_divergence(step, self.masters)) is not None:
            self.verdict.diverge(carried)
        if entry["ok"] is False:
            self.verdict.diverge(eq.Divergence(
                step, entry["worst_parameter"], entry["rel_param_distance"], entry["tolerance"], entry["noise_ratio"],
                f"the parameters after step {step} are {entry['rel_param_distance']:.2e} from the float64 reference "
                f"trajectory, {entry['noise_ratio']:.3g}x the drift of a {self.cfg.dtype} single process "
                f"({entry['floor_rel_param_distance']:.2e}): the weights changed in a way the checked gradients and "
                "updates do not account for (an unchecked step, see --check-every, or a change between steps)",
                check="trajectory", cause="trajectory"))
