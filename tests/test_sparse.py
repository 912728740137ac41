"""Sparse gradients (nn.Embedding(sparse=True), nn.EmbeddingBag(sparse=True): recommendation models' tables).

DDP, Horovod, nn.DataParallel and DeepSpeed at ZeRO-0 reduce a sparse gradient as such; the checks read it densified
(dpcompare.contract.sparse) against the dense gradient of the oracle's copies (their tables switched to sparse=False)
and judge the model: `equivalent`, gradient, update and trajectory checked. FSDP2 and ZeRO-1/2/3, which copy every
gradient into flat dense buffers, refuse the model before it trains, in one line naming the parameter (exit 2), as
does what torch itself cannot do with one (AdamW, SGD's weight decay, clip_grad_norm_) and what the checks cannot
model (16-bit sparse roundings). A DDP twin that doubles rank 1's sparse rows in its hook is `different`, naming the
table and the factor per rank. A checkpoint of SGD's sparse momentum loads bitwise equal.

Tiers: the densifying glue and the refusal lines in-process, one refusal and one 2-rank ddp run judged equivalent by
launch in the default tier; the rest of the backend matrix and the negative twin in the slow tier.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from dpcompare.adapters.ddp import DDPAdapter
from dpcompare.adapters.deepspeed import DeepSpeedAdapter
from dpcompare.adapters.fsdp import FSDPAdapter
from dpcompare.adapters.horovod import HorovodAdapter
from dpcompare.contract import Settings, sparse
from dpcompare.contract.optim_state import read_state
from dpcompare.measure.memory import census_bytes
from dpcompare.verify.oracle.gradient_oracle import verification_copy
from dpcompare.verify.model_facts.model_probe import probe
from dpcompare.verify.instruments.backend_reads import Reads
from test_equivalence_matrix import assert_equivalent
from test_failures import assert_one_error_line
from test_negative import different
from tests import sparse_models

BAG = "tests.sparse_models:bag_recommender"
EMB = "tests.sparse_models:sparse_embedding"
STEPS = ["--steps", "4"]
WS = 2
CPU = torch.device("cpu")


def _uncoalesced() -> torch.Tensor:
    """Rows 1, 1 and 3 of a (5, 2) table: row 1 listed twice, as a batch that reads it twice leaves it."""
    return torch.sparse_coo_tensor([[1, 1, 3]], torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]), (5, 2),
                                   check_invariants=True)


def _settings(**kwargs) -> Settings:
    options = {"zero_stage": 0, "amp_recipe": "autocast", "gradient_clipping": 0.0, **kwargs.pop("options", {})}
    return Settings(options=options, **kwargs)


def _refusal(found=("bag.weight",), backend="ddp", backend_refusal=None, **kwargs) -> str | None:
    settings = {"optimizer": "sgd", "weight_decay": 0.0, "clip_grad_norm": None, "dtype": "float32",
                "compression": "none", **kwargs}
    return sparse.refusal(found, {"bag.weight": "nn.EmbeddingBag(sparse=True)"}, backend, backend_refusal, **settings)


# -- the densifying glue ---------------------------------------------------------------------------------
def test_a_sparse_gradient_reads_dense_with_its_repeated_rows_summed():
    g = _uncoalesced()
    dense = sparse.dense(g)
    assert dense.layout == torch.strided and dense.shape == (5, 2)
    assert torch.equal(dense, torch.tensor([[0.0, 0], [4, 6], [0, 0], [5, 6], [0, 0]]))
    plain = torch.ones(3)
    assert sparse.dense(plain) is plain and sparse.dense(None) is None
    assert sparse.densified({"a": g, "b": None})["a"].layout == torch.strided
    state = sparse.densified_state({"a": {"momentum_buffer": g, "step": 3}})
    assert state["a"]["momentum_buffer"].layout == torch.strided and state["a"]["step"] == 3
    assert sparse.densified_state(None) is None


def test_the_checks_reads_are_dense_whatever_the_backend_left():
    reads = Reads({"bag.weight": _uncoalesced(), "b": None}, {}, {"bag.weight": {"momentum_buffer": _uncoalesced()}})
    assert reads.grads["bag.weight"].layout == torch.strided and reads.grads["b"] is None
    assert reads.state["bag.weight"]["momentum_buffer"].layout == torch.strided


def test_the_tables_are_found_by_module_and_by_the_probes_backward():
    model = sparse_models.bag_recommender(0).model
    assert sparse.tables(model) == {"bag.weight": "nn.EmbeddingBag(sparse=True)"}
    assert sparse.tables(sparse_models.sparse_embedding(0).model) == {"emb.weight": "nn.Embedding(sparse=True)"}
    frozen = nn.Sequential(nn.Embedding(4, 2, sparse=True).requires_grad_(False), nn.Embedding(4, 2))
    assert sparse.tables(frozen) == {}  # frozen, or dense: no sparse gradient
    w = sparse_models.bag_recommender(0)
    facts = probe(w.model, w.loss_fn, w.make_batch(0, 8), CPU)
    assert facts.sparse_grads == ("bag.weight",) and facts.unused == ()


def test_the_oracles_copies_compute_the_same_gradient_dense():
    w = sparse_models.bag_recommender(0)
    x, y = w.make_batch(0, 16)
    grads = {}
    for keep in (True, False):
        model = verification_copy(w.model, CPU, torch.float64, sparse=keep)
        w.loss_fn(model(x), y).backward()
        grads[keep] = model.bag.weight.grad
    assert grads[True].is_sparse and grads[False].layout == torch.strided
    assert torch.allclose(sparse.dense(grads[True]), grads[False], rtol=0, atol=1e-15)
    assert w.model.bag.sparse, "the template keeps its sparse table"


def test_sgds_momentum_of_a_sparse_gradient_is_read_dense():
    table = nn.Embedding(5, 2, sparse=True)
    optimizer = torch.optim.SGD(table.parameters(), lr=0.1, momentum=0.9)
    table(torch.tensor([1, 1, 3])).sum().backward()
    optimizer.step()
    assert optimizer.state[table.weight]["momentum_buffer"].is_sparse  # torch keeps it sparse
    momentum = read_state(optimizer, table)["weight"]["momentum_buffer"]
    assert momentum.layout == torch.strided and torch.equal(momentum[1], torch.full((2,), 2.0))


def test_the_memory_census_counts_a_sparse_gradients_indices_and_values():
    g = _uncoalesced()
    counted = census_bytes({"grads": [g]})
    assert counted["grads"] == 3 * 8 + 3 * 2 * 4  # int64 indices, float32 values (not the 5 x 2 dense table)


# -- the refusals ----------------------------------------------------------------------------------------
def test_a_backend_of_flat_dense_buffers_refuses_in_one_line_naming_the_parameter():
    line = _refusal(backend="fsdp", backend_refusal=FSDPAdapter.sparse_gradient_refusal(_settings()))
    assert line.startswith("fsdp cannot take the sparse gradient of `bag.weight` (nn.EmbeddingBag(sparse=True)): "
                           "FSDP2 shards every gradient"), line
    assert line.endswith("use ddp or horovod, or build the table with sparse=False") and "\n" not in line
    for stage in (1, 2, 3):
        said = DeepSpeedAdapter.sparse_gradient_refusal(_settings(options={"zero_stage": stage}))
        assert f"ZeRO-{stage} (--opt zero_stage={stage})" in said and "--opt zero_stage=0" in said, said
    assert DeepSpeedAdapter.sparse_gradient_refusal(_settings()) is None  # stage 0 all-gathers sparse rows
    assert "engine recipe" in DeepSpeedAdapter.sparse_gradient_refusal(
        _settings(amp="bf16", options={"amp_recipe": "engine"}))
    assert "unclipped" in DeepSpeedAdapter.sparse_gradient_refusal(_settings(options={"gradient_clipping": 1.0}))
    assert "unclipped" in DeepSpeedAdapter.sparse_gradient_refusal(_settings(clip_grad_norm=1.0))
    for adapter in (DDPAdapter, HorovodAdapter):
        assert adapter.sparse_gradient_refusal(_settings()) is None


@pytest.mark.parametrize(("settings", "expected"), [
    ({"optimizer": "adamw"}, "--optimizer adamw cannot step the sparse gradient of `bag.weight` (nn.EmbeddingBag("
                             "sparse=True)): torch's AdamW refuses sparse gradients; use --optimizer sgd"),
    ({"weight_decay": 0.01}, "--weight-decay 0.01 cannot apply to the sparse gradient of `bag.weight`"),
    ({"clip_grad_norm": 1.0}, "--clip-grad-norm cannot clip the sparse gradient of `bag.weight`"),
    ({"dtype": "bfloat16"}, "--dtype bfloat16: the checks cannot judge the sparse gradient of `bag.weight`"),
    ({"compression": "fp16"}, "--compression fp16: the checks cannot judge the sparse gradient of `bag.weight`"),
])
def test_what_torch_or_the_checks_cannot_do_with_a_sparse_gradient_is_refused(settings, expected):
    line = _refusal(**settings)
    assert line.startswith(expected) and "sparse=False" in line, line


def test_what_can_take_a_sparse_gradient_is_not_refused():
    assert _refusal() is None and _refusal(found=()) is None
    assert _refusal(dtype="float64") is None
    unknown = _refusal(found=("custom.weight",))
    assert unknown.startswith("`custom.weight` gets a sparse gradient from outside nn.Embedding"), unknown
    assert "and 1 more" in _refusal(found=("bag.weight", "other.weight"), optimizer="adamw")


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_adamw_on_a_sparse_table_is_one_line_and_exit_2(launch):
    proc, result = launch("reference", 1, EMB, [*STEPS, "--optimizer", "adamw"], "python")
    assert proc.returncode == 2 and result is None, proc.output[-4000:]
    assert_one_error_line(proc.stderr, "--optimizer adamw cannot step the sparse gradient of `emb.weight` "
                                       "(nn.Embedding(sparse=True))", "use --optimizer sgd")
    assert "Traceback" not in proc.output


# -- judged: ddp in the default tier, the rest of the matrix in the slow tier -----------------------------
def _judged(proc, result, backend: str, model: str, launcher: str, table: str) -> None:
    assert_equivalent(proc, result, backend=backend, world_size=result["world_size"], model=model, launcher=launcher,
                      steps=4)
    e = result["equivalence"]
    judged = {p["parameter"]: p for p in e["per_step"][0]["params"]}
    assert judged[table]["judged"] and judged[table]["ok"], judged[table]  # the table's gradient, densified
    notes = [n["text"] for n in e["notes"] if n["code"] == "sparse_gradients"]
    assert notes and f"`{table}`" in notes[0] and "densified" in notes[0], e["notes"]


@pytest.mark.multiproc
@pytest.mark.timeout(180)
def test_ddp_reduces_a_sparse_bag_and_is_judged_equivalent(launch):
    proc, result = launch("ddp", WS, BAG, STEPS, "torchrun")
    _judged(proc, result, "ddp", "bag-recommender", "torchrun", "bag.weight")


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("backend", "world_size", "model", "launcher", "extra"), [
    pytest.param("reference", 1, BAG, "python", [], id="reference-bag"),
    pytest.param("reference", 1, EMB, "python", [], id="reference-embedding"),
    pytest.param("dp", 1, EMB, "python", [], id="dp-embedding"),
    pytest.param("ddp", WS, EMB, "torchrun", [], id="ddp-embedding"),
    pytest.param("ddp", WS, BAG, "torchrun", ["--grad-accum", "2"], id="ddp-bag-accum"),
    pytest.param("horovod", WS, BAG, "horovodrun", [], id="horovod-bag"),
    pytest.param("horovod", WS, EMB, "horovodrun", [], id="horovod-embedding"),
    pytest.param("deepspeed", WS, BAG, "torchrun", ["--opt", "zero_stage=0"], id="zero0-bag"),
])
def test_every_backend_that_reduces_sparse_gradients_is_judged_equivalent(launch, backend, world_size, model, launcher,
                                                                          extra):
    if backend in ("horovod", "deepspeed"):
        pytest.importorskip(backend)
    proc, result = launch(backend, world_size, model, [*STEPS, *extra], launcher)
    name = "bag-recommender" if model == BAG else "sparse-embedding"
    _judged(proc, result, backend, name, launcher, "bag.weight" if model == BAG else "emb.weight")


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("backend", "extra", "expected"), [
    pytest.param("fsdp", [], "fsdp cannot take the sparse gradient of `bag.weight` (nn.EmbeddingBag(sparse=True)): "
                 "FSDP2 shards every gradient", id="fsdp"),
    *(pytest.param("deepspeed", ["--opt", f"zero_stage={s}"], f"deepspeed cannot take the sparse gradient of "
                   f"`bag.weight` (nn.EmbeddingBag(sparse=True)): ZeRO-{s} (--opt zero_stage={s})", id=f"zero{s}")
      for s in (1, 2, 3)),
])
def test_a_backend_of_flat_dense_buffers_refuses_before_training(launch, tmp_path, backend, extra, expected):
    if backend == "deepspeed":
        pytest.importorskip(backend)
    log_dir = tmp_path / "torchrun-logs"
    proc, result = launch(backend, WS, BAG, [*STEPS, *extra], "torchrun",
                          launcher_args=["--log-dir", str(log_dir), "--redirects", "3"])
    assert proc.returncode != 0 and result is None
    from conftest import torchrun_rank_logs

    logs = torchrun_rank_logs(log_dir)
    ours = [line for line in logs[0]["stderr"].splitlines() if line.startswith("dpcompare")]
    assert_one_error_line("\n".join(ours), expected, "use ddp or horovod, or build the table with sparse=False")
    assert all("Traceback" not in text for streams in logs.values() for text in streams.values())
    codes = [int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", proc.stderr)]
    assert 2 in codes and set(codes) <= {2, -15}, codes


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.timeout(180)
def test_a_hook_that_doubles_one_ranks_sparse_rows_is_different_naming_the_table(launch):
    proc, result = launch("tests.faulty_adapters:Rank1SparseScaledDDP", WS, BAG, STEPS, "torchrun")
    d = different(proc, result, "gradient")
    assert (d["step"], d["parameter"]) == (0, "bag.weight") and d["parameters"] == ["bag.weight"], d
    assert "rank 0 x1" in d["reason"] and "rank 1 x2" in d["reason"], d["reason"]
    assert result["equivalence"]["replicas_identical"] is True  # every rank holds the same wrong gradient


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_a_checkpoint_of_sparse_momentum_loads_bitwise_equal(launch, tmp_path):
    directory = str(tmp_path / "ckpt")
    proc, result = launch("reference", 1, BAG, ["--steps", "2", "--save-checkpoint", directory], "python")
    assert proc.returncode == 0 and result["equivalence"]["verdict"] == "equivalent", proc.output[-4000:]
    proc, result = launch("reference", 1, BAG, ["--steps", "2", "--load-checkpoint", directory], "python")
    assert proc.returncode == 0 and result["equivalence"]["verdict"] == "equivalent", proc.output[-4000:]
    parts = result["equivalence"]["checkpoint"]["loaded"]["parts"]
    assert parts["optimizer"] == "bitwise equal (5 parameters)" and parts["parameters"] == "bitwise equal (5)", parts
