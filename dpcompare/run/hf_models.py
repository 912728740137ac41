"""Hugging Face transformers models by name: `--model hf:NAME_OR_PATH`.

Owns: the workload of a transformers model built from its config alone (`AutoConfig`, then the Auto class its
config names: a causal LM or an image classifier) with random weights from the seed, on synthetic batches of the
config's shapes (token streams of `--seq-len` for a causal LM, pixels of the config's image size for a vision
model). Nothing is downloaded: a hub name needs its config.json in the local Hugging Face cache
(`hf download NAME config.json`), a folder holding a config.json works offline. `transformers` is an optional
extra (`pip install "dpcompare[hf]"`).

The model keeps its own class and parameter names (`model.layers.0.self_attn.q_proj.weight`): its class is swapped
for a subclass whose forward takes the batch's tensor and returns the logits, as the trainer's loss expects. Its
`_no_split_modules` name the blocks FSDP shards and `--activation-checkpointing` recomputes
(dpcompare.contract.workload.block_modules). Attention that drops out (GPT-2's attn_pdrop) runs through an eager
attention that applies the model's own `nn.Dropout` module, so its masks are captured and replayed in the oracle
like every other dropout; attention without dropout keeps the config's implementation (sdpa by default).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from dpcompare.run.config import CommandLineError
from dpcompare.run.workloads import Workload, _cross_entropy, _generator, token_stream

PREFIX = "hf:"
INSTALL = 'pip install "dpcompare[hf]"  (or: pip install transformers)'
DEFAULT_SEQ_LEN = 128
"""Tokens per sample of a causal LM when --seq-len is not given (at most the config's context)."""
ATTENTION = "dpcompare_eager"
"""The attention implementation registered for configs whose attention drops out: eager, dropout by module."""
_ATTENTION_DROPOUT_KEYS = ("attn_pdrop", "attention_dropout", "attention_probs_dropout_prob")


def is_hf(spec: str) -> bool:
    return spec.startswith(PREFIX)


def transformers_problem() -> str | None:
    """None when transformers imports; otherwise one line naming the install."""
    try:
        importlib.import_module("transformers")
    except Exception as exc:  # noqa: BLE001 - an incompatible build raises more than ImportError
        return f"--model hf:... needs the transformers package ({type(exc).__name__}: {exc}); install it: {INSTALL}"
    return None


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' own warnings while a config is read and a model built (a tiny config's token ids, deprecated
    keys) are not the run's: they are silenced for that time only."""
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)


def load_config(spec: str) -> Any:
    """The config named by `hf:NAME_OR_PATH`: a folder (or a config.json file) on disk, or a hub name whose config is
    in the local cache. Raises CommandLineError with one line saying what to do."""
    if (problem := transformers_problem()) is not None:
        raise CommandLineError(problem)
    from transformers import AutoConfig

    name = spec[len(PREFIX):].strip()
    if not name:
        raise CommandLineError("--model hf: names no model: give hf:NAME (a hub name whose config is cached) or "
                               "hf:PATH (a folder holding config.json), e.g. --model hf:./tiny-llama")
    path = Path(name).expanduser()
    try:
        with _quiet_transformers():
            if path.is_file():
                return AutoConfig.for_model(**json.loads(path.read_text()))
            if path.is_dir():
                return AutoConfig.from_pretrained(str(path), local_files_only=True)
            if name.startswith((".", "/", "~")) or path.suffix == ".json":
                raise CommandLineError(f"--model {spec}: {path} does not exist; give a folder holding config.json, a "
                                       "config.json file or a hub name")
            return AutoConfig.from_pretrained(name, local_files_only=True)
    except CommandLineError:
        raise
    except OSError as exc:
        raise CommandLineError(
            f"--model {spec}: no config for {name!r} on disk or in the local Hugging Face cache (nothing is downloaded "
            f"during a run); fetch it once with `hf download {name} config.json`, or give a folder holding its "
            f"config.json") from exc
    except (ValueError, KeyError, json.JSONDecodeError) as exc:
        raise CommandLineError(f"--model {spec}: transformers cannot read that config ({type(exc).__name__}: "
                               f"{str(exc).splitlines()[0] if str(exc) else ''})") from exc


def _kind(config: Any) -> str:
    """'causal_lm' or 'image_classification': the task the config's architectures name, else the first Auto mapping
    that holds its config class."""
    from transformers.models.auto import modeling_auto as auto

    for arch in getattr(config, "architectures", None) or []:
        if arch.endswith(("ForCausalLM", "LMHeadModel")):
            return "causal_lm"
        if arch.endswith("ForImageClassification"):
            return "image_classification"
    if type(config) in auto.MODEL_FOR_CAUSAL_LM_MAPPING:
        return "causal_lm"
    if type(config) in auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING:
        return "image_classification"
    raise CommandLineError(f"--model hf:...: a {type(config).__name__} ({config.model_type}) is neither a causal "
                           "language model nor an image classifier; dpcompare builds those two kinds (write a "
                           "--model package.module:function for another)")


def attention_dropout(config: Any) -> float:
    return max((float(getattr(config, k, 0.0) or 0.0) for k in _ATTENTION_DROPOUT_KEYS), default=0.0)


