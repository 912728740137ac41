"""HSDP (`--backend fsdp --opt replicas=R`, variant `fsdp:hsdp`): FSDP2 on a 2-D (replicate, shard) mesh is judged like
every backend, and its costs are set against the formulas with the shard group's size.

Checks, against what each part must produce:
  - the adapter, in one process: R must divide the world size (refused with the divisors, before any process group);
    R=2 of 4 ranks declares `capabilities.shard_replicas=2`, a shard group of 2;
  - a real 4-rank run with R=2 under torchrun at the run defaults (4 steps, SGD with momentum): `equivalent` to the
    float64 oracle, the full values read over both mesh dimensions (`DTensor.full_tensor()`), the replicas identical,
    and the run named `fsdp:hsdp`; also with AdamW, and with --clip-grad-norm 0.05 (the norm clipped by is the
    global one: the grad_norm check passes at every step, each clipped);
  - a bad R under torchrun: rank 0 says it in one line, every rank exits 2, nobody prints a traceback;
  - costs of one measured 4-rank run: each rank's model state (census of its local shards) is the ZeRO-3 formula with
    N = 2, the shard group, not 4; the collectives by kind are the analytic volume byte for byte (reduce-scatter and
    two all-gathers within a shard group of 2, an all-reduce of each rank's half of the gradients across the 2
    groups), and the bus figures take each kind's own ranks.
Negative twin: `tests.faulty_hsdp:ReplicaGroupOnlyHSDP`, whose replica groups never all-reduce with each other
(fully_shard on the 1-D shard sub-mesh): `different` at step 0 in the gradient check, cause `replica_group_only`
(ranks 0 and 1's mean), and the replicas differ.

Tiers: the default tier runs the adapter checks, the R=2 run at the defaults and the refusal; the `slow` tier the
twin, AdamW, the clip and the measured run.
"""

from __future__ import annotations

import re

import pytest
import torch

from dpcompare.adapters.fsdp import FSDPAdapter
from dpcompare.contract import Settings
from dpcompare.contract.launch_env import LaunchEnv
from conftest import torchrun_rank_logs
from test_equivalence_matrix import assert_equivalent
from test_failures import assert_one_error_line
from test_negative import different

WS = 4
HSDP = ["--opt", "replicas=2"]
STEPS = 4  # the run's default


def _adapter(world_size: int, replicas: int) -> FSDPAdapter:
    env = LaunchEnv(launcher="torchrun", rank=0, local_rank=0, world_size=world_size, local_world_size=world_size,
                    job_id="test")
    options = {"dist_backend": "auto", "reshard_after_forward": True, "replicas": replicas}
    return FSDPAdapter(env, torch.device("cpu"), Settings(options=options))


def test_replicas_declare_the_shard_group_and_must_divide_the_world_size():
    adapter = _adapter(WS, 2)
    assert (adapter.replicas, adapter.shard_ranks, adapter.capabilities.shard_replicas) == (2, 2, 2)
    assert FSDPAdapter.capabilities.shard_replicas == 1, "the class's declaration stays plain FSDP's"
    assert _adapter(WS, 1).capabilities == FSDPAdapter.capabilities
    for bad in (3, 0, 8):
        with pytest.raises(ValueError, match=rf"--opt replicas={bad} is invalid at world size 4: replicas must "
                                             r"divide the world size .* use one of 1, 2, 4 \(1: plain FSDP\)"):
            _adapter(WS, bad)


def _notes(result: dict) -> dict[str, str]:
    return {n["code"]: n["text"] for n in result["equivalence"]["notes"]}


def _hsdp_equivalent(proc, result) -> dict:
    assert_equivalent(proc, result, backend="fsdp", world_size=WS, model="mlp", launcher="torchrun", steps=STEPS)
    assert result["variant"] == "hsdp" and "fsdp:hsdp ws=4 mlp [torchrun]: equivalent" in proc.stdout
    assert result["capabilities"]["shard_replicas"] == 2 and result["capabilities"]["shards"] == "parameters"
    assert ("HSDP, a 2x2 mesh (replicate, shard): the 4 ranks form 2 replica groups of 2, each rank holds 1/2 of every "
            "parameter") in _notes(result)["fsdp.sharding"]
    return result["equivalence"]


