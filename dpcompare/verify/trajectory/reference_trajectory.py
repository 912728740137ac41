"""The reference trajectory, judged: how far the run's parameters drift from a float64 single process.

Owns: two plain single-process copies of the model trained on rank 0 beside the run, from the run's initial
weights on the same global batches, split as the backend split them (and, for a model that draws random
numbers, with the masks the ranks drew): one in float64, one in the run dtype or the run's mixed-precision
recipe (autocast with the run's loss scale, or 16-bit weights from fp32 master weights), each clipping its gradient
by its global norm before its step under --clip-grad-norm. A step the run's loss scaler skipped is skipped by both;
the run-recipe copy also skips a step whose own scaled gradient overflows. After every step the backend's parameters
are measured
against the float64 copy, and that distance is judged in multiples of the run-dtype copy's distance to it,
the drift a correct single process in the run dtype already has at that step. Imports no adapter.

Tolerance (written here once): at step k (0-based, after k+1 updates)
    rel_param_distance <= factor * (max(floor_k, (k+1) * depth * u) + (k+1) * world_size * u_wire)
with the factor of the gradient check. The (k+1) * depth * u term is the smallest floor (a float64 run, whose
run-dtype copy is the float64 copy); (k+1) * world_size * u_wire bounds what averaging N gradients adds per
step (u_wire: the compressed wire dtype's unit roundoff under --compression, else u).

Non-float parameters (integer and bool: an index, a mask) keep their dtype in both copies and are compared bitwise
after every step (`carried`): no gradient or optimizer step changes them, so the run's value must be the float64
copy's exactly. One the copies' own forward writes (a counter kept as a parameter) follows the forward's semantics,
as a buffer does: it is left to the replica fingerprints.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from copy import deepcopy
from typing import Callable, Iterator

import torch
from torch import nn

from dpcompare.verify.randomness import draw_recording as mk
from dpcompare.verify.ranks.oracle_messages import Status
from dpcompare.verify.replay.optimizer_replay import in_one_kernel, uncut
from dpcompare.verify.ranks.verifier_group import Peers
from dpcompare.verify.oracle.gradient_oracle import (DTYPES, TOLERANCE_FACTOR, UNIT_ROUNDOFF, Piece, accumulate_gradient,
                                          accumulate_raw, computed_by, finish_gradient, same_forwards,
                                          verification_copy)
from dpcompare.verify.replay.clipping_rule import clip_, clip_scale
from dpcompare.verify.judgement.held_values import releasable, release
from dpcompare.verify.judgement.tolerance import CHUNK, _norm, finite, rel_ratio
from dpcompare.verify.oracle.model_dtypes import is_float, non_float_divergence, state_distance
from dpcompare.verify.judgement.verdict import Divergence
from dpcompare.verify.randomness.draw_recording import MaskReplayer
from dpcompare.verify.trajectory.trajectory_offsets import Offsets, paired, step_in_parts
from dpcompare.verify.trajectory.trajectory_ranges import Ranges, TrajectoryRequest, optimizer
from dpcompare.verify.judgement.precision_recipe import NONE as NO_RECIPE
from dpcompare.verify.judgement.precision_recipe import Recipe
from dpcompare.contract.optim_state import OptimizerFactory
from dpcompare.verify.replay.optimizer_rebuild import schedule


class Trajectory:
    def __init__(self, template: nn.Module, loss_fn: Callable, factory: OptimizerFactory, dtype: str,
                 device: torch.device, depth: int, u_wire: float | None = None, recipe: Recipe = NO_RECIPE,
                 prestep: bool = False, clip: float | None = None, peers: Peers | None = None) -> None:
        """`peers`: the verifier's group where the ranks share the forwards; every rank then builds its Trajectory
        alike and holds, steps and judges its own range of the parameters (dpcompare.verify.trajectory.trajectory_ranges), rank 0 asking
        the others for each step and judgement (None: this process holds and runs all of it)."""
        self.loss_fn, self.device, self.depth, self.clip, self.factory = loss_fn, device, depth, clip, factory
        self.u = UNIT_ROUNDOFF[dtype]
        self.u_wire = self.u if u_wire is None else u_wire
        self.model64 = verification_copy(template, device, torch.float64)
        self.model_run = verification_copy(template, device, DTYPES[dtype])
        self.names = [n for n, p in template.named_parameters() if p.requires_grad]
        self.carried = [n for n, p in template.named_parameters() if not is_float(p)]
        """Non-float parameters, compared bitwise (see the module docstring)."""
        self.written: set[str] = set()
        """Of those, the ones the copies' forward writes: left to the replica fingerprints."""
        self.ranges = Ranges(peers, self.model64, uncut(self.model64, factory)) if peers is not None else None
        if self.ranges is not None:  # rank 0's initial weights, whatever this rank built
            for model in (self.model64, self.model_run):
                self.ranges.from_rank0(model)
        self.recipe = recipe
        # The engine recipe's forward runs on 16-bit weights loaded from the master copy (model_run) each step.
        self.work = verification_copy(template, device, recipe.weights_dtype) if recipe.weights_dtype else None
        if self.work is not None and self.ranges is not None:
            self.ranges.from_rank0(self.work)
        if self.work is not None:
            # The engine's master copies are made from the weights after their conversion to 16 bits: they start
            # from the initial weights rounded once (the float64 copy starts from the initial weights themselves).
            with torch.no_grad():
                for p, w in zip(self.model_run.parameters(), self.work.parameters()):
                    p.copy_(w)
            releasable(self.work)  # loaded from the master copy at every step: held only while it computes
        # by copy (its id), this rank's pieces of the parameters cut over the ranks (Ranges.pieces_of)
        self.pieces = {id(m): self.ranges.pieces_of(m) if self.ranges else {} for m in (self.model64, self.model_run)}
        self.opt64 = optimizer(factory, list(self._targets(self.model64)))  # grouped as the run's (optim_reference)
        self.opt_run = optimizer(factory, list(self._targets(self.model_run)))
        self._in_one_kernel()
        if prestep:  # the backend's recipe steps its optimizer once on zero gradients before the first step
            for model, opt in ((self.model64, self.opt64), (self.model_run, self.opt_run)):
                for p in self._stepped(model):
                    p.grad = torch.zeros_like(p)
                with torch.no_grad():
                    opt.step()
                self._zero_grad(model)
        self.steps = self.steps_before = 0
        """The steps judged so far, counted from the run's first (a continuation's from the saved run's first); before
        this process's first."""
        self.wire = self.wire_before = 0.0
        """The wire's allowance so far: the sum over those steps of the world size that averaged their gradients."""
        self._run_taken: tuple[object, list[Piece]] | None = None
        """The run-precision reference's gradient this step's run-precision copy steps from (`take_run`), with its
        forwards; None: the copy computes its own."""
        self.replayers = (MaskReplayer(self.model64), MaskReplayer(self.work if self.work is not None else self.model_run))
        self.offsets = Offsets(self.u)
        """The float64 copy's values between uses, held as offsets from the run-precision copy's
        (dpcompare.verify.trajectory.trajectory_offsets): given back before each use, held again after (after a step,
        once the step is judged)."""
        self._unjudged = False
        """Whether the float64 copy is whole after a step, to be held once that step is judged."""
        if self.ranges is not None:
            self._release()
        self._hold()

    # -- across a checkpoint ----------------------------------------------------------------------------------------
    def state(self) -> dict:
        """Both copies and their optimizers, with the steps taken and the wire's allowance so far: what a run that
        continues from a checkpoint resumes (`resume`) to be judged against one uninterrupted run. One process only."""
        if self.ranges is not None:
            raise RuntimeError("the reference trajectory is held in ranges: save it from a run with --oracle-ranks rank0")
        copy = lambda sd: {k: v.detach().to("cpu").clone() if torch.is_tensor(v) else v for k, v in sd.items()}  # noqa: E731
        self.offsets.restore()
        try:
            return {"model64": copy(self.model64.state_dict()), "model_run": copy(self.model_run.state_dict()),
                    "opt64": deepcopy(self.opt64.state_dict()), "opt_run": self.opt_run.state_dict(),
                    "steps": self.steps, "wire": self.wire, "written": sorted(self.written)}
        finally:
            self._hold()

    def resume(self, state: dict) -> None:
        """Continue from `state` (another run's `state()`, after its last step)."""
        self.offsets.restore()
        self.model64.load_state_dict(state["model64"])
        self.model_run.load_state_dict(state["model_run"])
        self.opt64.load_state_dict(state["opt64"])
        self.opt_run.load_state_dict(state["opt_run"])
        self._in_one_kernel()
        self.steps = self.steps_before = state["steps"]
        self.wire = self.wire_before = state["wire"]
        self.written = set(state["written"])
        self._hold()

    def _in_one_kernel(self) -> None:
        """The float64 copy's optimizer stepped in torch's fused kernel where it has one (SGD, Adam, AdamW:
        dpcompare.verify.replay.optimizer_replay.in_one_kernel): one pass over a parameter, its gradient and its state
        where the single-tensor loop makes one per op. The float64 copy is the reference, not a process's computation;
        the run-precision copy keeps the loop a single process runs."""
        in_one_kernel(self.opt64, torch.float64, torch.device(self.device))

    def _stepped(self, model: nn.Module) -> list[torch.nn.Parameter]:
        """The tensors of `model` this process's optimizer steps (`_targets`)."""
        return [t for _, t in self._targets(model)]

    def _targets(self, model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, the tensor this process steps of it) for each trainable parameter of `model` it steps: every one, or
        its own range's (a parameter it holds whole, its piece of one cut over the ranks)."""
        if self.ranges is None:
            return ((n, p) for n, p in model.named_parameters() if p.requires_grad)
        return self.ranges.targets(model, self.pieces.get(id(model), {}))

    def _zero_grad(self, model: nn.Module) -> None:
        model.zero_grad(set_to_none=True)
        for piece in self.pieces.get(id(model), {}).values():
            piece.grad = None

    def _release(self) -> None:
        for model in (self.model64, self.model_run):
            self.ranges.release(model)

    @contextmanager
    def whole(self) -> Iterator["Trajectory"]:
        """Both copies with the float64 copy's values given back (held as offsets between steps), for a reader between
        steps; held again after."""
        self.offsets.restore()
        try:
            yield self
        finally:
            self._hold()

    def _hold(self) -> None:
        self._unjudged = False
        run = self.pieces[id(self.model_run)]
        self.offsets.hold(paired(self.model64, self.opt64, self.model_run, self.opt_run, self.names,
                                 [(t, run[n]) for n, t in self.pieces[id(self.model64)].items()]))

    # -- a step ------------------------------------------------------------------------------------------------------
    def step(self, pieces: list[Piece], loss_scale: float = 1.0, skip: bool = False, at: int = 0) -> None:
        """One optimizer step of both copies on `pieces` at the run's step `at` (a schedule's hyper-parameters); none
        when the run's loss scaler skipped this step. Where the ranks share it, each runs its own forwards (the ranks'
        own pieces, where `pieces` are several ranks' forwards of the layout; else rank 0 runs them all) and steps its
        own range."""
        if skip:
            self._run_taken = None
            return
        if self.ranges is None:
            self._step(lambda: pieces, None, loss_scale, at)
            return
        ranks = len({p.rank for p in pieces})
        divided = ranks > 1 and all(p.position is not None for p in pieces)
        request = TrajectoryRequest("step", tuple(p.position for p in pieces) if divided else None,
                                    tuple(p.weight for p in pieces), tuple(dict.fromkeys(p.rank for p in pieces))
                                    if divided else (0,), ranks, loss_scale, at=at)
        self.ranges.ask(request)
        own = [p for p in pieces if p.rank == 0] if divided else pieces
        self._step(lambda: own, request, loss_scale, at)

    def serve(self, request: TrajectoryRequest, own: Callable[[], list[Piece]]) -> None:
        """A rank other than 0: its part of rank 0's `request` (`own`: its own forwards of the step, unpacked when
        called)."""
        if request.op == "step":
            try:
                self._step(own if request.positions is not None else list, request, request.loss_scale, request.at)
            except _Abandoned:  # a rank could not compute its share: none stepped, and rank 0 says why
                pass
        elif request.op == "judge":
            self.ranges.figures_at_rank0(self._judged(self._rank0s(None, dict(zip(self.names, request.dtypes)))))
        else:
            raise ValueError(f"unknown trajectory request {request.op!r}")

    def _step(self, own: Callable[[], list[Piece]], share: TrajectoryRequest | None, loss_scale: float, k: int) -> None:
        """Both copies' step `k` on this process's forwards `own()` at the step's `loss_scale`, shared as `share` says
        (None: not shared). The float64 optimizer state comes back a part at a time as it steps (step_in_parts)."""
        schedule(self.factory, (self.opt64, self.opt_run), k)  # the groups' hyper-parameters at step k
        self._in_one_kernel()  # (a schedule sets every entry of a group)
        self.offsets.restore([(p, None) for p in (*self.model64.parameters(), *self.pieces[id(self.model64)].values())])
        if share is not None:
            for model in (self.model64, self.model_run):
                self.ranges.gather(model, self.pieces[id(model)])
        try:
            pieces: list[Piece] | Exception = own()
        except Exception as exc:  # noqa: BLE001 - said by every rank alike, in its share's status
            if share is None:
                raise
            pieces = exc
        stepped = False
        try:
            self._step_both(pieces, share, loss_scale)
            stepped = True
        finally:
            if share is not None:
                self._release()
            if stepped:  # held once judged (`judge`): the figures read the float64 copy as it is, not given back
                self._unjudged = True
            else:
                self._hold()

    def _step_both(self, pieces: list[Piece] | Exception, share: TrajectoryRequest | None, loss_scale: float) -> None:
        carried = {n: p.detach().clone() for n, p in self.model64.named_parameters() if n in self.carried}
        self._accumulate(self.model64, pieces, share, self.replayers[0])
        self._clip(self.model64)
        step_in_parts(self.opt64, self._stepped(self.model64), self.offsets)
        self._zero_grad(self.model64)  # not needed until the next step: memory for the next check
        self.written.update(n for n, p in self.model64.named_parameters()
                            if n in carried and state_distance(p, carried[n]) != 0.0)
        taken, self._run_taken = self._run_taken, None
        if taken is not None and share is None and not isinstance(pieces, Exception) and same_forwards(taken[1], pieces):
            self._from(self.model_run, taken[0], private=True)  # the reference's gradient: clipped and stepped there
            return
        if not self.recipe.active:
            self._accumulate(self.model_run, pieces, share, self.replayers[1])
        else:
            work = self.work if self.work is not None else self.model_run
            if self.work is not None:
                self.work.load_state_dict(self.model_run.state_dict())
            grads, none = self._accumulate(work, pieces, share, self.replayers[1], self.recipe, loss_scale)
            finite = all(bool(torch.isfinite(g).all()) for g in grads.values())
            if share is not None:  # every range's
                finite = all(self.ranges.everyone(finite))
            work.zero_grad(set_to_none=True)  # the scaled sums; the unscaled gradients are in `grads`
            if self.work is not None:
                release(self.work)  # its buffers are read below; its weights are loaded again next step
            for n, p in self._targets(self.model_run):
                p.grad = (None if (n in none or not finite) or n not in grads
                          else grads[n].to(p.dtype).to(p.device))
            if not finite:  # its own loss scaler would skip this step
                return
            if self.work is not None:  # buffers (BatchNorm statistics) follow the forward's
                buffers = dict(self.work.named_buffers())
                for n, b in self.model_run.named_buffers():
                    b.copy_(buffers[n])
        self._clip(self.model_run)
        self.opt_run.step()
        self._zero_grad(self.model_run)

    def take(self, pieces: list[Piece], grads64: object, grads_run: object, models: tuple[nn.Module, nn.Module],
             private: bool) -> bool:
        """Both copies' step from gradients already computed, where they are the ones this step would compute: the
        oracle's float64 gradient and the run-precision reference's (`grads64`, `grads_run`: Compacts with their
        `source`), computed by copies of the same model (`models`: the oracle's, holding the buffers its forwards
        left) from the same forwards (`pieces`) at these copies' own weights and buffers, by a forward that writes no
        buffer. That is the first step of a fresh run, one process, no mixed-precision recipe, no non-float
        parameter. Returns whether it stepped (False: nothing was done; the step computes its own). `private`:
        the gradients are read after this (copied before the optimizer may change them in place)."""
        if (self.ranges is not None or self.recipe.active or self.carried or self.steps or self.steps_before
                or not computed_by(grads64, "64", pieces) or not computed_by(grads_run, "run", pieces)):
            return False
        state = grads64.source[1]
        if grads_run.source[1] is not state:
            return False
        self.offsets.restore()
        taken = False
        try:
            taken = self._take(state, grads64, grads_run, models, private)
            return taken
        finally:
            if taken:  # held once judged, as a computed step is (`_step`)
                self._unjudged = True
            else:
                self._hold()

    def take_run(self, pieces: list[Piece], grads_run: object, model: nn.Module) -> bool:
        """The run-precision copy's gradient of this step taken from the run-precision reference's (`grads_run`, a
        Compact with its `source`), where it is the one the copy would compute: the reference's copy (`model`, holding
        the buffers its forwards left) computed it from the same forwards (`pieces`) at these very weights and buffers
        (compared element by element), by a forward that writes no buffer, on one process, without a mixed-precision
        recipe. At one rank the copy's weights stay bitwise the run's while the run computes what one process does, so
        at every checked step its forward and backward are the reference's again. The copy steps from it when the
        trajectory steps (its float64 copy computes its own gradient then). Returns whether it was taken."""
        if (self.ranges is not None or self.recipe.active or self.carried
                or not computed_by(grads_run, "run", pieces) or not set(self.names) <= set(grads_run)):
            return False
        if not _holds(self.model_run, grads_run.source[1]) or not _same_buffers(self.model_run, model):
            return False
        self._run_taken = (grads_run, pieces)
        return True

    def _take(self, state: dict, grads64: object, grads_run: object, models: tuple[nn.Module, nn.Module],
              private: bool) -> bool:
        for mine, theirs, grads in ((self.model64, models[0], grads64), (self.model_run, models[1], grads_run)):
            if not _holds(mine, state) or not _same_buffers(mine, theirs) or not set(self.names) <= set(grads):
                return False
        for model, grads in ((self.model64, grads64), (self.model_run, grads_run)):
            self._from(model, grads, private)
        return True

    def _from(self, model: nn.Module, grads: object, private: bool) -> None:
        """One optimizer step of `model` (one of the two copies) from `grads` computed already (a Compact with its
        `source`), clipped as its own would be. `private`: `grads` are read after this (copied first: clipping and the
        optimizer may change a gradient in place)."""
        opt = self.opt64 if model is self.model64 else self.opt_run
        none = grads.source[3]
        for n, p in model.named_parameters():
            if n in self.names:
                g = grads.held(n)
                p.grad = None if n in none else (g.to(p.device, copy=private) if private else g.to(p.device))
        self._clip(model)
        opt.step()
        model.zero_grad(set_to_none=True)

    def _accumulate(self, model: nn.Module, pieces: list[Piece] | Exception, share: TrajectoryRequest | None,
                    replayer: MaskReplayer, recipe: Recipe = NO_RECIPE,
                    loss_scale: float = 1.0) -> tuple[dict, frozenset[str]]:
        """accumulate_gradient on `model` at its own weights, left in its gradients (where shared: this rank's
        range's, summed over the ranks' forwards by dpcompare.verify.trajectory.trajectory_ranges)."""
        if share is None:
            return accumulate_gradient(model, self.loss_fn, pieces, self.device, replayer, recipe, loss_scale)
        status, raw = Status(False), {}
        try:
            if isinstance(pieces, Exception):
                raise pieces
            if pieces:
                raw, none, _, loss = accumulate_raw(model, self.loss_fn, pieces, self.device, replayer, recipe,
                                                    loss_scale, share.ranks)
                status = Status(True, none, loss)
        except mk.MaskMismatch as exc:
            status = Status(False, mismatch=(exc.module, exc.reason))
        except Exception as exc:  # noqa: BLE001 - said by rank 0, in one line, with the others' ranks in step
            status = Status(False, error=f"rank {self.ranges.rank}: {type(exc).__name__}: {exc}")
        model.zero_grad(set_to_none=True)  # `raw` holds them: freed as they go to their owners
        statuses = self.ranges.everyone(status)
        failed = next((s for s in statuses if s.mismatch is not None or s.error is not None), None)
        if failed is not None:  # every rank alike: none steps (rank 0 says why)
            if self.ranges.rank != 0:
                raise _Abandoned
            if failed.mismatch is not None:
                raise mk.MaskMismatch(*failed.mismatch)
            raise RuntimeError(f"a rank computing its share of the reference trajectory failed: {failed.error}")
        none = frozenset.intersection(*[s.none for s in statuses if s.computed])
        sums = self.ranges.to_owners(model, raw, share.order)
        if id(model) in self.pieces:  # the recipe's 16-bit work copy takes none: its sums are returned
            for n, p in self._targets(model):
                if n in sums:
                    p.grad = None if n in none else sums[n]
        undo = 1.0 / ((share.ranks if recipe.active else 1) * loss_scale)
        return finish_gradient(sums, undo), none

    def follow(self, params: dict[str, torch.Tensor], names: frozenset[str]) -> None:
        """Load the run's values of `names` (the parameters the oracle coverage leaves out, which the copies do not
        train) into both copies, so their next step's forward runs from the run's weights there."""
        if not names:
            return
        self.offsets.restore()
        with torch.no_grad():
            for model in (self.model64, self.model_run):
                for n, p in model.named_parameters():
                    if n in names:
                        p.copy_(params[n].detach().to(device=p.device, dtype=p.dtype))
        self._hold()

    def carried_divergence(self, step: int, params: dict[str, torch.Tensor]) -> Divergence | None:
        """The run's non-float parameters after `step` (every parameter by name, `Adapter.master_params()`) against the
        float64 copy's, bitwise: the first that differs, with every one that does, or None."""
        return non_float_divergence(step, "trajectory", params, dict(self.model64.named_parameters()),
                                    [n for n in self.carried if n not in self.written], f"after step {step}")

    def _clip(self, model: nn.Module) -> None:
        """Clip `model`'s gradients by their global norm (where shared: the norm of every range's per-tensor norms,
        stacked in the parameters' order, as one process stacks them)."""
        if self.clip is None:
            return
        grads = {n: p.grad for n, p in self._targets(model) if p.grad is not None}
        with torch.no_grad():
            if self.ranges is None:
                clip_(list(grads.values()), self.clip)
                return
            own = {n: torch.linalg.vector_norm(g) for n, g in grads.items()}
            norm = self.ranges.global_norm(own, [n for n, _ in model.named_parameters()])
            if norm is None:
                return
            coefficient = clip_scale(norm, self.clip)
            for g in grads.values():
                g.mul_(coefficient.to(g.dtype))

    def judge(self, step: int, module: nn.Module | dict[str, torch.Tensor], world_size: int) -> dict:
        """The drift entry of `step` for the backend's parameters after the step (a module, or its master values by
        name), reduced parameter by parameter (no whole-model vector is built; where shared, each rank reduces its
        range and rank 0 adds the figures in the parameters' order)."""
        params = module if isinstance(module, dict) else dict(module.named_parameters())
        if self.ranges is not None:  # each owner judges its range of rank 0's parameters
            dtypes = {n: params[n].dtype for n in self.names}
            self.ranges.ask(TrajectoryRequest("judge", dtypes=tuple(dtypes[n] for n in self.names)))
            figures = self.ranges.figures_at_rank0(self._judged(self._rank0s(params, dtypes)))
        else:
            figures = self._judged(params)
        if not all(figures[n][0] for n in self.names):
            return {"step": step, "rel_param_distance": None, "floor_rel_param_distance": None,
                    "noise_ratio": None, "tolerance": None, "ok": None, "worst_parameter": None,
                    "reason": "the float64 reference trajectory is not finite (the training diverged)"}
        norms = {n: figures[n][1] for n in self.names}
        apart = {n: figures[n][2] for n in self.names}
        finite = all(figures[n][3] for n in self.names)
        floor2 = sum(figures[n][4] ** 2 for n in self.names)
        whole = math.sqrt(sum(v ** 2 for v in norms.values()))
        distance = rel_ratio(math.sqrt(sum(v ** 2 for v in apart.values())), whole) if finite else float("inf")
        floor = rel_ratio(math.sqrt(floor2), whole)
        k = step + 1
        # the wire's allowance: the world size of every step so far (a continuation's first at the saved run's)
        self.steps, self.wire = k, self.wire_before + max(k - self.steps_before, 0) * world_size
        floor_eff = max(floor, k * self.depth * self.u)
        tolerance = TOLERANCE_FACTOR * (floor_eff + self.wire * self.u_wire)
        share = whole / max(len(self.names), 1) ** 0.5
        worst = max(self.names, key=lambda n: rel_ratio(apart[n], norms[n], share))
        return {"step": step, "rel_param_distance": distance, "floor_rel_param_distance": floor,
                # as the gradient's: over the floor with the reduction's allowance (it passes at or below the factor)
                "noise_ratio": distance / (tolerance / TOLERANCE_FACTOR), "tolerance": tolerance,
                "ok": distance <= tolerance, "worst_parameter": worst}

    def _rank0s(self, params: dict[str, torch.Tensor] | None, dtypes: dict[str, torch.dtype]) -> dict:
        """Rank 0's parameters after the step, this rank's range of them (sent by rank 0)."""
        shapes = {n: p.shape for n, p in self.model_run.named_parameters()}  # (the float64 copy's may be held)
        return self.ranges.to_owners_from_rank0(self.names, params, dtypes, shapes)

    def _judged(self, params: dict[str, torch.Tensor]) -> dict[str, tuple[bool, float, float, bool, float]]:
        """`_figures`, then the float64 copy held if the step just taken left it whole."""
        try:
            return self._figures(params)
        finally:
            if self._unjudged:
                self._hold()

    def _figures(self, params: dict[str, torch.Tensor]) -> dict[str, tuple[bool, float, float, bool, float]]:
        """Per trainable parameter this process holds: (the float64 copy's finite, its norm, the run's distance from
        it, the run's finite, the run-precision copy's distance from it)."""
        ref = {**dict(self.model64.named_parameters()), **self.pieces[id(self.model64)]}
        run = {**dict(self.model_run.named_parameters()), **self.pieces[id(self.model_run)]}
        out = {}
        with torch.no_grad():
            for n in self.names:
                if self.ranges is not None and not (self.ranges.mine(n) or n in self.pieces[id(self.model64)]):
                    continue
                mine, other = (t.detach().reshape(-1) for t in (params[n], run[n]))
                ok = True
                norm = apart = floor = 0.0  # squared, a chunk at a time: no whole float64 copy of the parameter
                for start in range(0, other.numel(), CHUNK):
                    part = slice(start, start + CHUNK)
                    r = self.offsets.read((ref[n], None), part)  # the float64 copy's, held or not
                    ok, norm = ok and finite(r), norm + _norm(r) ** 2
                    apart += _norm(mine[part].to(device=r.device, dtype=torch.float64) - r) ** 2
                    floor += _norm(other[part].to(torch.float64) - r) ** 2
                out[n] = (ok, math.sqrt(norm), math.sqrt(apart), finite(mine), math.sqrt(floor))
        return out


class _Abandoned(Exception):
    """On a rank other than 0: a rank's share of a step failed, so no rank steps (rank 0 raises the reason)."""


def _holds(model: nn.Module, state: dict) -> bool:
    """Whether `model` holds `state` (a state dict the oracle loaded), every entry bitwise in the model's dtype."""
    own = model.state_dict()
    # compared in the wider of the two dtypes, element by element (no converted copy of the state is made)
    return own.keys() == state.keys() and all(
        t.shape == state[k].shape and bool((t == state[k].to(t.device)).all()) for k, t in own.items())


def _same_buffers(mine: nn.Module, theirs: nn.Module) -> bool:
    """Whether every buffer of `theirs` (after its forwards) is bitwise `mine`'s (before any): its forward wrote none."""
    ours = dict(mine.named_buffers())
    return all(n in ours and torch.equal(ours[n], b.to(ours[n].device)) for n, b in theirs.named_buffers())
