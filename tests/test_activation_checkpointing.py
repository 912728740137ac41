"""Activation checkpointing (--activation-checkpointing): each block of the model (dpcompare.block_modules, the blocks
FSDP shards) recomputes its forward in backward, under every backend, and the checks still hold it to the float64
oracle with dropout on.

Checked against: the same model without checkpointing (bitwise the same gradient, the same parameter names, the same
dropout masks captured, none twice); the forward's own masks for the recomputation's dropout (the mask capture sees a
redrawn mask); the float64 oracle for real runs of gpt-tiny (dropout 0.1) at the run defaults. Every check has its
negative: checkpointing without the forward's generator state (preserve_rng_state=False, allenai/OLMo-core PR #828)
changes the gradient, is seen by the capture, and a run of the twin (tests/faulty_checkpointing.py) is `different`
with cause recompute_redrew_masks; a backend whose capabilities say it cannot checkpoint, and a model with no block,
are refused in one line; peak_above_start_mib rises with what a step allocates and not without.

Tiers: the default tier runs the unit tests, DDP and the DDP twin on gpt-tiny; the `slow` tier every other backend,
AdamW, the FSDP twin and compare end to end.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import child_env
from test_compare import _ns
from dpcompare import Adapter, block_modules, checkpoint_blocks
from dpcompare.commands.compare import plan
from dpcompare.contract.activation_checkpointing import checkpointed_blocks
from dpcompare.measure.clocks import MemoryWindow
from dpcompare.run import backend
from dpcompare.run.config import RunConfig
from dpcompare.run.real_models import gpt_tiny
from dpcompare.verify.randomness.draw_recording import MaskRecorder

FLAG = ["--activation-checkpointing"]
WORLD_SIZE = 2


def _step(model: torch.nn.Module, workload, seed: int = 5) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One training forward and backward of gpt-tiny's first batch from generator seed `seed`: (loss, gradients)."""
    model.train()
    model.zero_grad(set_to_none=True)
    x, y = workload.make_batch(0, 8)
    torch.manual_seed(seed)
    loss = workload.loss_fn(model(x), y)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _models(preserve_rng_state: bool = True):
    workload = gpt_tiny(0)
    checkpointed = copy.deepcopy(workload.model)
    names = checkpoint_blocks(checkpointed, preserve_rng_state=preserve_rng_state)
    return workload, checkpointed, names


# -- the checkpointing itself ------------------------------------------------------------------------------------
def test_the_blocks_fsdp_shards_are_checkpointed_and_keep_their_names():
    workload, checkpointed, names = _models()
    assert names == [n for n, _ in block_modules(workload.model)] == ["h.0", "h.1"]
    assert checkpointed_blocks(checkpointed) == {"h.0": True, "h.1": True}
    assert checkpointed.state_dict().keys() == workload.model.state_dict().keys()
    assert [n for n, _ in checkpointed.named_modules()] == [n for n, _ in workload.model.named_modules()]
    # checkpointed once: a second call leaves the block's class as it is
    assert checkpoint_blocks(checkpointed) == names
    assert type(checkpointed.h[0]).__mro__[:2] == (type(checkpointed.h[0]), type(workload.model.h[0]))


def test_recomputing_with_the_forwards_generator_state_gives_the_same_gradient_bitwise():
    workload, checkpointed, _ = _models()
    loss, grads = _step(workload.model, workload)
    loss_c, grads_c = _step(checkpointed, workload)
    assert torch.equal(loss, loss_c)
    assert all(torch.equal(grads[n], grads_c[n]) for n in grads)


def test_recomputing_without_it_changes_the_gradient_but_not_the_loss():
    workload, redrawing, _ = _models(preserve_rng_state=False)
    loss, grads = _step(workload.model, workload)
    loss_r, grads_r = _step(redrawing, workload)
    assert torch.equal(loss, loss_r)  # the forward is the same function: only the backward's masks differ
    assert not torch.equal(grads["h.0.attn.c_attn.weight"], grads_r["h.0.attn.c_attn.weight"])


