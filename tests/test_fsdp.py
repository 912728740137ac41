"""FSDP2 (`--backend fsdp`, torch.distributed.fsdp.fully_shard): the sharded backend is judged like the others.

Checks, against what each part must produce:
  - the rule that picks the modules `fully_shard` wraps before the root (adapters/fsdp.py): each built-in workload's
    layers or transformer blocks, never a module whose parameters the model uses outside its forward (GPT's and the
    lm's output heads tied to the token embedding stay in the root's group), and the model's own `_no_split_modules`
    where it declares them;
  - one rank in a subprocess: sync(False) runs no reduce-scatter and keeps FSDP's unsharded gradients, zero_grad drops
    them, a micro-batch without sync is added into the next synced one, the optimizer steps the sharded parameters;
  - real 2-rank runs under torchrun: every rank holds a shard of each parameter, the checks read the full values
    through the adapter's collective reads (full_params, reduced_grads, master_params, optimizer_state), and the run
    is `equivalent` to the float64 oracle, measurement and the exposed-communication ablation included;
  - a bad `--opt reshard_after_forward=` is refused in one line, exit 2, before anything starts.
Negative twin: `tests.faulty_adapters:StaleShardFSDP`, whose last rank never writes the update into its shard of
2.weight: the all-gathered parameter is the same on every rank (replicas identical), part new and part stale, and the
update check names 2.weight at step 0, cause unapplied_shard (the rows that did not move).

Tiers: the default tier runs the rule, the one-rank sync check, one AdamW run, the bad option and the twin; the
`slow` tier runs gradient accumulation, reshard_after_forward=false, gpt-tiny (dropout masks captured under
fully_shard), cnn with --sync-bn, --amp bf16 and a forced fp16 overflow skipped where the oracle's emulation of the
ranks overflows.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from torch import nn

from dpcompare.adapters.fsdp import FSDPAdapter, block_modules
from dpcompare.run import real_models, workloads
from conftest import one_rank_script, without_launcher_vars
from test_equivalence_matrix import assert_equivalent
from test_failures import assert_one_error_line
from test_negative import different
from test_precision import FORCED, _assert_forced_overflow_skipped, _equivalent

WS = 2
STEPS = ["--steps", "2"]


# -- which modules are sharded --------------------------------------------------------------------------------
@pytest.mark.parametrize(("factory", "blocks"), [
    (workloads.mlp, ["0", "2", "4"]),
    (workloads.cnn, ["0", "1", "3", "4", "8"]),
    (workloads.mlp_unused, ["body.0", "body.2"]),
    (workloads.lm, ["blocks.0", "blocks.1"]),
    (real_models.gpt_tiny, ["h.0", "h.1"]),
], ids=["mlp", "cnn", "mlp-unused", "lm", "gpt-tiny"])
def test_blocks_are_the_container_elements_that_hold_parameters(factory, blocks):
    model = factory(0).model
    assert [n for n, _ in block_modules(model)] == blocks
    # Tied output heads (used outside their module's forward) stay in the root's group.
    inside = {id(p) for _, m in block_modules(model) for p in m.parameters()}
    for tied in ("wte.weight", "tok.weight"):
        if tied in dict(model.named_parameters()):
            assert id(dict(model.named_parameters())[tied]) not in inside


def test_blocks_the_model_declares_are_taken_as_declared():
    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)

    class Declared(nn.Module):
        _no_split_modules = ["Layer"]

        def __init__(self) -> None:
            super().__init__()
            self.first, self.second = Layer(), Layer()
            self.layers = nn.ModuleList([nn.Linear(4, 4)])

    assert [n for n, _ in block_modules(Declared())] == ["first", "second"]


def test_fsdp_declares_what_it_shards():
    caps = FSDPAdapter.capabilities
    assert (caps.shards, caps.can_disable_sync, caps.native_launcher) == ("parameters", True, "torchrun")
    assert FSDPAdapter.VARIANTS == {"noreshard": {"reshard_after_forward": False}, "hsdp": {"replicas": 2}}
    assert caps.shard_replicas == 1


ONE_RANK = one_rank_script("fsdp", "FSDPAdapter", "mlp", """
x, y = w.make_batch(0, 8)
def backward(context):
    with context:
        adapter.backward(w.loss_fn(wrapped.model(x), y))
def left_over():
    return sum(fp._unsharded_param.grad is not None for m in wrapped.module.modules() if hasattr(m, "_get_fsdp_state")
               for g in m._get_fsdp_state()._fsdp_param_groups for fp in g.fsdp_params)
