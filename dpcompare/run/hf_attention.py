"""The attention a `--model hf:` model runs, and what the result says of its dropout.

Owns: the attention implementation asked of transformers for a model class and its config (`choose`), dpcompare's
own eager attention `dpcompare_eager` (registered with transformers, whose dropout is the attention module's own
`nn.Dropout` module, or one `give_dropout_modules` adds to a module that drops out functionally, so its masks are
drawn by a module like every other dropout of the model), and the phrase
`model_info.source` gives the attention and the dropout (`describe`): what runs, never whether it was checked (that is
the verdict's). Imports transformers lazily and nothing of dpcompare.

The rule (issue 39): a class asks for sdpa only where it declares support for it (`_supports_sdpa`); a config whose
attention drops out runs `dpcompare_eager` where the class dispatches through transformers' attention interface
(`_supports_attention_backend`), else transformers' own eager path (Bloom's and Falcon's drop out by an
`nn.Dropout` there); everything else asks for nothing, so transformers picks its default (sdpa where it can, else
eager), and a model without attention (ResNet, ConvNeXt) is given no attention argument at all.
"""

from __future__ import annotations

import sys

import functools
import inspect
from typing import Any

import torch
from torch import nn

ATTENTION = "dpcompare_eager"
"""The attention implementation registered for configs whose attention drops out: eager, dropout by module."""
ATTENTION_DROPOUT_KEYS = ("attn_pdrop", "attention_dropout", "attention_probs_dropout_prob")
ADDED_DROPOUT = "dpcompare_attention_dropout"
"""The `nn.Dropout` given to an attention module that drops out functionally (Llama's, GPT-BigCode's), so that
`dpcompare_eager` draws its mask by a module too."""
_DROPOUT_MODULE_NAMES = ("attn_dropout", "attention_dropout", "dropout")
"""Where transformers' attention modules keep the `nn.Dropout` of their probabilities (GPT-2, Bloom, BERT and Swin)."""


def attention_dropout(config: Any) -> float:
    return max((float(getattr(config, k, 0.0) or 0.0) for k in ATTENTION_DROPOUT_KEYS), default=0.0)


def choose(cls: type, config: Any) -> str | None:
    """The `attn_implementation` to build `cls` with (None: ask for nothing)."""
    declared = getattr(config, "_attn_implementation", None)
    if declared:  # the user's config names one: transformers accepts it or says why not
        return declared
    if attention_dropout(config) > 0:
        if getattr(cls, "_supports_attention_backend", False):
            _register()
            return ATTENTION
        return "eager"
    return "sdpa" if getattr(cls, "_supports_sdpa", False) else None


def _dropout_module(module: nn.Module, p: float) -> nn.Dropout | None:
    """The attention module's own dropout of probability `p` (None where it keeps no such module); the one dpcompare
    gave it whatever its probability (--no-dropout sets it to 0 while the module still passes the config's)."""
    given = getattr(module, ADDED_DROPOUT, None)
    if isinstance(given, nn.Dropout):
        return given
    for name in _DROPOUT_MODULE_NAMES:
        drop = getattr(module, name, None)
        if isinstance(drop, nn.Dropout) and drop.p == p:
            return drop
    return None


@functools.cache
def _dispatches(cls: type) -> bool:
    """Does `cls.forward` call transformers' attention interface (the modules `dpcompare_eager` runs in)?"""
    try:
        return "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False


def attention_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if _dispatches(type(m))]


def give_dropout_modules(model: nn.Module, config: Any) -> int:
    """Give each attention module of `model` that keeps no `nn.Dropout` of the config's attention dropout one of its
    own (`ADDED_DROPOUT`: no parameter, no buffer, so the state dict is unchanged); returns how many got one."""
    p = attention_dropout(config)
    given = 0
    for module in attention_modules(model):
        if p > 0 and _dropout_module(module, p) is None:
            module.add_module(ADDED_DROPOUT, nn.Dropout(p))
            given += 1
    return given


def _softcapped(scores: torch.Tensor, softcap: float) -> torch.Tensor:
    """Gemma 2's attention logit soft-capping (transformers' eager attention for it)."""
    return torch.tanh(scores / softcap) * softcap


def eager_module_dropout(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                         softcap: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager attention (grouped key/value heads repeated, additive mask, Gemma 2's logit soft-capping) whose dropout is
    the module's own `nn.Dropout`, so the mask it draws is a module's; a module without one drops out functionally, as
    transformers' eager attention does."""
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        # attention sinks (GPT-OSS): the model's own eager attention, whose functional dropout the dispatcher records
        own = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if own is None:
            raise ValueError(f"--model hf:...: {type(module).__name__} uses attention sinks and its module defines no "
                             f"eager_attention_forward for {ATTENTION} to hand them to; set the config's attention "
                             "dropout to 0 to run the model's own attention")
        return own(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = (query @ key.transpose(-1, -2)) * (scaling if scaling is not None else query.shape[-1] ** -0.5)
    if softcap is not None:
        scores = _softcapped(scores, softcap)
    if attention_mask is not None:
        scores = scores + attention_mask[..., : key.shape[-2]]
    # in float32 at least, as transformers' eager attention does, and in float64 in the float64 oracle
    weights = scores.softmax(dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(value.dtype)
    drop = _dropout_module(module, dropout) if dropout > 0 else None
    if drop is not None:
        weights = drop(weights)
    elif dropout > 0:
        weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    return (weights @ value).transpose(1, 2).contiguous(), weights


@functools.cache
def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(ATTENTION, eager_module_dropout)
    AttentionMaskInterface.register(ATTENTION, eager_mask)


def _has_attention(model: nn.Module) -> bool:
    return any("Attention" in type(m).__name__ for m in model.modules())


def _dropout_fields(config: Any) -> list[str]:
    """The config's nonzero dropout probabilities other than the attention's, as `name p`."""
    fields = []
    for key, value in sorted(config.to_dict().items()):
        if ("drop" in key and key not in ATTENTION_DROPOUT_KEYS and isinstance(value, float) and value > 0
                and not key.startswith(("classifier", "summary"))):
            fields.append(f"{key} {value:g}")
    return fields


def describe(model: nn.Module, config: Any) -> str:
    """What runs: the attention implementation, where its dropout is drawn, and the config's other dropout."""
    if not _has_attention(model):
        phrase = "no attention"
    else:
        used = getattr(model.config, "_attn_implementation", None) or "eager"
        p = attention_dropout(config)
        if p == 0:
            phrase = f"attention {used}"
        elif used == ATTENTION and all(_dropout_module(m, p) for m in attention_modules(model)):
            phrase = f"attention {ATTENTION} (eager; its dropout {p:g} drawn by each attention module's nn.Dropout)"
        else:
            phrase = f"attention {used} (with its dropout {p:g})"
    others = _dropout_fields(config)
    if others:
        return f"{phrase}; dropout in the config: {', '.join(others)}"
    return f"{phrase}; no {'other ' if 'dropout' in phrase else ''}dropout in the config"


__all__ = ["ATTENTION", "attention_dropout", "choose", "describe", "eager_module_dropout"]
