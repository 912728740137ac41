"""Workloads with a planted fault for the negative tests, loaded like a user's `--model package.module:function`.

Not a test module (no `test_` prefix): pytest does not collect it.
"""

from __future__ import annotations

from torch import nn
from torch.nn import functional as F

from dpcompare.run.workloads import Workload, cnn, mlp


def sum_loss_mlp(seed: int) -> Workload:
    """The MLP with its loss reduced with `sum` over the samples instead of `mean`: every rank's loss is the
    sum over its shard, and the mean of those sums is 1/N of the global-batch sum."""
    base = mlp(seed)
    return Workload("sum-loss-mlp", base.model, base.make_batch, lambda out, y: F.cross_entropy(out, y, reduction="sum"))


def dropout_cnn(seed: int) -> Workload:
    """The CNN (BatchNorm) with dropout before its head: a random forward whose samples are coupled by
    BatchNorm, so the ranks' masks cannot be replayed shard by shard."""
    base = cnn(seed)
    layers = list(base.model.children())
    model = nn.Sequential(*layers[:-1], nn.Dropout(0.2), layers[-1])
    return Workload("dropout-cnn", model, base.make_batch, base.loss_fn)
