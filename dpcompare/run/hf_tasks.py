"""What a `--model hf:` model is trained on: its forward, its batches and its loss, per task, as transformers trains it.

Owns: the class swap that gives a transformers model the forward the trainer calls (`model(**batch)`, the batch a
dict as transformers' Trainer passes it, returning the model's output with its own loss; with the routers'
load-balancing loss where the config asks for it), the recomputation the verification copies switch on
(`recompute_activations`), and each task's data and loss:
  - causal LM: token streams of `seq` tokens, padded at the end to lengths of their own (dpcompare.run.workloads.
    token_batch), or packed: `input_ids`, `attention_mask` (0 on the padding) and `labels` (IGNORED on the padding,
    shifted by the model itself: its items are the labels after the first position, `shifted_items`);
  - masked LM: the same streams masked as transformers' collator masks them (15% of the positions at random, 80/10/10),
    or packed: the same number of positions masked in every sample; drawn from (seed, step), so every rank rebuilds
    the same global batch;
  the loss the model's own, the mean over the labels not IGNORED; under --loss-normalisation global a model whose loss
  is transformers' `loss_function` is given the step's count as `num_items_in_batch` (`takes_num_items`);
  - image classifier: Gaussian `pixel_values` and random `labels`.
Imports transformers lazily; of dpcompare only the contract and the built-in workloads' data helpers.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import torch
from torch import nn
from torch.nn import functional as F

from dpcompare.contract.activation_checkpointing import checkpoint_blocks
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
    """`cls` with a forward that takes the batch dict as transformers' Trainer passes it (`input_ids`,
    `attention_mask`, `labels`; `pixel_values`, `labels`) and returns the model's own output, its loss the model's own
    (module and parameter names unchanged); with `router_aux`, the routers' load-balancing loss asked for and added as
    the model adds it. `recompute_activations`: set by dpcompare's float64 verification copies, which then recompute
    each block in backward (`recompute`) to hold one block's activations at a time."""

    def forward(self: nn.Module, **batch: Any) -> Any:
        if getattr(self, "recompute_activations", False):
            recompute(self)
        extra: dict[str, Any] = {"use_cache": False} if task == "causal_lm" else {}
        if router_aux:
            extra["output_router_logits"] = True
        out = cls.forward(self, **batch, **extra)
        if router_aux and out.aux_loss is None:
            raise RuntimeError(f"{cls.__name__} returned no aux_loss though output_router_logits was asked for")
        return out

    return type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__,
                                       "__doc__": f"{cls.__name__}: forward(**batch) -> its output with its loss "
                                                  "(dpcompare --model hf:)"})


def takes_num_items(cls: type) -> bool:
    """Whether `cls`'s forward computes its loss with transformers' `loss_function`, which divides the sum by the
    `num_items_in_batch` it is given (BERT's masked LM, for one, takes the mean of its own)."""
    try:
        return "self.loss_function(" in inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False


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
Batch = dict[str, torch.Tensor]


def causal_tokens(seed: int, vocab: int, seq: int, token_data: str = "padded") -> Callable[[int, int], Batch]:
    """The causal LM's batch as a collator makes it: `input_ids` padded at the end (dpcompare.run.workloads.token_batch),
    `attention_mask` 0 on the padding, `labels` the ids with IGNORED on the padding (the model shifts them itself)."""
    def make_batch(step: int, global_batch: int) -> Batch:
        ids, targets = token_batch(seed, step, global_batch, vocab, seq, MAX_STRIDE, token_data)
        # the padding starts after the last position whose next token is a target
        lengths = (targets != IGNORED).sum(dim=1, keepdim=True) + 1
        mask = (torch.arange(seq)[None, :] < lengths).long()
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, IGNORED)}

    return make_batch


def shifted_items(batch: Batch) -> int:
    """A causal LM's items: the labels after the first position not IGNORED (the model predicts each from the ones
    before it)."""
    return int((batch["labels"][:, 1:] != IGNORED).sum())


