"""What a `--model hf:` model is trained on: its forward, its synthetic batches and its loss, per task.

Owns: the class swap that gives a transformers model the forward the trainer calls (`forward(batch)` returning the
logits, or the logits and the routers' load-balancing loss where the config asks for it), the recomputation the
verification copies switch on (`recompute_activations`), and each task's data and loss:
  - causal LM: token streams of `seq` tokens, next-token targets, padded at the end to lengths of their own with
    IGNORED targets there (dpcompare.run.workloads.token_batch), or packed;
  - masked LM: the same streams masked as transformers' collator masks them (15% of the positions at random, 80/10/10),
    or packed: the same number of positions masked in every sample; drawn from (seed, step), so every rank rebuilds
    the same global batch;
  the loss the mean over the targets not IGNORED (the workload's ignore_index: dpcompare.contract.normalisation);
  - image classifier: Gaussian pixels and random labels.
Imports transformers lazily; of dpcompare only the contract and the built-in workloads' data helpers.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch import nn
from torch.nn import functional as F

from dpcompare.contract.checkpointing import checkpoint_blocks
from dpcompare.contract.workload import block_modules
from dpcompare.run.workloads import _generator, token_batch, token_stream

MASKED_SHARE = 0.15
"""The share of a masked LM's positions masked per sample (BERT's), at least one."""
IGNORED = -100
"""The target of a position the loss leaves out (F.cross_entropy's ignore_index, transformers' convention)."""
DEFAULT_IMAGE_SIZE = 224
"""Pixels per side where the config gives no image_size (the model takes any size): ImageNet's."""
MAX_STRIDE = 8


@functools.cache
def task_class(cls: type, task: str, router_aux: bool) -> type:
    """`cls` with a forward that takes the batch tensor alone and returns the logits (module and parameter names
    unchanged); with `router_aux`, the logits and the routers' load-balancing loss of this forward's own tokens.
    `recompute_activations`: set by dpcompare's float64 verification copies, which then recompute each block in
    backward (`recompute`) to hold one block's activations at a time."""

    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if getattr(self, "recompute_activations", False):
            recompute(self)
        if task == "image_classification":
            return cls.forward(self, pixel_values=x).logits
        kwargs: dict[str, Any] = {"use_cache": False} if task == "causal_lm" else {}
        if not router_aux:
            return cls.forward(self, input_ids=x, **kwargs).logits
        out = cls.forward(self, input_ids=x, output_router_logits=True, **kwargs)
        if out.aux_loss is None:
            raise RuntimeError(f"{cls.__name__} returned no aux_loss though output_router_logits was asked for")
        return out.logits, out.aux_loss

    return type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__,
                                       "__doc__": f"{cls.__name__}: forward(batch) -> logits (dpcompare --model hf:)"})


