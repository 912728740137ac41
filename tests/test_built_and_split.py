"""What the ranks built, and how the batch is split: checked against what each rank built before wrapping and
against the float64 gradient of the global batch.

- Ranks whose models differ in a parameter's or buffer's name, shape or dtype are refused before the backend wraps
  them, in one line naming it and each rank's shape (dtype, or that it is missing), exit 2, said by rank 0 alone;
  ranks that built the same model are not (dpcompare.verify.starting_state.initial_state.compare).
- Ranks that built some values differently (an MoE expert seeded by the rank) are named: a backend that gives every
  rank rank 0's values when it wraps (DDP, DeepSpeed, Horovod) gets a note, one that does not (FSDP's shards, a DDP
  whose broadcast is undone) is `different` with cause `weights_built_apart`; weights that moved although every
  rank built them alike keep the cause `initial_weights` (dpcompare.verify.starting_state.initial_state.judge).
- A forward whose result depends on how the batch is split (control flow on the local batch's size or content) is
  named, with its float64 distance from the global batch, and judged as the ranks computed it: `equivalent` under a
  correct backend, `different` under a planted fault; a loss reduced with sum is told apart (its split gradient is
  a scalar multiple of the global one) and stays judged against the global batch. The split/global agreement allows
  for float32 computed inside the model (Gemma's norms), measured by reordering the global batch, so such a model
  is `equivalent` under --amp bf16 (dpcompare.verify.model_facts.batch_split).
- A relative error over a zero reference is null with its reason, never a figure (dpcompare.verify.judgement.tolerance).
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from torch import nn

import semantics_workloads as sw
from conftest import torchrun_rank_logs
from dpcompare import json_files
from dpcompare.run import workloads
from dpcompare.verify.oracle import float64_paths
from dpcompare.verify.oracle import gradient_oracle as eq
from dpcompare.verify.starting_state import initial_state
from dpcompare.verify.model_facts.replica_forwards import Forwards
from dpcompare.verify.model_facts.batch_split import SPLIT_AGREEMENT, SplitCheck
from dpcompare.verify.judgement.tolerance import rel_fro_of
from test_equivalence_matrix import assert_equivalent
from test_failures import assert_one_error_line
from test_negative import different

WS = 2
M = "tests.semantics_workloads"
QUICK = ["--measure-steps", "0"]
"""The defaults a user runs (4 checked steps, SGD with momentum); measurement off: nothing here measures."""
SLOW_LAUNCH_S = {"deepspeed": 400}
"""DeepSpeed's import and engine alone take minutes on two loaded cores (torchrun's default allowance is 180 s)."""


# -- what each rank built ------------------------------------------------------------------------------------------
def _mlp(width: int = 8, dtype: torch.dtype = torch.float32, seed: int = 0, extra: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, width), nn.BatchNorm1d(width), nn.Linear(width, 2)).to(dtype)
    if extra:
        model.register_parameter("scale", nn.Parameter(torch.ones(1)))
    return model


@pytest.mark.parametrize(("rank1", "expected"), [
    (dict(width=9), "parameter 0.weight: shape (8, 4) on rank 0, shape (9, 4) on rank 1"),
    (dict(dtype=torch.float64), "parameter 0.weight: dtype float32 on rank 0, dtype float64 on rank 1"),
    (dict(extra=True), "parameter scale: missing on rank 0, shape (1,) on rank 1"),
])
def test_ranks_that_built_different_models_are_refused_naming_the_tensor_and_each_ranks_shape(rank1, expected):
    built = initial_state.compare([initial_state.describe(_mlp()), initial_state.describe(_mlp(**rank1))])
    assert built.refusal is not None and expected in built.refusal, built.refusal
    assert "before wrapping" in built.refusal and "build the model from the seed alone" in built.refusal
    # ranks grouped by what they hold
    grouped = initial_state.compare([initial_state.describe(_mlp(**kw)) for kw in ({}, {"width": 9}, {}, {"width": 9})])
    assert "shape (8, 4) on ranks 0, 2, shape (9, 4) on ranks 1, 3" in grouped.refusal, grouped.refusal


def test_ranks_that_built_the_same_model_are_not_refused_and_differing_values_are_named_with_their_ranks():
    same = initial_state.compare([initial_state.describe(_mlp()) for _ in range(3)])
    assert same.refusal is None and same.values == {}
    other = _mlp()
    with torch.no_grad():
        other[2].weight.add_(1.0)
        other[1].running_mean.add_(1.0)
    apart = initial_state.compare([initial_state.describe(_mlp()), initial_state.describe(_mlp()), initial_state.describe(other)])
    assert apart.refusal is None
    assert apart.values == {"2.weight": (2,), "1.running_mean": (2,)}, apart.values
    assert apart.kinds == {"2.weight": "parameter", "1.running_mean": "buffer"}


def _judge(template: nn.Module, built_apart: dict, rank0: nn.Module, others: list[nn.Module]) -> eq.Verdict:
    verdict = eq.Verdict()
    full = {n: p.detach().clone() for n, p in rank0.named_parameters()}
    held = [initial_state.held({n: p.detach() for n, p in m.named_parameters()}, m) for m in (rank0, *others)]
    initial_state.judge(verdict, template, built_apart, full, rank0, held)
    return verdict


def _moe(rank: int, monkeypatch) -> nn.Module:
    monkeypatch.setattr(sw, "_rank", lambda: rank)
    return sw.TinyMoE(0, seed_expert_by_rank=True)


def test_values_built_apart_and_made_rank_0s_by_the_backend_are_a_note(monkeypatch):
    built = [_moe(r, monkeypatch) for r in range(WS)]
    apart = initial_state.compare([initial_state.describe(m) for m in built]).values
    assert set(apart) == {"experts.1.weight", "experts.1.bias"} and set(apart.values()) == {(1,)}
    verdict = _judge(built[0], apart, built[0], [built[0]])  # every rank holds rank 0's: a broadcast
    assert verdict.first_divergence is None and verdict.initial_weights_identical and verdict.replicas_identical
    text = next(n.text for n in verdict.notes if n.code == "initial_weights_built_apart")
    assert "experts.1.weight, experts.1.bias (rank 1 against rank 0's" in text and "rank 0's values" in text


def test_values_built_apart_that_the_backend_leaves_apart_are_different_with_that_cause(monkeypatch):
    built = [_moe(r, monkeypatch) for r in range(WS)]
    apart = initial_state.compare([initial_state.describe(m) for m in built]).values
    # each rank keeps its own (no broadcast)
    kept = _judge(built[0], apart, built[0], [built[1]]).first_divergence
    assert (kept.check, kept.cause, kept.step) == ("initial", "weights_built_apart", 0), kept
    assert kept.parameters == ["experts.1.weight", "experts.1.bias"] and "rank 1 still holds its own" in kept.reason
    # a sharded backend's patchwork: rank 0 holds rows of rank 1's
    patch = _moe(0, monkeypatch)
    with torch.no_grad():
        patch.experts[1].weight[16:] = built[1].experts[1].weight[16:]
    mixed = _judge(built[0], apart, patch, [patch]).first_divergence
    assert mixed.cause == "weights_built_apart" and mixed.parameter == "experts.1.weight", mixed
    assert "sharded backend" in mixed.reason and "optimizer step" not in mixed.reason
    # twin: weights every rank built alike that moved keep the other cause
    moved = _moe(0, monkeypatch)
    with torch.no_grad():
        moved.head.bias.add_(1e-3)
    other = _judge(built[0], apart, moved, [moved]).first_divergence
    assert other.cause == "initial_weights" and other.parameter == "head.bias", other
    alike = _judge(built[0], {}, moved, [moved]).first_divergence
    assert alike.cause == "initial_weights" and "optimizer step while wrapping" in alike.reason


def test_buffers_built_apart_are_judged_by_what_the_ranks_then_hold():
    mine, theirs = _mlp(), _mlp()
    with torch.no_grad():
        theirs[1].running_mean.add_(1.0)
    apart = initial_state.compare([initial_state.describe(mine), initial_state.describe(theirs)]).values
    assert apart == {"1.running_mean": (1,)}
    kept = _judge(mine, apart, mine, [theirs]).first_divergence
    assert kept.cause == "weights_built_apart" and "rank 1 still holds its own 1.running_mean" in kept.reason, kept
    broadcast = _judge(mine, apart, mine, [mine])
    assert broadcast.first_divergence is None and any(n.code == "initial_weights_built_apart" for n in broadcast.notes)


# -- how the batch is split ------------------------------------------------------------------------------------------
def _split_check(workload, step: int = 0, check: SplitCheck | None = None):
    """The split's finding for `workload` at 2 ranks, from its initial weights and `step`'s batch (as rank 0's
    verifier settles it at the first checked step)."""
    model = workload.model
    layout = eq.Layout(WS)
    if check is None:
        verdict = eq.Verdict()
        oracle = eq.Oracle(model, workload.loss_fn, "float32", torch.device("cpu"))
        forwards = Forwards(layout, oracle, batchnorms=[], per_replica=False, stochastic=False, dtype="float32",
                            depth=eq.depth_of(model), verdict=verdict)
        check = SplitCheck(oracle, forwards, depth=eq.depth_of(model), applies=True, verdict=verdict)
    state = model.state_dict()
    batch = workload.make_batch(step, 24)
    pieces = check.forwards.pieces(batch, None)
    return check, state, batch, pieces, check.oracle.oracle_of(state, pieces)


def _counting(check) -> list[int]:
    """The samples of each float64 gradient the split's oracle computes from here on."""
    sizes, oracle_of = [], check.oracle.oracle_of
    check.oracle.oracle_of = lambda state, pieces: (sizes.append(sum(p.x.shape[0] for p in pieces)),
                                                    oracle_of(state, pieces))[1]
    return sizes


