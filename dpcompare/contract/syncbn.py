"""Global-batch BatchNorm for any backend and any device.

torch.nn.SyncBatchNorm refuses CPU tensors ("expected input tensor to be on GPU"), and Horovod's needs
CUDA too, so on gloo there is no stock way to normalise with global-batch statistics. This module does it
with a differentiable all-reduce(sum) supplied by the adapter (torch.distributed.nn for process groups,
hvd.allreduce for Horovod). Two passes (mean, then centred sum of squares) keep float32 accuracy close to
F.batch_norm on the gathered batch. Imports no adapter.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

AllReduceSum = Callable[[torch.Tensor], torch.Tensor]


class GlobalBatchNorm(nn.Module):
    def __init__(self, bn: nn.modules.batchnorm._BatchNorm, allreduce_sum: AllReduceSum) -> None:
        super().__init__()
        self.num_features, self.eps, self.momentum = bn.num_features, bn.eps, bn.momentum
        self.affine, self.track_running_stats = bn.affine, bn.track_running_stats
        self.weight, self.bias = bn.weight, bn.bias
        self.register_buffer("running_mean", bn.running_mean)
        self.register_buffer("running_var", bn.running_var)
        self.register_buffer("num_batches_tracked", bn.num_batches_tracked)
        self._allreduce_sum = allreduce_sum

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)
        dims = [0] + list(range(2, x.dim()))
        shape = [1, -1] + [1] * (x.dim() - 2)
        local_count = x.numel() // x.shape[1]
        count_and_sum = self._allreduce_sum(
            torch.cat([x.new_full((1,), float(local_count)), x.sum(dim=dims)])
        )
        count = count_and_sum[0]
        mean = count_and_sum[1:] / count
        centred = x - mean.reshape(shape)
        var = self._allreduce_sum((centred * centred).sum(dim=dims)) / count
        y = centred * torch.rsqrt(var + self.eps).reshape(shape)
        if self.affine:
            y = y * self.weight.reshape(shape) + self.bias.reshape(shape)
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                m = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
                n = float(count)
                self.running_mean.mul_(1 - m).add_(mean.detach(), alpha=m)
                self.running_var.mul_(1 - m).add_(var.detach() * (n / max(n - 1.0, 1.0)), alpha=m)
        return y


def convert_global_batchnorm(module: nn.Module, allreduce_sum: AllReduceSum) -> nn.Module:
    """Replace every BatchNorm layer in `module` (in place where possible) with GlobalBatchNorm."""
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return GlobalBatchNorm(module, allreduce_sum)
    for name, child in module.named_children():
        setattr(module, name, convert_global_batchnorm(child, allreduce_sum))
    return module


def has_batchnorm(module: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules())


def process_group_allreduce_sum() -> AllReduceSum:
    """Differentiable all-reduce(sum) over the default torch.distributed process group."""
    import warnings

    import torch.distributed as dist
    from torch.distributed.nn.functional import all_reduce

    # Deprecated in favour of _functional_collectives, whose autograd support is still private; this one
    # is the documented differentiable all-reduce, so keep it and keep its warning out of every run.
    warnings.filterwarnings("ignore", message=r"torch\.distributed\.nn\.functional\.all_reduce is deprecated")
    return lambda t: all_reduce(t, op=dist.ReduceOp.SUM)
