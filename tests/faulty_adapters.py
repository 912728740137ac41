"""Deliberately broken DDP adapters for the negative tests (test_negative.py).

Each one plants a single, well-known data-parallel bug behind the unchanged adapter contract
(dpcompare.contract.Adapter), so that the verdict and its diagnosis can be held against a fault whose
step, parameter and cause are known in advance. They are loaded the way a user's adapter is:
`--backend tests.faulty_adapters:SummingDDP` with the repository root on PYTHONPATH.

Not a test module (no `test_` prefix): pytest does not collect it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dpcompare.adapters.ddp import DDPAdapter
from dpcompare.contract import Wrapped


def _sum_hook(state, bucket):
    # No annotations: DDP checks that `bucket` is annotated with dist.GradBucket itself, and under
    # `from __future__ import annotations` the annotation would be the string "dist.GradBucket".
    """A DDP communication hook that all-reduces each bucket and forgets to divide by the world size.

    DDP's default hook (allreduce_hook) divides by the world size; this is the classic bug of a
    hand-written hook or of Horovod's op=Sum: `.grad` becomes N times the global-batch gradient.
    """
    fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


class SummingDDP(DDPAdapter):
    """DDP whose gradients are summed over ranks instead of averaged (wrong from step 0, every parameter)."""

    name = "summing-ddp"

    def wrap(self, module, optimizer, local_batch: int, global_batch: int) -> Wrapped:
        wrapped = super().wrap(module, optimizer, local_batch, global_batch)
        wrapped.model.register_comm_hook(state=None, hook=_sum_hook)
        return wrapped


class SkipSyncOnceDDP(DDPAdapter):
    """DDP that silently runs the second step (step 1) under `no_sync()`: that step's `.grad` stays local.

    The trainer opens `sync(True)` once per training step, so the second call is step 1.
    """

    name = "skip-sync-once-ddp"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._sync_calls = 0

    def sync(self, enabled: bool):
        self._sync_calls += 1
        if self._sync_calls == 2:
            assert self.wrapped is not None
            return self.wrapped.model.no_sync()
        return super().sync(enabled)


class DriftedInitDDP(DDPAdapter):
    """DDP whose rank 1 ends up with a different last parameter after wrapping (DDP's initial broadcast
    is undone), as when a rank re-initialises or loads another checkpoint after the wrapper was built."""

    name = "drifted-init-ddp"

    def wrap(self, module, optimizer, local_batch: int, global_batch: int) -> Wrapped:
        wrapped = super().wrap(module, optimizer, local_batch, global_batch)
        if self.env.rank == 1:
            with torch.no_grad():
                list(wrapped.module.parameters())[-1].add_(1e-3)
        return wrapped
