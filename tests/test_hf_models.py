"""Hugging Face transformers models by name (`--model hf:NAME_OR_PATH`), checked against transformers itself and the
float64 oracle.

Checked against: transformers itself (the class the config's `architectures` names, its parameter names and
`_no_split_modules` kept; the same seed builds the same weights; sdpa asked for only where the class declares it, so
Gemma 2, Bloom, ResNet and ConvNeXt build, where asking for sdpa is refused), the batch as transformers trains on it
(one dict, `model(**batch)` returning the model's output, the workload's loss the model's own: every family's the
task's cross entropy of its logits), the config's shapes (tokens of --seq-len below the vocabulary, logits of the
vocabulary's width, pixels of its image size or the stated default where it gives none), every causal LM family's
padded batch (padded at the end, attention_mask 0 exactly where the labels are -100, the labels the ids; the model's
own loss, float64 in the float64 copy, the shifted cross entropy over the labels not -100, the sum divided by
num_items_in_batch where the model takes it; the padding changes no real token's logits, which are the sample's alone
unpadded, while other tokens there change the padding's own; the loss unshifted differs), the workload contract (a
masked LM's loss is a mean over samples because every sample masks as many positions; unequal counts would break it),
the verification copies (their recomputation gives the very gradient, and is left off where BatchNorm would count a
recomputed forward twice), dpcompare's eager attention (transformers' eager attention's numbers, Gemma 2's
soft-capping included), Mixtral's load-balancing loss (the model's loss is the shifted cross entropy plus its
coefficient times it, it reaches the router's gradient, and its value depends on how the batch is split), the mask
capture (GPT-2's and BERT's attention dropout drawn by their nn.Dropout modules) and real runs (tiny configs of
tests/hf_families.py): ResNet and the BERT masked LM on the reference (default tier), a handful under ddp, ZeRO-3 and
FSDP (slow tier), the family matrix (deep tier).
Negatives: a missing folder, an uncached hub name, a --seq-len past the context, an encoder-decoder, a class of
another task or one transformers lacks, an encoder's LM head on a config that is no decoder and transformers missing
are each one line, exit 2, no traceback.
"""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

import hf_families
from conftest import child_env
from dpcompare import block_modules
from dpcompare.contract import batches
from dpcompare.run import hf_attention, hf_classes, hf_models, hf_tasks
from dpcompare.run.config import CommandLineError, RunConfig

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'dpcompare[hf]')")

WIDTH = 64
CAUSAL_FAMILIES = [f for f in hf_families.FAMILIES if f not in hf_families.IMAGE_FAMILIES and f != "bert"]


def shifted_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A causal LM's loss as transformers defines it, computed here: each position's logits predict the next position's
    label, the mean over the labels after the first that are not -100."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                           ignore_index=hf_tasks.IGNORED)


