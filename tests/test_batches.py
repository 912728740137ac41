"""Batches of any structure (dpcompare.contract.batches): a dict, a tuple of inputs, a dataclass, sequence-first
tensors; each rank's rows of every tensor, the model called as the inputs' type says (or by the workload's own
forward), and the checks on the same structures.

- The structure's walk, the sample count and its refusal, the call's dispatch, the loss's refusal (unit tests).
- In one process (cli.main, the reference backend, and nn.DataParallel for the dict and the two inputs): each batch
  model judged `equivalent`; a batch whose tensors
  disagree on the sample count, a global batch of another size and a loss of one value a sample refused in one line,
  exit 2, nothing written.
- Under torchrun: the transformers-style dict batch with an attention mask, padded, is `equivalent` at 2 ranks with
  its normalisation named and, under --loss-normalisation global with --grad-accum 2 (the step's count handed to the
  model as num_items_in_batch), with no note; its twin whose model drops that count is `different`, cause named. The slow tier runs
  a cell of each (the deep tier every backend with every structure, and a checkpoint cell of the dict batch).
"""

from __future__ import annotations

import json
from collections import OrderedDict, namedtuple
from dataclasses import dataclass

import pytest
import torch

import batch_models as bm
from dpcompare.contract import batches
from dpcompare.contract.normalisation import LossError, counted
from dpcompare.run.trainer import batch_refusal
from test_failures import in_process  # noqa: F401 - the fixture

Pair = namedtuple("Pair", "a b")


@dataclass
class Box:
    t: torch.Tensor
    label: str = "kept"


def _tree(n: int = 6):
    return {"ids": torch.arange(n * 3).reshape(n, 3), "nested": (torch.randn(n, 2), [torch.ones(n)]),
            "box": Box(torch.arange(n)), "pair": Pair(torch.zeros(n, 1), torch.ones(n)), "scalar": torch.tensor(2.0),
            "name": "not a tensor", "od": OrderedDict(x=torch.arange(n))}


# -- the walk ------------------------------------------------------------------------------------------------------
def test_every_tensor_of_any_structure_is_sharded_chunked_joined_and_moved_and_other_leaves_pass_through():
    tree = _tree()
    assert batches.rows(tree) == 6
    odd = batches.stride(tree, 1, 2)
    assert odd["ids"][:, 0].tolist() == [3, 9, 15] and odd["box"].t.tolist() == [1, 3, 5]
    assert isinstance(odd["pair"], Pair) and isinstance(odd["od"], OrderedDict) and odd["box"].label == "kept"
    assert odd["name"] == "not a tensor" and odd["scalar"] is tree["scalar"]  # 0-dim: shared, not sharded
    parts = batches.chunk(tree, 4)
    assert [batches.rows(p) for p in parts] == [2, 2, 2]  # as torch.chunk cuts 6 rows in 4
    assert batches.equal(batches.cat(parts), tree) and not batches.equal(parts[0], tree)
    moved = batches.to(tree, "cpu", torch.float64)
    assert moved["nested"][0].dtype == torch.float64 and moved["ids"].dtype == torch.int64
    assert len(batches.leaves(tree)) == 8


def test_a_batch_whose_tensors_disagree_on_the_samples_is_refused_naming_them():
    tree = _tree()
    tree["nested"] = (torch.randn(5, 2), [torch.ones(6)])
    with pytest.raises(batches.BatchError, match=r"disagree on the number of samples .*\['nested'\]\[0\]: 5"):
        batches.rows(tree)
    with pytest.raises(batches.BatchError, match="no tensor with a sample dimension"):
        batches.rows({"a": torch.tensor(1.0), "b": "text"})
    with pytest.raises(batches.BatchError, match="return \\(inputs, targets\\)"):
        batches.pair(torch.zeros(3))
    inputs = {"x": torch.zeros(2)}
    assert batches.pair(inputs) == (inputs, inputs) and batches.pair([1, 2]) == (1, 2)


def test_a_declared_sample_dimension_shards_along_it():
    x = torch.arange(24).reshape(2, 6, 2)  # (T, B, F)
    with batches.convention(sample_dim=1):
        assert batches.rows(x) == 6
        assert batches.stride(x, 0, 3)[:, :, 0].tolist() == [[0, 6], [12, 18]]
        assert batches.rows(batches.cat(batches.chunk(x, 2))) == 6
    assert batches.rows(x) == 2  # outside the run's convention: dimension 0 again


def test_the_model_is_called_as_the_inputs_type_says_or_by_the_workloads_forward():
    seen = []

    def model(*args, **kwargs):
        seen.append((len(args), sorted(kwargs)))

    batches.call(model, {"a": 1, "b": 2})
    batches.call(model, (1, 2, 3))
    batches.call(model, Pair(1, 2))  # a named tuple is one input
    batches.call(model, torch.zeros(1))
    with batches.convention(forward=lambda m, inputs: m(inputs, extra=True)):
        batches.call(model, (1, 2))
    assert seen == [(0, ["a", "b"]), (3, []), (1, []), (1, []), (1, ["extra"])]


def test_a_loss_that_is_neither_one_value_nor_sum_and_count_is_refused():
    out, y = torch.randn(4), torch.randn(4)
    with pytest.raises(LossError, match=r"a tensor of shape \(4,\) as its loss"):
        counted(lambda o, t: (o - t) ** 2)(out, y)
    with pytest.raises(LossError, match="a tuple of 3"):
        counted(lambda o, t: (o.sum(), 4, 1))(out, y)
    with pytest.raises(LossError, match="returned NoneType"):
        counted(lambda o, t: None).sum_and_count(out, y)
    assert float(counted(lambda o, t: ((o - t) ** 2).mean())(out, y)) >= 0


