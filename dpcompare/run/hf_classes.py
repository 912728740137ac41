"""Which transformers class a `--model hf:` config builds, and for which task.

Owns: `resolve`, the class the config's `architectures` names (its first entry), or, for a config that names none,
the class its model type has for the first task dpcompare trains (a causal LM; a masked LM for an encoder family
such as BERT whose config is no decoder; an image classifier), with the task it is trained on. Refused, each in one
line that names why: an encoder-decoder model, a class transformers does not have (a model with its own code), a
class of another task, and an encoder's LM-head class on a config that is no decoder (it attends both ways, so
next-token targets would be in its own input). Imports transformers lazily and nothing of dpcompare but the
command-line error.
"""

from __future__ import annotations

from typing import Any, Literal

from dpcompare.run.config import CommandLineError

Task = Literal["causal_lm", "masked_lm", "image_classification"]
TASK_WORDS: dict[str, str] = {"causal_lm": "a causal language model", "masked_lm": "a masked language model",
                              "image_classification": "an image classifier"}
_BUILT = "dpcompare builds causal LMs, masked LMs and image classifiers"
_OWN_WORKLOAD = "or write a --model package.module:function (README, \"Your own model\")"


def _classes(mapping: dict[str, Any]) -> set[str]:
    """The class names of an Auto mapping (model type -> a name, or a tuple of names)."""
    names: set[str] = set()
    for value in mapping.values():
        names.update((value,) if isinstance(value, str) else value)
    return names


def _mappings() -> tuple[dict[str, Any], ...]:
    from transformers.models.auto import modeling_auto as auto

    return (auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
            auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES, auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES)


def _first(value: Any) -> str:
    return value if isinstance(value, str) else value[0]


def _encoder_decoder(spec: str, what: str) -> CommandLineError:
    return CommandLineError(f"--model {spec}: {what} is an encoder-decoder model, which dpcompare does not train "
                            f"({_BUILT}); give a config whose architectures names one of those, {_OWN_WORKLOAD}")


def _named_task(spec: str, config: Any, arch: str) -> Task:
    causal, masked, image, seq2seq = _mappings()
    if arch in _classes(seq2seq):
        raise _encoder_decoder(spec, arch)
    encoder = config.model_type in masked
    if arch in _classes(causal) and arch in _classes(masked):  # one head for both (XLM): the config says which
        return "causal_lm" if getattr(config, "is_decoder", False) else "masked_lm"
    if arch in _classes(causal):
        if encoder and not getattr(config, "is_decoder", False):
            raise CommandLineError(
                f"--model {spec}: {arch} is the LM head of an encoder that attends both ways, and its config is no "
                "decoder (is_decoder false), so next-token targets would be in its own input; set \"is_decoder\": "
                f"true in config.json to train it as a causal LM, or name {_first(masked[config.model_type])} to "
                "train it as a masked LM")
        return "causal_lm"
    if arch in _classes(masked):
        return "masked_lm"
    if arch in _classes(image):
        return "image_classification"
    raise CommandLineError(f"--model {spec}: its config's architectures names {arch}, which is neither a causal LM, a "
                           f"masked LM nor an image classifier ({_BUILT}); name one of those in architectures, "
                           f"{_OWN_WORKLOAD}")


def _default(spec: str, config: Any) -> tuple[str, Task]:
    causal, masked, image, _ = _mappings()
    kind = config.model_type
    if getattr(config, "is_encoder_decoder", False):
        raise _encoder_decoder(spec, f"a {type(config).__name__} ({kind})")
    if kind in masked and (kind not in causal or not getattr(config, "is_decoder", False)):
        return _first(masked[kind]), "masked_lm"
    if kind in causal:
        return _first(causal[kind]), "causal_lm"
    if kind in image:
        return _first(image[kind]), "image_classification"
    raise CommandLineError(f"--model {spec}: a {type(config).__name__} ({kind}) has no causal LM, masked LM or image "
                           f"classifier in transformers ({_BUILT}); {_OWN_WORKLOAD}")


def resolve(spec: str, config: Any) -> tuple[type, Task]:
    """The class to build for `config` and the task it trains on; CommandLineError (one line) where there is none."""
    import transformers

    archs = list(getattr(config, "architectures", None) or [])
    name = archs[0] if archs else None
    if name is not None:
        cls = getattr(transformers, name, None)
        if not isinstance(cls, type) or not issubclass(cls, transformers.PreTrainedModel):
            raise CommandLineError(f"--model {spec}: its config's architectures names {name}, which transformers "
                                   f"{transformers.__version__} does not have (a model with its own code is not "
                                   f"built); name a transformers class in architectures, {_OWN_WORKLOAD}")
        return cls, _named_task(spec, config, name)
    name, task = _default(spec, config)
    return getattr(transformers, name), task


__all__ = ["TASK_WORDS", "Task", "resolve"]