def test_a_mean_loss_over_independent_samples_computes_the_global_batch():
    check, state, batch, pieces, oracle = _split_check(workloads.mlp(1234))
    sizes = _counting(check)
    check.settle(0, state, batch, None, None, pieces, oracle)
    f = check.finding
    assert f.semantics == "global" and f.distance_rel_fro < 1e-14 and f.agreement == SPLIT_AGREEMENT, f
    assert not check.forwards.per_replica and check.verdict.split["semantics"] == "global"
    # within the least agreement, the reordered global batch (which could only widen it) is not computed: the split
    # alone is, its ranks' forwards
    assert f.rounding_rel_fro is None and sizes == [24], (f, sizes)


class _Divided(dict):
    """A gradient as the ranks' divided arithmetic holds it (dpcompare.verify.ranks.verifier_group.Remote): what tells it apart."""

    divided_by = object()


def _divided_split(check) -> None:
    """The check's oracle computing the ranks' split as divided arithmetic would (the same values, held apart)."""
    oracle_of = check.oracle.oracle_of
    check.oracle.oracle_of = lambda state, pieces: (
        _Divided(oracle_of(state, pieces)) if len(pieces) > 1 else oracle_of(state, pieces))


def test_the_split_the_ranks_computed_is_the_first_steps_oracle_where_it_is_the_global_batchs():
    check, state, batch, pieces, oracle = _split_check(workloads.mlp(1234))
    _divided_split(check)
    check.settle(0, state, batch, None, None, pieces, oracle)
    shards = check.shards(0)
    assert isinstance(shards, _Divided) and rel_fro_of(shards, oracle, check.oracle.names) < 1e-14
    assert check.shards(0) is None  # given once
    # another step's is never given; nor one the ranks did not compute, nor a split beyond the agreement
    check, state, batch, pieces, oracle = _split_check(workloads.mlp(1234))
    _divided_split(check)
    check.settle(0, state, batch, None, None, pieces, oracle)
    assert check.shards(1) is None and check.shards(0) is None
    check, state, batch, pieces, oracle = _split_check(workloads.mlp(1234))
    check.settle(0, state, batch, None, None, pieces, oracle)
    assert check.shards(0) is None
    check, state, batch, pieces, oracle = _split_check(sw.float32_norm_mlp(1234))
    _divided_split(check)
    check.settle(0, state, batch, None, None, pieces, oracle)
    assert check.finding.semantics == "global" and check.shards(0) is None  # global within rounding, beyond 1e-9


