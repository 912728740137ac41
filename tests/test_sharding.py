"""Sharded data parallelism (DeepSpeed ZeRO stages 1-3): judged against the float64 oracle like every backend.

Checks, against what each part must produce:
  - the diagnosis names a reduced gradient whose part was never written back (one rank's partition of the
    reduce-scatter left at zero) as `zeroed_partition`, with the elements it covers, and does not claim a gradient
    that is merely scaled (its twin);
  - real runs at world size 2 under torchrun with AdamW: ZeRO-1, -2 and -3 are `equivalent`, with and without
    --grad-accum 2, the full gradients, fp32 parameters and optimizer state read through DeepSpeed's own accessors
    on every rank;
  - the planted faults (tests/faulty_adapters.py): a ZeRO-2 whose last rank's gradient partition is dropped, and a
    ZeRO-1 whose rank 0 keeps stale parameters after the all-gather, each `different`, naming the parameters;
  - an unused parameter that ZeRO steps with a zero gradient: its step count is noted, and with weight decay its
    weights move where a single process leaves them, which is `different` (cause unused_zero_grad);
  - a stage that does not exist is refused in one line, exit 2.

Tiers: the default tier runs ZeRO-3 with gradient accumulation on the tied-head LM, both planted faults and the
refusal; the `slow` tier runs every stage x {1, 2} micro-batches on the mlp, the unused-parameter cases, gpt-tiny
(dropout masks captured) under ZeRO-3, bf16 under ZeRO-2 (engine) and ZeRO-3 (autocast: its Linear weights
gathered and their gradients reduced in bf16, the reference rounding the same ones), and that ZeRO-3 with LayerNorm
undeclared on its bf16 list (different).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from test_diagnosis import _diagnoses, _linear
from test_precision import _different
from test_precision import _equivalent as _equivalent_run

STEPS = ["--optimizer", "adamw", "--steps", "3", "--measure-steps", "0"]
ZERO = {n: ["--opt", f"zero_stage={n}"] for n in range(4)}


# -- the diagnosis ------------------------------------------------------------------------------------------
def _half_zeroed(oracle, state, oracle_grads, shards):
    """The oracle's gradient with its second half (flattened in parameter order) zero: rank 1's partition."""
    names = oracle.names
    total = sum(oracle_grads[n].numel() for n in names)
    out, seen = {}, 0
    for n in names:
        g = oracle_grads[n].clone().reshape(-1)
        start = max(total // 2 - seen, 0)
        g[start:] = 0
        seen += g.numel()
        out[n] = g.reshape(oracle_grads[n].shape)
    return out


def test_a_partition_never_written_is_named_with_its_elements() -> None:
    found = _diagnoses(_linear(), _half_zeroed)
    assert found[0].cause == "zeroed_partition", found
    assert "elements" in found[0].reason and "partition of the reduce-scatter" in found[0].reason
    assert found[0].parameters, "the parameters it covers are named"


def test_a_scaled_gradient_is_not_a_zeroed_partition() -> None:
    """The twin that must not fire: nothing is exactly zero, every element is off by the same factor."""
    found = _diagnoses(_linear(), lambda oracle, state, g, shards: {n: 0.5 * t for n, t in g.items()})
    assert all(d.cause != "zeroed_partition" for d in found), found
    assert found[0].cause in {"averaged_twice", "scaled"}, found


# -- real runs ------------------------------------------------------------------------------------------------
def _equivalent(proc, result: dict | None, stage: int) -> dict:
    e = _equivalent_run(proc, result)  # every check passed, replicas and reduced gradients identical across ranks
    if stage:
        assert any(n["code"] == "deepspeed.zero_stage" and f"ZeRO stage {stage}" in n["text"] for n in e["notes"])
    return e


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["deepspeed"], indirect=True)
def test_zero3_with_gradient_accumulation_and_a_tied_head(launch, backend) -> None:
    proc, result = launch(backend, 2, "lm", [*STEPS, *ZERO[3], "--grad-accum", "2"])
    _equivalent(proc, result, 3)


@pytest.mark.slow  # FSDP's stale shard keeps a sharded twin in the default tier
@pytest.mark.parametrize("backend", ["deepspeed"], indirect=True)
def test_a_dropped_gradient_partition_is_different_naming_its_parameters(launch, backend) -> None:
    proc, result = launch("tests.faulty_adapters:DroppedPartitionZeRO", 2, "mlp", [*STEPS, *ZERO[2]])
    d = _different(proc, result, "gradient", "zeroed_partition")
    assert d["step"] == 0 and d["parameters"] and d["parameter"] in d["parameters"]
    assert "one rank's partition of the reduce-scatter" in d["reason"]


@pytest.mark.slow  # the default tier keeps this capability in a sibling test
@pytest.mark.parametrize("backend", ["deepspeed"], indirect=True)
def test_stale_parameters_after_the_all_gather_are_different_naming_one(launch, backend) -> None:
    proc, result = launch("tests.faulty_adapters:StaleGatherZeRO", 2, "mlp", [*STEPS, *ZERO[1]])
    d = _different(proc, result, "replicas", "replicas")
    assert d["step"] == 0 and d["parameter"] in d["reason"], d
    assert "REPLICAS DIFFER" in proc.stdout


@pytest.mark.parametrize("backend", ["deepspeed"], indirect=True)
def test_a_stage_that_does_not_exist_is_refused_in_one_line(launch, backend) -> None:
    proc, result = launch(backend, 1, "mlp", [*STEPS, "--opt", "zero_stage=4"], launcher="python")
    assert proc.returncode == 2 and result is None
    lines = [line for line in proc.stderr.strip().splitlines() if "real_accelerator.py" not in line]
    assert lines == ["dpcompare: error: --opt zero_stage='4' is invalid: choose one of 0, 1, 2, 3"], lines
    assert "Traceback" not in proc.stderr


def _extension_lock(extensions: Path, monkeypatch, age_s: float) -> Path:
    """A build lock of DeepSpeed's CPU all-reduce op under its own TORCH_EXTENSIONS_DIR, `age_s` old."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(extensions))
    lock = Path(cpp_extension._get_build_directory("deepspeed_shm_comm", verbose=False)) / "lock"
    lock.touch()
    os.utime(lock, (time.time() - age_s, time.time() - age_s))
    return lock