def test_the_first_batch_is_refused_where_it_cannot_be_split_or_is_not_the_global_batch():
    good = bm.dict_attention(0).make_batch(0, 8)
    assert batch_refusal("m", good, 8) is None
    assert "returned 8 samples" in batch_refusal("m", good, 12)
    assert "disagree on the number of samples" in batch_refusal("m", bm.disagreeing(0).make_batch(0, 8), 8)


# -- in one process ------------------------------------------------------------------------------------------------
QUICK = ["--steps", "4", "--measure-steps", "0"]


@pytest.mark.parametrize(("backend", "model"), [("reference", "dict_attention"), ("reference", "two_towers"),
                                                ("reference", "dataclass_inputs"), ("reference", "seq_first"),
                                                ("dp", "dict_attention"), ("dp", "two_towers")])
def test_each_structure_is_equivalent_in_one_process(in_process, backend, model):  # noqa: F811
    status, out, err, written = in_process(backend, f"tests.batch_models:{model}", QUICK)
    assert status == 0, err[-3000:]
    e = json.loads(written[-1].read_text())["equivalence"]
    assert e["verdict"] == "equivalent", (e["first_divergence"], e["notes"])
    assert all(e["checks"][c]["status"] == "pass" for c in ("gradient", "update", "trajectory")), e["checks"]


@pytest.mark.parametrize(("model", "said"), [
    ("disagreeing", "disagree on the number of samples along dimension 0 (inputs[0], targets: 24; inputs[1]: 25)"),
    ("vector_loss", "the loss returned a tensor of shape (24,) as its loss: return a one-element tensor"),
])
def test_bad_batches_and_losses_are_one_line_exit_2_and_nothing_written(in_process, model, said):  # noqa: F811
    status, out, err, written = in_process("reference", f"tests.batch_models:{model}", QUICK)
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2 and not written, err[-2000:]
    assert len(lines) == 1 and said in lines[0] and "Traceback" not in err, lines


# -- under launchers ------------------------------------------------------------------------------------------------
def _equivalent(proc, result, label):
    assert proc.returncode == 0 and result is not None, proc.output[-4000:]
    e = result["equivalence"]
    assert e["verdict"] == "equivalent", (label, e["first_divergence"], e["notes"])
    for check in ("gradient", "update", "trajectory"):
        assert e["checks"][check]["status"] == "pass", (label, check, e["checks"][check])
    return e


@pytest.mark.multiproc
@pytest.mark.timeout(420)
def test_a_padded_dict_batch_with_an_attention_mask_under_ddp_is_named_per_rank_and_equivalent_globally(launch):
    proc, result = launch("ddp", 2, "tests.batch_models:dict_attention", QUICK, "torchrun")
    e = _equivalent(proc, result, "ddp local")
    assert e["split"]["cause"]["name"] == "normalisation", e["split"]
    proc, result = launch("ddp", 2, "tests.batch_models:dict_attention",
                          [*QUICK, "--loss-normalisation", "global", "--grad-accum", "2"], "torchrun")
    e = _equivalent(proc, result, "ddp global")
    assert not any(n["code"].startswith("split_") for n in e["notes"]), e["notes"]
    # the twin: the model drops the num_items_in_batch it is given, so each forward divides by its own count
    proc, result = launch("ddp", 2, "tests.batch_models:dict_attention_drops_the_count",
                          [*QUICK, "--loss-normalisation", "global"], "torchrun")
    assert result is not None, proc.output[-4000:]
    e = result["equivalence"]
    assert e["verdict"] == "different" and e["first_divergence"]["cause"] == "local_normalisation", \
        e["first_divergence"]


CELLS = {"ddp": ("ddp", []), "fsdp": ("fsdp", []), "horovod": ("horovod", []),
         **{f"zero{s}": ("deepspeed", ["--opt", f"zero_stage={s}"]) for s in range(4)}}


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize("model", ["dict_attention", "two_towers", "dataclass_inputs", "seq_first"])
@pytest.mark.parametrize("cell", list(CELLS))
def test_every_backend_takes_every_structure(launch, cell, model):
    backend, extra = CELLS[cell]
    launcher = "horovodrun" if backend == "horovod" else "torchrun"
    proc, result = launch(backend, 2, f"tests.batch_models:{model}", [*QUICK, *extra], launcher)
    _equivalent(proc, result, f"{cell} {model}")


@pytest.mark.multiproc
@pytest.mark.deep
@pytest.mark.timeout(900)
def test_a_dict_batch_moves_through_a_checkpoint_cell(tmp_path):
    """The checkpoint command's cell on the dict batch: saved under ddp at 2 ranks, loaded under fsdp at 2, the
    continuation judged against one uninterrupted float64 run."""
    from test_checkpoints import _command

    cells = _command(tmp_path, "ddp:2>fsdp:2", "--model", "tests.batch_models:dict_attention", "--global-batch", "16")
    cell = cells["ddp:2>fsdp:2"]
    assert cell["status"] == "ran" and cell["load_run"]["verdict"] == "equivalent", cell
    assert cell["load_run"]["checkpoint"]["loaded"]["causes"] == [], cell