def test_a_forward_that_depends_on_the_split_is_judged_per_replica_and_a_sum_is_told_apart():
    for model, control in ((sw.split_by_size_mlp, "size"), (sw.split_by_content_mlp, "content")):
        check, state, batch, pieces, oracle = _split_check(model(1234))
        now, _ = check.settle(0, state, batch, None, None, pieces, oracle)
        f = check.finding
        assert f.semantics == "per_replica" and f.distance_rel_fro > 0.05 and f.scale is None, (control, f)
        assert check.forwards.per_replica and len(now) == WS, control
        check.note(1e-7)
        text = next(n.text for n in check.verdict.notes if n.code == "split_dependent_forward")
        assert "control flow on the local batch" in text and f"{f.distance_rel_fro:.3g} away (relative" in text
        assert f.cause["name"] == "control_flow", f.cause  # each cause's own test: tests/test_normalisation.py
    # a loss reduced with sum: the split's gradient is 1/2 of the global one; the global batch stays the oracle
    base = workloads.mlp(1234)
    summed = workloads.Workload("sum", base.model, base.make_batch,
                                lambda out, y: torch.nn.functional.cross_entropy(out, y, reduction="sum"))
    check, state, batch, pieces, oracle = _split_check(summed)
    now, _ = check.settle(0, state, batch, None, None, pieces, oracle)
    f = check.finding
    assert f.semantics == "loss_not_mean" and abs(f.scale - 1 / WS) < 1e-12 and len(now) == 1, f
    check.note(1e-7)
    text = next(n.text for n in check.verdict.notes if n.code == "split_not_global")
    assert "the loss is not a mean" in text and "0.5x the global batch's gradient" in text


