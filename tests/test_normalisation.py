"""The loss's normalisation, and every cause of a split that moves the gradient, against what one process computes.

- A loss over items (tokens not ignored) is counted as the workload says (ignore_index, items, or a loss returning
  (sum, count)), or recognised from -100 targets; each forward's weight in the step's gradient is its share of the
  samples (each forward divides by its own count, `local`) or of the step's items (`global`).
- The padded token data of the built-in token models: lengths of their own, -100 targets on the padding; the masked
  LM's collator masking (15 %, 80/10/10).
- The split's cause (dpcompare.verify.model_facts.split_causes), each a test with a twin whose cause is another: the
  normalisation (a padded LM), a per-forward statistic (BatchNorm), samples that interact in the loss (in-batch
  negatives), control flow on the local batch's size and content, and rounding alone (no note).
- Under torchrun: a padded LM at 2 ranks is `equivalent` with the normalisation named (local) and with no note
  (global), and a backend that leaves the count out of the all-reduce is `different`, its cause named. The slow tier
  runs every backend both ways, with --grad-accum 4, and the loss returning (sum, count).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import normalisation_models as nm
import semantics_workloads as sw
from dpcompare.contract import batches
from dpcompare.contract.normalisation import counted, refusal
from dpcompare.run import hf_tasks, workloads
from dpcompare.run.trainer import counting
from dpcompare.verify.oracle import gradient_oracle as eq
from dpcompare.verify.model_facts.replica_forwards import Forwards
from dpcompare.verify.randomness.draw_recording import MaskMismatch
from dpcompare.verify.model_facts.batch_split import SplitCheck

WS = 2


# -- counting ------------------------------------------------------------------------------------------------------
def test_a_loss_over_items_is_counted_as_the_workload_says_and_its_mean_is_the_forwards_own():
    logits, y = torch.randn(3, 5, 7), torch.randint(0, 7, (3, 5))
    y[0, 2:] = workloads.IGNORE_INDEX
    mean = counted(lambda o, t: torch.nn.functional.cross_entropy(o.reshape(-1, 7), t.reshape(-1)), -100)
    pair = counted(nm._token_sum_and_count)
    assert mean.items_of(y) == 12 and pair.items_of(y) is None
    total, count = pair.sum_and_count(logits, y)
    assert count == 12 and pair.returns_count
    assert torch.allclose(pair(logits, y), total / 12) and torch.allclose(mean(logits, y), total / 12)
    assert torch.allclose(mean.sum_and_count(logits, y)[0], total)
    # a loss over samples: no count; its sum is the mean times the samples
    plain = counted(lambda o, t: o.mean())
    assert plain.items_of(y) is None and plain.sum_and_count(logits, y)[1] is None


def test_global_normalisation_refuses_a_count_it_cannot_make_before_the_forward():
    lm = counting(nm.padded_lm_sum_count(0))
    x, y = lm.make_batch(0, 4)
    lm.loss_fn(lm.model(x), y)
    assert "returns (sum, count)" in refusal("global", lm.loss_fn, y, "m") and refusal("local", lm.loss_fn, y, "m") is None
    undeclared = counting(nm.padded_lm_undeclared(0))
    assert "names no ignore_index" in refusal("global", undeclared.loss_fn, y, "m")
    assert refusal("global", counting(workloads.lm(0)).loss_fn, y, "m") is None


def test_each_forward_weighs_its_share_of_the_samples_or_of_the_steps_items():
    y = torch.full((8, 4), 1)
    y[0::2, 1:] = -100  # rank 0's samples hold 1 item each, rank 1's 4
    count = counted(lambda o, t: o, -100).count
    local, ranks = eq.Layout(2, 2, 1, count), eq.Layout(2, 1, 1, count)
    x = torch.zeros(8, 4)
    assert [p.weight for p in eq.replica_pieces((x, y), local)] == [0.25] * 4
    glob = dataclasses.replace(local, global_count=True)
    assert [p.weight for p in eq.replica_pieces((x, y), glob)] == pytest.approx([2 / 20, 2 / 20, 8 / 20, 8 / 20])
    # one rank's forwards weighted as that rank's own gradient before the backend averages: their mean is the step's
    per_rank = [[p.weight for p in eq.replica_pieces((x, y), dataclasses.replace(ranks, global_count=True), ranks=[r])]
                for r in range(2)]
    assert per_rank == [pytest.approx([2 * 4 / 20]), pytest.approx([2 * 16 / 20])]
    # nn.DataParallel's replicas: the loss sees the micro-batch gathered, so its replicas weigh their items in it
    replicas = eq.Layout(1, 1, 2, count)
    assert [p.weight for p in eq.replica_pieces((x[:2], y[:2]), replicas)] == pytest.approx([1 / 5, 4 / 5])


def test_the_built_in_token_data_is_padded_at_the_end_and_the_masked_lm_masks_as_the_collator():
    x, y = workloads.lm(0).make_batch(0, 64)
    packed = workloads.lm(0, token_data="packed").make_batch(0, 64)
    lengths = (y != -100).sum(dim=1) + 1
    assert lengths.min() >= 2 and lengths.max() <= 16 and len(set(lengths.tolist())) > 5
    real = torch.arange(16) < lengths.unsqueeze(1)
    assert torch.equal(x[real], packed[0][real]) and bool((x[~real] == workloads.PAD_ID).all())
    assert bool((packed[1] != -100).all())
    collated = hf_tasks.masked_tokens(0, 100, 64, 99)(0, 256)
    assert set(collated) == {"input_ids", "attention_mask", "labels"} and bool((collated["attention_mask"] == 1).all())
    tokens, targets = collated["input_ids"], collated["labels"]
    chosen = targets != -100
    share = float(chosen.float().mean())
    assert 0.13 < share < 0.18 and len(set(chosen.sum(dim=1).tolist())) > 5
    masked = float((tokens[chosen] == 99).float().mean())
    kept = float((tokens[chosen] == targets[chosen]).float().mean())
    assert 0.75 < masked < 0.85 and 0.07 < kept < 0.14


# -- the split's cause -------------------------------------------------------------------------------------------------
def _finding(workload, *, global_count: bool = False, grad_accum: int = 1, step: int = 0, unjoinable: bool = False):
    """The split's finding at 2 ranks on the workload's initial weights and step 0, as rank 0's verifier settles it."""
    workload = counting(workload)
    model = workload.model
    layout = eq.Layout(WS, grad_accum, 1, workload.loss_fn.count, global_count)
    verdict = eq.Verdict()
    oracle = eq.Oracle(model, workload.loss_fn, "float32", torch.device("cpu"))
    forwards = Forwards(layout, oracle, batchnorms=[], per_replica=False, stochastic=False, dtype="float32",
                        depth=eq.depth_of(model), verdict=verdict)
    check = SplitCheck(oracle, forwards, depth=eq.depth_of(model), applies=True, verdict=verdict)
    state = model.state_dict()
    batch = batches.pair(workload.make_batch(step, 24))  # (inputs, targets), as the run holds it
    inputs, targets = batch  # the probe's forward: a loss returning its count says so
    workload.loss_fn(batches.call(model, batches.take(inputs, slice(0, 2))), batches.take(targets, slice(0, 2)))
    pieces = forwards.pieces(batch, None)
    if unjoinable:  # the ranks' draws cannot be joined into the global batch's forward (OPT's masks)
        forwards.whole = _unjoinable
    check.settle(step, state, batch, None, None, pieces, oracle.oracle_of(state, pieces))
    check.note(1e-7)
    return check.finding, {n.code: n.text for n in verdict.notes}