def test_a_build_lock_is_stale_only_past_any_build(tmp_path, monkeypatch) -> None:
    from dpcompare.adapters.deepspeed_host import STALE_BUILD_LOCK_S, stale_build_lock

    lock = _extension_lock(tmp_path / "ext", monkeypatch, STALE_BUILD_LOCK_S + 60)
    assert stale_build_lock() == lock
    os.utime(lock, None)  # a build that holds it now
    assert stale_build_lock() is None
    lock.unlink()
    assert stale_build_lock() is None


@pytest.mark.parametrize("backend", ["deepspeed"], indirect=True)
def test_a_stale_build_lock_is_one_line_not_a_hang(launch, backend, tmp_path, monkeypatch) -> None:
    """A killed build of DeepSpeed's CPU op leaves its lock, and torch waits on it forever: the run refuses at once,
    naming the file and the command that clears it."""
    lock = _extension_lock(tmp_path / "ext", monkeypatch, 3600)
    proc, result = launch(backend, 1, "mlp", STEPS, launcher="python", timeout_s=120)
    assert proc.returncode == 2 and result is None, proc.output[-3000:]
    lines = [line for line in proc.stderr.strip().splitlines() if "real_accelerator.py" not in line]
    assert len(lines) == 1 and str(lock) in lines[0] and f"rm {lock}" in lines[0], lines



# -- breadth (slow) ---------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["deepspeed"], indirect=True)
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("accum", [1, 2])
def test_every_stage_is_equivalent_with_adamw(launch, backend, stage, accum) -> None:
    proc, result = launch(backend, 2, "mlp", [*STEPS, *ZERO[stage], "--grad-accum", str(accum)])
    e = _equivalent(proc, result, stage)
    assert e["checks"]["update"]["status"] == "pass", "the update is judged on the assembled fp32 parameters and state"


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["deepspeed"], indirect=True)
@pytest.mark.parametrize(("stage", "momentum"), [(1, "0.9"), (2, "0"), (3, "0.9")])
def test_every_stage_runs_the_default_sgd_and_is_equivalent(launch, backend, stage, momentum) -> None:
    """SGD is not on ZeRO's list of tested optimizers: DeepSpeed refuses it unless allowed; the adapter allows it,
    says so, and the verdict checks its numbers (with momentum, whose buffer is partitioned, and without)."""
    proc, result = launch(backend, 2, "mlp", ["--steps", "3", "--measure-steps", "0", "--momentum", momentum,
                                              *ZERO[stage]])
    e = _equivalent(proc, result, stage)
    assert e["checks"]["update"]["status"] == "pass", e["checks"]
    assert any(n["code"] == "deepspeed.untested_optimizer" and "SGD" in n["text"] for n in e["notes"]), e["notes"]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["deepspeed"], indirect=True)