def test_float32_inside_the_model_is_allowed_for_as_measured_and_a_split_is_still_caught():
    check, state, batch, pieces, oracle = _split_check(sw.float32_norm_mlp(1234))
    sizes = _counting(check)
    check.settle(0, state, batch, None, None, pieces, oracle)
    f = check.finding
    # the float64 copy's float32 norms put the split beyond float64's own agreement, within what reordering shows
    assert f.distance_rel_fro > SPLIT_AGREEMENT and f.rounding_rel_fro > SPLIT_AGREEMENT, f
    assert sizes == [24, 24], sizes  # the split, then the global batch reordered
    assert f.semantics == "global" and f.agreement == pytest.approx(10 * f.rounding_rel_fro), f
    assert not check.forwards.per_replica and len(check.forwards.pieces(batch, None)) == 1
    # the same norms upcast as written for half precision (x.float()): the float64 copies keep them float64, so the
    # split is the global batch's within float64's own agreement, and the casts kept are named
    check, state, batch, pieces, oracle = _split_check(sw.upcast_norm_mlp(1234))
    check.settle(0, state, batch, None, None, pieces, oracle)
    f = check.finding
    assert f.semantics == "global" and f.distance_rel_fro < SPLIT_AGREEMENT and f.agreement == SPLIT_AGREEMENT, f
    kept = float64_paths.report(check.oracle.model64)["float32_casts_kept_float64"]
    assert [k["op"] for k in kept] == ["Tensor.float"] and len(kept[0]["modules"]) == 4, kept
    forced, state, batch, pieces, oracle = _split_check(sw.float32_norm_mlp(1234))
    forced.settle(0, state, batch, None, None, pieces, oracle)  # a cast to a float32 tensor's dtype: not lifted
    assert float64_paths.report(forced.oracle.model64) is None
    # twin: the same float32 norms with a split-dependent forward are still found
    model = sw.float32_norm_mlp(1234)
    model.model.blocks[0].append(sw._BySize())
    check, state, batch, pieces, oracle = _split_check(model)
    check.settle(0, state, batch, None, None, pieces, oracle)
    assert check.finding.semantics == "per_replica", check.finding


