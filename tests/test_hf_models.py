"""Hugging Face transformers models by name (`--model hf:NAME_OR_PATH`), checked against the float64 oracle.

Checked against: transformers itself (the model's class, parameter names and `_no_split_modules` kept; the same seed
builds the same weights), the config's shapes (tokens of --seq-len below the vocabulary, logits of the vocabulary's
width), the mask capture (GPT-2's attention dropout, a functional call in transformers' own attention, is drawn by
its nn.Dropout module and captured), and real runs: a Llama-style and a GPT-2-style config of width 64, written by the
test, `equivalent` under the reference (default tier) and under ddp, DeepSpeed ZeRO-3 and FSDP at world size 2 (slow
tier; FSDP is the issue's own command). Negatives: a missing folder, an uncached hub name, a --seq-len past the
context or on a built-in model and transformers missing are each one line, exit 2, no traceback.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import child_env
from dpcompare import block_modules
from dpcompare.run import hf_models
from dpcompare.run.config import CommandLineError, RunConfig

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'dpcompare[hf]')")

WIDTH = 64


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
    w = hf_models.build(f"hf:{configs['llama']}", seed=3, seq_len=16)
    assert isinstance(w.model, transformers.LlamaForCausalLM)
    names = [n for n, _ in w.model.named_parameters()]
    assert "model.layers.0.self_attn.q_proj.weight" in names and "lm_head.weight" in names
    assert [n for n, _ in block_modules(w.model)] == ["model.layers.0", "model.layers.1"]  # its _no_split_modules
    x, y = w.make_batch(0, 4)
    assert x.shape == y.shape == (4, 16) and int(x.max()) < 256 and torch.equal(x[:, 1:], y[:, :-1])
    assert w.model(x).shape == (4, 16, 256) and w.tokens_per_sample == 16
    again = hf_models.build(f"hf:{configs['llama']}", seed=3, seq_len=16)
    other = hf_models.build(f"hf:{configs['llama']}", seed=4, seq_len=16)
    same = [torch.equal(a, b) for a, b in zip(w.model.parameters(), again.model.parameters())]
    assert all(same) and not torch.equal(next(w.model.parameters()), next(other.model.parameters()))
    assert "LlamaForCausalLM" in w.source and "16 tokens per sample" in w.source


def test_gpt2_attention_dropout_is_drawn_by_its_module_so_its_masks_are_captured(configs: dict[str, Path]) -> None:
    from dpcompare.verify import masks

    w = hf_models.build(f"hf:{configs['gpt2']}", seed=0)
    assert w.model.config._attn_implementation == hf_models.ATTENTION and "dropout 0.1 captured" in w.source
    assert w.model.lm_head.weight is w.model.transformer.wte.weight  # the tied head stays tied
    x, _ = w.make_batch(0, 2)
    assert masks.uncaptured(w.model.train().double(), x) is None  # every random number is a captured module's
    # transformers' stock attention drops out in a functional call: recorded at the dispatcher, captured as well
    stock = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(configs["gpt2"]),
                                                          attn_implementation="eager")
    stock.__class__ = hf_models._returning_logits(type(stock), "causal_lm")
    assert masks.uncaptured(stock.train().double(), x) is None


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
    from dpcompare.results import file_stem_of_model, result_path

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


@pytest.mark.deep  # the default tier runs this config on the reference under --check-coverage (tests/test_coverage.py)
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