def _outermost(blocks: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """The blocks inside no other block (ConvNeXt names its stages and their layers: the stages)."""
    names = [name for name, _ in blocks]
    return [(n, m) for n, m in blocks if not any(n.startswith(f"{other}.") for other in names)]


def recompute(model: nn.Module) -> None:
    """Make `model` recompute its blocks' activations in backward, once: transformers' own gradient checkpointing
    (non-reentrant) where the class supports it, else dpcompare's (`checkpoint_blocks` on its outermost blocks), and
    neither where the model holds BatchNorm (a recomputed forward would update its running statistics twice) or names
    no block: there the copy keeps its activations."""
    if getattr(model, "_dpcompare_recomputes", None) is not None:
        return
    model._dpcompare_recomputes = "none"
    if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        return
    if getattr(type(model), "supports_gradient_checkpointing", False):
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x renamed gradient checkpointing
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model._dpcompare_recomputes = "transformers"
    elif checkpoint_blocks(model, blocks=_outermost(block_modules(model))):
        model._dpcompare_recomputes = "dpcompare"


# -- data and loss ----------------------------------------------------------------------------------------
Batch = tuple[torch.Tensor, torch.Tensor]


def causal_tokens(seed: int, vocab: int, seq: int, token_data: str = "padded") -> Callable[[int, int], Batch]:
    def make_batch(step: int, global_batch: int) -> Batch:
        return token_batch(seed, step, global_batch, vocab, seq, MAX_STRIDE, token_data)

    return make_batch


def mask_token(config: Any) -> int:
    """The config's mask token where it names one inside the vocabulary, else the vocabulary's last id."""
    vocab = int(config.vocab_size)
    declared = getattr(config, "mask_token_id", None)
    return int(declared) if isinstance(declared, int) and 0 <= declared < vocab else vocab - 1


def masked_per_sample(seq: int) -> int:
    return max(1, round(MASKED_SHARE * seq))


def masked_tokens(seed: int, vocab: int, seq: int, mask_id: int, token_data: str = "padded"
                  ) -> Callable[[int, int], Batch]:
    """Token streams (never holding `mask_id`) with positions chosen for the loss, the targets the original tokens
    there and IGNORED elsewhere. `packed`: `masked_per_sample(seq)` positions of each sample, replaced by `mask_id`.
    Else as transformers' DataCollatorForLanguageModeling: each position chosen with probability MASKED_SHARE (at
    least one a sample), 80% of the chosen replaced by `mask_id`, 10% by a random token, 10% kept, so the count differs
    from sample to sample and from rank to rank. Drawn from (seed, step) alone: every rank rebuilds the same batch."""
    per_sample = masked_per_sample(seq)

    def make_batch(step: int, global_batch: int) -> Batch:
        tokens, _ = token_stream(seed, step, global_batch, vocab - 1, seq, MAX_STRIDE)
        tokens = tokens + (tokens >= mask_id).long()  # the stream skips the mask id
        # a generator of its own, from (seed, step) alone: every rank draws the same positions
        g = torch.Generator().manual_seed((seed * 1_000_003 + step) ^ (1 << 62))
        draw = torch.rand(global_batch, seq, generator=g)
        if token_data == "packed":
            where = draw.argsort(dim=1)[:, :per_sample]
            targets = torch.full_like(tokens, IGNORED).scatter_(1, where, tokens.gather(1, where))
            return tokens.scatter(1, where, mask_id), targets
        chosen = draw < MASKED_SHARE
        chosen[torch.arange(global_batch), draw.argmin(dim=1)] = True  # at least one position a sample
        targets = tokens.masked_fill(~chosen, IGNORED)
        kind = torch.rand(global_batch, seq, generator=g)
        random = torch.randint(0, vocab, (global_batch, seq), generator=g)
        inputs = torch.where(chosen & (kind < 0.8), torch.full_like(tokens, mask_id), tokens)
        return torch.where(chosen & (kind >= 0.8) & (kind < 0.9), random, inputs), targets

    return make_batch


def pixel_shape(config: Any) -> tuple[int, int, int, str]:
    """(channels, height, width, where the size comes from) of the config's images."""
    channels = int(getattr(config, "num_channels", 3) or 3)
    size = getattr(config, "image_size", None)
    if size is None:
        return (channels, DEFAULT_IMAGE_SIZE, DEFAULT_IMAGE_SIZE,
                f"the config gives no image_size and {type(config).__name__} takes any size: ImageNet's "
                f"{DEFAULT_IMAGE_SIZE}")
    height, width = (int(size), int(size)) if isinstance(size, (int, float)) else (int(size[0]), int(size[-1]))
    return channels, height, width, "the config's image_size"


def pixels(seed: int, shape: tuple[int, int, int], classes: int) -> Callable[[int, int], Batch]:
    def make_batch(step: int, global_batch: int) -> Batch:
        g = _generator(seed, step)
        x = torch.randn(global_batch, *shape, generator=g)
        return x, torch.randint(0, classes, (global_batch,), generator=g)

    return make_batch


def with_router_aux(coefficient: float) -> Callable[[tuple[torch.Tensor, torch.Tensor], torch.Tensor], torch.Tensor]:
    """The loss of a forward that returns (logits, load-balancing loss): cross entropy plus `coefficient` times the
    routers' loss, as transformers' MoE models add it with labels. The routers' loss is computed from the tokens of
    the forward that returned it, so under data parallelism it is each rank's own: the one part of MoE training that
    depends on how the batch is split. (nn.DataParallel gathers one per replica: their mean.)"""

    def loss_fn(output: tuple[torch.Tensor, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
        logits, aux = output
        return cross_entropy(logits, target) + coefficient * aux.mean()

    # the loss without the routers' term: what dpcompare.verify.split_causes tests the split with
    loss_fn.per_forward_term = lambda output, target: cross_entropy(output[0], target)
    return loss_fn


def cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy over the targets not IGNORED."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=IGNORED)


__all__ = ["causal_tokens", "cross_entropy", "mask_token", "masked_tokens", "pixel_shape", "pixels", "recompute",
           "task_class", "with_router_aux"]
