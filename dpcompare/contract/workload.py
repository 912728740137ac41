"""What a workload is: a model, its global batch and its loss, and optionally its own forward call, optimizer and
learning-rate schedule (`Workload`), how a global batch is sharded across ranks (`shard`, DistributedSampler's rule:
rank r takes samples r, r+N, r+2N, ... of every tensor: dpcompare.contract.batches), and which of
its modules are its blocks (`block_modules`: the units FSDP shards one by one and --activation-checkpointing
recomputes one by one). The built-in models are in `dpcompare.run.workloads`; a user workload is a function
`(seed: int) -> Workload`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from dpcompare.contract import batches

CONTAINERS = (nn.Sequential, nn.ModuleList)


@dataclass(slots=True)
class Workload:
    name: str
    model: nn.Module
    make_batch: Callable[[int, int], Any]
    """(step, global_batch) -> (inputs, targets) of the whole global batch, identical on every rank: each a tensor or
    any structure of tensors (dict, tuple, list, dataclass), or one dict alone (inputs and what the loss receives:
    dpcompare.contract.batches). dpcompare.data.from_dataset makes one from a torch Dataset."""
    loss_fn: Callable[[Any, Any], Any]
    """loss_fn(output, targets): the loss of the samples given: their mean (the mean of equal shards' losses is the
    global-batch loss); or, for
    a loss normalised over items (tokens not ignored, masked positions), the mean over the items, or `(sum, count)`,
    the sum over the items and their count (dpcompare.contract.normalisation)."""
    tokens_per_sample: int = 1
    source: str = "dpcompare"
    """Where the network's definition comes from (e.g. "torchvision 0.26.0"): recorded in the result."""
    ignore_index: int | None = None
    """The target value of positions the loss leaves out (-100: F.cross_entropy's and transformers' convention): the
    loss is the mean over the other positions, its items. None: a mean over samples, or a loss returning (sum, count)."""
    items: Callable[[torch.Tensor], Any] | None = None
    """How many items a forward's targets hold, where not by `ignore_index` (None: by `ignore_index`, or as the loss
    returns them)."""
    forward: Callable[[nn.Module, Any], Any] | None = None
    """forward(model, inputs) -> output: how the model is called (None: `model(**inputs)` for a dict, `model(*inputs)`
    for a tuple or list, `model(inputs)` otherwise)."""
    sample_dim: int = 0
    """The dimension of every batch tensor that counts samples (1 for sequence-first tensors)."""
    optimizer: Callable[[nn.Module], torch.optim.Optimizer] | None = None
    """optimizer(model) -> the training optimizer over the model's parameters, parameter groups and all (None: the
    run's --optimizer). Called on every copy that trains: each backend's, and the checks' references."""
    scheduler: Callable[[torch.optim.Optimizer], Any] | None = None
    """scheduler(optimizer) -> a learning-rate scheduler stepped once after every optimizer step (None: none)."""
    num_items_kwarg: str | None = None
    """The keyword the model's forward takes the step's count of items by under --loss-normalisation global
    (transformers' "num_items_in_batch"), its own loss then the sum over the forward's items divided by it."""


def shard(batch: Any, rank: int, world_size: int) -> tuple[Any, Any]:
    """Rank's (inputs, targets) of a global batch, strided like DistributedSampler (rank::world_size), every tensor."""
    x, y = batches.pair(batch)
    return batches.stride(x, rank, world_size), batches.stride(y, rank, world_size)


def _holds_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _shared_outside(root: nn.Module) -> Callable[[str], bool]:
    """A test of a module's name: does it hold a parameter that a module outside it holds too (a tied weight:
    BERT's word embedding, which its masked-LM head's decoder shares)?"""
    owners: dict[int, list[str]] = {}
    for name, module in root.named_modules(remove_duplicate=False):
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), []).append(name)
    shared = [names for names in owners.values() if len(set(names)) > 1]

    def test(block: str) -> bool:
        inside = lambda n: n == block or n.startswith(f"{block}.")  # noqa: E731
        return any(any(map(inside, names)) and not all(map(inside, names)) for names in shared)

    return test


def block_modules(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's blocks, by name, in module order:
      1. the modules whose class the model names in `_no_split_modules` (the Hugging Face convention), if it has one;
      2. else the elements of the model's outermost containers: every direct child of an `nn.Sequential` or
         `nn.ModuleList` found walking down from the root without entering a container's elements (a Sequential
         root's own layers: mlp, cnn; the transformer blocks of `gpt-*`'s `h` and `lm`'s `blocks`; ResNet's residual
         blocks),
    each only if it holds parameters. A container's element runs its parameters inside its own forward, which is what
    lets FSDP unshard them around that forward alone and a checkpoint recompute that forward alone; a module holding a
    parameter that a module outside it shares (BERT's embeddings, whose word embedding its head ties) is no block:
    FSDP would shard the block's copy and leave the other module the original, untying them."""
    shared = _shared_outside(root)
    return [(n, m) for n, m in _candidate_blocks(root) if not shared(n)]


def _candidate_blocks(root: nn.Module) -> list[tuple[str, nn.Module]]:
    declared = getattr(root, "_no_split_modules", None)
    if declared:
        names = set(declared)
        return [(n, m) for n, m in root.named_modules() if n and type(m).__name__ in names and _holds_parameters(m)]
    found: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            if isinstance(child, CONTAINERS):
                found.extend((f"{path}.{n}", c) for n, c in child.named_children() if _holds_parameters(c))
            else:
                visit(f"{path}.", child)

    if isinstance(root, CONTAINERS):
        return [(n, c) for n, c in root.named_children() if _holds_parameters(c)]
    visit("", root)
    return found
