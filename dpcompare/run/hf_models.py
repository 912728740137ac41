"""Hugging Face transformers models by name: `--model hf:NAME_OR_PATH`.

Owns: the workload of a transformers model built from its config alone with random weights from the seed: reading
the config (a folder or config.json on disk, or a hub name whose config is in the local Hugging Face cache; nothing
is downloaded: `hf download NAME config.json` fetches one), building the class it names
(dpcompare.run.hf_classes: a causal LM, a masked LM or an image classifier) with the attention
dpcompare.run.hf_attention chooses, and the workload of its task (dpcompare.run.hf_tasks: its forward, data and loss). `transformers` is an
optional extra (`pip install "dpcompare[hf]"`).

The model keeps its own class and parameter names (`model.layers.0.self_attn.q_proj.weight`): its class is swapped
for a subclass whose forward takes the batch dict (`model(**batch)`, as transformers' Trainer calls it) and returns
the model's output with its own loss. Its
`_no_split_modules` name the blocks FSDP shards and `--activation-checkpointing` recomputes
(dpcompare.contract.workload.block_modules). `model_info.source` says what was built and what runs (the attention,
where its dropout is drawn, the data), never whether it was checked: that is the verdict's. Imports transformers
only inside its functions (a run of another model never loads it) and nothing of dpcompare above the run.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from dpcompare.run import hf_attention, hf_classes, hf_tasks
from dpcompare.run.config import CommandLineError
from dpcompare.run.workloads import Workload

PREFIX = "hf:"
INSTALL = 'pip install "dpcompare[hf]"  (or: pip install transformers)'
DEFAULT_SEQ_LEN = 128
"""Tokens per sample of a causal LM when --seq-len is not given (at most the config's context)."""
ATTENTION = hf_attention.ATTENTION


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


def _why(exc: BaseException) -> str:
    """The first line of what went wrong at the bottom of `exc`'s causes (a validator's ValueError, not its
    wrapper's)."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _validation_errors() -> tuple[type[Exception], ...]:
    """What transformers' config classes raise on a field of the wrong type (huggingface_hub's strict dataclasses)."""
    errors = getattr(importlib.import_module("huggingface_hub.errors"), "StrictDataclassError", None)
    return (errors,) if isinstance(errors, type) else ()


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
    except (ValueError, KeyError, TypeError, json.JSONDecodeError, *_validation_errors()) as exc:
        raise CommandLineError(f"--model {spec}: transformers cannot read that config ({_why(exc)})") from exc


def _build_model(spec: str, cls: type, config: Any, attention: str | None, **kwargs: Any) -> nn.Module:
    try:
        with _quiet_transformers():
            return cls._from_config(config, dtype=torch.float32,
                                    **({"attn_implementation": attention} if attention else {}), **kwargs)
    except Exception as exc:  # noqa: BLE001 - the class's own __init__ on the config's fields: the config's error
        raise CommandLineError(f"--model {spec}: transformers cannot build {cls.__name__} from its config "
                               f"({_why(exc)})") from exc


def _router_aux(cls: type, config: Any) -> float:
    """The weight of the routers' load-balancing loss where the config asks for it (`output_router_logits`, a mixture
    of experts whose forward takes it: Mixtral, Qwen2-MoE, OLMoE, ...), else 0."""
    if not getattr(config, "output_router_logits", False):
        return 0.0
    if "output_router_logits" not in inspect.signature(cls.forward).parameters:
        return 0.0  # no router: the flag asks for nothing
    return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)


def build(spec: str, seed: int, seq_len: int | None = None, token_data: str = "padded") -> Workload:
    """The workload of `hf:NAME_OR_PATH`: the config's model with random weights from `seed` and synthetic data
    (`token_data`, a language model's: padded or packed, dpcompare.run.hf_tasks)."""
    config = load_config(spec)
    cls, task = hf_classes.resolve(spec, config)
    import transformers

    if task == "image_classification" and seq_len is not None:
        raise CommandLineError(f"--seq-len is for language models; {spec} is an image classifier: drop it")
    aux = _router_aux(cls, config) if task != "image_classification" else 0.0
    attention = hf_attention.choose(cls, config)
    torch.manual_seed(seed)
    model = _build_model(spec, cls, config, attention)
    if attention == hf_attention.ATTENTION:
        hf_attention.give_dropout_modules(model, config)
    model.__class__ = hf_tasks.task_class(cls, task, aux != 0.0)
    if hasattr(model.config, "use_cache"):
        model.config.use_cache = False  # training keeps no key/value cache (and recomputation refuses one)
    model.recompute_activations = False
    params = sum(p.numel() for p in model.parameters())
    source = (f"transformers {transformers.__version__} {cls.__name__} from {spec[len(PREFIX):]} ({_size(params)} "
              f"parameters, random init from the seed, {hf_attention.describe(model, config)})")
    if task == "image_classification":
        channels, height, width, origin = hf_tasks.pixel_shape(config)
        classes = int(config.num_labels)
        return Workload(spec, model, hf_tasks.pixels(seed, (channels, height, width), classes), hf_tasks.model_loss,
                        source=f"{source}, {channels}x{height}x{width} pixels ({origin}), {classes} classes, "
                               "its own loss")
    vocab = int(config.vocab_size)
    seq = _sequence_length(spec, config, seq_len)
    # a routers' load-balancing term is added to the loss per forward, not over items: the step's count would divide
    # the cross entropy alone, which the oracle's weighting of the whole loss by items does not model (the loss's
    # mean is scaled by its items instead)
    num_items = "num_items_in_batch" if hf_tasks.takes_num_items(cls) and not aux else None
    said = (", its own loss (num_items_in_batch under --loss-normalisation global)" if num_items else
            ", its own loss (its own mean: --loss-normalisation global scales it by the items)")
    if task == "masked_lm":
        mask_id = hf_tasks.mask_token(config)
        masking = (f"{hf_tasks.masked_per_sample(seq)} of {seq} tokens per sample masked (token {mask_id})"
                   if token_data == "packed" else
                   f"each of {seq} tokens chosen with probability {hf_tasks.MASKED_SHARE:g} (at least one a sample), "
                   f"80% of them masked (token {mask_id}), 10% a random token, 10% kept, as transformers' collator")
        return Workload(spec, model, hf_tasks.masked_tokens(seed, vocab, seq, mask_id, token_data),
                        hf_tasks.model_loss, tokens_per_sample=seq, ignore_index=hf_tasks.IGNORED,
                        num_items_kwarg=num_items,
                        source=f"{source}, masked LM: {masking}, positions drawn from (seed, step){said}")
    loss_fn = hf_tasks.with_router_aux(aux) if aux else hf_tasks.model_loss
    aux_note = (f"; load-balancing loss {aux:g} x the routers' auxiliary loss of each forward's own tokens (per rank: "
                "its value depends on how the batch is split)" if aux else "")
    lengths = ("padded at the end to lengths drawn from (seed, step), attention_mask 0 and labels -100 there"
               if token_data != "packed" else "packed")
    return Workload(spec, model, hf_tasks.causal_tokens(seed, vocab, seq, token_data), loss_fn, tokens_per_sample=seq,
                    ignore_index=hf_tasks.IGNORED, items=hf_tasks.shifted_items, num_items_kwarg=num_items,
                    source=f"{source}, {seq} tokens per sample ({lengths}){said}{aux_note}")


def _sequence_length(spec: str, config: Any, seq_len: int | None) -> int:
    context = int(getattr(config, "max_position_embeddings", 0) or getattr(config, "n_positions", 0) or 0)
    seq = seq_len or (min(DEFAULT_SEQ_LEN, context) if context else DEFAULT_SEQ_LEN)
    if context and seq > context:
        raise CommandLineError(f"--seq-len {seq} is longer than {spec}'s context ({context} positions): give "
                               f"--seq-len {context} or less")
    return seq


def _size(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return str(n)


def parameter_count(spec: str) -> int:
    """The parameters of `hf:NAME_OR_PATH` without building it (the meta device holds no storage)."""
    config = load_config(spec)
    cls, _ = hf_classes.resolve(spec, config)
    with torch.device("meta"):
        model = _build_model(spec, cls, config, hf_attention.choose(cls, config))
    return sum(p.numel() for p in model.parameters())


__all__ = ["build", "is_hf", "load_config", "parameter_count", "transformers_problem"]