@pytest.mark.parametrize("build", [workloads.lm, nm.padded_lm_sum_count, nm.padded_lm_undeclared],
                         ids=["ignore-index", "sum-count", "undeclared"])
def test_a_padded_lm_normalised_per_rank_is_named_with_its_counts(build):
    f, notes = _finding(build(1234))
    assert f.semantics == "per_replica" and f.distance_rel_fro > 0.01, f
    ev = f.cause["evidence"]["normalisation"]
    assert f.cause["name"] == "normalisation" and ev["holds"] and ev["reweighted_distance_rel_fro"] < 1e-12, f.cause
    assert sum(ev["items_per_rank"]) == int((build(1234).make_batch(0, 24)[1] != -100).sum())
    assert ev["items_per_rank"][0] != ev["items_per_rank"][1]
    text = notes["split_normalisation"]
    assert f"items per rank at step 0: {ev['items_per_rank'][0]}, {ev['items_per_rank'][1]}" in text
    assert f"{f.distance_rel_fro:.3g} away" in text and "--loss-normalisation global" in text
    assert "split_dependent_forward" not in notes and "control flow" not in text


def test_a_padded_lm_normalised_over_the_steps_items_computes_the_global_batch():
    for k in (1, 4):
        f, notes = _finding(workloads.lm(1234), global_count=True, grad_accum=k)
        assert f.semantics == "global" and f.distance_rel_fro < 1e-12 and not notes, (k, f, notes)
    f, notes = _finding(workloads.lm(1234), grad_accum=4)
    assert f.cause["name"] == "normalisation" and len(f.cause["evidence"]["normalisation"]["items_per_forward"]) == 8
    assert "per rank and per micro-batch" in notes["split_normalisation"]