def own_cross_entropy(task: str, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The task's cross entropy computed here: shifted for a causal LM, over the labels not -100 for a masked LM, over
    the samples for an image classifier."""
    if task == "causal_lm":
        return shifted_cross_entropy(logits, labels)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=hf_tasks.IGNORED)


def write_configs(root: Path) -> dict[str, Path]:
    """A Llama-style (grouped key/value heads, RMSNorm, SwiGLU, rotary positions, untied head) and a GPT-2-style
    (learned positions, dropout 0.1, tied head) config, 2 layers of width 64, vocabulary 256, context 64."""
    llama, gpt2 = root / "tiny-llama", root / "tiny-gpt2"
    transformers.LlamaConfig(hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=256, max_position_embeddings=64).save_pretrained(llama)
    transformers.GPT2Config(n_embd=WIDTH, n_layer=2, n_head=4, vocab_size=256, n_positions=64, bos_token_id=0,
                            eos_token_id=0).save_pretrained(gpt2)
    return {"llama": llama, "gpt2": gpt2}


@pytest.fixture(scope="module")
def configs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_configs(tmp_path_factory.mktemp("hf"))


def test_a_config_folder_builds_the_model_with_its_own_names_blocks_and_shapes(configs: dict[str, Path]) -> None:
    w = hf_models.build(f"hf:{configs['llama']}", seed=3, seq_len=16, token_data="packed")  # full-length streams
    assert isinstance(w.model, transformers.LlamaForCausalLM)
    names = [n for n, _ in w.model.named_parameters()]
    assert "model.layers.0.self_attn.q_proj.weight" in names and "lm_head.weight" in names
    assert [n for n, _ in block_modules(w.model)] == ["model.layers.0", "model.layers.1"]  # its _no_split_modules
    batch = w.make_batch(0, 4)  # a dict, as transformers' Trainer passes it: the model's inputs and its labels
    inputs, targets = batches.pair(batch)
    assert set(batch) == {"input_ids", "attention_mask", "labels"} and inputs is batch and targets is batch
    ids = batch["input_ids"]
    assert all(t.shape == (4, 16) for t in batch.values()) and int(ids.max()) < 256 and int(ids.min()) >= 0
    # packed: every position attended and a label; the labels are the ids themselves (the model shifts them)
    assert bool((batch["attention_mask"] == 1).all()) and torch.equal(batch["labels"], ids)
    steps = (ids[:, 1:] - ids[:, :-1]) % 256  # the learnable stream: each token the last plus the sample's stride
    assert bool((steps == steps[:, :1]).all()) and bool((steps > 0).all())
    assert w.items(batch) == 4 * 15 and w.ignore_index == hf_tasks.IGNORED  # the first position predicts nothing
    assert w.num_items_kwarg == "num_items_in_batch"  # LlamaForCausalLM's loss is transformers' loss_function
    out = w.model(**batch)
    assert out.logits.shape == (4, 16, 256) and w.tokens_per_sample == 16
    assert w.loss_fn(out, batch) is out.loss and out.loss.ndim == 0
    assert torch.allclose(out.loss, shifted_cross_entropy(out.logits, batch["labels"]), rtol=1e-6, atol=0)
    again = hf_models.build(f"hf:{configs['llama']}", seed=3, seq_len=16)
    other = hf_models.build(f"hf:{configs['llama']}", seed=4, seq_len=16)
    same = [torch.equal(a, b) for a, b in zip(w.model.parameters(), again.model.parameters())]
    assert all(same) and not torch.equal(next(w.model.parameters()), next(other.model.parameters()))
    assert "LlamaForCausalLM" in w.source and "16 tokens per sample" in w.source


def test_gpt2_attention_dropout_is_drawn_by_its_module_so_its_masks_are_captured(configs: dict[str, Path]) -> None:
    from dpcompare.verify.randomness import draw_recording

    w = hf_models.build(f"hf:{configs['gpt2']}", seed=0)
    assert w.model.config._attn_implementation == hf_models.ATTENTION
    assert "dropout 0.1 drawn by each attention module's nn.Dropout" in w.source and "captured" not in w.source
    assert w.model.lm_head.weight is w.model.transformer.wte.weight  # the tied head stays tied
    batch = w.make_batch(0, 2)
    assert draw_recording.uncaptured(w.model.train().double(), batch) is None  # every random number is a captured module's
    # transformers' stock attention drops out in a functional call: recorded at the dispatcher, captured as well
    stock = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(configs["gpt2"]),
                                                          attn_implementation="eager")
    stock.__class__ = hf_tasks.task_class(type(stock), "causal_lm", False)
    assert draw_recording.uncaptured(stock.train().double(), batch) is None


def test_an_attention_that_drops_out_functionally_is_given_a_dropout_module_of_its_own(tmp_path: Path) -> None:
    from dpcompare.verify.randomness import draw_recording
    from dpcompare.verify.randomness import random_modules

    folder = hf_families.write_family(tmp_path, "llama", attention_dropout=0.1)  # LlamaAttention keeps a float
    w = hf_models.build(f"hf:{folder}", 0, 16)
    added = [n for n, m in w.model.named_modules() if n.endswith(hf_attention.ADDED_DROPOUT)]
    assert added == [f"model.layers.{i}.self_attn.{hf_attention.ADDED_DROPOUT}" for i in range(2)]
    assert "drawn by each attention module's nn.Dropout" in w.source
    batch = w.make_batch(0, 2)
    assert draw_recording.uncaptured(w.model.train().double(), batch) is None
    assert all(hf_attention.ADDED_DROPOUT not in key for key in w.model.state_dict())  # the state dict unchanged
    switched = copy.deepcopy(w.model)
    random_modules.switch_off_dropout(switched)  # --no-dropout: the module it was given is switched off with the others
    with torch.no_grad():
        first, second = switched(**batch), switched(**batch)
        assert torch.equal(first.logits, second.logits) and torch.equal(first.loss, second.loss)
    # the negative: with dropout on, two forwards differ (the module draws)
    with torch.no_grad():
        first, second = w.model.train()(**batch), w.model(**batch)
        assert not torch.equal(first.logits, second.logits) and not torch.equal(first.loss, second.loss)


# -- every family: the class its config names, the attention its class supports -----------------------------------
@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return hf_families.write_families(tmp_path_factory.mktemp("families"))


def _build(folder: Path, family: str, seed: int = 0) -> hf_models.Workload:
    return hf_models.build(f"hf:{folder}", seed, None if family in hf_families.IMAGE_FAMILIES else 16)


@pytest.mark.parametrize("family", list(hf_families.FAMILIES))
def test_every_family_builds_the_class_its_config_names_with_an_attention_its_class_supports(
        families: dict[str, Path], family: str) -> None:
    w = _build(families[family], family)
    architecture = hf_families.FAMILIES[family][0]
    cls = getattr(transformers, architecture)
    assert type(w.model).__name__ == architecture and type(w.model).__mro__[1] is cls
    used = w.model.config._attn_implementation
    p = hf_attention.attention_dropout(w.model.config)
    if p > 0:  # dropout drawn by a module where transformers dispatches to dpcompare's attention
        assert used == (hf_attention.ATTENTION if cls._supports_attention_backend else "eager")
    else:
        assert (used == "sdpa") == cls._supports_sdpa
    assert "captured" not in w.source and "checked" not in w.source  # the verdict's to say
    assert hf_models.parameter_count(f"hf:{families[family]}") == sum(p.numel() for p in w.model.parameters())
    batch = w.make_batch(0, 2)
    _, task = hf_classes.resolve("hf:x", w.model.config)
    assert set(batch) == ({"pixel_values", "labels"} if task == "image_classification" else
                          {"input_ids", "attention_mask", "labels"})
    inputs, targets = batches.pair(batch)
    out = batches.call(w.model, inputs)  # model(**batch), as the trainer calls it
    loss = w.loss_fn(out, targets)
    assert loss is out.loss and loss.ndim == 0 and bool(loss.isfinite())
    # the model's own loss is the task's cross entropy of its logits (Mixtral's plus its routers' term)
    routers = getattr(w.loss_fn, "per_forward_term", None)
    own = routers(out, batch) if routers else loss
    assert torch.allclose(own, own_cross_entropy(task, out.logits, batch["labels"]), rtol=1e-5, atol=0)
    loss.backward()
    assert sum(p.grad is not None for p in w.model.parameters()) > 0


def test_models_without_attention_ask_for_none_and_a_config_without_image_size_gets_a_stated_one(
        families: dict[str, Path]) -> None:
    for family in ("resnet", "convnext"):
        w = _build(families[family], family)
        assert "no attention" in w.source
    resnet = _build(families["resnet"], "resnet")
    assert not hasattr(resnet.model.config, "image_size")
    batch = resnet.make_batch(0, 2)
    side = hf_tasks.DEFAULT_IMAGE_SIZE
    assert batch["pixel_values"].shape == (2, 3, side, side) and batch["labels"].shape == (2,)
    assert f"3x{side}x{side} pixels (the config gives no image_size" in resnet.source
    assert resnet.model(**batch).logits.shape == (2, resnet.model.config.num_labels)
    vit = _build(families["vit"], "vit")
    assert vit.make_batch(0, 2)["pixel_values"].shape[-1] == vit.model.config.image_size
    assert "the config's image_size" in vit.source
    # the negative: asking every class for sdpa, as the runs did, is refused by transformers for these
    for family in ("resnet", "gemma2", "bloom"):
        config = hf_families.family_config(family)
        with pytest.raises(ValueError, match="scaled_dot_product_attention"):
            getattr(transformers, config.architectures[0])._from_config(config, attn_implementation="sdpa")


def test_a_declared_block_whose_weight_a_module_outside_it_shares_is_no_block(families: dict[str, Path],
                                                                              tmp_path: Path) -> None:
    w = _build(families["bert"], "bert")
    assert "BertEmbeddings" in w.model._no_split_modules  # declared, but its word embedding is the head's decoder's
    assert w.model.cls.predictions.decoder.weight is w.model.bert.embeddings.word_embeddings.weight
    assert [n for n, _ in block_modules(w.model)] == ["bert.encoder.layer.0", "bert.encoder.layer.1"]
    # the negative: untied, the embeddings are a block of their own (FSDP sharding them alone would untie a tie)
    untied = hf_models.build(f"hf:{hf_families.write_family(tmp_path, 'bert', tie_word_embeddings=False)}", 0, 16)
    assert [n for n, _ in block_modules(untied.model)][0] == "bert.embeddings"


# -- the causal LM's batch: padded at the end as a collator pads it, the model's own loss ------------------------
@pytest.mark.parametrize("family", CAUSAL_FAMILIES)
def test_a_causal_lms_padding_is_masked_left_out_of_its_own_shifted_loss_and_changes_no_real_logit(
        families: dict[str, Path], family: str) -> None:
    from dpcompare.verify.oracle.gradient_oracle import verification_copy

    w = _build(families[family], family)
    batch = w.make_batch(0, 8)
    ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
    padding = labels == hf_tasks.IGNORED
    assert torch.equal(mask == 0, padding)  # the attention mask is 0 exactly where the labels are -100
    lengths = mask.sum(dim=1)
    assert torch.equal(mask, (torch.arange(16) < lengths[:, None]).long())  # padded at the end
    assert int(lengths.min()) >= 2 and len(set(lengths.tolist())) > 1  # lengths of their own
    assert torch.equal(labels[~padding], ids[~padding])  # the labels are the ids (the model shifts them itself)
    assert w.items(batch) == int((lengths - 1).sum()) == int((labels[:, 1:] != hf_tasks.IGNORED).sum())
    assert w.ignore_index == hf_tasks.IGNORED
    vocab = w.model.config.vocab_size
    model = verification_copy(w.model, torch.device("cpu"), torch.float64).eval()  # no dropout
    routers = getattr(w.loss_fn, "per_forward_term", None)  # Mixtral: its own loss adds the routers' term

    def cross_entropy_of(out) -> torch.Tensor:
        return routers(out, batch) if routers else out.loss

    with torch.no_grad():
        out = model(**batch)
        assert out.loss.dtype == torch.float64  # the float64 copy keeps the loss in float64
        # the model's own loss: the shifted cross entropy over the labels not -100
        ours = cross_entropy_of(out)
        assert float(abs(ours - shifted_cross_entropy(out.logits, labels))) < 1e-12 * float(ours)
        # the negative: unshifted, each position would score its own token
        unshifted = F.cross_entropy(out.logits.reshape(-1, vocab), labels.reshape(-1), ignore_index=hf_tasks.IGNORED)
        assert float(abs(ours - unshifted)) > 1e-6 * float(ours)
        if w.num_items_kwarg:  # given the step's count, the loss is the sum over the labels divided by it
            items = w.items(batch)
            for count in (items, 2 * items):
                given = cross_entropy_of(model(**batch, **{w.num_items_kwarg: torch.tensor(count)}))
                assert float(abs(given * count - ours * items)) < 1e-12 * float(ours * items)
        # the padding changes no real token's logits: other tokens there, the real tokens' logits the same ...
        g = torch.Generator().manual_seed(1)
        other = {**batch, "input_ids": torch.where(padding, torch.randint(0, vocab, ids.shape, generator=g), ids)}
        repadded = model(**other)
        real = ~padding
        scale = float(out.logits[real].abs().max())
        assert torch.allclose(repadded.logits[real], out.logits[real], rtol=0, atol=1e-12 * scale)
        assert not torch.allclose(repadded.logits[padding], out.logits[padding], rtol=0, atol=1e-6 * scale)
        assert float(abs(cross_entropy_of(repadded) - ours)) < 1e-12 * float(ours)  # ... and the same loss
        # ... and each sample's real tokens' logits those of the sample alone, unpadded
        for i, n in enumerate(lengths.tolist()):
            alone = model(input_ids=ids[i:i + 1, :n]).logits[0]  # no mask: all of it attended
            assert torch.allclose(alone, out.logits[i, :n], rtol=0, atol=1e-12 * scale), (i, n)


# -- the class: what architectures names, or the model type's; refusals in one line ---------------------------
@pytest.mark.parametrize(("model_type", "fields", "built", "task"), [
    ("llama", {}, "LlamaForCausalLM", "causal_lm"),  # no architectures: the model type's causal LM
    ("bert", {}, "BertForMaskedLM", "masked_lm"),  # an encoder: its masked LM, never its LM head
    ("bert", {"is_decoder": True}, "BertLMHeadModel", "causal_lm"),  # a decoder config: the LM head is causal
    ("bert", {"architectures": ["BertForMaskedLM"]}, "BertForMaskedLM", "masked_lm"),
    ("roberta", {"architectures": ["RobertaForMaskedLM"]}, "RobertaForMaskedLM", "masked_lm"),
    ("vit", {}, "ViTForImageClassification", "image_classification"),
])
def test_the_class_built_is_the_one_the_config_names(model_type: str, fields: dict, built: str, task: str) -> None:
    config = transformers.AutoConfig.for_model(model_type, **fields)
    assert hf_classes.resolve("hf:x", config) == (getattr(transformers, built), task)


@pytest.mark.parametrize(("model_type", "fields", "says"), [
    ("t5", {}, "encoder-decoder"),
    ("bart", {"architectures": ["BartForConditionalGeneration"]}, "BartForConditionalGeneration is an encoder-decoder"),
    ("llama", {"architectures": ["LlamaForSequenceClassification"]}, "neither a causal LM, a masked LM nor an image"),
    ("llama", {"architectures": ["MyOwnForCausalLM"]}, "does not have"),
    ("bert", {"architectures": ["BertLMHeadModel"]}, "is_decoder"),  # it would see its own next-token targets
    ("wav2vec2", {}, "has no causal LM, masked LM or image classifier"),
])
def test_a_class_dpcompare_cannot_train_is_refused_in_one_line(model_type: str, fields: dict, says: str) -> None:
    config = transformers.AutoConfig.for_model(model_type, **fields)
    with pytest.raises(CommandLineError, match=says) as caught:
        hf_classes.resolve("hf:x", config)
    assert "\n" not in str(caught.value)


# -- the masked LM ---------------------------------------------------------------------------------------------
def test_a_masked_lm_masks_positions_drawn_from_seed_and_step_and_its_loss_is_a_mean_over_samples(
        families: dict[str, Path]) -> None:
    """--token-data packed: the same number of positions masked in every sample (the collator's random masking, the
    default, is tests/test_normalisation.py's)."""
    w = hf_models.build(f"hf:{families['bert']}", 0, 16, token_data="packed")
    mask_id, per_sample = hf_tasks.mask_token(w.model.config), hf_tasks.masked_per_sample(16)
    batch = w.make_batch(3, 8)
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    assert batches.equal(batch, w.make_batch(3, 8))  # every rank rebuilds the same global batch
    assert not torch.equal(batch["labels"], w.make_batch(4, 8)["labels"])  # another step masks elsewhere
    x, y = batch["input_ids"], batch["labels"]
    assert bool((batch["attention_mask"] == 1).all())  # no padding: every position attended
    masked = y != hf_tasks.IGNORED
    assert masked.sum(dim=1).tolist() == [per_sample] * 8 and torch.equal(masked, x == mask_id)
    assert int(y[masked].max()) < w.model.config.vocab_size and int(y[masked].min()) >= 0
    # BERT's masked LM takes its own mean (no loss_function): nothing to give it the step's count with
    assert w.num_items_kwarg is None and not hf_tasks.takes_num_items(type(w.model).__mro__[1])
    model = w.model.double().eval()  # no dropout: the loss as a function of the batch
    with torch.no_grad():
        out = model(**batch)
        whole = w.loss_fn(out, batch)
        # the model's own loss: the mean cross entropy over the labels not -100 (unshifted: a masked LM's own positions)
        assert float(abs(whole - F.cross_entropy(out.logits[masked], y[masked]))) < 1e-12 * float(whole)
        shards = [w.loss_fn(model(**part), part) for part in (batches.stride(batch, r, 2) for r in range(2))]
        assert float(abs(whole - sum(shards) / 2)) < 1e-12 * float(whole)  # the workload contract
        # the negative: were one sample to mask fewer positions, the mean over masked tokens would not be over samples
        y_short = y.clone()
        y_short[0, masked[0].nonzero()[0]] = hf_tasks.IGNORED
        short = {**batch, "labels": y_short}
        whole = w.loss_fn(model(**short), short)
        shards = [w.loss_fn(model(**part), part) for part in (batches.stride(short, r, 2) for r in range(2))]
        assert float(abs(whole - sum(shards) / 2)) > 1e-6 * float(whole)


# -- the verification copies -------------------------------------------------------------------------------------
@pytest.mark.parametrize(("family", "how"), [("llama", "transformers"), ("convnext", "dpcompare"), ("resnet", "none")])
def test_verification_copies_recompute_where_the_model_can_and_give_the_very_gradient(
        families: dict[str, Path], family: str, how: str) -> None:
    from dpcompare.contract import activation_checkpointing
    from dpcompare.verify.oracle.gradient_oracle import verification_copy

    w = _build(families[family], family)
    batch = batches.to(w.make_batch(0, 2), "cpu", torch.float64)  # pixels in float64, token ids and labels as they are
    grads = []
    for recompute in (False, True):
        model = verification_copy(w.model, torch.device("cpu"), torch.float64)
        model.recompute_activations = recompute
        w.loss_fn(model(**batch), batch).backward()
        grads.append([p.grad for p in model.parameters()])
    assert getattr(model, "_dpcompare_recomputes") == how
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    if how == "dpcompare":  # ConvNeXt names its stages and their layers: only the stages recompute, once each
        stages = ["convnext.encoder.stages.0", "convnext.encoder.stages.1"]
        assert list(activation_checkpointing.checkpointed_blocks(model)) == stages
    if how == "none":  # the negative: recomputing a block that holds BatchNorm counts its batch twice
        model = verification_copy(w.model, torch.device("cpu"), torch.float64)
        activation_checkpointing.checkpoint_blocks(model)
        w.loss_fn(model(**batch), batch).backward()
        counts = {int(b) for n, b in model.named_buffers() if n.endswith("num_batches_tracked")}
        assert counts == {2}


# -- dpcompare's eager attention -----------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["gpt2", "gemma2", "bert"])
def test_dpcompare_eager_attention_computes_what_transformers_eager_attention_does(family: str, monkeypatch) -> None:
    # a soft-cap near the tiny model's attention logits (~1e-3), so that leaving it out shows
    config = hf_families.family_config(family, attention_dropout=0.1, attn_pdrop=0.1, attention_probs_dropout_prob=0.1,
                                       **({"attn_logit_softcapping": 1e-3} if family == "gemma2" else {}))
    cls = getattr(transformers, config.architectures[0])
    assert hf_attention.choose(cls, config) == hf_attention.ATTENTION
    x = torch.randint(0, config.vocab_size - 1, (2, 16))

    def logits(attention: str) -> torch.Tensor:
        torch.manual_seed(0)
        model = cls._from_config(config, attn_implementation=attention).eval()  # eval: no dropout
        with torch.no_grad():
            return model(input_ids=x).logits

    ours = logits(hf_attention.ATTENTION)
    assert torch.equal(ours, logits("eager"))  # float32: both take the softmax in float32, so to the bit
    if family == "gemma2":  # the negative: without Gemma 2's logit soft-capping the numbers differ
        monkeypatch.setattr(hf_attention, "_softcapped", lambda scores, softcap: scores)
        assert not torch.allclose(logits(hf_attention.ATTENTION), ours, rtol=0, atol=1e-4)


# -- Mixtral's load-balancing loss -------------------------------------------------------------------------------
def test_mixtral_adds_its_load_balancing_loss_of_each_forwards_own_tokens(tmp_path: Path) -> None:
    from dpcompare.verify.oracle.gradient_oracle import verification_copy

    eager = {"experts_implementation": "eager"}  # transformers' grouped-matmul experts have no float64 kernel
    with_aux = hf_models.build(f"hf:{hf_families.write_family(tmp_path / 'a', 'mixtral', eager)}", 0, 16)
    plain_folder = hf_families.write_family(tmp_path / "b", "mixtral", eager, output_router_logits=False)
    without = hf_models.build(f"hf:{plain_folder}", 0, 16)
    coefficient = with_aux.model.config.router_aux_loss_coef
    assert "load-balancing loss 0.02" in with_aux.source and "per rank" in with_aux.source
    batch = with_aux.make_batch(0, 4)
    labels = batch["labels"]
    assert bool((labels == hf_tasks.IGNORED).any())  # padded: the routers' loss leaves the padding out too
    # float64 copies, whose loss stays in float64 where transformers' loss_function casts it to float32
    model = verification_copy(with_aux.model, torch.device("cpu"), torch.float64)
    out = model(**batch)
    aux = out.aux_loss
    assert out.loss.dtype == aux.dtype == torch.float64 and aux.ndim == 0
    # the model's own loss: the shifted cross entropy over the labels not -100, plus the coefficient times the routers'
    loss = with_aux.loss_fn(out, batch)
    expected = (shifted_cross_entropy(out.logits, labels) + coefficient * aux).detach()
    assert loss is out.loss and float(abs(loss.detach() - expected)) < 1e-12 * float(expected)
    term = with_aux.loss_fn.per_forward_term(out, batch).detach()  # the loss without the routers' term
    assert float(abs(term - shifted_cross_entropy(out.logits, labels).detach())) < 1e-12 * float(term)
    loss.backward()
    gate = model.model.layers[0].mlp.gate.weight.grad.clone()
    plain = verification_copy(without.model, torch.device("cpu"), torch.float64)
    plain_out = plain(**batch)
    assert plain_out.aux_loss is None  # the negative: a config that does not ask for it computes no routers' loss
    assert torch.equal(plain_out.logits, out.logits)  # the same weights from the same seed: the same logits
    assert float(abs(plain_out.loss.detach() - term)) < 1e-12 * float(term)  # its loss is the cross entropy alone
    without.loss_fn(plain_out, batch).backward()
    # it reaches the router's gradient
    assert not torch.allclose(gate, plain.model.layers[0].mlp.gate.weight.grad, rtol=1e-6, atol=0)
    with torch.no_grad():  # its value depends on how the batch is split: each rank's is its own tokens'
        halves = [model(**batches.stride(batch, r, 2)).aux_loss for r in range(2)]
        assert float(abs(aux.detach() - sum(halves) / 2)) > 1e-9
    # the float64 probe reads a forward that returns the model's output with its loss and the routers' loss
    from dpcompare.verify.model_facts import model_probe

    facts = model_probe.probe(with_aux.model, with_aux.loss_fn, batch, torch.device("cpu"))
    assert not facts.stochastic and not facts.unused


def test_router_settings_are_read_where_the_model_has_routers(tmp_path: Path) -> None:
    folder = hf_families.write_family(tmp_path / "null", "mixtral", {"router_aux_loss_coef": None})
    with pytest.raises(CommandLineError, match="router_aux_loss_coef") as caught:  # transformers' own check, one line
        hf_models.build(f"hf:{folder}", 0, 16)
    assert "\n" not in str(caught.value)
    folder = hf_families.write_family(tmp_path / "llama", "llama", {"output_router_logits": True})
    w = hf_models.build(f"hf:{folder}", 0, 16)  # no router: the flag asks for nothing
    out = w.model(**w.make_batch(0, 2))
    assert getattr(out, "aux_loss", None) is None and getattr(out, "router_logits", None) is None
    assert w.loss_fn is hf_tasks.model_loss and "load-balancing" not in w.source


@pytest.mark.parametrize(("family", "fields", "says"), [
    ("llama", {"hidden_size": 66}, "cannot read that config (ValueError: The hidden size (66) is not a multiple"),
    ("gpt2", {"n_embd": 66}, "cannot build GPT2LMHeadModel from its config (ValueError: `embed_dim` must be divisible"),
])
def test_a_config_transformers_rejects_is_one_line_with_its_reason(tmp_path: Path, family: str, fields: dict,
                                                                   says: str) -> None:
    folder = hf_families.write_family(tmp_path, family, fields)
    with pytest.raises(CommandLineError) as caught:
        hf_models.build(f"hf:{folder}", 0, 16)
    assert says in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize(("spec", "seq_len", "says"), [
    ("hf:/nonexistent/tiny", None, "does not exist"),
    ("hf:nobody-here/no-such-model-xyz", None, "hf download nobody-here/no-such-model-xyz config.json"),
    ("hf:", None, "names no model"),
    ("LLAMA", 65, "longer than"),
])
def test_bad_hf_input_is_one_line(configs: dict[str, Path], spec: str, seq_len: int | None, says: str) -> None:
    spec = f"hf:{configs['llama']}" if spec == "LLAMA" else spec
    with pytest.raises(CommandLineError, match=says):
        hf_models.build(spec, seed=0, seq_len=seq_len)


def test_a_result_file_is_named_by_the_model_not_by_its_path() -> None:
    from dpcompare.run.result_writer import file_stem_of_model, result_path

    assert file_stem_of_model("hf:/tmp/x/tiny-llama/") == "hf-tiny-llama"
    assert file_stem_of_model("hf:meta-llama/Llama-3.2-1B") == "hf-Llama-3.2-1B"
    assert file_stem_of_model("gpt-tiny") == "gpt-tiny"
    path = result_path("out", "ddp", 2, "hf:/a/b/c")
    assert path.parent == Path("out") and "hf-c" in path.name and "/" not in path.name


def test_seq_len_is_refused_on_a_model_that_fixes_its_own() -> None:
    with pytest.raises(ValueError, match="drop --seq-len"):
        RunConfig(model="gpt-tiny", seq_len=32).validate()


def test_without_transformers_the_run_says_how_to_install_it(tmp_path: Path, configs: dict[str, Path]) -> None:
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "transformers.py").write_text("raise ImportError('No module named transformers')\n")
    env = child_env(tmp_path)
    env["PYTHONPATH"] = f"{blocker}:{env['PYTHONPATH']}"
    done = subprocess.run([sys.executable, "-m", "dpcompare", "--model", f"hf:{configs['llama']}", "--out",
                           str(tmp_path / "out")], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and 'pip install "dpcompare[hf]"' in lines[0] and "Traceback" not in done.stderr


@pytest.mark.deep  # the default tier runs this config on the reference under --check-coverage (tests/test_oracle_coverage.py)
def test_a_llama_config_is_equivalent_on_the_reference_with_its_verification_cost(
        launch, configs: dict[str, Path]) -> None:
    done, result = launch("reference", 1, f"hf:{configs['llama']}", ["--seq-len", "16", "--measure-steps", "2",
                                                                      "--warmup-steps", "1"])
    assert done.returncode == 0, done.output[-3000:]
    assert result["equivalence"]["verdict"] == "equivalent", result["equivalence"]
    assert result["equivalence"]["oracle_coverage"] is None  # every parameter checked
    m = result["metrics"]
    assert m["verify_ms_per_step"] > 0 and m["verify_steps"] == 4 and m["verify_checked_steps"] == 4
    assert m["verify_peak_mib"] > 0 and m["verify_above_start_mib"] > 0 and m["step_ms_p50"] > 0
    assert result["model_info"]["parameters"] == sum(
        p.numel() for p in hf_models.build(f"hf:{configs['llama']}", 0).model.parameters())


# The slow tier runs the two commands (Llama-style under FSDP and ZeRO-3) and GPT-2 with its dropout and tied
# head under FSDP; the deep tier the rest of the matrix.
HF_CASES = [pytest.param(model, backend, extra, id=f"{name}-{model}",
                         marks=pytest.mark.slow if (model, name) in {("llama", "fsdp"), ("llama", "zero3"),
                                                                     ("gpt2", "fsdp")} else pytest.mark.deep)
            for model in ("llama", "gpt2")
            for name, backend, extra in (("fsdp", "fsdp", []), ("zero3", "deepspeed", ["--opt", "zero_stage=3"]),
                                         ("ddp", "ddp", []))]


@pytest.mark.multiproc
@pytest.mark.parametrize(("model", "backend", "extra"), HF_CASES)
def test_tiny_hf_configs_are_equivalent_at_world_size_2(launch, configs: dict[str, Path], model: str, backend: str,
                                                        extra: list[str]) -> None:
    if backend == "deepspeed":
        pytest.importorskip("deepspeed")
    # the run's defaults (4 checked steps, SGD with momentum); GPT-2 with its dropout on, under AdamW
    args = [*extra, *(["--optimizer", "adamw"] if model == "gpt2" else [])]
    done, result = launch(backend, 2, f"hf:{configs[model]}", [*args, "--measure-steps", "2", "--warmup-steps", "1"],
                          launcher="torchrun")
    assert done.returncode == 0, done.output[-3000:]
    e = result["equivalence"]
    assert e["verdict"] == "equivalent", (e["first_divergence"], e["unverifiable_reason"])
    assert e["checked_steps"] == [0, 1, 2, 3]
    if model == "gpt2":
        assert e["stochastic"]["captured"] and any("attn_dropout" in m for m in e["stochastic"]["modules"])
