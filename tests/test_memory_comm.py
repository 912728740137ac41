"""The cost side of sharded data parallelism: model-state memory measured and by the ZeRO paper's formula, and
communication by kind measured where Python dispatches it and by the same paper's accounting.

Checks dpcompare.measure.memory (the census counts every storage byte once, the formula against hand-computed numbers
and the paper's own figure 1), dpcompare.measure.volume (the analytic volume per kind, nccl-tests' bus factors, the
per-kind figures from synthetic records), dpcompare.measure.collectives (the recorder over a one-rank gloo group:
bytes per kind, a nested call counted once, async time up to wait(), the originals restored), the run's metrics'
choice of rank (dpcompare.measure.run_metrics), the schema, and real runs (ddp: analytic only; deepspeed ZeRO-0: the measured all-reduce is the gradient).
Every figure has a twin where it must come out different.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from dpcompare.measure import bandwidth, memory, volume
from dpcompare.measure import run_metrics as measure
from dpcompare.measure.samples import RankSample
from dpcompare.measure.collectives import CollectiveRecorder
from conftest import one_rank_script, without_launcher_vars

MIB = 1024.0 * 1024.0


# -- census ------------------------------------------------------------------------------------------------------
def test_views_of_one_flat_buffer_count_once_and_separate_tensors_count_each() -> None:
    flat = torch.zeros(100)  # 400 bytes
    views = [flat[:60].view(6, 10), flat[60:]]
    assert memory.census_bytes({"params": views})["params"] == 400
    assert memory.census_bytes({"params": views + [flat]})["params"] == 400  # the buffer itself adds nothing
    # the twin: two tensors of the same sizes that are not views of one storage count twice
    apart = [torch.zeros(60), torch.zeros(40), torch.zeros(100)]
    assert memory.census_bytes({"params": apart})["params"] == 800


def test_a_tensor_in_two_components_counts_in_the_first() -> None:
    p = torch.zeros(10, dtype=torch.float64)  # 80 bytes
    g = torch.zeros(10)
    counted = memory.census_bytes({"grads": [g, p], "params": [p], "optimizer": [p[:5]]})
    assert counted["params"] == 80 and counted["grads"] == 40 and counted["optimizer"] == 0
    assert memory.census_bytes({"grads": [p]})["grads"] == 80  # the twin: alone it counts there


def test_a_partial_view_counts_its_own_bytes_not_the_whole_buffer() -> None:
    bucket = torch.zeros(1000)
    part = bucket[100:150]
    assert memory.census_bytes({"grads": [part]})["grads"] == 200
    overlapping = [bucket[100:150], bucket[120:200]]  # 100..200: 100 floats
    assert memory.census_bytes({"grads": overlapping})["grads"] == 400
    transposed = torch.zeros(4, 3).t()  # a strided view spans the whole storage
    assert memory.census_bytes({"params": [transposed]})["params"] == 48


def test_a_sharded_tensor_counts_its_local_shard() -> None:
    class Sharded:  # duck-typed like a DTensor: what this rank holds is to_local()
        def __init__(self, local: torch.Tensor) -> None:
            self.local = local

        def to_local(self) -> torch.Tensor:
            return self.local

    shard = torch.zeros(25)
    assert memory.census_bytes({"params": [Sharded(shard)]})["params"] == 100
    assert memory.census_bytes({"params": [Sharded(shard), shard]})["params"] == 100  # the same storage
    assert memory.census_bytes({"params": [None, torch.zeros(0)]})["params"] == 0


def test_census_mib_falls_back_to_the_analytic_comm_buffers_and_says_so() -> None:
    params = [torch.zeros(256 * 1024)]  # 1 MiB
    fallback = memory.census_mib({"params": params, "comm_buffers": []}, analytic_comm_buffer_bytes=2 * 1024 * 1024)
    assert fallback["params"] == 1.0 and fallback["comm_buffers"] == 2.0 and fallback["total"] == 3.0
    assert fallback["comm_buffers_method"].startswith("analytic")
    listed = memory.census_mib({"params": params, "comm_buffers": [torch.zeros(512 * 1024)]}, 2 * 1024 * 1024)
    assert listed["comm_buffers"] == 2.0 and listed["comm_buffers_method"].startswith("measured")
    unknown = memory.census_mib({"params": params}, None)
    assert unknown["comm_buffers"] is None and unknown["total"] == 1.0


# -- the ZeRO formula ---------------------------------------------------------------------------------------------
def _formula_bytes(**kw) -> dict[str, float]:
    out = memory.zero_formula_mib(**kw)
    return {k: out[k] * MIB for k in ("params", "grads", "optimizer", "master_params", "total")}


@pytest.mark.parametrize(("shards", "expected"), [
    ("none", (4000, 4000, 8000)), ("optimizer", (4000, 4000, 2000)),
    ("gradients", (4000, 1000, 2000)), ("parameters", (1000, 1000, 2000)),
])
def test_fp32_adam_is_4_4_8_psi_divided_by_stage(shards, expected) -> None:
    got = _formula_bytes(psi=1000, trainable=1000, world_size=4, shards=shards, weight_bytes=4, masters=False,
                         optimizer="adamw")
    assert (got["params"], got["grads"], got["optimizer"]) == pytest.approx(expected)
    assert got["master_params"] == 0 and got["total"] == pytest.approx(sum(expected))


@pytest.mark.parametrize(("shards", "gb"), [("none", 120.0), ("optimizer", 31.4), ("gradients", 16.6),
                                           ("parameters", 1.9)])
def test_mixed_precision_adam_reproduces_the_papers_figure_1(shards, gb) -> None:
    # Rajbhandari et al. 2020, figure 1: Psi = 7.5B, N = 64, K = 12 -> 120, 31.4, 16.6, 1.9 GB per device.
    got = _formula_bytes(psi=7_500_000_000, trainable=7_500_000_000, world_size=64, shards=shards, weight_bytes=4,
                         masters=True, optimizer="adam")
    assert got["total"] / 1e9 == pytest.approx(gb, abs=0.05)
    assert got["master_params"] + got["optimizer"] == pytest.approx(12 * 7.5e9 / (64 if shards != "none" else 1))


@pytest.mark.parametrize(("optimizer", "momentum", "masters", "k"), [
    ("sgd", 0.9, False, 4), ("sgd", 0.0, False, 0), ("sgd", 0.9, True, 8), ("sgd", 0.0, True, 4), ("adamw", 0.0, True, 12),
])
def test_other_optimizers_have_their_own_k(optimizer, momentum, masters, k) -> None:
    got = _formula_bytes(psi=1000, trainable=1000, world_size=1, shards="none", weight_bytes=4, masters=masters,
                         optimizer=optimizer, momentum=momentum)
    assert got["optimizer"] + got["master_params"] == pytest.approx(k * 1000)
    assert got["params"] == (2000 if masters else 4000)


def test_frozen_parameters_have_no_gradient_or_state_and_float64_doubles_everything() -> None:
    got = _formula_bytes(psi=1000, trainable=600, world_size=2, shards="none", weight_bytes=8, masters=False,
                         optimizer="adamw")
    assert (got["params"], got["grads"], got["optimizer"]) == pytest.approx((8000, 4800, 9600))
    text = memory.zero_formula_mib(psi=1000, trainable=600, world_size=2, shards="gradients", weight_bytes=4,
                                   masters=False, optimizer="adamw")
    assert text["stage"] == 2 and "Psi_t=600" in text["formula"] and "/N" in text["formula"]


def test_hsdp_divides_by_the_shard_group_not_the_world_size() -> None:
    """8 ranks as 2 replica groups of 4 (capabilities.shard_replicas=2) hold what 4-way sharding holds."""
    kw = dict(psi=1000, trainable=1000, shards="parameters", weight_bytes=4, masters=False, optimizer="adamw")
    hsdp = memory.zero_formula_mib(world_size=8, replicas=2, **kw)
    assert hsdp["total"] == pytest.approx(memory.zero_formula_mib(world_size=4, **kw)["total"])
    assert hsdp["total"] * MIB == pytest.approx(16 * 1000 / 4)
    assert "N=4 (HSDP: the 8 ranks as 2 replica groups of 4)" in hsdp["formula"]
    assert "HSDP" not in memory.zero_formula_mib(world_size=8, **kw)["formula"]
    with pytest.raises(ValueError, match="replicas must divide the world size"):
        memory.zero_formula_mib(world_size=8, replicas=3, **kw)


def test_the_formula_refuses_what_it_does_not_know() -> None:
    base = dict(psi=10, trainable=10, world_size=2, weight_bytes=4, masters=False, optimizer="adamw")
    with pytest.raises(ValueError, match="shards"):
        memory.zero_formula_mib(shards="everything", **base)
    with pytest.raises(ValueError, match="lion"):
        memory.zero_formula_mib(shards="none", **{**base, "optimizer": "lion"})


def test_param_counts_read_a_zero3_placeholder_by_its_ds_numel() -> None:
    full, placeholder = torch.nn.Parameter(torch.zeros(30)), torch.nn.Parameter(torch.zeros(0))
    placeholder.ds_numel = 50
    frozen = torch.nn.Parameter(torch.zeros(20), requires_grad=False)
    assert memory.param_counts([full, placeholder, frozen]) == (100, 80)
    assert memory.param_counts([torch.nn.Parameter(torch.zeros(0))]) == (0, 0)  # the twin: no ds_numel, no elements


# -- analytic volume and bus factors --------------------------------------------------------------------------------
def test_bus_factors_are_nccl_tests() -> None:
    assert bandwidth.bus_factor("all_reduce", 4) == pytest.approx(1.5)
    assert bandwidth.bus_factor("all_gather", 4) == pytest.approx(0.75)
    assert bandwidth.bus_factor("reduce_scatter", 4) == pytest.approx(0.75)
    assert bandwidth.bus_factor("broadcast", 4) == 1.0 and bandwidth.bus_factor("all_reduce", 1) == 0.0
    with pytest.raises(ValueError):
        bandwidth.bus_factor("all_to_all", 4)


def _bus(by_kind: dict[str, int], n: int) -> float:
    return sum(b * bandwidth.bus_factor(k, n) for k, b in by_kind.items())


def test_analytic_volume_per_stage_and_zero3_is_one_and_a_half_all_reduces() -> None:
    g = p = 1000
    ddp = volume.analytic_bytes_per_step("none", g, p, 8)
    assert ddp == {"all_reduce": 1000}
    z1 = volume.analytic_bytes_per_step("optimizer", g, p, 8)
    assert z1 == volume.analytic_bytes_per_step("gradients", g, p, 8) == {"reduce_scatter": 1000, "all_gather": 1000}
    z3 = volume.analytic_bytes_per_step("parameters", g, p, 8)
    assert z3 == {"reduce_scatter": 1000, "all_gather": 2000}
    assert _bus(z1, 8) == pytest.approx(_bus(ddp, 8))
    assert _bus(z3, 8) == pytest.approx(1.5 * _bus(ddp, 8))
    kept = volume.analytic_bytes_per_step("parameters", g, p, 8, reshard=False)  # the twin: gathered once
    assert _bus(kept, 8) == pytest.approx(_bus(ddp, 8))
    assert volume.analytic_bytes_per_step("parameters", g, p, 1) == {}


def test_hsdp_volume_is_fsdp_within_a_shard_group_plus_an_all_reduce_of_the_shards_across_groups() -> None:
    """8 ranks as 2 replica groups of 4: FSDP's reduce-scatter and all-gathers over 4 ranks, then each rank
    all-reduces its quarter of the gradients with the 2 groups; the bus factors take the ranks each kind spans."""
    g = p = 1000
    hsdp = volume.analytic_bytes_per_step("parameters", g, p, 8, replicas=2)
    assert hsdp == {"reduce_scatter": 1000, "all_gather": 2000, "all_reduce": 250}
    ranks = volume.kind_ranks(8, 2)
    assert (ranks["reduce_scatter"], ranks["all_gather"], ranks["all_reduce"]) == (4, 4, 2)
    assert volume.kind_ranks(8) == {k: 8 for k in volume.KINDS}
    bus = sum(b * bandwidth.bus_factor(k, ranks[k]) for k, b in hsdp.items())
    assert bus == pytest.approx(1000 * 0.75 + 2000 * 0.75 + 250 * 1.0)
    # One rank per shard group: nothing to scatter or gather, the groups all-reduce the whole gradient (DDP's volume).
    assert volume.analytic_bytes_per_step("parameters", g, p, 2, replicas=2) == {"all_reduce": 1000}
    assert volume.analytic_bytes_per_step("parameters", g, p, 8) == {"reduce_scatter": 1000, "all_gather": 2000}
    assert "HSDP, 2 replica groups" in volume.analytic_method("parameters", True, 2)
    with pytest.raises(ValueError, match="HSDP"):
        volume.analytic_bytes_per_step("gradients", g, p, 8, replicas=2)
    with pytest.raises(ValueError, match="replicas must divide"):
        volume.analytic_bytes_per_step("parameters", g, p, 8, replicas=3)


def test_union_counts_overlapping_calls_once() -> None:
    assert volume.union_ms([(0, 2), (1, 3), (5, 6)]) == 4
    assert volume.union_ms([(0, 2), (2, 3)]) == 3 and volume.union_ms([]) == 0


# -- per-kind figures from records ----------------------------------------------------------------------------------
def _record(kinds: dict[str, dict[str, list]]) -> dict:
    return {"method": "test recorder", "steps": 2, "kinds": kinds, "unwaited": 0, "unparsed": 0}


def test_comm_by_kind_takes_bytes_from_rank0_and_time_from_the_rank_that_waited_least() -> None:
    r0 = _record({"all_reduce": {"bytes": [4e6, 4e6], "calls": [2, 2], "ms": [8.0, 8.0]},
                  "all_gather": {"bytes": [2e6, 2e6], "calls": [1, 1], "ms": [1.0, 3.0]}})
    r1 = _record({"all_reduce": {"bytes": [4e6, 4e6], "calls": [2, 2], "ms": [4.0, 4.0]},
                  "all_gather": {"bytes": [2e6, 2e6], "calls": [1, 1], "ms": [5.0, 5.0]}})
    out = volume.comm_by_kind([r0, r1], {"all_reduce": 4_000_000}, 2, None, "analytic test")
    ar, ag = out["all_reduce"], out["all_gather"]
    assert ar["bytes_per_step"] == 4e6 and ar["calls_per_step"] == 2 and ar["analytic_bytes_per_step"] == 4_000_000
    assert ar["ms_per_step"] == 4.0 and ar["ms_per_step_max"] == 8.0
    assert ar["busbw_gbps"] == pytest.approx(1.0)  # 4e6 B in 4 ms = 1 GB/s, x 2(2-1)/2
    assert ag["ms_per_step"] == 2.0 and ag["busbw_gbps"] == pytest.approx(0.5)  # 2e6 B / 2 ms x 1/2
    assert ag["analytic_bytes_per_step"] == 0 and "reduce_scatter" not in out


def test_comm_by_kind_takes_each_kinds_bus_factor_over_the_ranks_it_spans_under_hsdp() -> None:
    """4 ranks as 2 replica groups of 2: the all-reduce spans 2 ranks (factor 1, not 1.5), the reduce-scatter 2
    (factor 1/2, not 3/4)."""
    rec = _record({"all_reduce": {"bytes": [2e6, 2e6], "calls": [1, 1], "ms": [2.0, 2.0]},
                   "reduce_scatter": {"bytes": [4e6, 4e6], "calls": [1, 1], "ms": [4.0, 4.0]}})
    out = volume.comm_by_kind([rec] * 4, {"all_reduce": 2_000_000, "reduce_scatter": 4_000_000}, 4, None, "a",
                              replicas=2)
    ar, rs = out["all_reduce"], out["reduce_scatter"]
    assert (ar["group_ranks"], rs["group_ranks"]) == (2, 2)
    assert ar["bus_bytes_per_step"] == ar["analytic_bus_bytes_per_step"] == pytest.approx(2e6)
    assert rs["bus_bytes_per_step"] == rs["analytic_bus_bytes_per_step"] == pytest.approx(2e6)
    assert ar["busbw_gbps"] == pytest.approx(1.0) and rs["busbw_gbps"] == pytest.approx(0.5)
    flat = volume.comm_by_kind([rec] * 4, {"all_reduce": 2_000_000}, 4, None, "a")  # the twin: one group of 4
    assert flat["all_reduce"]["group_ranks"] == 4 and flat["all_reduce"]["bus_bytes_per_step"] == pytest.approx(3e6)


def test_comm_by_kind_is_analytic_only_when_nothing_passed_python_or_nothing_was_recorded() -> None:
    empty = _record({})
    out = volume.comm_by_kind([empty, empty], {"all_reduce": 100}, 2, None, "analytic test")
    assert out["all_reduce"]["bytes_per_step"] is None and out["all_reduce"]["analytic_bytes_per_step"] == 100
    assert "C++ Reducer" in out["all_reduce"]["method"]
    off = volume.comm_by_kind([None, None], {"reduce_scatter": 10, "all_gather": 20}, 2, "instrumentation off", "a")
    assert {k: v["bytes_per_step"] for k, v in off.items()} == {"reduce_scatter": None, "all_gather": None}
    assert "instrumentation off" in off["all_gather"]["method"]


# -- the recorder ------------------------------------------------------------------------------------------------
@pytest.fixture
def one_rank_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield dist
    dist.destroy_process_group()


def test_recorder_counts_bytes_per_kind_per_step_and_restores_the_originals(one_rank_group) -> None:
    dist = one_rank_group
    from torch.distributed import distributed_c10d as c10d

    originals = {name: getattr(dist, name) for name in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")}
    cached = dist.all_gather_into_tensor  # as DeepSpeed's TorchBackend keeps it from before the window
    dist.all_reduce(torch.ones(1000))  # before the window: not counted
    rec = CollectiveRecorder(torch.device("cpu"))
    rec.begin()
    try:
        assert dist.all_reduce is not originals["all_reduce"] and c10d.all_gather_single is not None
        dist.all_reduce(torch.ones(100))  # 400 B
        dist.all_gather_into_tensor(torch.empty(10), torch.ones(10))  # 40 B, through all_gather_single: once
        rec.step()
        cached(torch.empty(30), torch.ones(30))  # the reference taken before: seen through all_gather_single
        dist.reduce_scatter_tensor(torch.empty(5), torch.ones(5))
        dist.broadcast(torch.ones(7), src=0)
        with rec.paused():
            dist.all_reduce(torch.ones(999))  # paused: not counted
        rec.step()
    finally:
        record = rec.end(2)
    dist.all_reduce(torch.ones(1000))  # after the window: not counted
    assert {name: getattr(dist, name) for name in originals} == originals
    kinds = record["kinds"]
    assert kinds["all_reduce"]["bytes"] == [400, 0] and kinds["all_reduce"]["calls"] == [1, 0]
    assert kinds["all_gather"]["bytes"] == [40, 120] and kinds["all_gather"]["calls"] == [1, 1]
    assert kinds["reduce_scatter"]["bytes"] == [0, 20] and kinds["broadcast"]["bytes"] == [0, 28]


def test_an_async_call_is_timed_until_its_wait_returns(one_rank_group) -> None:
    dist = one_rank_group
    rec = CollectiveRecorder(torch.device("cpu"))
    rec.begin()
    try:
        work = dist.all_reduce(torch.ones(10), async_op=True)
        assert isinstance(work, dist.Work)  # FSDP2 checks this
        time.sleep(0.05)
        work.wait()
        assert work.is_completed()
        rec.step()
        dist.all_reduce(torch.ones(10))  # the twin: a synchronous call ends when it returns
        rec.step()
    finally:
        record = rec.end(2)
    ms = record["kinds"]["all_reduce"]["ms"]
    assert ms[0] >= 50 and ms[1] < 50 and record["unwaited"] == 0


def test_the_recorder_restores_the_originals_when_the_window_fails(one_rank_group) -> None:
    dist = one_rank_group
    before = dist.all_reduce
    rec = CollectiveRecorder(torch.device("cpu"))
    with pytest.raises(RuntimeError, match="boom"):
        rec.begin()
        try:
            raise RuntimeError("boom")
        finally:
            rec.close()
    assert dist.all_reduce is before
    rec.close()  # idempotent
    assert dist.all_reduce is before


# -- the run's metrics -----------------------------------------------------------------------------------------------
def _sample(census=None, collectives=None):
    return RankSample([10.0, 10.0], [], [], {"peak_mem_mib": 1.0, "peak_mem_reserved_mib": None}, None, None,
                              model_state=census, collectives=collectives)


def _summarize(samples, **kw):
    args = dict(world_size=len(samples), local_batch=4, tokens_per_sample=1, warmup_steps=0, grad_bytes=4000,
                message_bytes=None, message_reason="n/a", model_state={"total": 9.0}, microbench_busbw=None,
                microbench_reason="none", scaling="strong", comm_possible=None)
    args.update(kw)
    return measure.summarize(samples, **args)


def _census(total, optimizer):
    return {"params": 1.0, "grads": 1.0, "optimizer": optimizer, "master_params": 0.0, "comm_buffers": total - 2 - optimizer,
            "total": total, "comm_buffers_method": "measured"}


def test_model_state_is_the_largest_rank_and_every_rank_is_kept() -> None:
    m = _summarize([_sample(_census(4.0, 1.0)), _sample(_census(4.5, 1.5))],
                   model_state_formula={"total": 3.0}, comm_analytic={"all_reduce": 4000}, comm_analytic_method="a")
    assert m["model_state_mib"]["rank"] == 1 and m["model_state_mib"]["total"] == 4.5
    assert [r["optimizer"] for r in m["model_state_mib_per_rank"]] == [1.0, 1.5]
    assert m["model_state_formula_mib"] == {"total": 3.0}
    assert m["comm_by_kind"]["all_reduce"]["analytic_bytes_per_step"] == 4000


def test_a_rank_without_census_leaves_the_analytic_model_state_with_the_reason() -> None:
    m = _summarize([_sample(_census(4.0, 1.0)), _sample({"reason": "model_state_tensors() raised KeyError"})])
    assert m["model_state_mib"]["total"] == 9.0 and m["model_state_mib"]["method"].startswith("analytic")
    assert m["model_state_mib_per_rank"] is None and "rank(s) 1" in m["reasons"]["model_state_mib_per_rank"]
    assert "KeyError" in m["reasons"]["model_state_mib_per_rank"]
    assert m["comm_by_kind"] is None and m["reasons"]["comm_by_kind"]


# -- the schema ------------------------------------------------------------------------------------------------------
def _payload_with(metrics: dict) -> dict:
    from dpcompare import json_files
    from dpcompare.run.config import RunConfig
    from dpcompare.verify.oracle import gradient_oracle as eq

    policy = eq.tolerance_policy("float32", 1, 3)
    return json_files.sanitize(json_files.base_payload(
        backend="reference", launcher="python", world_size=1, device="cpu", model="mlp", global_batch=24,
        local_batch=24, scaling="strong", steps=1, tag=None, config=RunConfig().to_dict(),
        equivalence=eq.Verdict().to_dict(policy), env=json_files.environment(), created_unix=0.0, metrics=metrics))


def test_schema_accepts_the_new_metrics_and_rejects_a_malformed_kind() -> None:
    import jsonschema

    from tests.conftest import validate_result

    m = _summarize([_sample(_census(4.0, 1.0)), _sample(_census(4.0, 1.0))],
                   comm_analytic={"reduce_scatter": 10, "all_gather": 20}, comm_analytic_method="a",
                   model_state_formula=memory.zero_formula_mib(psi=10, trainable=10, world_size=2, shards="optimizer",
                                                               weight_bytes=4, masters=False, optimizer="adamw"),
                   comm_measured_reason="instrumentation off")
    payload = _payload_with(json.loads(json.dumps(m)))
    validate_result(payload)
    for break_it in (lambda p: p["metrics"]["comm_by_kind"].__setitem__("all_to_all", p["metrics"]["comm_by_kind"]["all_gather"]),
                     lambda p: p["metrics"]["comm_by_kind"]["all_gather"].pop("method"),
                     lambda p: p["metrics"]["model_state_formula_mib"].__setitem__("stage", 4),
                     lambda p: p["metrics"]["model_state_mib_per_rank"][0].__setitem__("optimizer", -1.0)):
        broken = json.loads(json.dumps(payload))
        break_it(broken)
        with pytest.raises(jsonschema.ValidationError):
            validate_result(broken)


# -- real runs -------------------------------------------------------------------------------------------------------
RUN = ["--optimizer", "adamw", "--steps", "2", "--measure-steps", "5"]


@pytest.mark.slow  # breadth: the default tier keeps this capability's other test
@pytest.mark.multiproc
def test_ddp_measures_every_ranks_model_state_and_its_all_reduce_is_analytic_only(launch) -> None:
    done, result = launch("ddp", 2, "mlp", RUN)
    assert result is not None, done.output
    m = result["metrics"]
    ranks = m["model_state_mib_per_rank"]
    assert len(ranks) == 2 and ranks[0]["total"] == pytest.approx(ranks[1]["total"])
    formula = m["model_state_formula_mib"]
    assert formula["stage"] == 0
    for part in ("params", "grads"):
        assert ranks[0][part] == pytest.approx(formula[part])
    assert ranks[0]["optimizer"] == pytest.approx(formula["optimizer"], rel=1e-2)  # + Adam's step counters
    ar = m["comm_by_kind"]["all_reduce"]
    assert ar["bytes_per_step"] is None and ar["analytic_bytes_per_step"] == m["grad_bytes_per_step"]


@pytest.mark.slow  # the default tier measures DeepSpeed's all-reduce at ZeRO-1 (test_deepspeed_zero1_halves_...)
@pytest.mark.multiproc
def test_deepspeed_zero0_all_reduce_measured_in_python_is_the_gradient(launch) -> None:
    pytest.importorskip("deepspeed")
    done, result = launch("deepspeed", 2, "mlp", RUN)
    assert result is not None, done.output
    ar = result["metrics"]["comm_by_kind"]["all_reduce"]
    assert ar["bytes_per_step"] == ar["analytic_bytes_per_step"] == result["metrics"]["grad_bytes_per_step"]
    assert ar["calls_per_step"] >= 1 and ar["ms_per_step"] > 0 and ar["busbw_gbps"] > 0
    assert "reduce_scatter" not in result["metrics"]["comm_by_kind"]


# -- the report --------------------------------------------------------------------------------------------------
def _reported_run(backend: str, options: dict, *, census: bool = True, kinds: bool = True) -> RunResult:
    from dpcompare.result_view import RunResult
    from tests.test_report import metrics, run_result

    formula = memory.zero_formula_mib(psi=1 << 20, trainable=1 << 20, world_size=2, shards="optimizer" if options
                                      else "none", weight_bytes=4, masters=False, optimizer="adamw")
    state = {"params": 4.0, "grads": 4.0, "optimizer": 4.0 if options else 8.0, "master_params": 0.0,
             "comm_buffers": 4.0, "total": 16.0 if options else 20.0, "comm_buffers_method": "analytic (test)"}
    extra = {"model_state_formula_mib": formula}
    if census:
        extra.update(model_state_mib={**state, "rank": 0, "method": "census"}, model_state_mib_per_rank=[state, state])
    if kinds:
        analytic = volume.analytic_bytes_per_step("optimizer" if options else "none", 4 * 2**20, 4 * 2**20, 2)
        records = [_record({"all_gather": {"bytes": [4 * 2**20] * 2, "calls": [1, 1], "ms": [4.0, 4.0]},
                            "all_reduce": {"bytes": [4 * 2**20] * 2, "calls": [1, 1], "ms": [8.0, 8.0]}})] * 2
        extra["comm_by_kind"] = volume.comm_by_kind(records if options else [None, None], analytic, 2,
                                                     None if options else "instrumentation off", "analytic (test)")
    return RunResult(run_result(backend, 2, metrics_=metrics(**extra), config={"options": options}, knobs=options))


def _cost_markdown(runs, knob_runs) -> str:
    from dpcompare.commands.report.markdown import Footnotes
    from dpcompare.commands.report.markdown_cost import cost_sections
    from dpcompare.commands.report.derive import derive, scaling_baseline

    notes = Footnotes()
    base = scaling_baseline(runs)
    lines = cost_sections(runs, [derive(r, base) for r in runs], notes, knob_runs)
    return "\n".join(lines + notes.lines())


def test_report_tables_show_each_rank_against_the_formula_and_the_bus_traffic_against_ddp() -> None:
    baseline, zero1 = _reported_run("deepspeed", {}), _reported_run("deepspeed", {"zero_stage": 1})
    text = _cost_markdown([baseline], [zero1])
    assert "#### Model state per rank against the ZeRO formula (MiB)" in text
    assert "| deepspeed | 2 | zero_stage=1 | 1 | 4.00 | 4.00 | 4.00 | 0.00 | 4.00 (a)" in text
    assert "**ZeRO-1 formula**" in text and "**ZeRO-0 formula**" in text
    # measured: all-reduce + all-gather of the gradient's size = 1.5x DDP's bus bytes; the ZeRO-1 prediction 1x
    assert "| deepspeed | 2 | zero_stage=1 | **bus total** | 6 MiB (1.50x DDP) | 4 MiB (1.00x DDP) |" in text
    assert "| deepspeed | 2 | - | all-reduce | n/a[^" in text  # instrumentation off: analytic only
    # the twin: a result written before the census and the kinds has neither table
    old = _reported_run("ddp", {}, census=False, kinds=False)
    old.raw["metrics"].pop("model_state_formula_mib")
    text = _cost_markdown([old], [])
    assert "Model state per rank" not in text and "Communication by kind" not in text
    assert "| ddp | 2 | 512 | 4.00 | 4.00 | 0.00 | 0.00 | 4.00 | 12.0 | n/a[^" in text


def test_model_state_plot_is_drawn_with_the_formula_and_skipped_without_any_state(tmp_path) -> None:
    from dpcompare.commands.report.plots_cost import plot_model_state

    path = tmp_path / "model_state.png"
    assert plot_model_state([_reported_run("deepspeed", {}), _reported_run("deepspeed", {"zero_stage": 1})], path) is None
    assert path.stat().st_size > 1000
    bare = _reported_run("ddp", {}, census=False, kinds=False)
    bare.raw["metrics"]["model_state_mib"] = None
    assert "no run recorded model_state_mib" in plot_model_state([bare], tmp_path / "none.png")
    assert not (tmp_path / "none.png").exists()


@pytest.mark.slow  # fsdp keeps sharded model state against the formula in the default tier
@pytest.mark.multiproc
def test_deepspeed_zero1_halves_the_optimizer_state_and_its_gradients_go_as_an_all_reduce(launch) -> None:
    pytest.importorskip("deepspeed")
    done, result = launch("deepspeed", 2, "mlp", [*RUN, "--opt", "zero_stage=1"])
    assert result is not None, done.output
    m = result["metrics"]
    formula, ranks = m["model_state_formula_mib"], m["model_state_mib_per_rank"]
    assert formula["stage"] == 1
    for rank in ranks:  # half of Adam's 8 Psi (+ the step counter), where ZeRO-0 holds all of it
        assert rank["optimizer"] == pytest.approx(formula["optimizer"], rel=1e-2)
        assert rank["optimizer"] < 0.6 * (8 * m["grad_bytes_per_step"] / 4) / MIB
        assert rank["params"] == pytest.approx(formula["params"])
    kinds = m["comm_by_kind"]
    # DeepSpeed's defaults (use_multi_rank_bucket_allreduce) all-reduce the gradient buckets instead of the
    # reduce-scatter the paper counts; the updated partitions come back by all-gather, as the paper says
    assert kinds["reduce_scatter"]["bytes_per_step"] == 0 and kinds["reduce_scatter"]["analytic_bytes_per_step"] > 0
    assert kinds["all_reduce"]["bytes_per_step"] >= m["grad_bytes_per_step"]
    assert kinds["all_gather"]["bytes_per_step"] == pytest.approx(kinds["all_gather"]["analytic_bytes_per_step"], rel=1e-2)


@pytest.mark.slow  # the default tier keeps this capability in a sibling test
@pytest.mark.multiproc
def test_fsdp_gathers_the_parameters_twice_a_step_when_it_reshards(launch) -> None:
    done, result = launch("fsdp", 2, "mlp", RUN)
    assert result is not None, done.output
    m = result["metrics"]
    kinds = m["comm_by_kind"]
    params = m["grad_bytes_per_step"]  # every parameter is trainable in mlp
    assert kinds["all_gather"]["bytes_per_step"] == kinds["all_gather"]["analytic_bytes_per_step"] == 2 * params
    assert kinds["reduce_scatter"]["bytes_per_step"] == kinds["reduce_scatter"]["analytic_bytes_per_step"] == params
    assert "all_reduce" not in kinds
    assert m["model_state_mib_per_rank"][0]["params"] == pytest.approx(m["model_state_formula_mib"]["params"])


# -- the ablation's own memory --------------------------------------------------------------------------------
DDP_ABLATION = one_rank_script("ddp", "DDPAdapter", "mlp_wide", """
ddp = wrapped.model
with adapter.comm_off():
    inside = (adapter.wrapped.model is ddp, ddp.require_backward_grad_sync)