def test_a_split_that_changes_the_gradient_only_at_a_later_step_is_found_there():
    workload = sw.split_later_mlp(1234)
    check, state, batch, pieces, oracle = _split_check(workload, step=0)
    check.settle(0, state, batch, None, None, pieces, oracle)
    assert check.finding.semantics == "global"
    floor = check.oracle.floor_of(state, eq.replica_pieces(batch, check.layout))
    assert check.reconsider(0, state, batch, None, None, pieces, oracle, floor) is None  # the baseline
    for step, changes in ((1, False), (3, True)):
        _, state, batch, pieces, oracle = _split_check(workload, step=step, check=check)
        floor = check.oracle.floor_of(state, eq.replica_pieces(batch, check.layout))
        now = check.reconsider(step, state, batch, None, None, pieces, oracle, floor)
        assert (now is not None) == changes, step
    assert check.finding.semantics == "per_replica" and check.finding.step == 3 and check.forwards.per_replica


# -- no garbage figures ------------------------------------------------------------------------------------------------
def test_a_relative_error_over_a_zero_reference_is_null_with_its_reason():
    names = ["w", "unused"]
    oracle = {"w": torch.ones(3, dtype=torch.float64), "unused": torch.zeros(2, dtype=torch.float64)}
    grads = {"w": oracle["w"] * (1 + 1e-7), "unused": torch.full((2,), 1e-3, dtype=torch.float64)}
    params, model = eq.compare(grads, oracle, oracle, dtype="float32", world_size=WS, depth=2, names=names,
                               spread=oracle)
    by = {p.parameter: p for p in params}
    assert math.isnan(by["unused"].max_rel_err) and "is zero throughout" in by["unused"].max_rel_err_reason
    assert by["w"].max_rel_err == pytest.approx(1e-7, rel=1e-3) and by["w"].max_rel_err_reason is None
    verdict = eq.Verdict(checks=[eq.StepCheck(0, params, True, True, model=model)])
    out = json_files.sanitize(verdict.to_dict(eq.tolerance_policy("float32", WS, 2)))
    assert out["max_rel_err"] == pytest.approx(1e-7, rel=1e-3) and out["max_rel_err_reason"] is None
    step_params = {p["parameter"]: p for p in out["per_step"][0]["params"]}
    assert step_params["unused"]["max_rel_err"] is None and "zero throughout" in step_params["unused"]["max_rel_err_reason"]
    only_zero = eq.Verdict(checks=[eq.StepCheck(0, [by["unused"]], True, True)])
    out = json_files.sanitize(only_zero.to_dict(eq.tolerance_policy("float32", WS, 2)))
    assert out["max_rel_err"] is None and "zero throughout" in out["max_rel_err_reason"]


