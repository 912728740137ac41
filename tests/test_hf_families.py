"""The transformers families users train (tests/hf_families.py), run and judged as a user runs them.

Checked against: the float64 oracle, through real runs of tiny configs with the run's defaults (4 checked steps,
SGD with momentum) and each family's own dropout. Default tier: one run per new code path, on the reference: ConvNeXt
(no attention, verification copies that recompute on dpcompare's terms) and the BERT masked LM (masked positions from
(seed, step), attention dropout by its nn.Dropout). Slow tier: a handful at world size 2 (the masked LM and its tied
embedding under FSDP, Gemma 2's eager attention under ZeRO-3, Bloom under bf16, Llama's attention dropout through
the module dpcompare gives it under FSDP), and the negative: a backend that sums the gradients instead of averaging
them is `different` on the masked LM. A ResNet at three ranks, where 1/3 in the graph and DDP's division after
round differently: `equivalent` under DDP, and an undeclared fp16 wire still `different`. Deep tier: the family matrix of issue 39, every family under ddp, FSDP and
ZeRO-3 at world size 2 in float32 and under --amp bf16, each `equivalent` (experiments/hf_family_matrix.py writes
the same matrix as a table).
"""

from __future__ import annotations

from pathlib import Path

import pytest

import hf_families

pytest.importorskip("transformers", reason="transformers is not installed (pip install 'dpcompare[hf]')")

BACKENDS = {"ddp": ("ddp", []), "fsdp": ("fsdp", []), "zero3": ("deepspeed", ["--opt", "zero_stage=3"])}
PRECISIONS = {"float32": [], "bf16": ["--amp", "bf16"]}
SLOW = {("bert", "fsdp", "float32"), ("gemma2", "zero3", "float32"), ("bloom", "ddp", "bf16"), ("opt", "zero3", "bf16")}


@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return hf_families.write_families(tmp_path_factory.mktemp("families"))


def _model_args(family: str) -> list[str]:
    return [] if family in hf_families.IMAGE_FAMILIES else ["--seq-len", "16"]


@pytest.mark.parametrize(("family", "says"), [
    pytest.param("convnext", ["no attention", "3x32x32 pixels"], marks=pytest.mark.slow),
    pytest.param("bert", ["BertForMaskedLM", "masked LM: each of 16 tokens chosen with probability 0.15", "80% of them masked"], marks=pytest.mark.slow),
])
def test_a_model_without_attention_and_a_masked_lm_are_equivalent_on_the_reference(
        launch, families: dict[str, Path], family: str, says: list[str]) -> None:
    args = [*_model_args(family), "--measure-steps", "0"]
    done, result = launch("reference", 1, f"hf:{families[family]}", args)
    assert done.returncode == 0, done.output[-3000:]
    e = result["equivalence"]
    assert e["verdict"] == "equivalent", (e["first_divergence"], e["unverifiable_reason"])
    assert e["checked_steps"] == [0, 1, 2, 3]
    assert all(phrase in result["model_info"]["source"] for phrase in says), result["model_info"]["source"]
    if family == "bert":  # its dropout, the attention's included, drawn by modules whose masks are captured
        assert e["stochastic"]["captured"] and any("attention.self.dropout" in m for m in e["stochastic"]["modules"])


def _cases() -> list:
    cases = []
    for family in hf_families.FAMILIES:
        for precision in PRECISIONS:
            for backend in BACKENDS:
                mark = pytest.mark.slow if (family, backend, precision) in SLOW else pytest.mark.deep
                cases.append(pytest.param(family, backend, precision, id=f"{family}-{backend}-{precision}", marks=mark))
    return cases


@pytest.mark.multiproc
@pytest.mark.parametrize(("family", "backend", "precision"), _cases())
def test_every_family_is_equivalent_at_world_size_2(launch, families: dict[str, Path], family: str, backend: str,
                                                    precision: str) -> None:
    name, extra = BACKENDS[backend]
    if name == "deepspeed":
        pytest.importorskip("deepspeed")
    done, result = launch(name, 2, f"hf:{families[family]}",
                          [*extra, *PRECISIONS[precision], *_model_args(family), "--measure-steps", "0"],
                          launcher="torchrun", timeout_s=600)
    assert done.returncode == 0, done.output[-3000:]
    e = result["equivalence"]
    assert e["verdict"] == "equivalent", (e["first_divergence"], e["unverifiable_reason"])
    assert e["checked_steps"] == [0, 1, 2, 3]


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_backend_that_sums_instead_of_averaging_is_different_on_the_masked_lm(launch, families: dict[str, Path]
                                                                                ) -> None:
    done, result = launch("tests.faulty_adapters:SummingDDP", 2, f"hf:{families['bert']}",
                          [*_model_args("bert"), "--steps", "2", "--measure-steps", "0"], launcher="torchrun")
    assert done.returncode == 0, done.output[-3000:]
    e = result["equivalence"]
    assert e["verdict"] == "different" and e["first_divergence"]["step"] == 0, e["first_divergence"]
    assert e["first_divergence"]["check"] == "gradient"


@pytest.mark.slow
@pytest.mark.multiproc
def test_llama_with_attention_dropout_is_equivalent_under_fsdp_its_masks_drawn_by_the_module_dpcompare_gave_it(
        launch, tmp_path: Path) -> None:
    folder = hf_families.write_family(tmp_path, "llama", attention_dropout=0.1)
    done, result = launch("fsdp", 2, f"hf:{folder}", [*_model_args("llama"), "--measure-steps", "0"],
                          launcher="torchrun")
    assert done.returncode == 0, done.output[-3000:]
    e = result["equivalence"]
    assert e["verdict"] == "equivalent", (e["first_divergence"], e["unverifiable_reason"])
    assert e["stochastic"]["captured"]
    assert all(m.endswith("self_attn.dpcompare_attention_dropout") for m in e["stochastic"]["modules"])


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize(("backend", "verdict"), [("ddp", "equivalent"),
                                                  ("tests.faulty_adapters:Fp16WireDDP", "different")])
def test_a_resnet_at_three_ranks_is_judged_with_the_division_where_backends_do_it(
        launch, families: dict[str, Path], backend: str, verdict: str) -> None:
    """Per-replica BatchNorm over a rank's 8 samples, at a world size that is not a power of two: the reference's
    1/3 in the graph and DDP's division after round differently, and BatchNorm's backward carries it to 30x the
    smallest floor on the convolutions before it (tests/test_twin_divides_after.py). With the floor's twin dividing
    after, DDP with AdamW is `equivalent` (it was `different` at 31.8x its floor); an undeclared fp16 wire, whose
    rounding lands on every parameter, is still caught there."""
    done, result = launch(backend, 3, f"hf:{families['resnet']}", ["--optimizer", "adamw", "--measure-steps", "0"],
                          launcher="torchrun", timeout_s=600)
    assert done.returncode == 0, done.output[-3000:]
    e = result["equivalence"]
    assert e["verdict"] == verdict, (e["first_divergence"], e["unverifiable_reason"])
    assert e["checked_steps"] == [0, 1, 2, 3] if verdict == "equivalent" else e["first_divergence"]["step"] == 0
    assert "divided_after" in [n["code"] for n in e["notes"]]
    if verdict == "different":  # the wire named on every failing parameter, whatever order the ring added them in
        d = e["first_divergence"]
        assert d["cause"] == "wire_dtype" and "matches none" not in d["reason"], d["reason"]
