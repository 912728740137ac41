"""The reference trajectory, judged: how far the run's parameters drift from a float64 single process.

Owns: two plain single-process copies of the model trained on rank 0 beside the run, from the run's initial
weights on the same global batches, split as the backend split them (and, for a model that draws random
numbers, with the masks the ranks drew): one in float64, one in the run dtype. After every step the backend's parameters are measured
against the float64 copy, and that distance is judged in multiples of the run-dtype copy's distance to it,
the drift a correct single process in the run dtype already has at that step. Imports no adapter.

Tolerance (written here once): at step k (0-based, after k+1 updates)
    rel_param_distance <= factor * (max(floor_k, (k+1) * depth * u) + (k+1) * world_size * u_wire)
with the factor of the gradient check. The (k+1) * depth * u term is the smallest floor (a float64 run, whose
run-dtype copy is the float64 copy); (k+1) * world_size * u_wire bounds what averaging N gradients adds per
step (u_wire: the compressed wire dtype's unit roundoff under --compression, else u).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from dpcompare.verify.equivalence import (DTYPES, TOLERANCE_FACTOR, UNIT_ROUNDOFF, Piece, accumulate_gradient, rel_fro,
                                          verification_copy)
from dpcompare.verify.masks import MaskReplayer
from dpcompare.verify.update_check import OptimizerFactory


def _flat(module: nn.Module, names: list[str]) -> torch.Tensor:
    params = dict(module.named_parameters())
    return torch.cat([params[n].detach().double().reshape(-1).cpu() for n in names])


class Trajectory:
    def __init__(self, template: nn.Module, loss_fn: Callable, factory: OptimizerFactory, dtype: str,
                 device: torch.device, depth: int, u_wire: float | None = None) -> None:
        self.loss_fn, self.device, self.depth = loss_fn, device, depth
        self.u = UNIT_ROUNDOFF[dtype]
        self.u_wire = self.u if u_wire is None else u_wire
        self.model64 = verification_copy(template, device, torch.float64)
        self.model_run = verification_copy(template, device, DTYPES[dtype])
        self.names = [n for n, p in template.named_parameters() if p.requires_grad]
        self.opt64 = factory([p for p in self.model64.parameters() if p.requires_grad])
        self.opt_run = factory([p for p in self.model_run.parameters() if p.requires_grad])
        self.replayers = (MaskReplayer(self.model64), MaskReplayer(self.model_run))

    def step(self, pieces: list[Piece]) -> None:
        for model, optimizer, replayer in ((self.model64, self.opt64, self.replayers[0]),
                                           (self.model_run, self.opt_run, self.replayers[1])):
            accumulate_gradient(model, self.loss_fn, pieces, self.device, replayer)
            optimizer.step()
            model.zero_grad(set_to_none=True)  # not needed until the next step: memory for the next check

    def judge(self, step: int, module: nn.Module, world_size: int) -> dict:
        """The drift entry of `step` for the backend's `module` (after the step)."""
        ref = _flat(self.model64, self.names)
        if not bool(torch.isfinite(ref).all()):
            return {"step": step, "rel_param_distance": None, "floor_rel_param_distance": None, "noise_ratio": None,
                    "tolerance": None, "ok": None, "worst_parameter": None,
                    "reason": "the float64 reference trajectory is not finite (the training diverged)"}
        mine = _flat(module, self.names)
        distance = rel_fro(mine, ref) if bool(torch.isfinite(mine).all()) else float("inf")
        floor = rel_fro(_flat(self.model_run, self.names), ref)
        k = step + 1
        floor_eff = max(floor, k * self.depth * self.u)
        tolerance = TOLERANCE_FACTOR * (floor_eff + k * world_size * self.u_wire)
        return {"step": step, "rel_param_distance": distance, "floor_rel_param_distance": floor,
                "noise_ratio": distance / floor_eff, "tolerance": tolerance, "ok": distance <= tolerance,
                "worst_parameter": self._worst(module)}

    def _worst(self, module: nn.Module) -> str:
        params = dict(module.named_parameters())
        ref = dict(self.model64.named_parameters())
        share = float(torch.linalg.vector_norm(_flat(self.model64, self.names))) / max(len(self.names), 1) ** 0.5
        return max(self.names, key=lambda n: rel_fro(params[n].detach().double().cpu(), ref[n].detach().double().cpu(),
                                                     share))