stepped = all(id(p) in {id(q) for g in wrapped.optimizer.param_groups for q in g["params"]} for p in w.model.parameters())
backward(adapter.comm_off())
unsynced = (sum(p.grad is not None for p in wrapped.module.parameters()), left_over())
adapter.zero_grad()
cleared = left_over()
backward(adapter.sync(True))
synced = adapter.reduced_grads()
adapter.zero_grad()
backward(adapter.sync(False)); backward(adapter.sync(True))
twice = adapter.reduced_grads()
doubled = all(torch.allclose(twice[n], 2 * synced[n]) for n in synced)
print(stepped, unsynced, cleared, doubled)
adapter.teardown()
""")


def test_sync_off_keeps_the_gradients_local_and_zero_grad_drops_them(tmp_path):
    """`can_disable_sync`: without sync no reduce-scatter runs (no sharded gradient appears, FSDP keeps the unsharded
    ones); zero_grad drops those (the ablation's unsynced arm must not leak into the next step), and a micro-batch
    under sync(False) is added into the next synced one (gradient accumulation). The optimizer steps the sharded
    parameters fully_shard made."""
    out = subprocess.run([sys.executable, "-c", ONE_RANK], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env={**without_launcher_vars(os.environ), "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[-2] == "True (0, 6) 0 True", out.stdout


# -- real runs ------------------------------------------------------------------------------------------------
def _notes(result: dict) -> dict[str, str]:
    return {n["code"]: n["text"] for n in result["equivalence"]["notes"]}


@pytest.mark.slow  # breadth: the default tier keeps this capability's other test
@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_fsdp_adamw_is_equivalent_with_every_value_read_in_full(launch, record_noise_ratio):
    """Measured too (the default): the ablation's unsynced arm switches the reduce-scatter off and the next synced
    step starts from no leftover gradient."""
    proc, result = launch("fsdp", WS, "mlp", [*STEPS, "--optimizer", "adamw"])
    assert_equivalent(proc, result, backend="fsdp", world_size=WS, model="mlp", launcher="torchrun")
    record_noise_ratio(result)
    notes = _notes(result)
    assert "fully_shard on 3 block(s) (0, 2, 4) and the root, reshard_after_forward=true" in notes["fsdp.sharding"]
    assert "reduce-scatter only" in notes["fsdp.ablation"]
    assert result["metrics"]["step_ms_p50"] is not None


@pytest.mark.multiproc
@pytest.mark.timeout(150)
def test_a_bad_reshard_option_is_one_line_and_exit_2(launch):
    proc, result = launch("fsdp", 1, "mlp", ["--opt", "reshard_after_forward=maybe"], "python")
    assert proc.returncode == 2, proc.output[-4000:]
    assert result is None
    assert_one_error_line(proc.stderr, "--opt reshard_after_forward='maybe' is invalid", "true/false")
    assert "Traceback" not in proc.output


@pytest.mark.slow  # breadth: the default tier keeps this capability's other test
@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_a_stale_shard_after_the_step_is_named_by_the_update_check(launch):
    """Negative twin: every rank all-gathers the same stale rows, so only the update check can see them."""
    proc, result = launch("tests.faulty_adapters:StaleShardFSDP", WS, "mlp", [*STEPS, "--measure-steps", "0"],
                          launcher="torchrun")
    d = different(proc, result, "update")
    e = result["equivalence"]
    assert (d["step"], d["parameter"]) == (0, "2.weight"), d
    assert d["parameters"] == ["2.weight"] and d["noise_ratio"] > 10, d
    assert d["cause"] == "unapplied_shard" and "rows 32-63 of 64 of 2.weight" in d["reason"], d
    assert e["checks"]["gradient"]["status"] == "pass", e["checks"]
    assert e["replicas_identical"] is True, "the all-gather hands every rank the same stale rows"


# -- slow: the breadth ----------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("model", "extra"), [
    ("mlp", ["--grad-accum", "2"]),
    ("mlp", ["--opt", "reshard_after_forward=false"]),
    ("gpt-tiny", ["--optimizer", "adamw"]),
    ("cnn", ["--sync-bn"]),
], ids=["grad-accum-2", "no-reshard", "gpt-tiny", "cnn-sync-bn"])
def test_fsdp_breadth_is_equivalent(launch, record_noise_ratio, model, extra):
    proc, result = launch("fsdp", WS, model, [*STEPS, "--measure-steps", "0", *extra])
    assert_equivalent(proc, result, backend="fsdp", world_size=WS, model=model, launcher="torchrun")
    record_noise_ratio(result)
    if model == "gpt-tiny":
        probe = result["equivalence"]["stochastic"]
        assert probe["stochastic"] and probe["captured"] and probe["reason"] is None, probe
    if "reshard_after_forward=false" in extra:
        assert "reshard_after_forward=false" in _notes(result)["fsdp.sharding"]


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_fsdp_bf16_autocast_is_equivalent(launch):
    proc, result = launch("fsdp", WS, "gpt-tiny", [*STEPS, "--measure-steps", "0", "--amp", "bf16"])
    p = _equivalent(proc, result)["precision"]
    assert (p["amp"], p["recipe"], p["wire"], p["loss_scaler"]) == ("bf16", "autocast", "none", None), p


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_fsdp_forced_fp16_overflow_is_skipped_on_every_rank(launch):
    """torch.amp.GradScaler over DTensor gradients: DTensor reduces the inf/NaN check over the mesh (max), so a rank
    whose shard is finite skips with the rank whose shard overflowed, where the oracle's emulation overflows."""
    proc, result = launch("fsdp", WS, "mlp", ["--steps", "8", "--measure-steps", "0", *FORCED])
    _assert_forced_overflow_skipped(proc, result)