@pytest.mark.slow  # breadth: the default tier keeps this capability's other test
@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_hsdp_at_4_ranks_is_equivalent_at_the_run_defaults(launch, record_noise_ratio):
    proc, result = launch("fsdp", WS, "mlp", [*HSDP, "--measure-steps", "0"])
    _hsdp_equivalent(proc, result)
    record_noise_ratio(result)
    assert result["config"]["optimizer"] == "sgd" and result["config"]["momentum"] > 0


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.timeout(200)
def test_replicas_that_do_not_divide_the_world_size_are_one_line_and_exit_2(launch, tmp_path):
    log_dir = tmp_path / "torchrun-logs"
    proc, result = launch("fsdp", WS, "mlp", ["--opt", "replicas=3"], "torchrun",
                          launcher_args=["--log-dir", str(log_dir), "--redirects", "3"])
    assert proc.returncode != 0 and result is None
    logs = torchrun_rank_logs(log_dir)
    assert_one_error_line(logs[0]["stderr"], "--opt replicas=3 is invalid at world size 4", "use one of 1, 2, 4")
    for rank, streams in logs.items():
        assert rank == 0 or streams["stderr"] == "", (rank, streams["stderr"])
        assert all("Traceback" not in text for text in streams.values()), rank
    codes = [int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", proc.stderr)]
    assert 2 in codes and set(codes) <= {2, -15}, codes


# -- slow: the twin, the optimizers, the clip -------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_replica_groups_that_never_all_reduce_are_named(launch):
    proc, result = launch("tests.faulty_hsdp:ReplicaGroupOnlyHSDP", WS, "mlp", [*HSDP, "--measure-steps", "0"],
                          launcher="torchrun")
    d = different(proc, result, "gradient")
    e = result["equivalence"]
    assert d["step"] == 0 and d["cause"] == "replica_group_only" and d["noise_ratio"] > 1e3, d
    assert "the mean of the local gradients of ranks 0, 1 only (2 of the 4 ranks: one of 2 replica groups)" in d["reason"]
    assert d["parameters"] == ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"], d
    assert e["replicas_identical"] is False, "each group trained on its own half of the batch"


@pytest.mark.multiproc
@pytest.mark.timeout(300)
@pytest.mark.parametrize("extra", [pytest.param(["--optimizer", "adamw"], id="adamw", marks=pytest.mark.deep),
                                   pytest.param(["--clip-grad-norm", "0.05"], id="clip", marks=pytest.mark.slow)])
def test_hsdp_is_equivalent_with_adamw_and_with_the_clip(launch, record_noise_ratio, extra):
    proc, result = launch("fsdp", WS, "mlp", [*HSDP, "--measure-steps", "0", *extra])
    e = _hsdp_equivalent(proc, result)
    record_noise_ratio(result)
    if "--clip-grad-norm" in extra:
        norm = e["checks"]["grad_norm"]
        assert norm["status"] == "pass" and norm["clip"] == 0.05, norm
        assert norm["clipped_steps"] == list(range(STEPS)), "the clip takes effect at every checked step"


# -- slow: the costs ----------------------------------------------------------------------------------------------
def _measured(shared_launch) -> dict:
    proc, result = shared_launch("fsdp", WS, "mlp", HSDP)
    _hsdp_equivalent(proc, result)
    return result["metrics"]


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_each_ranks_model_state_is_the_formula_over_the_shard_group(shared_launch):
    m = _measured(shared_launch)
    formula = m["model_state_formula_mib"]
    assert formula["stage"] == 3 and "N=2 (HSDP: the 4 ranks as 2 replica groups of 2)" in formula["formula"]
    per_rank = m["model_state_mib_per_rank"]
    assert len(per_rank) == WS
    for census in per_rank:  # the mlp's rows divide by 2: no padding, so byte for byte
        for part in ("params", "grads", "optimizer"):
            assert census[part] == pytest.approx(formula[part], rel=1e-9), (part, census, formula)
    # Twice what 4-way sharding would hold: the replicate dimension keeps a whole copy per group.
    psi_bytes = m["grad_bytes_per_step"]
    assert formula["params"] * 1024 * 1024 == pytest.approx(psi_bytes / 2)


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_collectives_by_kind_are_the_hsdp_volume_over_each_kinds_ranks(shared_launch):
    m = _measured(shared_launch)
    kinds, grad = m["comm_by_kind"], m["grad_bytes_per_step"]
    assert set(kinds) == {"reduce_scatter", "all_gather", "all_reduce"}, kinds
    expected = {"reduce_scatter": (grad, 2, 0.5), "all_gather": (2 * grad, 2, 0.5), "all_reduce": (grad // 2, 2, 1.0)}
    for kind, (nbytes, ranks, factor) in expected.items():
        row = kinds[kind]
        assert row["analytic_bytes_per_step"] == nbytes and row["bytes_per_step"] == nbytes, (kind, row)
        assert row["group_ranks"] == ranks, (kind, row)
        assert row["bus_bytes_per_step"] == pytest.approx(nbytes * factor), (kind, row)
        assert "HSDP, 2 replica groups" in row["analytic_method"]
    assert kinds["reduce_scatter"]["calls_per_step"] == kinds["all_reduce"]["calls_per_step"] == 3  # one per group


def test_compare_leaves_out_hsdp_where_its_replicas_do_not_divide_the_world_size_and_says_why(tmp_path, monkeypatch):
    """compare --backends fsdp,fsdp:hsdp at world sizes 1, 2, 4: HSDP's 2 replica groups cannot be made of one rank,
    so fsdp:hsdp/1 is listed with the run's own refusal instead of launched to fail; plain FSDP runs at every size."""
    from dpcompare.commands.compare import plan
    from dpcompare.run import registry
    from test_compare import _ns

    monkeypatch.setattr(registry, "availability", lambda b: (True, ""))
    planned = plan.plan(_ns(backends="fsdp,fsdp:hsdp", world_sizes="1,2,4", collectives="none"), tmp_path)
    assert [j.label for j in planned.jobs] == ["fsdp/1", "fsdp/2", "fsdp/4", "fsdp:hsdp/2", "fsdp:hsdp/4"]
    (refused,) = planned.unavailable
    assert refused["backend"] == "fsdp:hsdp/1" and refused["launcher"] == "torchrun"
    assert refused["reason"].startswith("--opt replicas=2 is invalid at world size 1: replicas must divide")
    # Twin: the refusal is the adapter's own, the one the run raises before it starts.
    fsdp = plan.adapter_class("fsdp")
    assert fsdp.world_size_refusal(1, {"replicas": 2}) == refused["reason"]
    assert fsdp.world_size_refusal(4, {"replicas": 2}) is None and fsdp.world_size_refusal(3, {}) is None