print(inside[0], inside[1], ddp.require_backward_grad_sync, adapter.ablation_bytes())
adapter.teardown()
""")


def test_ddps_ablation_switches_its_one_wrappers_sync_off_and_holds_nothing(tmp_path):
    """DDP's unsynced arm is the measured DDP itself under no_sync (a second DDP over the same module would share its
    parameters' autograd hooks, which breaks models whose unused parameters change with the data): the same object
    runs, its sync is off inside comm_off() and back on after, and the arm holds no memory of its own."""
    out = subprocess.run([sys.executable, "-c", DDP_ABLATION], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path, env={**without_launcher_vars(os.environ), "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[-2].split() == ["True", "False", "True", "0"], out.stdout


def test_peak_memory_leaves_out_what_only_the_ablation_holds() -> None:
    from types import SimpleNamespace

    from dpcompare.run.measurement import MeasurementPhase

    # what the unsynced arm holds was there when the window opened: the rise above the start keeps it out already
    window = SimpleNamespace(peak=lambda: {"peak_mem_mib": 100.0, "peak_mem_reserved_mib": 120.0},
                             above_start=lambda peak: 30.0)
    phase = SimpleNamespace(cfg=SimpleNamespace(instrument=True),
                            adapter=SimpleNamespace(ablation_bytes=lambda: 16 * 1024 * 1024))
    assert MeasurementPhase._peak(phase, window, pairs=10) == {"peak_mem_mib": 84.0, "peak_mem_reserved_mib": 104.0,
                                                               "peak_above_start_mib": 30.0}
    assert MeasurementPhase._peak(phase, window, pairs=0) == {"peak_mem_mib": 100.0, "peak_mem_reserved_mib": 120.0,
                                                              "peak_above_start_mib": 30.0}
    phase.cfg.instrument = False
    assert MeasurementPhase._peak(phase, window, pairs=10) == {"peak_mem_mib": None, "peak_mem_reserved_mib": None,
                                                               "peak_above_start_mib": None}