# -- real runs -----------------------------------------------------------------------------------------------------------
def _refused(launch, tmp_path, backend: str, extra: list[str], expected: list[str]) -> None:
    log_dir = tmp_path / "torchrun-logs"
    proc, result = launch(backend, WS, f"{M}:rank_shaped_mlp", [*QUICK, *extra], "torchrun",
                          launcher_args=["--log-dir", str(log_dir), "--redirects", "3"],
                          timeout_s=SLOW_LAUNCH_S.get(backend))
    assert proc.returncode != 0 and result is None
    logs = torchrun_rank_logs(log_dir)
    ours = [line for line in logs[0]["stderr"].splitlines() if "real_accelerator.py" not in line]
    assert_one_error_line("\n".join(ours), *expected)
    assert logs[1]["stderr"] == "", logs[1]["stderr"]  # rank 1 leaves silently
    assert all("Traceback" not in text for streams in logs.values() for text in streams.values())
    codes = [int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", proc.stderr)]
    assert 2 in codes and set(codes) <= {2, -15}, codes


SHAPES = ["the ranks built different models before wrapping",
          "parameter 0.weight: shape (64, 32) on rank 0, shape (65, 32) on rank 1"]


@pytest.mark.multiproc
@pytest.mark.timeout(450)
@pytest.mark.parametrize(("backend", "extra"), [
    # the refusal itself is decided in-process (the unit tests above); one launch under ddp and fsdp in the slow
    # tier, ZeRO-3's (a minute of DeepSpeed's start) in the deep tier
    pytest.param("ddp", [], id="ddp", marks=pytest.mark.slow),
    pytest.param("fsdp", [], id="fsdp", marks=pytest.mark.slow),
    pytest.param("deepspeed", ["--opt", "zero_stage=3"], id="zero3", marks=pytest.mark.deep),
])
def test_ranks_that_built_different_shapes_are_refused_before_wrapping(launch, tmp_path, backend, extra):
    _refused(launch, tmp_path, backend, extra, SHAPES)


@pytest.mark.slow  # breadth: the default tier keeps this capability's other test
@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_rank_seeded_weights_under_fsdp_are_different_naming_them(launch):
    proc, result = launch("fsdp", WS, f"{M}:rank_seeded_moe", QUICK)
    d = different(proc, result, "initial")
    assert (d["step"], d["cause"], d["parameter"]) == (0, "weights_built_apart", "experts.1.weight"), d
    assert d["parameters"] == ["experts.1.weight", "experts.1.bias"] and "rank 1 against rank 0's" in d["reason"]
    assert "optimizer step" not in d["reason"] and result["equivalence"]["initial_weights_identical"] is False


@pytest.mark.multiproc
@pytest.mark.timeout(450)
@pytest.mark.parametrize(("backend", "extra"), [
    pytest.param("ddp", [], id="ddp", marks=pytest.mark.slow),
    pytest.param("deepspeed", ["--opt", "zero_stage=3"], id="zero3", marks=pytest.mark.deep),
    pytest.param("deepspeed", ["--opt", "zero_stage=0"], id="zero0", marks=pytest.mark.deep),
    pytest.param("horovod", [], id="horovod", marks=pytest.mark.deep),
])
def test_rank_seeded_weights_under_a_broadcasting_backend_are_equivalent_with_a_note(launch, backend, extra):
    pytest.importorskip({"deepspeed": "deepspeed", "horovod": "horovod.torch"}.get(backend, "torch"))
    proc, result = launch(backend, WS, f"{M}:rank_seeded_moe", [*QUICK, *extra], timeout_s=SLOW_LAUNCH_S.get(backend))
    e = result["equivalence"] if result else {}
    assert proc.returncode == 0 and e["verdict"] == "equivalent", proc.output[-4000:]
    text = next(n["text"] for n in e["notes"] if n["code"] == "initial_weights_built_apart")
    assert "experts.1.weight, experts.1.bias (rank 1 against rank 0's" in text
    assert "the ranks built different initial weights; the backend gave every rank rank 0's" in proc.stdout


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_rank_seeded_weights_under_a_ddp_that_does_not_broadcast_are_different(launch):
    proc, result = launch("tests.faulty_adapters:NoBroadcastDDP", WS, f"{M}:rank_seeded_moe", QUICK, "torchrun")
    d = different(proc, result, "initial")
    assert d["cause"] == "weights_built_apart" and "rank 1 still holds its own experts.1.weight" in d["reason"], d


@pytest.mark.multiproc
@pytest.mark.slow  # the default tier keeps the in-process split tests above
@pytest.mark.timeout(240)
def test_a_forward_that_depends_on_the_split_is_named_and_judged_as_the_ranks_ran_it(launch):
    proc, result = launch("ddp", WS, f"{M}:split_by_content_mlp", QUICK)
    assert_equivalent(proc, result, backend="ddp", world_size=WS, model="split-by-content-mlp", launcher="torchrun",
                      steps=4)
    split = result["equivalence"]["split"]
    assert split["semantics"] == "per_replica" and split["step"] == 0 and split["distance_rel_fro"] > 0.05, split
    assert any(n["code"] == "split_dependent_forward" for n in result["equivalence"]["notes"])
    assert split["cause"]["name"] == "control_flow", split["cause"]
    assert ("the forward depends on how the batch is split (control flow on the local batch): judged as the ranks' "
            "forwards") in proc.stdout


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_a_fault_under_a_split_dependent_forward_is_still_caught(launch):
    proc, result = launch("tests.faulty_adapters:SummingDDP", WS, f"{M}:split_by_content_mlp", QUICK, "torchrun")
    d = different(proc, result)
    assert (d["step"], d["cause"]) == (0, "summed"), d
    assert result["equivalence"]["split"]["semantics"] == "per_replica"


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_a_split_that_changes_the_gradient_at_a_later_step_is_named_not_blamed(launch):
    proc, result = launch("ddp", WS, f"{M}:split_later_mlp", QUICK)
    assert_equivalent(proc, result, backend="ddp", world_size=WS, model="split-later-mlp", launcher="torchrun",
                      steps=4)
    assert result["equivalence"]["split"]["semantics"] == "per_replica" and result["equivalence"]["split"]["step"] == 3


@pytest.mark.multiproc
@pytest.mark.timeout(450)
@pytest.mark.parametrize(("backend", "extra"), [
    pytest.param("ddp", [], id="ddp", marks=pytest.mark.slow),
    pytest.param("fsdp", [], id="fsdp", marks=pytest.mark.deep),
    pytest.param("deepspeed", ["--opt", "zero_stage=3"], id="zero3", marks=pytest.mark.deep),
])
def test_float32_norms_inside_the_model_are_equivalent_under_bf16(launch, backend, extra):
    proc, result = launch(backend, WS, f"{M}:float32_norm_mlp", [*QUICK, "--amp", "bf16", *extra],
                          timeout_s=SLOW_LAUNCH_S.get(backend))
    e = result["equivalence"] if result else {}
    assert proc.returncode == 0 and e["verdict"] == "equivalent", proc.output[-4000:]
    assert e["split"]["semantics"] == "global" and e["split"]["distance_rel_fro"] > SPLIT_AGREEMENT, e["split"]


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory):
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("gemma")
    transformers.AutoConfig.for_model(
        "gemma", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, vocab_size=128, max_position_embeddings=64).save_pretrained(path)
    return path


@pytest.mark.deep
@pytest.mark.multiproc
@pytest.mark.timeout(450)
@pytest.mark.parametrize(("backend", "extra"), [
    pytest.param("ddp", [], id="ddp"),
    pytest.param("fsdp", [], id="fsdp"),
    pytest.param("deepspeed", ["--opt", "zero_stage=3"], id="zero3"),
])
def test_gemma_is_equivalent_under_bf16(launch, gemma, backend, extra):
    proc, result = launch(backend, WS, f"hf:{gemma}", [*QUICK, "--seq-len", "16", "--amp", "bf16", *extra],
                          timeout_s=SLOW_LAUNCH_S.get(backend))
    e = result["equivalence"] if result else {}
    assert proc.returncode == 0 and e["verdict"] == "equivalent", proc.output[-4000:]
    # a language model's batches are padded (--token-data's default), each rank's loss a mean over its own tokens:
    # its shards part from the global batch's loss by their token counts, and the split says so, reweighted
    split = e["split"]
    assert (split["semantics"], split["cause"]["name"]) == ("per_replica", "normalisation"), split
    assert split["cause"]["evidence"]["normalisation"]["holds"], split