def test_packed_token_data_is_split_free():
    f, notes = _finding(workloads.lm(1234, token_data="packed"))
    assert f.semantics == "global" and not notes


def test_samples_that_interact_in_the_loss_are_named_and_a_per_sample_loss_is_not():
    f, notes = _finding(nm.in_batch_negatives(1234))
    samples = f.cause["evidence"]["samples"]
    assert f.cause["name"] == "samples_interact" and samples["rows_distance_rel"] < 1e-12, f.cause
    assert "normalisation" not in f.cause["evidence"]  # a loss over samples: no count to test
    assert "the samples interact in the loss" in notes["split_dependent_forward"]
    f, notes = _finding(nm.prototype_towers(1234))
    assert f.semantics == "global" and not notes


@pytest.mark.parametrize(("build", "branch", "said"), [
    (sw.split_by_size_mlp, "size", "branches on the local batch's size"),
    (sw.split_by_content_mlp, "content", "branches on the local batch's content in tensor ops"),
    (sw.split_later_mlp, "content", "reads a tensor's value into Python")], ids=["size", "content", "read"])
def test_control_flow_on_the_local_batch_is_named_not_an_interaction(build, branch, said):
    f, notes = _finding(build(1234), step=3 if build is sw.split_later_mlp else 0)
    samples = f.cause["evidence"]["samples"]
    assert f.cause["name"] == "control_flow" and samples["branch"] == branch, f.cause
    text = notes["split_dependent_forward"]
    assert said in text and "interact" not in text and "normalised" not in text and "mixes" not in text


class _Mixing(torch.nn.Module):
    """Each sample's features plus the mean over its batch: the model mixes the samples, with a gradient."""

    def forward(self, x):
        return x + x.mean(dim=0, keepdim=True)


def test_a_model_that_mixes_samples_is_named_so_not_control_flow():
    base = workloads.mlp(1234)
    layers = list(base.model.children())
    mixing = workloads.Workload("mixing", torch.nn.Sequential(layers[0], _Mixing(), *layers[1:]), base.make_batch,
                                base.loss_fn)
    f, notes = _finding(mixing)
    samples = f.cause["evidence"]["samples"]
    assert f.cause["name"] == "model_interaction" and samples["cross_sample_gradient_rel"] > 1e-3, f.cause
    assert "the model mixes the samples" in notes["split_dependent_forward"]


def test_rounding_below_the_floor_is_no_note():
    f, notes = _finding(sw.float32_norm_mlp(1234))
    assert f.semantics == "global" and not notes