@pytest.mark.parametrize("preserve_rng_state", [True, False], ids=["preserved", "redrawn"])
def test_the_capture_records_each_mask_once_and_holds_the_recomputation_to_it(preserve_rng_state):
    workload, checkpointed, _ = _models(preserve_rng_state)
    records = []
    for model in (workload.model, checkpointed):
        recorder = MaskRecorder(model)
        with recorder.recording():
            _step(model, workload)
        records.append(recorder.take())
    plain, recorded = records
    assert not recorded.problems and recorded.masks.keys() == plain.masks.keys()
    for name, calls in plain.masks.items():  # one mask per forward call, the same masks: the recomputation adds none
        assert [m.unpack().tolist() for m in recorded.masks[name]] == [m.unpack().tolist() for m in calls], name
    if preserve_rng_state:
        assert recorded.redrawn == {}
    else:
        assert {"h.0.attn.attn_dropout", "h.1.attn.resid_dropout"} <= set(recorded.redrawn), recorded.redrawn
        assert "fits none of the 1 draw(s) its forward made" in recorded.redrawn["h.0.attn.attn_dropout"]


# -- refusals -----------------------------------------------------------------------------------------------------
class _CannotCheckpoint(Adapter):
    name = "cannot-checkpoint"
    capabilities = dataclasses.replace(Adapter.capabilities, activation_checkpointing=False)


def test_a_backend_that_declares_it_cannot_is_refused_before_the_run():
    cfg = RunConfig(backend="tests:cannot", activation_checkpointing=True)
    with pytest.raises(ValueError) as refused:
        backend.settings_for(_CannotCheckpoint, cfg)
    assert str(refused.value).startswith("--activation-checkpointing is not available for --backend tests:cannot")
    backend.settings_for(Adapter, cfg)  # the base class can
    backend.settings_for(_CannotCheckpoint, RunConfig(backend="tests:cannot"))  # without the flag, nothing to refuse


def test_a_model_without_blocks_is_refused_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "dpcompare", "--model", "tests.faulty_checkpointing:no_blocks",
                           *FLAG, "--out", str(tmp_path)], capture_output=True, text=True, env=child_env(tmp_path),
                          cwd=Path(__file__).resolve().parents[1], timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("dpcompare: error: --activation-checkpointing is invalid for --model "
                               "tests.faulty_checkpointing:no_blocks: it names no block"), lines


# -- compare and the memory figure ----------------------------------------------------------------------------------
def test_compare_passes_the_flag_to_every_run(tmp_path):
    planned = plan.plan(_ns(backends="reference,ddp,fsdp", collectives="none", activation_checkpointing=True), tmp_path)
    assert planned.jobs and all("--activation-checkpointing" in job.command for job in planned.jobs)
    plain = plan.plan(_ns(backends="reference,ddp", collectives="none"), tmp_path / "plain")
    assert all("--activation-checkpointing" not in job.command for job in plain.jobs)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's resident high-water mark")
@pytest.mark.parametrize("allocate_mib", [0, 96], ids=["nothing", "96MiB"])
def test_the_memory_above_the_windows_start_is_what_the_window_allocated(allocate_mib):
    window = MemoryWindow(torch.device("cpu"))
    window.reset()
    if allocate_mib:
        held = torch.ones(allocate_mib * 2**18)  # float32: 4 bytes each, every page touched
        assert float(held[-1]) == 1.0
        del held
    above = window.above_start(window.peak())
    assert above is not None
    assert (above > 0.8 * allocate_mib) if allocate_mib else (above < 48), above


# -- real runs --------------------------------------------------------------------------------------------------
def assert_checkpointed_and_equivalent(proc, result: dict | None) -> None:
    assert proc.returncode == 0, proc.output[-6000:]
    e = result["equivalence"]
    assert e["verdict"] == "equivalent", f"{e['first_divergence']} {e.get('unverifiable_reason')}"
    assert result["config"]["activation_checkpointing"] is True
    assert result["activation_checkpointing"] == {"blocks": 2, "names": ["h.0", "h.1"], "preserve_rng_state": True}
    assert e["stochastic"]["captured"] is True, e["stochastic"]  # judged with dropout on, on the ranks' own masks
    for check in ("gradient", "update", "trajectory"):
        assert e["checks"][check]["status"] == "pass", (check, e["checks"][check])
    assert "activation_checkpointing" in [n["code"] for n in e["notes"]]
    assert "2 block(s) recomputed in backward (--activation-checkpointing" in proc.stdout, proc.stdout[-2000:]