def mask_token(config: Any) -> int:
    """The config's mask token where it names one inside the vocabulary, else the vocabulary's last id."""
    vocab = int(config.vocab_size)
    declared = getattr(config, "mask_token_id", None)
    return int(declared) if isinstance(declared, int) and 0 <= declared < vocab else vocab - 1


def masked_per_sample(seq: int) -> int:
    return max(1, round(MASKED_SHARE * seq))


def masked_tokens(seed: int, vocab: int, seq: int, mask_id: int, token_data: str = "padded"
                  ) -> Callable[[int, int], Batch]:
    """Token streams (never holding `mask_id`) with positions chosen for the loss, `labels` the original tokens there
    and IGNORED elsewhere. `packed`: `masked_per_sample(seq)` positions of each sample, replaced by `mask_id`. Else as
    transformers' DataCollatorForLanguageModeling: each position chosen with probability MASKED_SHARE (at least one a
    sample), 80% of the chosen replaced by `mask_id`, 10% by a random token, 10% kept, so the count differs from sample
    to sample and from rank to rank. Drawn from (seed, step) alone: every rank rebuilds the same batch."""
    per_sample = masked_per_sample(seq)

    def make_batch(step: int, global_batch: int) -> Batch:
        tokens, _ = token_stream(seed, step, global_batch, vocab - 1, seq, MAX_STRIDE)
        tokens = tokens + (tokens >= mask_id).long()  # the stream skips the mask id
        # a generator of its own, from (seed, step) alone: every rank draws the same positions
        g = torch.Generator().manual_seed((seed * 1_000_003 + step) ^ (1 << 62))
        draw = torch.rand(global_batch, seq, generator=g)
        mask = torch.ones_like(tokens)
        if token_data == "packed":
            where = draw.argsort(dim=1)[:, :per_sample]
            labels = torch.full_like(tokens, IGNORED).scatter_(1, where, tokens.gather(1, where))
            return {"input_ids": tokens.scatter(1, where, mask_id), "attention_mask": mask, "labels": labels}
        chosen = draw < MASKED_SHARE
        chosen[torch.arange(global_batch), draw.argmin(dim=1)] = True  # at least one position a sample
        labels = tokens.masked_fill(~chosen, IGNORED)
        kind = torch.rand(global_batch, seq, generator=g)
        random = torch.randint(0, vocab, (global_batch, seq), generator=g)
        inputs = torch.where(chosen & (kind < 0.8), torch.full_like(tokens, mask_id), tokens)
        inputs = torch.where(chosen & (kind >= 0.8) & (kind < 0.9), random, inputs)
        return {"input_ids": inputs, "attention_mask": mask, "labels": labels}

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
        return {"pixel_values": x, "labels": torch.randint(0, classes, (global_batch,), generator=g)}

    return make_batch


def model_loss(output: Any, batch: Batch) -> torch.Tensor:
    """The model's own loss of the batch (the mean over its labels not IGNORED, or over its samples)."""
    return output.loss


def with_router_aux(coefficient: float) -> Callable[[Any, Batch], torch.Tensor]:
    """The model's own loss of a forward that asked for its routers' load-balancing loss: cross entropy plus
    `coefficient` times the routers' loss, as transformers' MoE models add it with labels. The routers' loss is computed
    from the tokens of the forward that returned it, so under data parallelism it is each rank's own: the one part of
    MoE training that depends on how the batch is split. (nn.DataParallel gathers one per replica: their mean.)"""

    def loss_fn(output: Any, batch: Batch) -> torch.Tensor:
        return output.loss

    # the loss without the routers' term: what dpcompare.verify.model_facts.split_causes tests the split with
    loss_fn.per_forward_term = lambda output, batch: output.loss - coefficient * output.aux_loss.to(output.loss.device)
    return loss_fn


def cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy over the targets not IGNORED."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=IGNORED)


__all__ = ["causal_tokens", "cross_entropy", "mask_token", "masked_tokens", "model_loss", "pixel_shape", "pixels",
           "recompute", "shifted_items", "takes_num_items", "task_class", "with_router_aux"]
