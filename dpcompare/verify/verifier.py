"""The verification phase on rank 0: three checks per step and the verdict they add up to.

Owns: the model probe before wrapping (unused, frozen and random parts of the model), and for every step of
the verification phase
  - the gradient check: the reduced gradient against the float64 oracle of the global-batch loss, in
    multiples of the run dtype's own noise floor (dpcompare.verify.equivalence);
  - the update check: the parameter update against a plain optimizer step taken in float64 from the same
    parameters, the expected optimizer state and the oracle gradient (dpcompare.verify.update_check);
  - the trajectory: the parameters after the step against a float64 single process trained beside the
    run (dpcompare.verify.trajectory);
  - the ranks' generators, when the forward draws random numbers: each rank must draw its own;
  - the module buffers (BatchNorm running statistics and any other): across ranks, and against what the
    oracle's forwards predict under each known semantics (dpcompare.verify.buffers).
The oracle computes what data parallelism computes: the global batch in one forward, or, where the model
couples the samples of a batch (BatchNorm without --sync-bn), each replica's own forwards as the backend
split them, its distance from the global batch stated as a note. Dropout masks are the ones the ranks drew,
captured during their forward (dpcompare.verify.masks), never redrawn.
A failed check is diagnosed (dpcompare.verify.diagnosis); a part that cannot be checked is recorded as such and
the verdict says `unverifiable` with the reason, never `equivalent`. Everything here runs on generators
forked from the run's, so checking never changes the random numbers the run draws. Imports no adapter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from dpcompare.verify import equivalence as eq
from dpcompare.verify import masks as mk
from dpcompare.verify import stochastic
from dpcompare.contract import Adapter, ModelFacts, Wrapped
from dpcompare.verify.buffers import BufferCheck
from dpcompare.verify.diagnosis import (GradientEvidence, UpdateEvidence, diagnose_gradient, diagnose_update, reason_of,
                                        state_difference, step_count_mismatch, FRESH_STEPPED_TRAP)
from dpcompare.verify.tolerance import REQUIRED_POWER, classic_tolerance
from dpcompare.verify.stochastic import RngState
from dpcompare.verify.trajectory import Trajectory
from dpcompare.verify.precision import PrecisionReport, Recipe, ScaleStep
from dpcompare.contract.optim_state import OptimizerFactory, OptState, read_hparams
from dpcompare.verify.update_check import reference_step

SPLIT_AGREEMENT = 1e-9
STUCK_SKIPS = 3
"""Consecutive steps skipped on overflow at one unchanged loss scale that make a stuck scaler: a dynamic scaler lowers
its scale at every overflow (GradScaler) or at every second one (DeepSpeed's, hysteresis 2); one that never does skips
every step from there on."""
"""The ranks' split and the global batch, both in float64, agree to about 1e-15 where the loss is a mean over
independent samples; a loss that is not (a sum) puts them a factor apart."""

STOCHASTIC_REL_DIFF = 2.0**-30
"""Two float64 forwards of the same input that differ by more than this (relative) draw random numbers:
some 10^6 float64 roundings, far below what one changed dropout mask element does (~1e-3)."""


def probe(template: nn.Module, loss_fn: Callable, batch: tuple[torch.Tensor, torch.Tensor], device: torch.device) -> ModelFacts:
    """One float64 forward/backward of the first global batch (which parameters get no gradient), a second
    forward of the same input (does the forward draw random numbers?) and, when it does, whether capturing
    the dropout modules' masks accounts for all of it (which module draws where no mask can be captured)."""
    model = eq.verification_copy(template, device, torch.float64).train()
    x, y = batch
    x = x.to(device)
    x = x.double() if x.is_floating_point() else x
    with stochastic.isolated(device):
        first = model(x)
        with torch.no_grad():
            second = model(x)
        loss_fn(first, y.to(device)).backward()
    diff = float(torch.linalg.vector_norm((first.detach() - second).double()))
    norm = float(torch.linalg.vector_norm(first.detach().double()))
    named = list(model.named_parameters())
    drawn = diff > STOCHASTIC_REL_DIFF * max(norm, 1e-300)
    uncaptured = None
    if drawn:
        with stochastic.isolated(device):
            uncaptured = mk.uncaptured(eq.verification_copy(template, device, torch.float64), x)
    return ModelFacts(
        unused=tuple(n for n, p in named if p.requires_grad and p.grad is None),
        frozen=tuple(n for n, p in named if not p.requires_grad),
        random_modules=tuple(stochastic.random_modules(template)),
        stochastic=drawn,
        uncaptured=uncaptured,
    )


@dataclass(slots=True)
class Reads:
    """What every rank read from the backend at a checked step, after the reduce and before the optimizer step
    (`Adapter.reduced_grads()`, `master_params()`, `optimizer_state()`: full values, assembled from the ranks'
    parts where the backend shards them); rank 0's verifier judges them."""

    grads: dict[str, torch.Tensor | None]
    masters: dict[str, torch.Tensor]
    state: OptState | None


@dataclass(slots=True)
class _Pending:
    """What the update check of a step needs from before the optimizer step."""

    step: int
    params: eq.Grads
    grads: dict[str, torch.Tensor | None]
    """The backend's reduced gradient (None where it left none), float64 on the CPU."""
    none: frozenset[str]
    """The parameters a single process gives no gradient (not in the loss)."""
    backend_state: OptState | None
    backend_hparams: list[dict[str, Any]]
    scale: ScaleStep | None = None
    """The loss scaler at this step (None: the loss is not scaled)."""
    skipped_before: int = 0
    """The backend's count of skipped steps before this step's optimizer step."""


class Verifier:
    def __init__(self, *, cfg, world_size: int, template: nn.Module, loss_fn: Callable, facts: ModelFacts,
                 wrapped: Wrapped, device: torch.device, factory: OptimizerFactory, layout: eq.Layout,
                 replay_reason: str | None, backend: Adapter) -> None:
        self.cfg, self.world_size, self.device, self.factory = cfg, world_size, device, factory
        self.template, self.facts, self.wrapped = template, facts, wrapped
        self.layout = layout
        self.batchnorms = [n for n, m in template.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        self.has_batchnorm = bool(self.batchnorms)
        self.per_replica = self.has_batchnorm and not cfg.sync_bn and layout.splits_the_batch
        """BatchNorm without --sync-bn: the oracle runs each replica's forwards, as the backend does."""
        self.dtype = eq.DTYPES[cfg.dtype]
        self.depth = eq.depth_of(template)
        self.backend = backend
        self.recipe = Recipe(backend.amp_recipe(), cfg.amp, device.type)
        self.wire = backend.gradient_wire()
        """The gradients' dtype on the wire: --compression, or what the backend's precision recipe sends."""
        self.oracle = eq.Oracle(template, loss_fn, cfg.dtype, device, self.recipe)
        self.names = self.oracle.names
        self.u_wire = eq.wire_roundoff(cfg.dtype, self.wire)
        self.trajectory = Trajectory(template, loss_fn, factory, cfg.dtype, device, self.depth, self.u_wire, self.recipe,
                                     prestep=backend.optimizer_prestep() is not None)
        self.buffers = BufferCheck(self.oracle, self.depth, cfg.dtype)
        self.verdict = eq.Verdict(notes=list(wrapped.notes))
        scaler = backend.scaler_state()
        self.verdict.precision = PrecisionReport(cfg.amp, self.recipe.kind, self.recipe.describe(), self.wire,
                                                 scaler.method if scaler else None, scaler.scale if scaler else None)
        self.optimizer = backend.optimizer_view()[0]  # its hyper-parameters; its state comes with each step's Reads
        self.masters: dict[str, torch.Tensor] = {}
        """The values the optimizer steps, full, as last read on every rank (`Adapter.master_params()`)."""
        self.all_names = [n for n, _ in template.named_parameters()]
        """Every parameter, trainable or not, in the order the ranks' digests list them."""
        if self.recipe.active:
            scaled = (f"; the loss is scaled ({scaler.method}, {scaler.scale:.9g} at the start) and the floor is taken "
                      "at each step's scale, where its overflow predicts the steps the backend must skip"
                      if scaler is not None else "")
            self.verdict.note("mixed_precision",
                              f"--amp {cfg.amp}, {self.recipe.kind} recipe: {self.recipe.describe()}; the noise floor "
                              f"is this recipe's, recomputed rank by rank from the parameters the optimizer holds"
                              f"{scaled}")
        self.prestep = backend.optimizer_prestep()
        """What the backend's recipe does to its optimizer before the first step by design (None: nothing)."""
        self.expected_state: OptState | None = {}  # a fresh optimizer's (after the declared pre-step, at step 0)
        self.expected_from = ("a fresh optimizer's" if self.prestep is None else
                              "a fresh optimizer's after one step on zero gradients")
        self.pending: _Pending | None = None
        self._scaler_before = None
        self._unpacked: tuple[list[mk.MaskRecord], list[eq.Masks]] | None = None
        """The last step's records and their unpacked masks."""
        self._split_global: bool | None = None
        self._stuck: tuple[float, int] = (math.nan, 0)
        """The loss scale of the last skipped steps and how many in a row were skipped at it."""
        """The ranks' split computes the global batch's gradient (None: not yet measured)."""
        self.previous: tuple[int, eq.Grads] | None = None
        self.stopped = False
        """No further check: the run diverged, or its randomness cannot be captured."""
        self.dumps: dict[str, np.ndarray] = {}

        self.verdict.parameters = {"unused": list(facts.unused), "frozen": list(facts.frozen), "unused_grad": {}}
        if facts.frozen:
            self.verdict.note("frozen_parameters", f"frozen parameters (requires_grad=False) left out of every check: "
                                      f"{', '.join(facts.frozen)}")
        if facts.unused:
            self.verdict.note("unused_parameters", f"parameters that take no part in the loss: {', '.join(facts.unused)}; their "
                                      "gradient must be None or zero on every rank")
        self._probe_randomness(replay_reason)
        if self.optimizer is None and getattr(backend.capabilities, "shards", "none") == "none":
            self.verdict.note("optimizer_state_unreadable", "no torch optimizer holding the model's parameters was found behind the "
                                      "backend's optimizer: its state cannot be read")

    # -- before the first step -------------------------------------------------------------------
    def _probe_randomness(self, replay_reason: str | None) -> None:
        facts = self.facts
        modules = ", ".join(facts.random_modules) or "an operation in forward"
        self.verdict.stochastic = {"stochastic": facts.stochastic, "modules": list(facts.random_modules),
                                   "captured": False, "reason": None, "capture_bytes_per_step": None}
        if not facts.stochastic:
            return
        blockers = []
        if facts.uncaptured:
            blockers.append(f"{facts.uncaptured} draws random numbers where no mask can be captured (dropout inside a "
                            "functional call or a fused kernel, such as scaled_dot_product_attention's dropout_p, or a "
                            "random operation other than dropout)")
        if replay_reason:
            blockers.append(replay_reason)
        if blockers:
            self._unverifiable(f"the forward draws random numbers ({modules}) and {'; '.join(blockers)}: comparing "
                               "against an oracle that draws its own would measure randomness, not rounding; rerun "
                               "with --no-dropout to check the computation deterministically")
            self.verdict.stochastic["reason"] = "; ".join(blockers)
            return
        self.verdict.stochastic["captured"] = True
        self.verdict.note("masks_captured", f"the forward draws random numbers ({modules}): each rank's dropout masks are "
                                  "captured during its forward and applied in the oracle, the floor and the reference "
                                  "trajectory")

    def _unverifiable(self, reason: str) -> None:
        self.verdict.unverifiable.append(reason)
        self.stopped = True

    def check_initial(self, params: dict[str, torch.Tensor]) -> None:
        """Rank 0's weights before step 0 (full, `Adapter.full_params()`) are the workload's initial weights (the
        ranks agreeing with each other is checked separately, by fingerprint)."""
        built = dict(self.template.named_parameters())
        for name, p in params.items():
            want = built[name].detach().to(dtype=p.dtype)
            have = p.detach().cpu()
            if not torch.equal(have, want):
                change = eq.rel_fro(have.double(), want.double())
                self.verdict.initial_weights_identical = False
                self.verdict.diverge(eq.Divergence(
                    0, name, change, 0.0, math.nan,
                    f"the weights before step 0 are not the workload's initial weights ({name} moved by {change:.2e} "
                    "relative): something changed them after the model was built, such as an optimizer step while "
                    "wrapping (Horovod's broadcast_optimizer_state on a fresh optimizer runs step() on zero gradients, "
                    "horovod/horovod#3743) or a checkpoint load", check="initial", cause="initial_weights",
                    parameters=[name]))
                return

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

    def _pieces(self, batch, records: list[mk.MaskRecord] | None) -> list[eq.Piece]:
        """The forwards the oracle runs for this step (see the module docstring); raises MaskMismatch when the
        captured masks do not fit them."""
        n = batch[0].shape[0]
        masks = self._forward_masks(n, records) if records is not None else None
        if self.per_replica or (masks is not None and not self.has_batchnorm):
            return eq.replica_pieces(batch, self.layout, masks)
        if masks is None:
            return eq.global_pieces(batch)
        return eq.global_pieces(batch, mk.combine(masks, [p[3] for p in self.layout.positions(n)], n))

    def _forward_masks(self, batch_size: int, records: list[mk.MaskRecord]) -> list[eq.Masks]:
        """Each forward's masks, in the order of `layout.positions`: a rank's masks split by micro-batch. Unpacked
        once per step: the gradient check, the buffers and the trajectory of a step share them."""
        cached = self._unpacked
        if cached is not None and len(cached[0]) == len(records) and all(a is b for a, b in zip(cached[0], records)):
            return cached[1]
        out = self._split_masks(batch_size, records)
        self._unpacked = (list(records), out)
        return out

    def _split_masks(self, batch_size: int, records: list[mk.MaskRecord]) -> list[eq.Masks]:
        for record in records:
            for name, why in record.problems.items():
                raise mk.MaskMismatch(name, why)
        k = self.layout.grad_accum
        calls: dict[tuple[int, int], dict[str, list[torch.Tensor]]] = {}
        out = []
        for rank, micro, replica, _ in self.layout.positions(batch_size):
            key = (rank, replica)
            if key not in calls:
                calls[key] = records[rank].calls(replica if self.layout.replicas > 1 else None)
            forward = {}
            for name, masks in calls[key].items():
                if len(masks) % k:
                    raise mk.MaskMismatch(name, f"{len(masks)} masks were captured over {k} micro-batches")
                c = len(masks) // k
                forward[name] = masks[micro * c:(micro + 1) * c]
            out.append(forward)
        return out

    def _note_per_replica(self, step: int, state: dict, batch, oracle: eq.Grads, floor: eq.Grads,
                          pieces: list[eq.Piece]) -> None:
        """The distance between the per-replica gradient the run is judged against and the single-process
        global-batch gradient, measured once (the first checked step), in floors of the gradient check."""
        if not self.per_replica or self.verdict.batchnorm is not None:
            return
        n = batch[0].shape[0]
        whole, none = None, self.oracle.none
        try:
            masks = (mk.combine([p.masks or {} for p in pieces], [p[3] for p in self.layout.positions(n)], n)
                     if self.facts.stochastic else None)
            whole = self.oracle.oracle_of(state, eq.global_pieces(batch, masks))
        except mk.MaskMismatch:
            pass  # masks that are not batch-first cannot be joined: the distance stays unmeasured, and says so
        self.oracle.none = none  # the judged oracle's
        names = self.names
        floor_rel = max(eq.rel_fro(eq.flat(floor, names), eq.flat(oracle, names)), self.depth * eq.UNIT_ROUNDOFF[self.cfg.dtype])
        distance = eq.rel_fro(eq.flat(whole, names), eq.flat(oracle, names)) if whole is not None else None
        ws, k, r = self.layout.world_size, self.layout.grad_accum, self.layout.replicas
        forwards = ws * k * r
        local = n // forwards
        shown = ", ".join(self.batchnorms[:4]) + (f" and {len(self.batchnorms) - 4} more" if len(self.batchnorms) > 4 else "")
        split = " x ".join([f"{ws} rank(s)"] + ([f"{k} micro-batches"] if k > 1 else []) +
                           ([f"{r} device replicas"] if r > 1 else []))
        measured = (f"at step {step} that gradient is {distance:.3g} (relative) from the single-process global-batch "
                    f"gradient, {distance / floor_rel:.3g}x the {self.cfg.dtype} noise floor" if distance is not None else
                    "its distance from the global-batch gradient was not measured (the captured masks are not batch-first)")
        self.verdict.batchnorm = {"semantics": "per_replica", "modules": list(self.batchnorms), "local_batch": local,
                                  "forwards": forwards, "step": step, "distance_rel_fro": distance,
                                  "floors": distance / floor_rel if distance is not None else None}
        self.verdict.note("per_replica_batchnorm",
                          f"BatchNorm without --sync-bn ({len(self.batchnorms)} module(s): {shown}): each of the {split} "
                          f"normalises its own {local} samples, so the run computes the mean of those forwards' losses, "
                          f"and the oracle computes exactly that; {measured}; --sync-bn makes it one computation")

    def _floor_pieces(self, batch, pieces: list[eq.Piece], forward_masks: list[eq.Masks] | None) -> list[eq.Piece]:
        """The forwards of the run-precision reference: each rank's own (as its loss scale and its rounding act rank
        by rank, and as each rank's shard sums into the reduction), except with global BatchNorm, one forward."""
        if (self.has_batchnorm and self.cfg.sync_bn) or len(pieces) > 1 or not self.layout.splits_the_batch:
            return pieces
        return eq.replica_pieces(batch, self.layout, forward_masks)

    def _split_is_global(self, state: dict, split: list[eq.Piece], oracle: eq.Grads) -> bool:
        """Whether the ranks' split of the batch computes the global batch's gradient (in float64, once, at the first
        checked step): the run-precision reference splits the batch as the ranks do, which is the same function only
        where the loss is a mean over independent samples, as the workload contract says. Where it is not (a loss
        reduced with sum), the reference is the global batch, as the oracle is, and the run's split is judged
        against it."""
        if self._split_global is None:
            names = self.names
            gap = eq.rel_fro(eq.flat(self.oracle.oracle_of(state, split), names), eq.flat(oracle, names))
            self._split_global = gap <= SPLIT_AGREEMENT
            if not self._split_global:
                self.verdict.note("split_not_global",
                                  f"the ranks' split of the global batch does not compute its gradient on this workload: "
                                  f"in float64 the two are {gap:.3g} apart (a loss that is not a mean over its samples, "
                                  "or samples that interact); the run-precision reference is the global batch, as the "
                                  "oracle is")
        return self._split_global

    def _spread_pieces(self, pieces: list[eq.Piece]) -> list[eq.Piece]:
        """The same function grouped the way data parallelism may legitimately group it differently, for the floor of
        what it alone changes: the ranks' forwards summed in reverse order (a recomputation too: a nondeterministic
        kernel shows here); where one forward stands for several ranks' samples (global BatchNorm under --sync-bn) its
        samples in the order the ranks hold them, so the statistics are reduced in another order. A rank's own forward
        is never regrouped: every backend runs it as it is, and in a chaotic regime (BatchNorm over a few samples at
        bf16) a regrouped forward would measure that chaos, not data parallelism."""
        if len(pieces) != 1 or not self.layout.splits_the_batch:
            return list(reversed(pieces))
        p = pieces[0]
        n = p.x.shape[0]
        order = torch.cat([idx for *_, idx in self.layout.positions(n)])
        if p.masks is not None and any(m.dim() == 0 or m.shape[0] != n for ms in p.masks.values() for m in ms):
            return [p]
        masks = {k: [m[order] for m in ms] for k, ms in p.masks.items()} if p.masks is not None else None
        return [eq.Piece(p.x[order], p.y[order], p.weight, masks, p.rank)]

    def _emulated_wire(self, pieces: list[eq.Piece]) -> torch.dtype | None:
        """The wire dtype the run-precision reference sends the ranks' shares through: the declared one
        (--compression, or the backend's recipe) where it is narrower than the run dtype and every rank's share is a
        piece of its own; None: the reduction's rounding is bounded (world_size x its unit roundoff) instead."""
        name = eq.WIRE_DTYPE[self.wire]
        if name is None or eq.UNIT_ROUNDOFF[name] <= eq.UNIT_ROUNDOFF[self.cfg.dtype]:
            return None
        return getattr(torch, name) if len({p.rank for p in pieces}) == self.world_size else None

    def _wire_loses(self, sent: eq.Grads, unsent: eq.Grads) -> bool:
        """Whether the declared wire changes the reference beyond its rounding (world_size x its unit roundoff, times
        the factor) anywhere: gradients below its smallest subnormal flushed to zero, or above its range."""
        u = eq.UNIT_ROUNDOFF[eq.WIRE_DTYPE[self.wire]]
        names = [n for n in self.names if n in sent]
        share = float(torch.linalg.vector_norm(eq.flat(unsent, names))) / max(len(names), 1) ** 0.5
        return any(not bool(torch.isfinite(sent[n]).all())
                   or eq.rel_fro(sent[n], unsent[n], share) > eq.TOLERANCE_FACTOR * self.world_size * u for n in names)

    def _run_state(self, module: nn.Module, before: dict) -> dict:
        """The state the step's forward ran from: the parameters the optimizer holds (fp32 master values where the
        backend keeps them apart) and the module buffers as they were before the forward."""
        state = {k: v.detach().clone() for k, v in module.state_dict().items()}
        for name, t in self.masters.items():
            if name in state:
                state[name] = t.detach().clone()
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
            pieces = self._pieces(batch, records)
            forward_masks = self._forward_masks(n, records) if records is not None else None
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
                oracle = self.oracle.oracle_of(state, pieces)
                none = self.oracle.none
                run_pieces = self._floor_pieces(batch, pieces, forward_masks)
                if run_pieces is not pieces and not self._split_is_global(state, run_pieces, oracle):
                    run_pieces = pieces
                self.oracle.none = none
                wire = self._emulated_wire(run_pieces)
                if wire is None:
                    floor = self.oracle.floor_of(state, run_pieces, loss_scale)
                    spread = self.oracle.floor_of(state, self._spread_pieces(run_pieces), loss_scale)
                else:  # the wire's rounding is measured, not bounded: the reduction's allowance is the run dtype's
                    unsent: eq.Grads = {}
                    floor = self.oracle.wire_floor_of(state, run_pieces, wire, loss_scale, unsent=unsent)
                    if self._wire_loses(floor, unsent):
                        # Beyond rounding (gradients flushed to zero or overflowed on it): judged against the
                        # reference without the wire, with its rounding bounded, so what it lost shows.
                        wire = None
                        floor = self.oracle.floor_of(state, run_pieces, loss_scale)
                        spread = self.oracle.floor_of(state, self._spread_pieces(run_pieces), loss_scale)
                    else:
                        self.verdict.wire_rounding = "measured"
                        spread = self.oracle.wire_floor_of(state, run_pieces, wire, loss_scale, regrouped=True)
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
            pending = _Pending(
                step, {n: self.masters[n].detach().double().cpu().clone() for n in self.names},
                {n: (None if reduced.get(n) is None else grads[n]) for n in self.names}, none,
                backend_state, read_hparams(self.optimizer) if self.optimizer is not None else [],
                scale_step, scaler.skipped_steps if scaler is not None else 0)
            if overflow:
                self._expect_skip(scale_step, pending)
                if failure is not None:
                    self.verdict.diverge(failure)
                return
            self._note_per_replica(step, state, batch, oracle, floor, pieces)
            params, model = eq.compare(grads, oracle, floor, dtype=self.cfg.dtype, world_size=self.world_size,
                                       depth=self.depth, u_sum=self.u_wire if wire is None else None,
                                       names=self.names, spread=spread)
            digests = eq.first_mismatch([i["grads"] for i in info], self.all_names)
            check = eq.StepCheck(step, params, True, digests is None, model=model)
            self.verdict.checks.append(check)
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
                    dtype=self.cfg.dtype, layout=self.layout, per_replica=self.per_replica, masks=forward_masks,
                    previous=self.previous, loss_scale=loss_scale if scaler is not None else None,
                    judged_tolerance={p.parameter: p.tolerance_rel_fro for p in params},
                    missing=frozenset(n for n in self.names if reduced.get(n) is None and n not in none),
                    rank_norms=[i.get("grad_norms") or {} for i in info] if apart else None)
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

    def _expect_skip(self, scale_step: ScaleStep, pending: _Pending) -> None:
        """The recipe overflows at this step's loss scale in the oracle's emulation of the ranks: the backend's
        reduced gradient must hold inf or NaN too, and its optimizer step must be skipped (checked after it)."""
        self.pending = pending
        if scale_step.reduced_non_finite:
            return
        scale_step.ok = False
        scale_step.reason = (f"at step {scale_step.step} the ranks' {self.cfg.amp} gradients overflow at loss scale "
                             f"{scale_step.scale:.9g} (the oracle's rank-by-rank emulation of the recipe holds inf or "
                             "NaN), but the backend's reduced gradient is finite: the backend does not scale the loss "
                             "as its recipe says, or reduces before the scaled gradients are formed, so it will not "
                             "skip the steps the other backends skip")
        self.verdict.diverge(eq.Divergence(scale_step.step, "(loss scale)", math.nan, 0.0, math.nan, scale_step.reason,
                                           check="loss_scale", cause="overflow_not_seen"))

    def _mask_failure(self, step: int, exc: mk.MaskMismatch) -> None:
        self._unverifiable(f"the dropout masks of {exc.module} could not be captured at step {step} ({exc}): the "
                           "oracle would measure randomness, not rounding; rerun with --no-dropout")
        self.verdict.stochastic["captured"] = False
        self.verdict.stochastic["reason"] = f"{exc.module}: {exc}"

    def _record_unused(self, info: list[dict]) -> None:
        forms = self.verdict.parameters["unused_grad"]
        for name in self.facts.unused:
            seen = {i["unused"].get(name, "none") for i in info}
            forms[name] = seen.pop() if len(seen) == 1 else "mixed"

    def check_update(self, step: int, masters: dict[str, torch.Tensor]) -> None:
        """After the optimizer step, with the values it stepped as every rank read them (`Adapter.master_params()`):
        the update check of a step whose gradient was checked, or, where the loss scale overflowed, the skip."""
        self.masters = masters
        pending, self.pending = self.pending, None
        if pending is None or pending.step != step or self.stopped:
            self.expected_state = None  # an unchecked step: the next step's state cannot be predicted
            return
        if pending.scale is not None and self._judge_scaler(pending):
            return
        state = pending.backend_state
        if state is None:
            self._unverifiable(f"the update check at step {step} cannot know the optimizer state: the backend's "
                               "optimizer_state() gave none (no torch optimizer holding the model's parameters was "
                               "found behind the backend's optimizer)")
            return
        expected = self.expected_state
        if step == 0 and self.prestep is not None and expected == {}:
            zeros = {n: torch.zeros_like(t) for n, t in pending.params.items()}
            expected = reference_step(self.factory, pending.params, zeros, {}, torch.float64, self.device).state
        # A parameter a single process gives no gradient is not stepped there: the reference replays it with none.
        single = {n: (None if n in pending.none else g) for n, g in pending.grads.items()}
        with stochastic.isolated(self.device):
            after = {n: self.masters[n].detach().double().cpu() for n in self.names}
            delta = {n: after[n] - pending.params[n] for n in self.names}
            ref = reference_step(self.factory, pending.params, single, state, torch.float64, self.device)
            floor = reference_step(self.factory, pending.params, single, state, self.dtype, self.device)
            params, model = eq.compare(delta, ref.delta, floor.delta, dtype=self.cfg.dtype, world_size=1,
                                       depth=self.depth, names=self.names)
            ratios = {n: _ratio(delta[n], ref.delta[n]) for n in self.names}
            whole = _ratio(eq.flat(delta, self.names), eq.flat(ref.delta, self.names))
            self.verdict.checks[-1].update = eq.UpdateCheck(params, ratios, whole, model)
            failing = [p for p in params if not p.ok]
            if not model.ok and not failing:
                failing = list(params)
            # The state the step started from, against what the previous step left (a fresh optimizer's before step 0,
            # or the one the backend's recipe declares). A step count is a whole number: a wrong one is a fault
            # whatever the update's noise. An unused parameter the backend hands a zero gradient (ZeRO's flat
            # partitions step as a whole) counts steps a single process does not take.
            zero_stepped = [n for n in self.facts.unused if self.verdict.parameters["unused_grad"].get(n) == "zero"]
            self._note_unused_stepped(step, state, zero_stepped)
            judged_names = [n for n in self.names if n not in zero_stepped]
            if expected is not None and self.verdict.first_divergence is None:
                counted = step_count_mismatch(state, expected, judged_names)
                differs = counted or state_difference(state, expected, judged_names)
                if differs is not None:
                    wrong, text = differs
                    # What the state costs the update: the backend's update against the one the expected state gives.
                    had = eq.compare(delta, reference_step(self.factory, pending.params, single, expected, torch.float64,
                                                           self.device).delta,
                                     reference_step(self.factory, pending.params, single, expected, self.dtype,
                                                    self.device).delta,
                                     dtype=self.cfg.dtype, world_size=1, depth=self.depth, names=self.names)[0]
                    first = next(p for p in had if p.parameter == wrong[0])
                    self.verdict.diverge(eq.Divergence(
                        step, first.parameter, first.rel_fro_err, first.tolerance_rel_fro, first.noise_ratio,
                        f"the gradient passed but the update did not: the optimizer state before step {step} is not "
                        f"{self.expected_from}: {text}{FRESH_STEPPED_TRAP if step == 0 else ''}", check="update",
                        cause="optimizer_state", parameters=wrong))
            if step == 0 and self.prestep is not None and expected is not None:
                self._note_prestep(pending, single, delta)
            if failing and self.verdict.first_divergence is None:
                evidence = UpdateEvidence(
                    step=step, names=self.names, delta=delta, reference=ref.delta,
                    tolerance={p.parameter: p.tolerance_rel_fro for p in params}, params=pending.params,
                    grads=single, expected_state=state, backend_state=state,
                    factory=self.factory, device=self.device, world_size=self.world_size, lr=self.cfg.lr,
                    weight_decay=self.cfg.weight_decay, backend_hparams=pending.backend_hparams,
                    expected_from=self.expected_from, skipped=self._skipped_since(pending))
                found = diagnose_update(evidence, [p.parameter for p in failing])
                first = next((p for p in failing if not p.ok), failing[0])
                self.verdict.diverge(eq.Divergence(
                    step, first.parameter, first.rel_fro_err, first.tolerance_rel_fro, first.noise_ratio,
                    f"the gradient passed but the update did not: {reason_of(found)}", check="update",
                    cause=found[0].cause, parameters=[p.parameter for p in failing]))
            self._judge_power(step)
            # The next step's expected state: the one this step leaves, the optimizer replayed from the backend's own
            # state with the gradient it was handed (zeros included, where the backend gave zeros).
            leaves = ref if all((g is None) == (pending.grads[n] is None) for n, g in single.items()) else \
                reference_step(self.factory, pending.params, pending.grads, state, torch.float64, self.device)
            self.expected_state = leaves.state
            self.expected_from = f"the state step {step} left"

    def finish(self) -> None:
        """After the last step: `equivalent` needs at least one step whose gradient was compared. A run whose every
        checked step overflowed its loss scale (and was rightly skipped) compared none: the trajectory alone, which
        saw no update, cannot stand for the verdict."""
        if self.verdict.checks or self.stopped or not self.cfg.check_every:
            return
        skipped = self.verdict.precision.skipped_steps if self.verdict.precision is not None else []
        self.verdict.unverifiable.append(
            f"every checked step's scaled gradients overflowed and the step was skipped (steps "
            f"{', '.join(map(str, skipped))}), so no gradient or update was compared: run more --steps (the loss "
            "scaler halves the scale at each overflow) or start from a smaller --loss-scale" if skipped else
            "no checked step compared a gradient: run more --steps")

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

    def _note_prestep(self, pending: _Pending, single: dict[str, torch.Tensor | None], delta: eq.Grads) -> None:
        """The backend's recipe steps its optimizer on zero gradients before the first step, by design: its state
        before step 0 was held to that, and what it does to the first update is measured against a fresh optimizer's."""
        fresh = reference_step(self.factory, pending.params, single, {}, torch.float64, self.device).delta
        ratio = _ratio(eq.flat(delta, self.names), eq.flat(fresh, self.names))
        self.verdict.note("optimizer_prestep",
                          f"{self.prestep}: its optimizer state before step 0 is that step's, as expected, not a fresh "
                          f"optimizer's; the first update is {ratio:.4g}x a fresh optimizer's (||update|| ratio; with "
                          "Adam the bias correction runs one step ahead, with SGD a zero momentum buffer steps like none)")

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

    def _skipped_since(self, pending: _Pending) -> bool:
        scaler = self.backend.scaler_state()
        return scaler is not None and scaler.skipped_steps > pending.skipped_before

    def _judge_scaler(self, pending: _Pending) -> bool:
        """The loss scaler's side of a step: its scale afterwards and whether the backend skipped. A step the recipe
        overflows must be skipped (master weights unchanged to the bit); a finite one must not be. Returns True
        when the step was an overflow (nothing further to check)."""
        scale_step = pending.scale
        scaler = self.backend.scaler_state()
        skipped = self._skipped_since(pending)
        unchanged = all(torch.equal(self.masters[n].detach().double().cpu(), pending.params[n]) for n in self.names)
        scale_step.skipped = skipped and unchanged
        scale_step.scale_after = scaler.scale if scaler is not None else None
        if not scale_step.predicted_overflow:
            if scale_step.ok is None:
                scale_step.ok = not scale_step.skipped
            return False
        if scale_step.ok is False:  # the overflow was not seen: already recorded at the gradient check
            return True
        moved = [n for n in self.names if not torch.equal(self.masters[n].detach().double().cpu(), pending.params[n])]
        if scale_step.skipped:
            scale_step.ok = True
            # The state the next step starts from is the one this step found: a skipped step changes nothing.
            self._judge_backoff(pending.step, scale_step)
            return True
        scale_step.ok = False
        stepped = not skipped and moved
        scale_step.reason = (f"at step {pending.step} the scaled {self.cfg.amp} gradients overflowed (loss scale "
                             f"{scale_step.scale:.9g}; the reduced gradient holds inf or NaN) and the backend "
                             + (f"still stepped the optimizer: {len(moved)} parameter(s) moved, first {moved[0]}; a "
                                "loss scaler must skip a step whose unscaled gradients are not finite (GradScaler.step, "
                                "DeepSpeed's overflow check)" if stepped else
                                "did not count the step as skipped" + (f" and moved {moved[0]}" if moved else "")))
        self.verdict.diverge(eq.Divergence(pending.step, moved[0] if moved else "(loss scale)", math.inf, 0.0, math.inf,
                                           scale_step.reason, check="loss_scale",
                                           cause="stepped_on_overflow" if stepped else "skip_not_counted",
                                           parameters=moved))
        return True

    def _judge_backoff(self, step: int, scale_step: ScaleStep) -> None:
        """A scaler whose scale never comes down after overflows skips every step: `different` once STUCK_SKIPS steps
        in a row were skipped at one scale."""
        scale, count = self._stuck
        after = scale_step.scale_after if scale_step.scale_after is not None else scale_step.scale
        count = count + 1 if after == scale and scale_step.scale == scale else 1
        self._stuck = (after, count)
        if count < STUCK_SKIPS or self.verdict.first_divergence is not None:
            return
        reason = (f"steps {step - count + 1}-{step} all overflowed and were skipped at the same loss scale "
                  f"{after:.9g}: the scaler never lowers its scale after an overflow (a dynamic loss scaler backs off "
                  "at every overflow, or every second one with DeepSpeed's hysteresis), so every later step is "
                  "skipped too and the model never trains")
        scale_step.reason = reason
        self.verdict.diverge(eq.Divergence(step, "(loss scale)", math.inf, 0.0, math.inf, reason, check="loss_scale",
                                           cause="scale_never_lowered"))

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
            pieces = self._pieces(batch, records)
            with stochastic.isolated(self.device):
                self.trajectory.step(pieces, loss_scale, skip=skip)
        except mk.MaskMismatch as exc:
            self._mask_failure(step, exc)
            return
        entry = self.trajectory.judge(step, {n: t for n, t in self.masters.items()}, self.world_size)
        self.verdict.drift.append(entry)
        if entry["ok"] is False:
            self.verdict.diverge(eq.Divergence(
                step, entry["worst_parameter"], entry["rel_param_distance"], entry["tolerance"], entry["noise_ratio"],
                f"the parameters after step {step} are {entry['rel_param_distance']:.2e} from the float64 reference "
                f"trajectory, {entry['noise_ratio']:.3g}x the drift of a {self.cfg.dtype} single process "
                f"({entry['floor_rel_param_distance']:.2e}): the weights changed in a way the checked gradients and "
                "updates do not account for (an unchecked step, see --check-every, or a change between steps)",
                check="trajectory", cause="trajectory"))


def _ratio(a: torch.Tensor, b: torch.Tensor) -> float:
    nb = float(torch.linalg.vector_norm(b))
    na = float(torch.linalg.vector_norm(a))
    if nb == 0.0:
        return 1.0 if na == 0.0 else math.inf
    return na / nb
