"""How a workload's loss is normalised: over the samples of a forward, or over its items (tokens not ignored, masked
positions), and, with --loss-normalisation global, over the items of the whole step.

Owns: `Counted`, the workload's loss as the trainer and the checks call it. A workload says its loss is a sum over
items divided by their count in one of two ways:
  - `Workload.ignore_index`: targets equal to it are no item, and the loss is the mean over the others (what
    F.cross_entropy(ignore_index=-100) and transformers' losses compute); `Workload.items` counts another way;
  - `loss_fn` returns `(sum, count)`: the sum over the forward's items and their count.
Called as `loss(output, target)`, `Counted` returns the forward's own mean (sum / count) in either case: what a rank
computes when each rank and each micro-batch normalises by its own count (`local`, the default, what a training loop
that calls the loss on its micro-batch computes). `global`: every forward's sum is divided by the step's count over
all ranks and micro-batches (transformers' `num_items_in_batch`, summed over the accumulation window and the ranks),
which makes the ranks' split compute the global batch's loss. A loss that returns anything else (a tensor of more than
one element, a tuple of another length) is refused (LossError). Targets may be any structure of tensors
(dpcompare.contract.batches): `ignore_index` counts a mapping's "labels", or its one integer tensor. Imports of
dpcompare's only the batch's walk.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, Callable, Literal

import torch

from dpcompare.contract import batches

Normalisation = Literal["local", "global"]
NORMALISATIONS: tuple[str, ...] = ("local", "global")


def counter(ignore_index: int | None, items: Callable[[torch.Tensor], Any] | None) -> Callable[[torch.Tensor], int] | None:
    """How many items targets hold: `items` where given, else the targets not equal to `ignore_index`; None where the
    workload names neither (a plain mean over samples, or a `(sum, count)` loss whose count only the forward knows)."""
    if items is not None:
        return lambda y: int(items(y))
    if ignore_index is not None:
        return lambda y: int((labels(y) != ignore_index).sum())
    return None


class LossError(ValueError):
    """A loss that returned neither a one-element tensor nor (sum, count)."""


def labels(targets: Any) -> torch.Tensor:
    """The tensor of targets an ignore index is read from: the targets themselves, a mapping's "labels", or the one
    integer tensor they hold."""
    if torch.is_tensor(targets):
        return targets
    if isinstance(targets, Mapping) and torch.is_tensor(targets.get("labels")):
        return targets["labels"]
    found = [t for t in batches.leaves(targets) if not t.is_floating_point() and t.dim() > 0]
    if len(found) != 1:
        raise LossError(f"the workload names an ignore_index but its targets hold {len(found)} integer tensors and no "
                        "\"labels\": give the Workload items=(targets -> count) instead")
    return found[0]


def _scalar(out: Any, what: str) -> Any:
    if not torch.is_tensor(out) or out.numel() != 1:
        said = f"a tensor of shape {tuple(out.shape)}" if torch.is_tensor(out) else type(out).__name__
        raise LossError(f"the loss returned {said} as its {what}: return a one-element tensor (the mean), or (sum, "
                        "count)")
    return out


def _samples(output: Any, target: Any) -> int:
    try:
        return batches.rows(target)
    except batches.BatchError:  # targets with no sample dimension (the model's own loss): the output's rows
        first = batches.first(output)
        return int(first.shape[batches.current().sample_dim]) if first is not None and first.dim() else 1


class Counted:
    """A workload's loss (`loss_fn`), normalised as the run asks. See the module docstring."""

    def __init__(self, loss_fn: Callable, count: Callable[[torch.Tensor], int] | None) -> None:
        self.loss_fn, self.count = loss_fn, count
        functools.update_wrapper(self, loss_fn, updated=())
        self.returns_count = False
        """The loss returned (sum, count) at least once."""

    @property
    def counts_items(self) -> bool:
        """The loss is normalised over items the checks can count (from the targets, or as the loss returns them)."""
        return self.count is not None or self.returns_count

    def sum_and_count(self, output: Any, target: torch.Tensor) -> tuple[torch.Tensor, int | None]:
        """The forward's loss as the sum over its items and their count (None: a mean over samples; its sum is then
        the mean times the samples)."""
        out = self._out(output, target)
        if isinstance(out, tuple):
            total, count = out
            return total, int(count)
        count = self.count(target) if self.count is not None else None
        return out * (count if count is not None else _samples(output, target)), count

    def _out(self, output: Any, target: Any) -> Any:
        """What the loss returned: one-element tensor, or (sum, count) (else LossError)."""
        out = self.loss_fn(output, target)
        if isinstance(out, tuple):
            if len(out) != 2:
                raise LossError(f"the loss returned a tuple of {len(out)}: return the loss (a one-element tensor) or "
                                "(sum, count)")
            self.returns_count = True
            return _scalar(out[0], "sum"), out[1]
        return _scalar(out, "loss")

    def __call__(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        """The forward's own mean: over its items, or over its samples."""
        out = self._out(output, target)
        if isinstance(out, tuple):
            total, count = out
            return total / count
        return out

    def items_of(self, target: torch.Tensor) -> int | None:
        """The items the targets hold, where they say (None where the loss alone counts them)."""
        return self.count(target) if self.count is not None else None


def counted(loss_fn: Callable, ignore_index: int | None = None,
            items: Callable[[torch.Tensor], Any] | None = None) -> Counted:
    """`loss_fn` as a Counted (once: a Counted is returned as it is)."""
    return loss_fn if isinstance(loss_fn, Counted) else Counted(loss_fn, counter(ignore_index, items))


def refusal(normalisation: str, loss: Counted, targets: torch.Tensor, model: str) -> str | None:
    """Why --loss-normalisation global cannot count this workload's items before its forwards (after one forward of
    `loss`, which says whether it returns its own count), or None."""
    if normalisation != "global" or loss.count is not None:
        return None
    if loss.returns_count:
        return (f"--loss-normalisation global: --model {model}'s loss returns (sum, count), whose count only its "
                "forward knows, so the step's count cannot be summed before the first backward; give the Workload "
                "ignore_index or items (the count from the targets), or use --loss-normalisation local")
    if any(not t.is_floating_point() and bool((t == -100).any()) for t in batches.leaves(targets)):
        return (f"--loss-normalisation global: --model {model}'s targets hold -100 (F.cross_entropy's ignore index) "
                "but its Workload names no ignore_index, so its items cannot be counted; give the Workload "
                "ignore_index=-100 (or items)")
    return None