def test_batchnorm_per_replica_is_tested_as_its_cause():
    """BatchNorm without --sync-bn: on its running statistics the ranks' split is the global batch's gradient."""
    w = counting(workloads.cnn(1234))
    model = w.model
    verdict = eq.Verdict()
    oracle = eq.Oracle(model, w.loss_fn, "float32", torch.device("cpu"))
    bns = [n for n, m in model.named_modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    forwards = Forwards(eq.Layout(WS), oracle, batchnorms=bns, per_replica=True, stochastic=False, dtype="float32",
                        depth=eq.depth_of(model), verdict=verdict)
    state, batch = model.state_dict(), w.make_batch(0, 24)
    pieces = forwards.pieces(batch, None)
    forwards.note_per_replica(0, state, batch, oracle.oracle_of(state, pieces), oracle.floor_of(state, pieces), pieces)
    bn = verdict.batchnorm
    assert bn["distance_rel_fro"] > 1e-3 and bn["cause"]["name"] == "statistic", bn
    assert bn["cause"]["evidence"]["statistic"]["distance_rel_fro"] < 1e-12
    assert "with BatchNorm on its running statistics the split is" in verdict.notes[0].text


def test_mixtrals_load_balancing_loss_is_a_per_forward_statistic_beside_the_normalisation(tmp_path):
    """Mixtral's routers' loss is each forward's own: with it left out (and the forwards weighted by their items, the
    padded data's normalisation taken out too) the split is the global batch's."""
    pytest.importorskip("transformers")
    import hf_families
    from dpcompare.run import hf_models

    folder = hf_families.write_family(tmp_path, "mixtral", {"experts_implementation": "eager"})
    padded = hf_models.build(f"hf:{folder}", 1234, 16)
    batch = padded.make_batch(0, 24)  # one dict: input_ids, attention_mask (0 on the padding), labels (-100 there)
    assert torch.equal(batch["attention_mask"] == 0, batch["labels"] == -100)
    f, notes = _finding(padded)
    ev = f.cause["evidence"]
    assert f.cause["name"] == "statistic" and not ev["normalisation"]["holds"], f.cause
    # counted as the model's loss counts: the labels after the first position not -100 (it shifts them itself)
    assert sum(ev["normalisation"]["items_per_rank"]) == hf_tasks.shifted_items(batch)
    assert ev["normalisation"]["items_per_rank"][0] != ev["normalisation"]["items_per_rank"][1]
    assert ev["statistic"]["distance_rel_fro"] < 1e-9 and "load-balancing" in ev["statistic"]["taken_out"]
    text = notes["split_dependent_forward"]
    assert "a statistic of its own samples" in text and "normalised per rank too" in text
    # packed, the routers' loss alone
    f, notes = _finding(hf_models.build(f"hf:{folder}", 1234, 16, token_data="packed"))
    assert f.cause["name"] == "statistic" and not f.cause["evidence"]["normalisation"]["tested"], f.cause
    assert "normalised per rank too" not in notes["split_dependent_forward"]


# -- under the launchers -------------------------------------------------------------------------------------------
CELLS = {"ddp": ("ddp", []), "fsdp": ("fsdp", []), "horovod": ("horovod", []),
         **{f"zero{s}": ("deepspeed", ["--opt", f"zero_stage={s}"]) for s in range(4)}}
"""Each cell's backend and what selects its variant."""
QUICK = ["--steps", "4", "--measure-steps", "0"]


def _notes(result: dict) -> dict[str, str]:
    return {n["code"]: n["text"] for n in result["equivalence"]["notes"]}


def _assert_normalised_per_rank(proc, result, label) -> None:
    assert proc.returncode == 0 and result is not None, proc.output[-4000:]
    e = result["equivalence"]
    assert e["verdict"] == "equivalent", (label, e["first_divergence"], e["notes"])
    split = e["split"]
    assert split["semantics"] == "per_replica" and split["cause"]["name"] == "normalisation", (label, split)
    notes = _notes(result)
    assert "split_normalisation" in notes and "split_dependent_forward" not in notes, (label, notes)
    counts = split["cause"]["evidence"]["normalisation"]["items_per_rank"]
    assert f"items per rank at step 0: {counts[0]}, {counts[1]}" in notes["split_normalisation"]
    assert "the loss is normalised per rank: compared with the ranks' own normalisation" in proc.stdout


def _assert_global(proc, result, label) -> None:
    assert proc.returncode == 0 and result is not None, proc.output[-4000:]
    e = result["equivalence"]
    assert e["verdict"] == "equivalent", (label, e["first_divergence"], e["notes"])
    assert e["split"] is None or e["split"]["semantics"] == "global", (label, e["split"])
    assert not any(c.startswith("split_") for c in _notes(result)), (label, e["notes"])
    for check in ("gradient", "update", "trajectory"):
        assert e["checks"][check]["status"] == "pass", (label, check, e["checks"][check])


@pytest.mark.multiproc
@pytest.mark.timeout(420)
def test_a_padded_lm_under_ddp_is_named_per_rank_equivalent_globally_and_a_count_left_local_is_caught(launch):
    proc, result = launch("ddp", WS, "lm", QUICK, "torchrun")
    _assert_normalised_per_rank(proc, result, "ddp local")
    proc, result = launch("ddp", WS, "lm", [*QUICK, "--loss-normalisation", "global"], "torchrun")
    _assert_global(proc, result, "ddp global")
    # the twin: the count's all-reduce left out of the training loop
    proc, result = launch("tests.faulty_adapters:LocalCountDDP", WS, "lm", [*QUICK, "--loss-normalisation", "global"],
                          "torchrun")
    assert result is not None, proc.output[-4000:]
    e = result["equivalence"]
    assert e["verdict"] == "different" and e["first_divergence"]["step"] == 0, e["first_divergence"]
    assert e["first_divergence"]["cause"] == "local_normalisation", e["first_divergence"]
    assert "divided its loss by its own item count" in proc.stdout


def _matrix():
    for cell in CELLS:
        for k in (1, 4):
            if k == 4 and cell not in ("ddp", "zero0", "zero2"):
                continue
            for model in ("lm", "tests.normalisation_models:padded_lm_sum_count"):
                if model != "lm" and (k == 4 or cell not in ("ddp", "zero3", "horovod")):
                    continue
                yield pytest.param(cell, k, model, marks=[pytest.mark.slow],
                                   id=f"{cell}-ga{k}-{model.rsplit(':', 1)[-1]}")


@pytest.mark.multiproc
@pytest.mark.timeout(540)
@pytest.mark.parametrize(("cell", "grad_accum", "model"), list(_matrix()))
def test_every_backend_names_the_normalisation_and_is_equivalent_under_global_normalisation(launch, cell,
                                                                                           grad_accum, model):
    backend, extra = CELLS[cell]
    args = [*QUICK, *extra, "--grad-accum", str(grad_accum)]
    launcher = "horovodrun" if backend == "horovod" else "torchrun"
    proc, result = launch(backend, WS, model, args, launcher)
    _assert_normalised_per_rank(proc, result, f"{cell} local")
    if model != "lm":  # its count only its forward knows: refused in one line, by every rank alike
        proc, result = launch(backend, WS, model, [*args, "--loss-normalisation", "global"], launcher)
        assert proc.returncode != 0 and result is None
        said = [line for line in proc.output.splitlines() if "dpcompare: error:" in line]  # mpirun prefixes a rank
        assert said and all("returns (sum, count), whose count only its forward knows" in line for line in said), said
        assert "File \"/work/main/dpcompare" not in proc.output and "dpcompare/run" not in proc.output
        return
    proc, result = launch(backend, WS, model, [*args, "--loss-normalisation", "global"], launcher)
    _assert_global(proc, result, f"{cell} global")


def _unjoinable(batch, masks):
    raise MaskMismatch("drop", "not batch-first")


def test_where_the_draws_cannot_be_joined_the_normalisation_is_still_measured_on_the_ranks_forwards():
    """OPT's dropout masks are not batch-first: no global batch to hold the split to, but weighting the ranks' own
    forwards by their items measures what the normalisation changes; a packed batch has nothing to say."""
    f, notes = _finding(workloads.lm(1234), unjoinable=True)
    ev = f.cause["evidence"]["normalisation"]
    assert f.semantics == "per_replica" and f.cause["name"] == "normalisation" and ev["weighted_by_items_distance_rel_fro"] > 0.01
    assert "the global batch itself is not measured" in notes["split_normalisation"]
    f, notes = _finding(workloads.lm(1234, token_data="packed"), unjoinable=True)
    assert f is None and not notes
    # divided by the step's count, the ranks' forwards are weighted by their items already: nothing to say (the run's
    # line once failed on the finding's unmeasured distance: OPT under --loss-normalisation global)
    f, notes = _finding(workloads.lm(1234), unjoinable=True, global_count=True)
    assert f is None and not any(code.startswith("split_") for code in notes), (f, notes)