def assert_redrawn_and_named(proc, result: dict | None) -> None:
    assert proc.returncode == 0, proc.output[-6000:]
    e = result["equivalence"]
    d = e["first_divergence"]
    assert e["verdict"] == "different" and d is not None, e
    assert (d["step"], d["check"], d["cause"]) == (0, "gradient", "recompute_redrew_masks"), d
    assert "recomputed dropout in backward with other masks than the forward drew" in d["reason"], d["reason"]
    assert result["activation_checkpointing"]["preserve_rng_state"] is False


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_ddp_checkpointed_with_dropout_is_equivalent(launch):
    proc, result = launch("ddp", WORLD_SIZE, "gpt-tiny", [*FLAG, "--measure-steps", "3", "--warmup-steps", "1"])
    assert_checkpointed_and_equivalent(proc, result)
    assert result["metrics"]["peak_above_start_mib"] is not None, result["metrics"]["reasons"]


@pytest.mark.slow  # breadth: the default tier keeps this capability's other test
@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_checkpointing_that_redraws_the_masks_is_different_and_named(launch):
    proc, result = launch("tests.faulty_checkpointing:RedrawingDDP", WORLD_SIZE, "gpt-tiny",
                          [*FLAG, "--steps", "1", "--measure-steps", "0"])
    assert_redrawn_and_named(proc, result)


SLOW, DEEP = pytest.mark.slow, pytest.mark.deep  # reference, ddp and fsdp: `compare --suite questions` (slow) runs them


@pytest.mark.multiproc
@pytest.mark.timeout(420)
@pytest.mark.parametrize(("backend", "world_size", "options"), [
    pytest.param("reference", 1, [], id="reference", marks=DEEP),
    pytest.param("dp", 1, [], id="dp", marks=SLOW),
    pytest.param("fsdp", 2, [], id="fsdp", marks=DEEP),
    pytest.param("horovod", 2, [], id="horovod", marks=DEEP),
    pytest.param("deepspeed", 2, [], id="zero0", marks=DEEP),
    pytest.param("deepspeed", 2, ["--opt", "zero_stage=3"], id="zero3", marks=DEEP),
    pytest.param("ddp", 2, ["--optimizer", "adamw"], id="ddp-adamw", marks=SLOW),
    pytest.param("fsdp", 2, ["--optimizer", "adamw"], id="fsdp-adamw", marks=DEEP),
], indirect=["backend"])
def test_every_backend_checkpointed_with_dropout_is_equivalent(backend, world_size, options, launch):
    proc, result = launch(backend, world_size, "gpt-tiny", [*FLAG, "--measure-steps", "0", *options])
    assert_checkpointed_and_equivalent(proc, result)


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_fsdp_checkpointing_that_redraws_the_masks_is_different_and_named(launch):
    proc, result = launch("tests.faulty_checkpointing:RedrawingFSDP", WORLD_SIZE, "gpt-tiny",
                          [*FLAG, "--steps", "1", "--measure-steps", "0"])
    assert_redrawn_and_named(proc, result)


@pytest.mark.deep
@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_compare_with_the_flag_checkpoints_every_run(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "dpcompare", "compare", "--backends", "reference,ddp,fsdp",
                           "--world-sizes", "2", "--model", "gpt-tiny", "--steps", "2", "--measure-steps", "0",
                           "--global-batch", "24",  # compare's default 2048 costs minutes a job to check on CPU
                           "--collectives", "none", "--out", str(tmp_path), "--no-report", *FLAG],
                          capture_output=True, text=True, env=child_env(tmp_path), timeout=560,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir,) = [p for p in tmp_path.iterdir() if (p / "compare.json").exists() and not p.is_symlink()]
    summary = json.loads((run_dir / "compare.json").read_text())
    assert summary["activation_checkpointing"] is True
    assert [(r["label"], r["verdict"]) for r in summary["runs"] if r["verdict"] != "equivalent"] == []
    for r in summary["runs"]:
        assert json.loads(Path(r["result_path"]).read_text())["activation_checkpointing"]["blocks"] == 2, r["label"]
