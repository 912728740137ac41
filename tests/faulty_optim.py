"""Deliberately broken DDP adapters for the user's optimizer and schedule (tests/test_recipe_optim.py).

Each plants one well-known fault of a training loop that takes the user's optimizer and learning-rate schedule, behind
the unchanged adapter contract, so that the update check, whose expected hyper-parameters come from a reference built
apart from the backend (dpcompare.verify.replay.optimizer_rebuild), must catch it and name it:

  DecayEveryGroupDDP   applies the weight decay of the first group to every group (a loop that rebuilds the optimizer
                       from model.parameters() with one weight_decay): the no-decay group decays (cause group_hparams)
  DoubleScheduleDDP    steps the scheduler twice per optimizer step (a loop that steps it, and a callback that steps it
                       again): from step 1 on the learning rate runs ahead (cause schedule)
  DroppedGroupLrDDP    drops a group's own learning rate (groups rebuilt from their params and weight_decay only), so
                       it runs at the optimizer's default (cause group_hparams)

Loaded the way a user's adapter is: `--backend tests.faulty_optim:DoubleScheduleDDP` with the repository root on
PYTHONPATH. Not a test module (no `test_` prefix): pytest does not collect it.
"""

from __future__ import annotations

from dpcompare.adapters.ddp import DDPAdapter
from dpcompare.contract import Wrapped


class DecayEveryGroupDDP(DDPAdapter):
    name = "decay-every-group-ddp"

    def wrap(self, module, optimizer, local_batch: int, global_batch: int) -> Wrapped:
        decay = optimizer.param_groups[0]["weight_decay"]
        for group in optimizer.param_groups:
            group["weight_decay"] = decay
        return super().wrap(module, optimizer, local_batch, global_batch)


class DoubleScheduleDDP(DDPAdapter):
    name = "double-schedule-ddp"

    def step(self) -> None:
        super().step()
        self.scheduler.step()  # the loop's own step() then steps it once more (Adapter.step)


class DroppedGroupLrDDP(DDPAdapter):
    name = "dropped-group-lr-ddp"

    def wrap(self, module, optimizer, local_batch: int, global_batch: int) -> Wrapped:
        for group in optimizer.param_groups[1:]:
            group["lr"] = optimizer.defaults["lr"]
        return super().wrap(module, optimizer, local_batch, global_batch)
