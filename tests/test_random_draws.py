"""Dropout drawn outside nn.Dropout is recorded where it is drawn and replayed: functional F.dropout (OPT's layers),
drop path (torch.rand + floor_, timm's and Swin's), scaled_dot_product_attention's dropout_p and
nn.TransformerEncoderLayer (tests/random_models.py), under ddp and fsdp.

Checked against: the float64 copy replaying a float32 forward's draws computes its gradient (to float32 rounding);
the probe's list of what draws (module, type, op); a checkpointed copy's recomputation, which must take the very
numbers its forward took, also where the checkpoint calls a block's forward past its hooks; --no-dropout, after which
nothing draws; the float64 oracle of real 2-rank runs at the run defaults (4 steps, SGD with momentum; AdamW). Every
check has its negative: another seed's draws give another gradient; a recomputation that redraws, in a copy, is
refused, and on a rank is reported; a draw --no-dropout cannot switch off (RReLU, a custom op drawing inside itself)
is named with its op and module; a backend whose recomputation on one rank draws shifted numbers
(tests/faulty_random.py) and one whose ranks draw identical numbers are `different`.

Tiers: the default tier runs the unit tests and one ddp run of the model that draws all three ways; `slow` the fsdp
run under AdamW and the two twins; `deep` every model under ddp and fsdp with both optimizers, each with its twin.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import random_models as rm
from dpcompare import checkpoint_blocks
from dpcompare.verify.oracle import gradient_oracle as eq
from dpcompare.verify.randomness import random_modules
from dpcompare.verify.randomness.draw_recording import MaskMismatch, MaskRecorder, MaskReplayer
from dpcompare.verify.model_facts.model_probe import judge_randomness, probe
from dpcompare.verify.judgement.verdict import Verdict
from faulty_random import _shifted_class
from test_equivalence_matrix import assert_equivalent
from test_negative import different

MODELS = {"functional-dropout": (rm.functional_dropout, ["blocks.0 (FunctionalDropoutBlock) aten.bernoulli_",
                                                         "blocks.1 (FunctionalDropoutBlock) aten.bernoulli_"]),
          "drop-path": (rm.drop_path_model, ["blocks.0 (DropPathBlock) aten.rand", "blocks.1 (DropPathBlock) aten.rand"]),
          "sdpa-dropout": (rm.sdpa_dropout, ["blocks.0 (SdpaBlock) aten.bernoulli_", "blocks.1 (SdpaBlock) aten.bernoulli_"]),
          "transformer-layer": (rm.transformer_layer, ["blocks.0.self_attn (MultiheadAttention) aten.bernoulli_",
                                                       "blocks.0.dropout1 (Dropout) aten.bernoulli_"])}
CPU = torch.device("cpu")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _recorded_step(model: nn.Module, workload, seed: int = 5, n: int = 6):
    """A float32 training forward and backward of the first batch from generator seed `seed`, its draws recorded:
    (record, gradients)."""
    model.train()
    model.zero_grad(set_to_none=True)
    x, y = workload.make_batch(0, n)
    recorder = MaskRecorder(model)
    torch.manual_seed(seed)
    with recorder.recording():
        workload.loss_fn(model(x), y).backward()
    return recorder.take(), {k: p.grad.clone() for k, p in model.named_parameters()}


def _replayed(model64: nn.Module, workload, calls, n: int = 6) -> dict[str, torch.Tensor]:
    x, y = workload.make_batch(0, n)
    return eq.accumulate_gradient(model64, workload.loss_fn, eq.global_pieces((x, y), calls), CPU,
                                  MaskReplayer(model64))[0]


# -- record and replay ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(MODELS))
def test_the_probe_finds_each_draw_and_a_float64_copy_replays_it(name):
    make, expected = MODELS[name]
    workload = make(0)
    facts = probe(workload.model, workload.loss_fn, workload.make_batch(0, 6), CPU)
    assert facts.stochastic and facts.uncaptured is None
    assert set(expected) <= set(facts.random_ops), facts.random_ops
    record, grads = _recorded_step(workload.model, workload)
    assert record.masks and not record.problems and not record.redrawn
    model64 = eq.verification_copy(workload.model, CPU, torch.float64)
    replayed = _replayed(model64, workload, record.calls())
    worst = max(_rel(grads[k], replayed[k]) for k in grads)
    assert worst < 1e-5, worst

    # Negative: the draws of another seed give another gradient.
    other, _ = _recorded_step(copy.deepcopy(workload.model), workload, seed=6)
    elsewhere = _replayed(model64, workload, other.calls())
    assert max(_rel(grads[k], elsewhere[k]) for k in grads) > 1e-3


def test_sdpa_runs_its_math_path_only_while_recording_or_replaying():
    workload = rm.sdpa_dropout(0)
    seen = []
    original = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append((torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.math_sdp_enabled()))
        return original(*args, **kwargs)

    torch.nn.functional.scaled_dot_product_attention = spy
    try:
        record, _ = _recorded_step(workload.model, workload)
        with MaskReplayer(workload.model).applying(record.calls()):
            workload.model(workload.make_batch(0, 6)[0])
        workload.model(workload.make_batch(0, 6)[0])  # a measured step's forward: the fast kernels as the user set them
    finally:
        torch.nn.functional.scaled_dot_product_attention = original
    assert seen[:4] == [(False, True)] * 4 and seen[4:] == [(True, True)] * 2, seen


# -- recomputation ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["functional-dropout", "drop-path", "sdpa-dropout"])
def test_a_checkpointed_copy_recomputes_with_the_numbers_its_forward_took(name):
    """The block's own draws run past its hooks when checkpoint_blocks recomputes it (the block's forward is called
    directly): the replay finds the forward's numbers by the generator state the checkpoint restores."""
    workload = MODELS[name][0](0)
    record, _ = _recorded_step(workload.model, workload)
    plain = _replayed(eq.verification_copy(workload.model, CPU, torch.float64), workload, record.calls())
    checkpointed = eq.verification_copy(workload.model, CPU, torch.float64)
    assert checkpoint_blocks(checkpointed) == ["blocks.0", "blocks.1"]
    again = _replayed(checkpointed, workload, record.calls())
    assert all(torch.equal(plain[k], again[k]) for k in plain)

    # Negative: a copy whose recomputation redraws is refused, not silently differentiated.
    redrawing = eq.verification_copy(workload.model, CPU, torch.float64)
    checkpoint_blocks(redrawing, preserve_rng_state=False)
    with pytest.raises(MaskMismatch, match="generator state no forward call had"):
        _replayed(redrawing, workload, record.calls())


