"""Deliberately broken gradient clipping under --clip-grad-norm, for tests/test_clipping.py.

Each adapter plants one known clipping fault behind the unchanged adapter contract (`Adapter.clip_grad_norm`, the
reduce): clipping before the all-reduce, clipping by parts' own norms, not clipping, and reporting one rank's shards'
norm. Loaded the way a user's adapter is: `--backend tests.faulty_clipping:ClipInPartsDDP --clip-grad-norm 0.05`.
The faults of runs without clipping are in tests/faulty_adapters.py.

Not a test module (no `test_` prefix): pytest does not collect it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dpcompare.adapters.ddp import DDPAdapter
from dpcompare.adapters.fsdp import FSDPAdapter


class ClipBeforeReduceDDP(DDPAdapter):
    """DDP under --clip-grad-norm that clips each rank's local gradient by its local norm before the all-reduce (the
    clip placed between backward and a hand-written reduce) and reports that local norm: the reduced gradient is the
    mean of differently scaled local gradients, not the global-batch gradient clipped."""

    name = "clip-before-reduce-ddp"

    def sync(self, enabled: bool):
        return self.wrapped.model.no_sync()  # every backward local: the reduce below is the only one

    def reduce(self) -> None:
        params = [p for p in self.wrapped.module.parameters() if p.grad is not None]
        self._local_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm=self.settings.clip_grad_norm))
        for p in params:
            dist.all_reduce(p.grad)
            p.grad.div_(self.env.world_size)

    def clip_grad_norm(self, max_norm: float) -> float | None:
        return self._local_norm  # clipped already, before the reduce


class ClipInPartsDDP(DDPAdapter):
    """DDP under --clip-grad-norm that clips its parameters in two parts, each by its own norm (the first half of the
    parameters and the rest, as a ZeRO-2 rank clipping its partition by the partition's norm), and reports the
    global norm: the norm is right, the update is not."""

    name = "clip-in-parts-ddp"

    def clip_grad_norm(self, max_norm: float) -> float | None:
        params = [p for p in self.wrapped.module.parameters() if p.grad is not None]
        half = len(params) // 2
        norms = [float(torch.nn.utils.clip_grad_norm_(part, max_norm)) for part in (params[:half], params[half:])]
        return sum(n * n for n in norms) ** 0.5


class UnclippedDDP(DDPAdapter):
    """DDP under --clip-grad-norm that reports the gradient's global norm and never clips (a clip_grad_norm_ called
    with max_norm=inf to log the norm, where the clip belonged)."""

    name = "unclipped-ddp"

    def clip_grad_norm(self, max_norm: float) -> float | None:
        params = [p for p in self.wrapped.module.parameters() if p.grad is not None]
        return float(torch.nn.utils.clip_grad_norm_(params, float("inf")))


class ShardNormFSDP(FSDPAdapter):
    """FSDP2 under --clip-grad-norm whose clipping is right (clip_grad_norm_ on the DTensor gradients) but which reports
    a norm it computed by hand over `p.grad.to_local()`: this rank's shards' norm, never reduced over the mesh, so the
    norm a training loop logs and schedules on is one rank's part."""

    name = "shard-norm-fsdp"

    def clip_grad_norm(self, max_norm: float) -> float | None:
        params = [p for p in self.wrapped.module.parameters() if p.grad is not None]
        local = torch.stack([torch.linalg.vector_norm(p.grad.to_local()) for p in params])
        torch.nn.utils.clip_grad_norm_(params, max_norm)
        return float(torch.linalg.vector_norm(local))
