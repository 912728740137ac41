"""Tiny configs of the transformers families users train, for `--model hf:DIR` (support for the tests, not a test).

Owns: `FAMILIES` (the model types of issue 39's matrix, each with the dimensions that make it small and the
`architectures` its config names), `family_config` (the config, built with `AutoConfig.for_model`, dropout left as
the family's config has it) and `write_family` / `write_families` (the config.json folders a run reads). Imports
transformers only; nothing of dpcompare.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

WIDTH = 64
VOCAB = 256
CONTEXT = 64

_DECODER = dict(hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=CONTEXT)
_IMAGE = 32
"""Pixels per side of the vision configs: the smallest that every family's patching and downsampling accepts."""

FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    # name: (architectures[0], the config's fields that make it tiny)
    "llama": ("LlamaForCausalLM", _DECODER),
    "qwen2": ("Qwen2ForCausalLM", _DECODER),
    "qwen3": ("Qwen3ForCausalLM", {**_DECODER, "head_dim": WIDTH // 4}),
    "mistral": ("MistralForCausalLM", {**_DECODER, "head_dim": WIDTH // 4, "sliding_window": 32}),
    "gemma": ("GemmaForCausalLM", {**_DECODER, "head_dim": WIDTH // 4}),
    "gemma2": ("Gemma2ForCausalLM", {**_DECODER, "head_dim": WIDTH // 4, "sliding_window": 32}),
    "phi3": ("Phi3ForCausalLM", {**_DECODER, "original_max_position_embeddings": CONTEXT, "pad_token_id": 0,
                                 "bos_token_id": 1, "eos_token_id": 2}),
    "gpt_neox": ("GPTNeoXForCausalLM", {k: v for k, v in _DECODER.items() if k != "num_key_value_heads"}),
    "opt": ("OPTForCausalLM", dict(hidden_size=WIDTH, ffn_dim=2 * WIDTH, num_hidden_layers=2, num_attention_heads=4,
                                   vocab_size=VOCAB, max_position_embeddings=CONTEXT, word_embed_proj_dim=WIDTH,
                                   pad_token_id=1, bos_token_id=2, eos_token_id=2)),
    "bloom": ("BloomForCausalLM", dict(hidden_size=WIDTH, n_layer=2, n_head=4, vocab_size=VOCAB)),
    "falcon": ("FalconForCausalLM", dict(hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=4,
                                         vocab_size=VOCAB, max_position_embeddings=CONTEXT, ffn_hidden_size=2 * WIDTH,
                                         bos_token_id=0, eos_token_id=0)),
    "gpt2": ("GPT2LMHeadModel", dict(n_embd=WIDTH, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=CONTEXT,
                                     bos_token_id=0, eos_token_id=0)),
    "mixtral": ("MixtralForCausalLM", {**_DECODER, "num_local_experts": 4, "num_experts_per_tok": 2,
                                       "output_router_logits": True, "router_aux_loss_coef": 0.02}),
    "bert": ("BertForMaskedLM", dict(hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=2,
                                     num_attention_heads=4, vocab_size=VOCAB, max_position_embeddings=CONTEXT)),
    "vit": ("ViTForImageClassification", dict(hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=2,
                                              num_attention_heads=4, image_size=_IMAGE, patch_size=8, num_labels=10)),
    "convnext": ("ConvNextForImageClassification", dict(hidden_sizes=[16, 32], depths=[1, 1], patch_size=4,
                                                        image_size=_IMAGE, num_labels=10, num_stages=2)),
    "resnet": ("ResNetForImageClassification", dict(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                                                    layer_type="basic", num_labels=10)),
    "swin": ("SwinForImageClassification", dict(image_size=_IMAGE, patch_size=4, embed_dim=16, depths=[1, 1],
                                                num_heads=[2, 4], window_size=4, num_labels=10)),
}
"""Issue 39's minimum: the decoder families, a mixture of experts, a masked LM, a vision transformer, two
convolutional networks without attention (ResNet without `image_size` in its config) and a windowed vision
transformer with drop path."""


IMAGE_FAMILIES = frozenset({"vit", "convnext", "resnet", "swin"})
"""The image classifiers (no --seq-len)."""


def family_config(name: str, **overrides: Any) -> Any:
    """The tiny config of family `name` (a key of FAMILIES), its `architectures` set, `overrides` applied last."""
    from transformers import AutoConfig

    architecture, fields = FAMILIES[name]
    return AutoConfig.for_model(name, architectures=[architecture], **{**fields, **overrides})


def write_family(root: Path, name: str, json_fields: dict[str, Any] | None = None, **overrides: Any) -> Path:
    """`root/tiny-NAME`, a folder holding the family's config.json (`--model hf:FOLDER`); `json_fields` are written
    into config.json as they are, for the keys transformers reads but does not save (`experts_implementation`)."""
    folder = root / f"tiny-{name.replace('_', '-')}"
    family_config(name, **overrides).save_pretrained(folder)
    if json_fields:
        path = folder / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **json_fields}, indent=2))
    return folder


def write_families(root: Path, names: list[str] | None = None) -> dict[str, Path]:
    return {name: write_family(root, name) for name in (names or list(FAMILIES))}
