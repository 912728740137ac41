"""The models users bring, by dtype and kernel: integer and bool parameters are carried in their dtype and compared
bitwise, and an op with no float64 kernel runs on the model's own alternative path or in float32, stated.

Checked against: plain PyTorch (the same model's float32 gradient, the dtypes it was built with), a backend that
rounds an int64 parameter through float32 with torch's own `average_parameters` (must be `different`, naming the
parameter and the rounding), a call that fails in float32 too (must raise its own error), and runs under ddp, fsdp,
DeepSpeed ZeRO 0/3, Horovod and the reference (models: tests/dtype_models.py).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from dpcompare.verify.memory import oracle_coverage as oc
from dpcompare.verify.oracle import gradient_oracle as eq
from dpcompare.verify.oracle import float64_paths
from dpcompare.verify.oracle.model_dtypes import as_input, float_dtype, non_float_change, non_float_divergence, state_distance
from dpcompare.verify.diagnosis.state_comparison import state_difference
from dpcompare.verify.trajectory.reference_trajectory import Trajectory

from dtype_models import ID_BASE, GroupedMoE, grouped_moe, index_mlp

STEPS = ["--steps", "4", "--measure-steps", "0"]


def _sgd(params, **overrides):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, **overrides)


# -- non-float parameters and buffers: carried, not converted --------------------------------------------------------
def test_the_floating_dtype_is_the_first_floating_parameters_not_the_first_parameters() -> None:
    first = nn.Module()  # an index registered before any weight, as `next(model.parameters())` would see it
    first.ids = nn.Parameter(torch.arange(3), requires_grad=False)
    first.body = index_mlp(0).model.double()
    assert next(first.parameters()).dtype == torch.int64
    assert float_dtype(first) == torch.float64
    assert as_input(torch.ones(2), first, torch.device("cpu")).dtype == torch.float64
    assert as_input(torch.ones(2, dtype=torch.long), first, torch.device("cpu")).dtype == torch.int64
    assert float_dtype(nn.Module()) == torch.float32  # nothing floating: the default


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_every_verification_copy_keeps_integer_and_bool_state_as_built(dtype: torch.dtype) -> None:
    template = index_mlp(0).model
    model = eq.verification_copy(template, torch.device("cpu"), dtype)
    assert model.ids.dtype == torch.int64 and torch.equal(model.ids, template.ids)
    assert model.keep.dtype == torch.bool and model.forwards.dtype == torch.int64
    assert model.fc1.weight.dtype == dtype


def test_the_oracle_runs_a_model_with_integer_parameters_and_agrees_with_float32() -> None:
    w = index_mlp(0)
    oracle = eq.Oracle(w.model, w.loss_fn, "float32", torch.device("cpu"))
    assert "ids" not in oracle.names and "keep" not in oracle.names  # no gradient: not in the gradient check
    x, y = w.make_batch(0, 16)
    state = w.model.state_dict()
    grads64, grads32 = oracle.oracle(state, x, y), oracle.floor(state, x, y)
    for name in oracle.names:
        assert eq.rel_fro(grads32[name], grads64[name]) < 1e-5, name
    assert w.model.forwards.item() == 0  # the run's own buffer never moved


def test_non_float_state_is_compared_bitwise() -> None:
    ids = torch.tensor([ID_BASE + 1, 7])
    assert state_distance(ids, ids.clone()) == 0.0
    assert state_distance(ids, ids + torch.tensor([1, 0])) == math.inf  # 1 in 2**40: still a difference
    assert state_distance(ids, ids.to(torch.float64)) == math.inf  # the same values in another dtype
    assert state_distance(torch.tensor([True]), torch.tensor([False])) == math.inf
    assert 0.0 < state_distance(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0 + 1e-6])) < 1e-6


def test_a_non_float_change_is_named_by_what_it_is() -> None:
    ids = ID_BASE + torch.arange(4) * 1_000_003 + 1
    cause, why = non_float_change("ids", ids.to(torch.float32).to(torch.int64), ids)
    assert cause == "non_float_rounded" and "rounded to float32" in why and "4 of 4 elements" in why
    assert non_float_change("ids", ids.to(torch.float32), ids)[0] == "non_float_converted"
    assert non_float_change("ids", ids.flip(0), ids)[0] == "non_float_changed"
    found = non_float_divergence(2, "trajectory", {"a": ids, "b": ids.flip(0)}, {"a": ids, "b": ids}, ["a", "b"],
                                 "after step 2")
    assert found is not None and found.parameter == "b" and found.check == "trajectory" and found.parameters == ["b"]
    assert non_float_divergence(2, "trajectory", {"a": ids}, {"a": ids.clone()}, ["a"], "after step 2") is None


def test_the_trajectory_compares_non_float_parameters_but_not_one_its_forward_writes() -> None:
    class Counting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 2)
            self.seen = nn.Parameter(torch.zeros((), dtype=torch.long), requires_grad=False)
            self.index = nn.Parameter(torch.tensor([ID_BASE + 3, 1]), requires_grad=False)

        def forward(self, x):
            self.seen.add_(1)  # a counter kept as a parameter: its value follows how often the forward ran
            return self.lin(x)[:, self.index % 2]

    model = Counting()
    trajectory = Trajectory(model, F.mse_loss, _sgd, "float32", torch.device("cpu"), depth=1)
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    trajectory.step([eq.Piece(x[:4], y[:4], 0.5), eq.Piece(x[4:], y[4:], 0.5)])
    run = {n: p.detach().clone() for n, p in model.named_parameters()}
    run["seen"] += 1  # each rank ran one forward, the single process two: not a fault
    assert trajectory.carried == ["seen", "index"] and trajectory.written == {"seen"}
    assert trajectory.carried_divergence(0, run) is None
    run["index"] = run["index"].float().long()
    found = trajectory.carried_divergence(0, run)
    assert found is not None and found.parameter == "index" and found.cause == "non_float_rounded"


def test_integer_optimizer_state_is_compared_exactly() -> None:
    expected = {"w": {"count": torch.tensor([100_000, 3])}}
    assert state_difference({"w": {"count": torch.tensor([100_001, 3])}}, expected, ["w"]) is not None
    assert state_difference({"w": {"count": torch.tensor([100_000, 3])}}, expected, ["w"]) is None
    floating = {"w": {"m": torch.tensor([1.0, 3.0])}}
    assert state_difference({"w": {"m": torch.tensor([1.0 + 1e-9, 3.0])}}, floating, ["w"]) is None


def test_the_memory_plan_counts_what_every_copy_holds() -> None:
    frozen = nn.Linear(64, 64)
    frozen.requires_grad_(False)
    model = nn.Sequential(nn.Linear(8, 8), frozen)
    trainable = sum(p.numel() for p in model[0].parameters())
    plain = oc.need_bytes(trainable, trainable, "sgd")
    counted = oc.need_bytes(trainable, trainable, "sgd", copied=sum(p.numel() for p in model.parameters()))
    assert counted - plain == pytest.approx(oc.COPY_BYTES_PER_PARAM * sum(p.numel() for p in frozen.parameters()))


# -- ops with no float64 kernel --------------------------------------------------------------------------------------
def test_grouped_mm_really_has_no_float64_kernel() -> None:
    """The premise of the fallback tests below, on this torch: if this ever passes, pick another op."""
    a, b = torch.randn(8, 16, dtype=torch.float64), torch.randn(2, 16, 4, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="Double"):
        torch._grouped_mm(a, b, offs=torch.tensor([3, 8], dtype=torch.int32))


def _grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(as_input(x, model, torch.device("cpu"))), y).backward()
    return {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}


def test_an_op_with_no_float64_kernel_runs_in_float32_and_is_recorded() -> None:
    w = grouped_moe(0)
    x, y = w.make_batch(0, 24)
    copy64 = eq.verification_copy(w.model, torch.device("cpu"), torch.float64)
    g64, g32 = _grads(copy64, x, y), _grads(copy.deepcopy(w.model), x, y)
    assert set(g64) == set(g32)
    for name in g32:  # float32 rounding apart, not a different function (a grad of the wrong op would be O(1))
        assert eq.rel_fro(g64[name], g32[name]) < 1e-5, name
    recorded = float64_paths.report(copy64)
    assert recorded is not None and recorded["switched"] == []
    op = recorded["float32_ops"][0]
    assert op["op"] == "_grouped_mm" and op["modules"] == ["1 (GroupedMoE)"] and op["precision"] == "float32"
    assert op["calls"] == 2 and not op["tf32"] and "Double" in op["error"]
    assert any("_grouped_mm in 1 (GroupedMoE)" in p for p in float64_paths.phrases(recorded))
    # everything else stayed float64: the experts' weights and their gradients
    assert copy64[1].w_in.dtype == torch.float64 and copy64[1].w_in.grad.dtype == torch.float64
    assert float64_paths.report(eq.verification_copy(w.model, torch.device("cpu"), torch.float32)) is None


def test_a_call_that_fails_in_float32_too_raises_its_own_error() -> None:
    class Broken(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return torch.mm(self.lin(x), torch.ones(3, 2, dtype=x.dtype))  # a shape error, in any dtype

    model = eq.verification_copy(Broken(), torch.device("cpu"), torch.float64)
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        model(torch.randn(2, 4, dtype=torch.float64))
    assert float64_paths.report(model) is None
    assert torch._C._len_torch_function_stack() == 0  # the fallback left with the failed call


def test_an_in_place_call_in_float32_writes_back_into_the_float64_tensor() -> None:
    x = torch.full((3,), 1.5, dtype=torch.float64)
    out = float64_paths._in_float32(torch.Tensor.mul_, (x, 2.0), {})
    assert out is x and x.dtype == torch.float64 and torch.equal(x, torch.full((3,), 3.0, dtype=torch.float64))
    target = torch.empty(3, dtype=torch.float64)
    float64_paths._in_float32(torch.add, (x, 1.0), {"out": target})
    assert torch.equal(target, torch.full((3,), 4.0, dtype=torch.float64))


def _tiny_mixtral():
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(
        "mixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=128, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def _lm_grads(model: nn.Module, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(input_ids=tokens, labels=tokens).loss.backward()
    return {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}


def test_mixtral_float64_copy_takes_the_models_eager_experts_and_the_others_keep_grouped_mm() -> None:
    template = _tiny_mixtral()
    assert template.config._experts_implementation == "grouped_mm"
    copy64 = eq.verification_copy(template, torch.device("cpu"), torch.float64)
    copy32 = eq.verification_copy(template, torch.device("cpu"), torch.float32)
    assert copy64.config._experts_implementation == "eager"
    assert template.config._experts_implementation == copy32.config._experts_implementation == "grouped_mm"
    tokens = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
    g64, g32 = _lm_grads(copy64, tokens), _lm_grads(copy32, tokens)
    assert max(eq.rel_fro(g32[n], g64[n]) for n in g32) < 1e-4
    recorded = float64_paths.report(copy64)
    assert recorded is not None and recorded["float32_ops"] == []
    assert recorded["switched"] == [{"module": "(the model)", "setting": "experts_implementation",
                                     "from": "grouped_mm", "to": "eager", "why": float64_paths.ALTERNATIVES[0][3]}]


def test_without_the_models_alternative_its_grouped_mm_runs_in_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    template = _tiny_mixtral()
    monkeypatch.setattr(float64_paths, "ALTERNATIVES", ())
    copy64 = eq.verification_copy(template, torch.device("cpu"), torch.float64)
    tokens = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
    g64 = _lm_grads(copy64, tokens)
    g32 = _lm_grads(eq.verification_copy(template, torch.device("cpu"), torch.float32), tokens)
    assert max(eq.rel_fro(g32[n], g64[n]) for n in g32) < 1e-4
    recorded = float64_paths.report(copy64)
    assert recorded is not None and recorded["switched"] == []
    assert recorded["float32_ops"] and all("experts" in m for op in recorded["float32_ops"] for m in op["modules"])


# -- runs ------------------------------------------------------------------------------------------------------------
def _first_divergence(result: dict) -> dict:
    return result["equivalence"]["first_divergence"] or {}


def test_a_backend_that_rounds_an_integer_parameter_through_float32_is_different(launch) -> None:
    proc, result = launch("tests.dtype_models:AveragingDDP", 2, "tests.dtype_models:index_mlp", STEPS)
    assert proc.returncode == 0, proc.output[-3000:]
    e, d = result["equivalence"], _first_divergence(result)
    assert e["verdict"] == "different" and e["replicas_identical"]  # every rank rounded alike: no fingerprint sees it
    assert d["step"] == 0 and d["parameter"] == "ids" and d["cause"] == "non_float_rounded"
    assert "rounded to float32" in d["reason"] and "ids" in proc.stdout


@pytest.mark.slow
def test_an_op_with_no_float64_kernel_is_equivalent_under_ddp_and_said(launch) -> None:
    proc, result = launch("ddp", 2, "tests.dtype_models:grouped_moe", STEPS)
    assert proc.returncode == 0, proc.output[-3000:]
    e = result["equivalence"]
    assert e["verdict"] == "equivalent" and e["min_detectable_rel"] <= 0.1
    assert [op["op"] for op in e["oracle_precision"]["float32_ops"]] == ["_grouped_mm"]
    assert "ORACLE IN FLOAT32" in proc.stdout and "_grouped_mm in 1 (GroupedMoE)" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize(("backend", "extra"), [("ddp", ["--optimizer", "adamw", "--lr", "0.01"]), ("fsdp", [])])
def test_integer_parameters_are_equivalent(launch, backend: str, extra: list[str]) -> None:
    proc, result = launch(backend, 2, "tests.dtype_models:index_mlp", [*STEPS, *extra])
    assert proc.returncode == 0, proc.output[-3000:]
    e = result["equivalence"]
    assert e["verdict"] == "equivalent" and e["min_detectable_rel"] <= 0.1, proc.stdout[-2000:]
    assert set(e["parameters"]["frozen"]) == {"ids", "keep"}
    assert next(b for b in e["buffers"] if b["name"] == "forwards")["dtype"] == "int64"


@pytest.mark.deep
@pytest.mark.parametrize(("backend", "model", "extra"), [
    ("ddp", "index_mlp", []), ("fsdp", "index_mlp", ["--optimizer", "adamw", "--lr", "0.01"]),
    ("deepspeed", "index_mlp", []), ("deepspeed", "index_mlp", ["--opt", "zero_stage=2"]),
    ("deepspeed", "index_mlp", ["--opt", "zero_stage=3"]), ("horovod", "int_index_mlp", []),
    ("reference", "index_mlp", [])])
def test_integer_parameters_under_every_backend(launch, backend: str, model: str, extra: list[str]) -> None:
    proc, result = launch(backend, 1 if backend == "reference" else 2, f"tests.dtype_models:{model}", [*STEPS, *extra])
    assert proc.returncode == 0, proc.output[-3000:]
    assert result["equivalence"]["verdict"] == "equivalent", proc.stdout[-2000:]


@pytest.mark.deep
def test_horovod_refuses_a_bool_parameter_it_cannot_broadcast_in_one_line(launch) -> None:
    proc, result = launch("horovod", 2, "tests.dtype_models:index_mlp", STEPS)
    assert proc.returncode != 0 and result is None and "Exit code: 2" in proc.output  # horovodrun's own status is 1
    said = [line for line in proc.output.splitlines() if "Horovod cannot broadcast" in line]
    # rank 0 says it; another rank still running a moment later says it too, with its rank (cli's convention for an
    # error that could be one rank's alone)
    assert said and "keep" in said[0] and "uint8" in said[0] and "[rank" not in said[0], proc.output[-3000:]
    assert all("[rank" in line for line in said[1:]), said
    assert "/dpcompare/" not in proc.output  # no traceback of ours (horovodrun prints its own on any failed rank)


@pytest.mark.deep
@pytest.mark.parametrize(("backend", "extra"), [("fsdp", []), ("deepspeed", ["--opt", "zero_stage=3"])])
def test_an_op_with_no_float64_kernel_under_sharding_backends(launch, backend: str, extra: list[str]) -> None:
    proc, result = launch(backend, 2, "tests.dtype_models:grouped_moe", [*STEPS, *extra])
    assert proc.returncode == 0, proc.output[-3000:]
    assert result["equivalence"]["verdict"] == "equivalent", proc.stdout[-2000:]


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory: pytest.TempPathFactory):
    transformers = pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("mixtral")
    transformers.AutoConfig.for_model(
        "mixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=128,
        max_position_embeddings=64).save_pretrained(folder)
    return folder


@pytest.mark.deep
def test_mixtral_is_equivalent_under_ddp_on_its_eager_experts(launch, mixtral_dir) -> None:
    proc, result = launch("ddp", 2, f"hf:{mixtral_dir}", [*STEPS, "--seq-len", "16"])
    assert proc.returncode == 0, proc.output[-3000:]
    e = result["equivalence"]
    assert e["verdict"] == "equivalent", proc.stdout[-2000:]
    assert e["oracle_precision"]["switched"][0]["to"] == "eager" and not e["oracle_precision"]["float32_ops"]


@pytest.mark.deep
@pytest.mark.parametrize(("backend", "extra"), [("fsdp", []), ("deepspeed", ["--opt", "zero_stage=3"])])
def test_mixtral_under_sharding_backends(launch, mixtral_dir, backend: str, extra: list[str]) -> None:
    proc, result = launch(backend, 2, f"hf:{mixtral_dir}", [*STEPS, "--seq-len", "16", *extra])
    assert proc.returncode == 0, proc.output[-3000:]
    assert result["equivalence"]["verdict"] == "equivalent", proc.stdout[-2000:]


# -- a run in float64 (--dtype float64): its own state is float64 on the CPU ----------------------------------------
def test_comparing_float64_optimizer_states_leaves_both_as_they_were() -> None:
    """The update check compares the backend's state with the expected one before it replays the step from the former:
    the comparison must not take its gap in place in a float64 CPU tensor, which `.to(float64)` hands back as it is.
    Twin: a state that differs is still found."""
    have = {"w": {"momentum_buffer": torch.randn(3000, dtype=torch.float64)}}
    want = {"w": {"momentum_buffer": have["w"]["momentum_buffer"] * (1 + 1e-9)}}
    kept = {k: v["momentum_buffer"].clone() for k, v in (("have", have["w"]), ("want", want["w"]))}
    assert state_difference(have, want, ["w"]) is None
    assert torch.equal(have["w"]["momentum_buffer"], kept["have"]) and torch.equal(want["w"]["momentum_buffer"],
                                                                                    kept["want"])
    wrong = {"w": {"momentum_buffer": kept["want"] * 2}}
    found = state_difference(have, wrong, ["w"])
    assert found is not None and found[0] == ["w"], found
    assert torch.equal(have["w"]["momentum_buffer"], kept["have"])


@pytest.mark.parametrize("optimizer", [[], ["--optimizer", "adamw", "--lr", "0.01"]], ids=["sgd-momentum", "adamw"])
def test_a_float64_run_with_optimizer_state_is_equivalent(launch, optimizer: list[str]) -> None:
    """--dtype float64 at two ranks, 4 checked steps with momentum (or AdamW's moments): the update check replays
    each step from the state the backend held, unchanged by the comparison taken before it."""
    proc, result = launch("ddp", 2, "mlp", [*STEPS, "--dtype", "float64", *optimizer])
    assert proc.returncode == 0, proc.output[-3000:]
    e = result["equivalence"]
    assert e["verdict"] == "equivalent", (e["first_divergence"], proc.stdout[-2000:])
    assert e["checks"]["update"]["status"] == "pass" and e["checks"]["trajectory"]["status"] == "pass"
