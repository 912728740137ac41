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
from typing import Callable

import torch
from torch import nn

from dpcompare.verify.equivalence import (DTYPES, TOLERANCE_FACTOR, UNIT_ROUNDOFF, Piece, accumulate_gradient,
                                          verification_copy)
from dpcompare.verify.clipping import clip_
from dpcompare.verify.held import releasable, release
from dpcompare.verify.tolerance import rel_ratio
from dpcompare.verify.dtypes import is_float, non_float_divergence, state_distance
from dpcompare.verify.verdict import Divergence
from dpcompare.verify.masks import MaskReplayer
from dpcompare.verify.precision import NONE as NO_RECIPE
from dpcompare.verify.precision import Recipe
from dpcompare.contract.optim_state import OptimizerFactory


class Trajectory:
    def __init__(self, template: nn.Module, loss_fn: Callable, factory: OptimizerFactory, dtype: str,
                 device: torch.device, depth: int, u_wire: float | None = None, recipe: Recipe = NO_RECIPE,
                 prestep: bool = False, clip: float | None = None) -> None:
        self.loss_fn, self.device, self.depth = loss_fn, device, depth
        self.clip = clip
        self.u = UNIT_ROUNDOFF[dtype]
        self.u_wire = self.u if u_wire is None else u_wire
        self.model64 = verification_copy(template, device, torch.float64)
        self.model_run = verification_copy(template, device, DTYPES[dtype])
        self.names = [n for n, p in template.named_parameters() if p.requires_grad]
        self.carried = [n for n, p in template.named_parameters() if not is_float(p)]
        """Non-float parameters, compared bitwise (see the module docstring)."""
        self.written: set[str] = set()
        """Of those, the ones the copies' forward writes: left to the replica fingerprints."""
        self.opt64 = factory([p for p in self.model64.parameters() if p.requires_grad])
        self.opt_run = factory([p for p in self.model_run.parameters() if p.requires_grad])
        self.recipe = recipe
        if prestep:  # the backend's recipe steps its optimizer once on zero gradients before the first step
            for model, opt in ((self.model64, self.opt64), (self.model_run, self.opt_run)):
                for p in model.parameters():
                    p.grad = torch.zeros_like(p) if p.requires_grad else None
                with torch.no_grad():
                    opt.step()
                model.zero_grad(set_to_none=True)
        # The engine recipe's forward runs on 16-bit weights loaded from the master copy (model_run) each step.
        self.work = verification_copy(template, device, recipe.weights_dtype) if recipe.weights_dtype else None
        if self.work is not None:
            # The engine's master copies are made from the weights after their conversion to 16 bits: they start
            # from the initial weights rounded once (the float64 copy starts from the initial weights themselves).
            with torch.no_grad():
                for p, w in zip(self.model_run.parameters(), self.work.parameters()):
                    p.copy_(w)
            releasable(self.work)  # loaded from the master copy at every step: held only while it computes
        self.replayers = (MaskReplayer(self.model64), MaskReplayer(self.work if self.work is not None else self.model_run))
        self.divider = None
        """Rank 0's dpcompare.verify.divided.Divider where the ranks share the forwards (None: this process runs all)."""

    def step(self, pieces: list[Piece], loss_scale: float = 1.0, skip: bool = False) -> None:
        """One optimizer step of both copies on `pieces`; none when the run's loss scaler skipped this step."""
        if skip:
            return
        carried = {n: p.detach().clone() for n, p in self.model64.named_parameters() if n in self.carried}
        self._accumulate(self.model64, "64", pieces, self.replayers[0])
        self._clip(self.model64)
        self.opt64.step()
        self.model64.zero_grad(set_to_none=True)  # not needed until the next step: memory for the next check
        self.written.update(n for n, p in self.model64.named_parameters()
                            if n in carried and state_distance(p, carried[n]) != 0.0)
        if not self.recipe.active:
            self._accumulate(self.model_run, "run", pieces, self.replayers[1])
        else:
            work = self.work if self.work is not None else self.model_run
            if self.work is not None:
                self.work.load_state_dict(self.model_run.state_dict())
            grads, none = self._accumulate(work, "run", pieces, self.replayers[1], self.recipe, loss_scale)
            finite = all(bool(torch.isfinite(g).all()) for g in grads.values())
            work.zero_grad(set_to_none=True)  # the scaled sums; the unscaled gradients are in `grads`
            if self.work is not None:
                release(self.work)  # its buffers are read below; its weights are loaded again next step
            for n, p in self.model_run.named_parameters():
                p.grad = None if (n in none or not finite) or not p.requires_grad else grads[n].to(p.dtype).to(p.device)
            if not finite:  # its own loss scaler would skip this step
                return
            if self.work is not None:  # buffers (BatchNorm statistics) follow the forward's
                buffers = dict(self.work.named_buffers())
                for n, b in self.model_run.named_buffers():
                    b.copy_(buffers[n])
        self._clip(self.model_run)
        self.opt_run.step()
        self.model_run.zero_grad(set_to_none=True)

    def _accumulate(self, model: nn.Module, slot: str, pieces: list[Piece], replayer: MaskReplayer,
                    recipe: Recipe = NO_RECIPE, loss_scale: float = 1.0) -> tuple[dict, frozenset[str]]:
        """accumulate_gradient on `model` at its own weights, left in its gradients; every rank running its own
        forwards where the pieces are several ranks' (dpcompare.verify.divided: the helpers load these weights)."""
        if self.divider is not None and self.divider.divides(pieces):
            return self.divider.gradient(slot, model, replayer, None, pieces, self.loss_fn, self.device, recipe,
                                         loss_scale, into_model=True)
        return accumulate_gradient(model, self.loss_fn, pieces, self.device, replayer, recipe, loss_scale)

    def follow(self, params: dict[str, torch.Tensor], names: frozenset[str]) -> None:
        """Load the run's values of `names` (the parameters the oracle coverage leaves out, which the copies do not
        train) into both copies, so their next step's forward runs from the run's weights there."""
        if not names:
            return
        with torch.no_grad():
            for model in (self.model64, self.model_run):
                for n, p in model.named_parameters():
                    if n in names:
                        p.copy_(params[n].detach().to(device=p.device, dtype=p.dtype))

    def carried_divergence(self, step: int, params: dict[str, torch.Tensor]) -> Divergence | None:
        """The run's non-float parameters after `step` (every parameter by name, `Adapter.master_params()`) against the
        float64 copy's, bitwise: the first that differs, with every one that does, or None."""
        return non_float_divergence(step, "trajectory", params, dict(self.model64.named_parameters()),
                                    [n for n in self.carried if n not in self.written], f"after step {step}")

    def _clip(self, model: nn.Module) -> None:
        if self.clip is not None:
            with torch.no_grad():
                clip_([p.grad for p in model.parameters() if p.grad is not None], self.clip)

    def judge(self, step: int, module: nn.Module | dict[str, torch.Tensor], world_size: int) -> dict:
        """The drift entry of `step` for the backend's parameters after the step (a module, or its master values by
        name), reduced parameter by parameter (no whole-model vector is built)."""
        ref = dict(self.model64.named_parameters())
        run = dict(self.model_run.named_parameters())
        params = module if isinstance(module, dict) else dict(module.named_parameters())
        with torch.no_grad():
            if not all(bool(torch.isfinite(ref[n]).all()) for n in self.names):
                return {"step": step, "rel_param_distance": None, "floor_rel_param_distance": None,
                        "noise_ratio": None, "tolerance": None, "ok": None, "worst_parameter": None,
                        "reason": "the float64 reference trajectory is not finite (the training diverged)"}
            norms = {n: _norm(ref[n]) for n in self.names}
            apart = {n: _norm(params[n].detach().to(device=ref[n].device, dtype=torch.float64) - ref[n])
                     for n in self.names}
            finite = all(bool(torch.isfinite(params[n]).all()) for n in self.names)
            floor2 = sum(_norm(run[n].to(torch.float64) - ref[n]) ** 2 for n in self.names)
        whole = math.sqrt(sum(v ** 2 for v in norms.values()))
        distance = rel_ratio(math.sqrt(sum(v ** 2 for v in apart.values())), whole) if finite else float("inf")
        floor = rel_ratio(math.sqrt(floor2), whole)
        k = step + 1
        floor_eff = max(floor, k * self.depth * self.u)
        tolerance = TOLERANCE_FACTOR * (floor_eff + k * world_size * self.u_wire)
        share = whole / max(len(self.names), 1) ** 0.5
        worst = max(self.names, key=lambda n: rel_ratio(apart[n], norms[n], share))
        return {"step": step, "rel_param_distance": distance, "floor_rel_param_distance": floor,
                # as the gradient's: over the floor with the reduction's allowance (it passes at or below the factor)
                "noise_ratio": distance / (tolerance / TOLERANCE_FACTOR), "tolerance": tolerance,
                "ok": distance <= tolerance, "worst_parameter": worst}


def _norm(t: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(t.detach()))