def test_zero_under_fp16_autocast_reads_its_own_scaler_and_is_equivalent(launch, backend) -> None:
    """ZeRO 1-3 keep the torch_autocast GradScaler on their optimizer and unscale the partitions inside their step:
    the reduced gradients are read scaled and divided by its scale (they were 65536x the oracle)."""
    proc, result = launch(backend, 2, "mlp", ["--steps", "3", "--measure-steps", "0", "--amp", "fp16", *ZERO[1]])
    e = _equivalent(proc, result, 1)
    assert "ZeRO stage 1 optimizer" in e["precision"]["loss_scaler"], e["precision"]
    assert any(n["code"] == "deepspeed.zero_autocast_fp16" for n in e["notes"]), e["notes"]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["deepspeed"], indirect=True)
def test_a_loss_scale_that_never_comes_down_is_different(launch, backend) -> None:
    """DeepSpeed's own defect, the negative case: ZeRO under the torch_autocast section returns on overflow before
    its GradScaler's update(), so a forced overflow (initial scale 2^24) is skipped at 2^24 forever."""
    proc, result = launch(backend, 2, "mlp", ["--steps", "4", "--measure-steps", "0", "--amp", "fp16",
                                              "--loss-scale", str(2**24), *ZERO[2]])
    d = _different(proc, result, "loss_scale", "scale_never_lowered")
    assert d["step"] == 2 and "steps 0-2 all overflowed and were skipped at the same loss scale 16777216" in d["reason"]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["deepspeed"], indirect=True)
def test_zero_steps_unused_parameters_with_a_zero_gradient_and_says_so(launch, backend) -> None:
    proc, result = launch(backend, 2, "mlp-unused", [*STEPS, *ZERO[2]])
    e = _equivalent(proc, result, 2)
    assert set(e["parameters"]["unused_grad"].values()) == {"zero"}, e["parameters"]
    assert any(n["code"] == "unused_stepped" for n in e["notes"]), e["notes"]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["deepspeed"], indirect=True)
def test_zero_with_weight_decay_moves_unused_parameters_and_is_different(launch, backend) -> None:
    proc, result = launch(backend, 2, "mlp-unused", [*STEPS, *ZERO[2], "--weight-decay", "0.1"])
    d = _different(proc, result, "update", "unused_zero_grad")
    assert all(p.startswith("aux_head") for p in d["parameters"]), d


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["deepspeed"], indirect=True)
@pytest.mark.parametrize("model,stage,extra", [
    ("gpt-tiny", 3, []),
    ("mlp", 2, ["--amp", "bf16", "--opt", "amp_recipe=engine"]),
    ("mlp", 3, ["--amp", "bf16"]),
    ("gpt-tiny", 3, ["--amp", "bf16"]),
])
def test_zero_breadth(launch, backend, model, stage, extra) -> None:
    proc, result = launch(backend, 2, model, [*STEPS, *ZERO[stage], *extra])
    _equivalent(proc, result, stage)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["deepspeed"], indirect=True)
def test_zero3_under_bf16_autocast_with_undeclared_narrow_norms_is_different(launch, backend) -> None:
    """ZeRO-3 under torch_autocast gathers and reduces its lower_precision_safe_modules' parameters in bf16, which
    the reference reproduces for the parameters the adapter declares: the same run treating LayerNorm as safe too,
    undeclared, is `different` on the LayerNorm parameters (the declared run is equivalent: test_zero_breadth)."""
    proc, result = launch("tests.faulty_adapters:NarrowNormsZeRO", 2, "gpt-tiny", [*STEPS, *ZERO[3], "--amp", "bf16"])
    assert proc.returncode == 0, proc.output[-3000:]
    d = result["equivalence"]["first_divergence"]
    assert result["equivalence"]["verdict"] == "different" and d["step"] == 0 and d["check"] == "gradient", d
    assert d["parameters"] and all(".ln_" in p or p.startswith("ln_f") for p in d["parameters"]), d


def test_an_update_with_rows_that_did_not_move_is_an_unapplied_shard() -> None:
    from dpcompare.verify.diagnosis.diagnose import _UpdateHypotheses  # the hypothesis alone, on a hand-made update

    ref = {"w": torch.arange(1.0, 9.0).reshape(4, 2), "b": torch.ones(4)}
    held = {"w": ref["w"].clone(), "b": ref["b"].clone()}
    held["w"][2:] = 0  # the last two rows: rank 1's shard at world size 2
    ev = type("Ev", (), {"names": ["w", "b"], "delta": held, "reference": ref, "world_size": 2, "backend_hparams": [],
                         "lr": 0.1, "tolerance": {"w": 1e-6, "b": 1e-6}})()
    found = _UpdateHypotheses(ev).unapplied(["w"])
    assert [d.cause for d in found] == ["unapplied_shard"] and "rows 2-3 of 4 of w" in found[0].reason
    scaled = dict(held, w=ref["w"] * 0.5)  # its twin: every row moved, by half: no shard was lost
    ev.delta = scaled
    assert _UpdateHypotheses(ev).unapplied(["w"]) == []