def _eager_module_dropout(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                          **_: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager attention (grouped key/value heads repeated, additive mask) whose dropout is the module's own
    `nn.Dropout` (`attn_dropout`), so the mask it draws is captured; a module without one drops out functionally
    (the probe then names it uncapturable)."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = (query @ key.transpose(-1, -2)) * (scaling if scaling is not None else query.shape[-1] ** -0.5)
    if attention_mask is not None:
        scores = scores + attention_mask[..., : key.shape[-2]]
    weights = scores.softmax(dim=-1).to(value.dtype)
    drop = getattr(module, "attn_dropout", None)
    if isinstance(drop, nn.Dropout):
        weights = drop(weights)
    elif dropout > 0:
        weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    return (weights @ value).transpose(1, 2).contiguous(), weights


@functools.cache
def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(ATTENTION, _eager_module_dropout)
    AttentionMaskInterface.register(ATTENTION, eager_mask)


@functools.cache
def _returning_logits(cls: type, kind: str) -> type:
    """`cls` with a forward that takes the batch tensor alone and returns the logits tensor (module and parameter
    names unchanged). `recompute_activations`: set by dpcompare's float64 verification copies, which recompute each
    block in backward (transformers' gradient checkpointing) to hold one block's activations at a time."""

    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if getattr(self, "recompute_activations", False) and not _recomputing(self):
            _recompute(self)
        if kind == "causal_lm":
            return cls.forward(self, input_ids=x, use_cache=False).logits
        return cls.forward(self, pixel_values=x).logits

    return type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__,
                                       "__doc__": f"{cls.__name__}: forward(batch) -> logits (dpcompare --model hf:)"})


def _recomputing(model: nn.Module) -> bool:
    if hasattr(type(model), "is_activation_checkpointing"):  # transformers >= 5.x renamed gradient checkpointing
        return bool(model.is_activation_checkpointing)
    return bool(model.is_gradient_checkpointing)


def _recompute(model: nn.Module) -> None:
    """transformers' per-layer recomputation, non-reentrant."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def build(spec: str, seed: int, seq_len: int | None = None) -> Workload:
    """The workload of `hf:NAME_OR_PATH`: the config's model with random weights from `seed` and synthetic data."""
    config = load_config(spec)
    kind = _kind(config)
    import transformers
    from transformers import AutoModelForCausalLM, AutoModelForImageClassification

    p_attn = attention_dropout(config)
    attention = getattr(config, "_attn_implementation", None) or "sdpa"
    if p_attn > 0:
        _register_attention()
        attention = ATTENTION
    auto = AutoModelForCausalLM if kind == "causal_lm" else AutoModelForImageClassification
    torch.manual_seed(seed)
    try:
        with _quiet_transformers():
            model = auto.from_config(config, dtype=torch.float32, attn_implementation=attention)
    except (ValueError, ImportError) as exc:
        raise CommandLineError(f"--model {spec}: transformers cannot build {type(config).__name__} from its config "
                               f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from exc
    model.__class__ = _returning_logits(type(model), kind)
    model.recompute_activations = False
    params = sum(p.numel() for p in model.parameters())
    source = (f"transformers {transformers.__version__} {type(model).__name__} from {spec[len(PREFIX):]} "
              f"({_size(params)} parameters, random init from the seed, attention {attention}"
              f"{f' with dropout {p_attn:g} captured' if p_attn > 0 else ''})")
    name = spec
    if kind == "causal_lm":
        vocab = int(config.vocab_size)
        context = int(getattr(config, "max_position_embeddings", 0) or getattr(config, "n_positions", 0) or 0)
        seq = seq_len or (min(DEFAULT_SEQ_LEN, context) if context else DEFAULT_SEQ_LEN)
        if context and seq > context:
            raise CommandLineError(f"--seq-len {seq} is longer than {spec}'s context ({context} positions): give "
                                   f"--seq-len {context} or less")

        def make_tokens(step: int, global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
            return token_stream(seed, step, global_batch, vocab, seq, 8)

        return Workload(name, model, make_tokens, _cross_entropy, tokens_per_sample=seq,
                        source=f"{source}, {seq} tokens per sample")
    if seq_len is not None:
        raise CommandLineError(f"--seq-len is for causal language models; {spec} is an image classifier: drop it")
    side, channels = int(config.image_size), int(getattr(config, "num_channels", 3))
    classes = int(config.num_labels)

    def make_pixels(step: int, global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = _generator(seed, step)
        x = torch.randn(global_batch, channels, side, side, generator=g)
        return x, torch.randint(0, classes, (global_batch,), generator=g)

    return Workload(name, model, make_pixels, _cross_entropy,
                    source=f"{source}, {channels}x{side}x{side} pixels, {classes} classes")


def _size(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return str(n)


def parameter_count(spec: str) -> int:
    """The parameters of `hf:NAME_OR_PATH` without building it (the meta device holds no storage)."""
    config = load_config(spec)
    from transformers import AutoModelForCausalLM, AutoModelForImageClassification

    auto = AutoModelForCausalLM if _kind(config) == "causal_lm" else AutoModelForImageClassification
    with torch.device("meta"), _quiet_transformers():
        model = auto.from_config(config, dtype=torch.float32)
    return sum(p.numel() for p in model.parameters())


__all__ = ["build", "is_hf", "load_config", "parameter_count", "transformers_problem"]