@pytest.mark.parametrize("name", ["functional-dropout", "drop-path", "sdpa-dropout"])
def test_a_rank_whose_recomputation_draws_other_numbers_is_seen(name):
    workload = MODELS[name][0](0)
    faithful = copy.deepcopy(workload.model)
    checkpoint_blocks(faithful)
    record, _ = _recorded_step(faithful, workload)
    assert record.masks and record.redrawn == {}
    for redraw in ("preserve_rng_state=False", "shifted by one number"):
        model = copy.deepcopy(workload.model)
        if redraw == "shifted by one number":
            for block in model.blocks:
                block.__class__ = _shifted_class(type(block))
        else:
            checkpoint_blocks(model, preserve_rng_state=False)
        record, _ = _recorded_step(model, workload)
        # The block's own draws run past its hooks in the recomputation: named as the blocks that drew alike.
        assert list(record.redrawn) == ["blocks.0 or blocks.1"], (redraw, record.redrawn)
        assert "in the recomputation fits none of the" in record.redrawn["blocks.0 or blocks.1"]


# -- --no-dropout -----------------------------------------------------------------------------------------------------
class _CustomNoise(nn.Module):
    """Calls an op of its own (torch.library) with a dropout_p, drawing inside it as a fused kernel does."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(rm.DIM, rm.DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.dpcompare_tests.noisy_dropout(self.fc(x), 0.2)


@torch.library.custom_op("dpcompare_tests::noisy_dropout", mutates_args=())
def _noisy_dropout(x: torch.Tensor, dropout_p: float) -> torch.Tensor:
    return x * (torch.rand_like(x) >= dropout_p) / (1 - dropout_p)


_noisy_dropout.register_autograd(lambda ctx, grad: (grad, None), setup_context=lambda ctx, inputs, output: None)


def test_no_dropout_switches_off_every_probability_the_models_hold():
    models = [make(0).model for make, _ in MODELS.values()] + [
        nn.LSTM(4, 4, num_layers=2, dropout=0.3), nn.MultiheadAttention(4, 2, dropout=0.2)]
    for model in models:
        switched = random_modules.switch_off_dropout(model)
        assert switched, type(model)
        assert not any(isinstance(v, float) and 0 < v <= 1 and ("drop" in k or k == "p")
                       for m in model.modules() for k, v in vars(m).items()), switched
    workload = rm.all_random(0)
    assert random_modules.switch_off_dropout(workload.model) == ["blocks.0.dropout", "blocks.1.drop_prob",
                                                             "blocks.2.dropout_p"]
    facts = probe(workload.model, workload.loss_fn, workload.make_batch(0, 6), CPU)
    assert not facts.stochastic and facts.random_ops == ()
    # Twin: a float that is no dropout probability stays.
    norm = nn.LayerNorm(4)
    assert random_modules.switch_off_dropout(norm) == [] and norm.eps == 1e-5


@pytest.mark.parametrize(("extra", "says"), [
    (lambda: nn.RReLU(), "2 (RReLU) aten.rrelu_with_noise, recorded on every rank and replayed in the oracle"),
    (lambda: _CustomNoise(), "not replayable (2 (_CustomNoise) calls dpcompare_tests.noisy_dropout.default with "
                             "dropout 0.2, which draws its random numbers inside the kernel"),
], ids=["rrelu", "custom-kernel"])
def test_what_still_draws_after_no_dropout_is_named_with_its_op(extra, says):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(rm.FEATURES, rm.DIM), nn.Dropout(0.1), extra(), nn.Flatten(), nn.LazyLinear(3))
    batch = (torch.randn(4, rm.SEQ, rm.FEATURES), torch.randint(0, 3, (4,)))
    model(batch[0])  # the lazy head takes its shape
    switched = random_modules.switch_off_dropout(model)
    facts = probe(model, nn.functional.cross_entropy, batch, CPU)
    assert switched == ["1"] and facts.stochastic
    note = random_modules.no_dropout_note(switched, facts)
    assert note.startswith("--no-dropout: dropout switched off in 1; the forward still draws random numbers: ")
    assert says in note, note
    verdict = Verdict()
    reason = judge_randomness(facts, None, verdict)
    assert (reason is None) == (facts.uncaptured is None) and verdict.stochastic["captured"] == (reason is None)


# -- real runs ----------------------------------------------------------------------------------------------------------
WORLD_SIZE = 2
RUN = ["--measure-steps", "0"]  # the checks at the run defaults (4 steps, SGD with momentum); costs not measured
DEEP = pytest.mark.deep


def _replayed_run(proc, result, backend: str, model: str) -> None:
    assert_equivalent(proc, result, backend=backend, world_size=WORLD_SIZE, model=model, launcher="torchrun", steps=4)
    probe_ = result["equivalence"]["stochastic"]
    assert probe_["stochastic"] and probe_["captured"] and probe_["capture_bytes_per_step"] > 0, probe_


@pytest.mark.multiproc
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("backend", "name", "options"), [
    pytest.param("ddp", "all_random", [], id="ddp-all", marks=pytest.mark.slow),
    pytest.param("fsdp", "all_random", ["--optimizer", "adamw"], id="fsdp-all-adamw", marks=pytest.mark.slow),
    *[pytest.param(backend, fn, opt, id=f"{backend}-{fn}-{'adamw' if opt else 'sgd'}", marks=DEEP)
      for backend in ("ddp", "fsdp") for fn in ("functional_dropout", "drop_path_model", "sdpa_dropout",
                                                "transformer_layer")
      for opt in ([], ["--optimizer", "adamw"])],
])
def test_random_models_are_equivalent(backend, name, options, launch):
    proc, result = launch(backend, WORLD_SIZE, f"tests.random_models:{name}", [*RUN, *options])
    _replayed_run(proc, result, backend, result["model"] if result else name)
    assert "recorded where they are drawn" in next(n["text"] for n in result["equivalence"]["notes"]
                                                   if n["code"] == "masks_captured")


@pytest.mark.multiproc
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("backend", "name"), [
    pytest.param("tests.faulty_random:ShiftedRecomputeDDP", "all_random", id="ddp-all", marks=pytest.mark.slow),
    *[pytest.param(f"tests.faulty_random:ShiftedRecompute{b}", fn, id=f"{b.lower()}-{fn}", marks=DEEP)
      for b in ("DDP", "FSDP") for fn in ("functional_dropout", "drop_path_model", "sdpa_dropout", "transformer_layer")],
])
def test_a_rank_recomputing_with_shifted_numbers_is_different(backend, name, launch):
    proc, result = launch(backend, WORLD_SIZE, f"tests.random_models:{name}", [*RUN, "--activation-checkpointing"])
    d = different(proc, result)
    assert (d["step"], d["cause"]) == (0, "recompute_redrew_masks"), d
    assert "rank 1:" in d["reason"] and "in the recomputation fits none of the" in d["reason"], d["reason"]


@pytest.mark.multiproc
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", [
    pytest.param("all_random", marks=pytest.mark.slow),
    *[pytest.param(fn, marks=DEEP) for fn in ("functional_dropout", "drop_path_model", "sdpa_dropout",
                                              "transformer_layer")]])
def test_ranks_drawing_the_same_numbers_are_different(name, launch):
    proc, result = launch("tests.faulty_adapters:SameSeedDDP", WORLD_SIZE, f"tests.random_models:{name}", RUN)
    d = different(proc, result, "rng")
    assert (d["step"], d["cause"]) == (0, "same_seed"), d
