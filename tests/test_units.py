"""Unit tests of dpcompare's glue, in one process, no launcher.

Checks against independent references where one exists: launch detection against the variables each
real launcher sets (torchrun, the deepspeed launcher, horovodrun, Open MPI, PMI, Slurm); sharding against
torch's own DistributedSampler; GlobalBatchNorm against nn.BatchNorm2d in float64; the metrics of
equivalence.compare (dpcompare.verify.judgement.tolerance) against hand-computed values (the diagnosis: test_diagnosis.py); the watchdog's culprit against fake heartbeat files; configuration, registry and result
schema errors against the messages and rejections they promise. Every passing case has a twin that
must fail.
"""

from __future__ import annotations

import copy
import json
import math
import time

import pytest
import torch
from torch import nn
from torch.utils.data import DistributedSampler

from conftest import validate_result
from dpcompare.verify.oracle import gradient_oracle as eq
import dpcompare
from dpcompare import json_files
from dpcompare.run import result_writer
from dpcompare.contract import launch_env as launch
from dpcompare.run import registry
from dpcompare.contract import syncbn
from dpcompare.run import workloads
from dpcompare.run.config import RunConfig
from dpcompare.run.watchdog import Watchdog

U32 = 2.0**-24


# -- launch detection -----------------------------------------------------------------------------------
TORCHRUN_ENV = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                "TORCHELASTIC_RUN_ID": "abc", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
                "GROUP_RANK": "1"}
DEEPSPEED_ENV = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_SIZE": "2", "CROSS_RANK": "0",
                 "CROSS_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
HOROVODRUN_ENV = {"HOROVOD_RANK": "2", "HOROVOD_SIZE": "3", "HOROVOD_LOCAL_RANK": "2", "HOROVOD_LOCAL_SIZE": "3",
                  "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1", "HOROVOD_GLOO_RENDEZVOUS_PORT": "1234"}
OMPI_ENV = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "3", "OMPI_MCA_ess_base_jobid": "42"}


@pytest.mark.parametrize(("env", "expected"), [
    pytest.param(TORCHRUN_ENV, ("torchrun", 3, 1, 4, 2), id="torchrun"),
    pytest.param(DEEPSPEED_ENV, ("deepspeed", 1, 1, 2, 2), id="deepspeed-launcher"),
    pytest.param(HOROVODRUN_ENV, ("horovodrun", 2, 2, 3, 3), id="horovodrun-gloo"),
    # horovodrun --mpi also sets Open MPI's variables: Horovod's own win.
    pytest.param({**OMPI_ENV, **HOROVODRUN_ENV}, ("horovodrun", 2, 2, 3, 3), id="horovodrun-mpi"),
    pytest.param(OMPI_ENV, ("mpirun", 1, 1, 3, 3), id="openmpi"),
    # After ensure_rendezvous() fills RANK/WORLD_SIZE under mpirun, detection must still say mpirun.
    pytest.param({**OMPI_ENV, "RANK": "1", "WORLD_SIZE": "3"}, ("mpirun", 1, 0, 3, 1), id="openmpi-after-rendezvous"),
    pytest.param({"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"},
                 ("mpirun", 2, 0, 4, 2), id="pmi"),
    pytest.param({"SLURM_PROCID": "5", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                  "SLURM_NTASKS_PER_NODE": "4", "SLURM_JOB_ID": "77"}, ("slurm", 5, 1, 8, 4), id="srun"),
    # A batch script's shell has SLURM_PROCID but is no srun step: one process.
    pytest.param({"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_JOB_ID": "77"}, ("python", 0, 0, 1, 1),
                 id="slurm-batch-shell"),
    pytest.param({}, ("python", 0, 0, 1, 1), id="plain-python"),
])
def test_detect_reads_each_launchers_variables(env, expected):
    got = launch.detect(env)
    assert (got.launcher, got.rank, got.local_rank, got.world_size, got.local_world_size) == expected


def test_detect_tells_torchrun_from_the_deepspeed_launcher():
    # Both set RANK/WORLD_SIZE; only torchrun sets TORCHELASTIC_RUN_ID, only deepspeed CROSS_RANK+LOCAL_SIZE.
    assert launch.detect({**DEEPSPEED_ENV, "TORCHELASTIC_RUN_ID": "x"}).launcher == "torchrun"
    assert launch.detect({k: v for k, v in TORCHRUN_ENV.items() if k != "TORCHELASTIC_RUN_ID"}).launcher == "torchrun"
    assert launch.detect({k: v for k, v in DEEPSPEED_ENV.items() if k != "CROSS_RANK"}).launcher == "torchrun"


def test_detect_job_id_differs_between_launches():
    a = launch.detect(TORCHRUN_ENV).job_id
    b = launch.detect({**TORCHRUN_ENV, "TORCHELASTIC_RUN_ID": "other"}).job_id
    assert a != b


def test_detect_refuses_pmix_without_a_world_size():
    # srun --mpi=pmix / prterun export PMIX_RANK but no size: guessing "one process" would be silently wrong.
    with pytest.raises(RuntimeError, match="PMIX_RANK"):
        launch.detect({"PMIX_RANK": "1"})


def test_detect_rejects_a_non_integer_rank():
    with pytest.raises(RuntimeError, match="RANK='one' is not an integer"):
        launch.detect({**TORCHRUN_ENV, "RANK": "one"})


# -- configuration --------------------------------------------------------------------------------------
def test_default_config_is_valid():
    RunConfig().validate()
    RunConfig(scaling="weak", local_batch=4, inject_fault="hang:1:2").validate()


@pytest.mark.parametrize(("fields", "message"), [
    ({"steps": 0}, "--steps=0 is invalid"),
    ({"lr": -1.0}, "--lr=-1.0 is invalid"),
    ({"lr": 1e3}, "--lr=1000.0 is invalid"),
    ({"lr": math.nan}, "--lr=nan is invalid"),
    ({"momentum": 1.0}, "--momentum=1.0 is invalid"),
    ({"weight_decay": -0.1}, "--weight-decay=-0.1 is invalid"),
    ({"global_batch": 0}, "--global-batch=0 is invalid"),
    ({"check_every": -1}, "--check-every=-1 is invalid"),
    ({"timeout_s": 0.0}, "--timeout-s=0.0 is invalid"),
    ({"scaling": "weak"}, "also pass --local-batch"),
    ({"backend": ""}, "name a backend"),
    ({"inject_fault": "crash:1"}, "use crash:RANK:STEP"),
    ({"inject_fault": "explode:1:1"}, "use crash:RANK:STEP"),
])
def test_invalid_config_names_the_field_and_the_fix(fields, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        RunConfig(**fields).validate()


def test_batch_sizes_strong_and_weak_scaling():
    assert RunConfig(global_batch=24).batch_sizes(3) == (24, 8)
    assert RunConfig(global_batch=24).batch_sizes(1) == (24, 24)
    assert RunConfig(scaling="weak", local_batch=5).batch_sizes(3) == (15, 5)


@pytest.mark.parametrize(("global_batch", "world_size", "suggestion"), [(25, 2, "e.g. 24"), (1, 2, "e.g. 2"), (10, 4, "e.g. 8")])
def test_batch_sizes_refuses_unequal_shards(global_batch, world_size, suggestion):
    with pytest.raises(ValueError, match=f"not divisible by world size {world_size}") as info:
        RunConfig(global_batch=global_batch).batch_sizes(world_size)
    assert suggestion in str(info.value) and "--scaling weak" in str(info.value)


# -- workloads and sharding -------------------------------------------------------------------------------
def partition_problem(shards: list[torch.Tensor], batch: torch.Tensor) -> str | None:
    """Why `shards` (of sample ids) are not a disjoint, equal partition of `batch`, or None."""
    ids = [s.tolist() for s in shards]
    if len({len(i) for i in ids}) != 1:
        return f"unequal shard sizes {[len(i) for i in ids]}"
    flat = [v for i in ids for v in i]
    if len(set(flat)) != len(flat):
        return "shards overlap"
    if sorted(flat) != sorted(batch.tolist()):
        return "shards do not cover the batch"
    return None


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 6])
def test_shard_is_distributed_sampler_order_disjoint_equal_and_complete(world_size):
    x = torch.arange(24)
    batch = (x.float().unsqueeze(1), x.clone())
    shards = [dpcompare.shard(batch, r, world_size) for r in range(world_size)]
    assert partition_problem([s[1] for s in shards], x) is None
    for rank, (xs, ys) in enumerate(shards):
        sampler = DistributedSampler(range(24), num_replicas=world_size, rank=rank, shuffle=False)
        assert ys.tolist() == list(sampler)
        assert torch.equal(xs.squeeze(1).long(), ys), "inputs and targets must be sharded alike"


def test_partition_check_catches_duplicated_and_missing_shards():
    x = torch.arange(24)
    batch = (x, x)
    duplicated = [dpcompare.shard(batch, 0, 2)[1]] * 2  # --inject-fault dupdata: everyone reads rank 0's shard
    assert partition_problem(duplicated, x) == "shards overlap"
    assert partition_problem([x[:12], x[12:23]], x) == "unequal shard sizes [12, 11]"
    assert partition_problem([x[:6], x[6:12]], x) == "shards do not cover the batch"


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("name", ["mlp", "cnn", "lm"])
def test_one_seed_builds_bitwise_identical_weights_and_data(name):
    factory = getattr(workloads, name)
    a, b, other = factory(1234), factory(1234), factory(1235)
    sa, sb, so = _state(a.model), _state(b.model), _state(other.model)
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa), "same seed, different weights"
    assert not all(torch.equal(sa[k], so[k]) for k in sa), "the seed does not reach the weights"
    for step in (0, 3):
        xa, ya = a.make_batch(step, 12)
        xb, yb = b.make_batch(step, 12)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not torch.equal(a.make_batch(0, 12)[0], a.make_batch(1, 12)[0]), "every step must get new data"


def test_mean_of_equal_shard_losses_is_the_global_loss():
    w = workloads.mlp(7)
    x, y = w.make_batch(0, 12)
    with torch.no_grad():
        whole = w.loss_fn(w.model(x), y)
        parts = [w.loss_fn(w.model(xs), ys) for xs, ys in (dpcompare.shard((x, y), r, 3) for r in range(3))]
    torch.testing.assert_close(torch.stack(parts).mean(), whole)


# -- equivalence metrics ------------------------------------------------------------------------------------
def _grads(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"0.weight": torch.randn(8, 4, generator=g, dtype=torch.float64),
            "0.bias": torch.randn(8, generator=g, dtype=torch.float64),
            "2.weight": torch.randn(3, 8, generator=g, dtype=torch.float64)}


def _as_float32(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.float().double() for k, v in grads.items()}


def test_compare_grads_passes_the_oracle_itself():
    oracle = _grads()
    params = eq.compare(oracle, oracle, _as_float32(oracle), dtype="float32", world_size=2, depth=2)[0]
    assert all(p.ok and p.rel_fro_err == 0.0 and p.max_abs_err == 0.0 and p.noise_ratio == 0.0 for p in params)


def test_compare_grads_passes_the_float32_rounding_of_the_oracle():
    oracle = _grads()
    floor = _as_float32(oracle)
    params = eq.compare(floor, oracle, floor, dtype="float32", world_size=2, depth=2)[0]
    assert [p.parameter for p in params] == list(oracle)
    assert all(p.ok for p in params)
    assert all(p.noise_ratio <= 1.0 for p in params)


def test_compare_grads_passes_one_ulp_off_the_float32_gradient():
    oracle = _grads()
    floor = _as_float32(oracle)
    one_ulp = {k: torch.nextafter(v.float(), torch.full_like(v.float(), math.inf)).double() for k, v in oracle.items()}
    assert all(not torch.equal(one_ulp[k], floor[k]) for k in oracle)
    params = eq.compare(one_ulp, oracle, floor, dtype="float32", world_size=2, depth=2)[0]
    assert all(p.ok for p in params), [(p.parameter, p.noise_ratio) for p in params]
    assert max(p.noise_ratio for p in params) < 10


def test_compare_grads_fails_a_gradient_twice_too_large():
    oracle = _grads()
    floor = _as_float32(oracle)
    doubled = {k: 2 * v for k, v in floor.items()}
    params = eq.compare(doubled, oracle, floor, dtype="float32", world_size=2, depth=2)[0]
    assert not any(p.ok for p in params)
    # ||2o - o|| / max(||o||, ||O|| / sqrt(T)): 1.0 unless a small parameter is measured against its share.
    share = float(torch.linalg.vector_norm(torch.cat([v.reshape(-1) for v in oracle.values()]))) / math.sqrt(len(oracle))
    for p in params:
        norm = float(torch.linalg.vector_norm(oracle[p.parameter]))
        assert p.rel_fro_err == pytest.approx(norm / max(norm, share), rel=1e-6)
    assert min(p.noise_ratio for p in params) > 1e4


def test_compare_reads_a_non_finite_value_across_chunks_and_a_huge_float64_one_as_finite():
    """`_sums` reads a value held below float64 as finite exactly where its squared norm is: an inf or a NaN anywhere
    in a parameter larger than one chunk makes its error +inf; a float64 value whose square overflows (1e300) is read
    element by element and stays finite. Its relative figures match their definitions, computed whole."""
    from dpcompare.verify.judgement import tolerance

    n = tolerance.CHUNK + 7
    torch.manual_seed(3)
    o = torch.randn(n, dtype=torch.float64)
    g = (o * (1 + 1e-7)).float()
    floor = (o * (1 - 1e-7)).float()
    for poison in (math.inf, math.nan):
        bad = g.clone()
        bad[n - 3] = poison  # in the second chunk
        s = tolerance._sums(bad, o, floor, floor, floor, 2.0**-24)
        assert s.finite is False, poison
    huge = o.clone()
    huge[-1] = 1e300
    s = tolerance._sums(huge, o, o, floor, floor, 2.0**-53)
    assert s.finite is True and s.max_abs == pytest.approx(1e300 - float(o[-1]), rel=1e-12)
    s = tolerance._sums(g, o, floor, floor, floor, 2.0**-24)
    d = (g.double() - o).abs()
    assert s.finite and s.go2 == pytest.approx(float(d.pow(2).sum()), rel=1e-10)
    assert s.max_abs == float(d.max())
    scale = float(o.abs().max())
    assert s.max_rel == pytest.approx(float((d / (o.abs() + 2.0**-24 * scale)).max()), rel=1e-12)
    assert s.fo2 == pytest.approx(float((floor.double() - o).pow(2).sum()), rel=1e-10)


def test_compare_grads_arithmetic_by_hand():
    # One parameter, oracle (3, 4): ||o|| = 5. Floor off by 1e-6 in one element, run off by 3e-6 in another.
    oracle = {"w": torch.tensor([3.0, 4.0], dtype=torch.float64)}
    floor = {"w": torch.tensor([3.0 + 1e-6, 4.0], dtype=torch.float64)}
    grads = {"w": torch.tensor([3.0, 4.0 + 3e-6], dtype=torch.float64)}
    (p,) = eq.compare(grads, oracle, floor, dtype="float32", world_size=2, depth=1)[0]
    assert p.max_abs_err == pytest.approx(3e-6, rel=1e-9)
    assert p.rel_fro_err == pytest.approx(3e-6 / 5, rel=1e-9)
    assert p.floor_rel_fro_err == pytest.approx(1e-6 / 5, rel=1e-9)
    # floor_p = max(2e-7, 2e-7, 1 * u) = 2e-7, plus the reduction's 2u: noise_ratio = error / (tolerance / 10)
    assert p.noise_ratio == pytest.approx((3e-6 / 5) / (2e-7 + 2 * U32), rel=1e-9)
    assert p.tolerance_rel_fro == pytest.approx(eq.TOLERANCE_FACTOR * (2e-7 + 2 * U32), rel=1e-12)
    assert p.max_rel_err == pytest.approx(3e-6 / (4.0 + U32 * 4.0), rel=1e-9)
    assert p.ok
    # The depth term takes over when the floor is below it: depth 10 -> floor_p = 10u.
    (q,) = eq.compare(grads, oracle, oracle, dtype="float32", world_size=2, depth=10)[0]
    assert q.noise_ratio == pytest.approx((3e-6 / 5) / (10 * U32 + 2 * U32), rel=1e-9)


def test_compare_grads_measures_a_zero_gradient_against_its_share_of_the_model():
    # A conv bias feeding BatchNorm has an analytically ~0 gradient: rounding noise there is not a failure.
    oracle = {"w": torch.tensor([3.0, 4.0], dtype=torch.float64), "b": torch.zeros(2, dtype=torch.float64)}
    grads = {"w": oracle["w"].clone(), "b": torch.tensor([1e-9, 0.0], dtype=torch.float64)}
    params = {p.parameter: p for p in eq.compare(grads, oracle, oracle, dtype="float32", world_size=1, depth=2)[0]}
    share = 5.0 / math.sqrt(2)
    assert params["b"].rel_fro_err == pytest.approx(1e-9 / share, rel=1e-9)
    assert params["b"].ok
    grads["b"] = torch.tensor([1e-3, 0.0], dtype=torch.float64)
    params = {p.parameter: p for p in eq.compare(grads, oracle, oracle, dtype="float32", world_size=1, depth=2)[0]}
    assert not params["b"].ok


def _noisy(grads: dict[str, torch.Tensor], rel: float, seed: int = 1) -> dict[str, torch.Tensor]:
    """`grads` plus independent noise of `rel` times each tensor's norm: a low-precision reference far from float64."""
    g = torch.Generator().manual_seed(seed)
    return {k: v + rel * float(torch.linalg.vector_norm(v)) * torch.randn(v.shape, generator=g, dtype=torch.float64)
            / math.sqrt(v.numel()) for k, v in grads.items()}


def test_against_the_run_precision_reference_a_huge_precision_floor_keeps_the_power():
    # A deep network at bf16: the run-precision reference is 100 % away from float64. The backend computes what that
    # reference computes (up to a float32 regrouping): judged against it, a doubled gradient fails, while the
    # float64-only rule (floor = the precision's distance) passes it.
    oracle = _grads()
    run = _noisy(oracle, 1.0)
    regrouped = _as_float32(run)
    backend = {k: v.float().double() for k, v in run.items()}
    params, model = eq.compare(backend, oracle, run, dtype="float32", world_size=2, depth=2, spread=regrouped)
    assert all(p.ok for p in params) and model.ok
    assert all(p.floor_rel_fro_err > 0.5 for p in params), "the precision floor is reported, not judged"
    assert model.min_detectable_rel < 1e-4 and eq.min_detectable(params, model) < 1e-4
    doubled = {k: 2 * v for k, v in backend.items()}
    params, model = eq.compare(doubled, oracle, run, dtype="float32", world_size=2, depth=2, spread=regrouped)
    assert not any(p.ok for p in params) and not model.ok
    classic, _ = eq.compare(doubled, oracle, run, dtype="float32", world_size=2, depth=2)
    assert all(p.ok for p in classic), "the float64-only rule has no power here: the flaw the run-precision rule fixes"


def test_min_detectable_rel_by_hand():
    # One parameter (3, 4), reference equal to the oracle: ||o|| = 5. Spread off by 1e-6 in one element:
    # floor_p = max(2e-7, 2e-7, depth * u) = 2e-7 at depth 1; tolerance 10 * (2e-7 + 2u); a uniform change eps moves
    # the judged error by eps, so min_detectable_rel = tolerance.
    oracle = {"w": torch.tensor([3.0, 4.0], dtype=torch.float64)}
    spread = {"w": torch.tensor([3.0 + 1e-6, 4.0], dtype=torch.float64)}
    (p,), model = eq.compare(oracle, oracle, oracle, dtype="float32", world_size=2, depth=1, spread=spread)
    assert p.judged_floor_rel_fro == pytest.approx(2e-7, rel=1e-9)
    assert p.tolerance_rel_fro == pytest.approx(10 * (2e-7 + 2 * U32), rel=1e-12)
    assert p.min_detectable_rel == pytest.approx(p.tolerance_rel_fro, rel=1e-9)
    scaled = {"w": oracle["w"] * (1 + 1.05 * p.min_detectable_rel)}
    assert not eq.compare(scaled, oracle, oracle, dtype="float32", world_size=2, depth=1, spread=spread)[0][0].ok
    scaled = {"w": oracle["w"] * (1 + 0.95 * p.min_detectable_rel)}
    assert eq.compare(scaled, oracle, oracle, dtype="float32", world_size=2, depth=1, spread=spread)[0][0].ok


def test_a_parameter_too_noisy_to_judge_is_left_out_and_counted_and_the_model_still_judges():
    oracle = _grads()
    spread = dict(oracle, **{"0.bias": oracle["0.bias"] + 0.5 * oracle["0.bias"].flip(0)})
    backend = dict(oracle, **{"0.bias": oracle["0.bias"] * 1.2})  # within its own noise: not judged alone
    params, model = eq.compare(backend, oracle, oracle, dtype="float32", world_size=2, depth=2, spread=spread)
    by = {p.parameter: p for p in params}
    assert not by["0.bias"].judged and by["0.bias"].ok and by["0.bias"].min_detectable_rel > 1.0
    cov = eq.coverage(params)
    assert (cov.parameters, cov.parameters_judged, cov.left_out) == (3, 2, ["0.bias"])
    assert cov.elements_judged == cov.elements - 8
    nan = dict(backend, **{"0.bias": torch.full((8,), math.nan, dtype=torch.float64)})
    assert not {p.parameter: p for p in eq.compare(nan, oracle, oracle, dtype="float32", world_size=2, depth=2,
                                                     spread=spread)[0]}["0.bias"].ok, "non-finite never passes"
    uniform = {k: 1.5 * v for k, v in oracle.items()}
    params, model = eq.compare(uniform, oracle, oracle, dtype="float32", world_size=2, depth=2, spread=spread)
    assert not model.ok, "the whole-model vector catches a uniform change"


def test_first_mismatch_names_the_first_disagreeing_rank_and_parameter():
    names = ["a", "b", "c"]
    same = ["1", "2", "3"]
    assert eq.first_mismatch([same, same, same], names) is None
    assert eq.first_mismatch([same], names) is None
    assert eq.first_mismatch([same, same, ["1", "2", "x"]], names) == (2, "c")
    assert eq.first_mismatch([same, ["1", "x", "x"], ["x", "2", "3"]], names) == (1, "b")


def test_tensor_digest_is_bitwise():
    t = torch.tensor([1.0, 2.0])
    assert eq.tensor_digest(t) == eq.tensor_digest(t.clone())
    assert eq.tensor_digest(t) != eq.tensor_digest(torch.nextafter(t, torch.full_like(t, 3.0)))
    assert eq.tensor_digest(torch.tensor([0.0])) != eq.tensor_digest(torch.tensor([-0.0]))


def test_verdict_summarises_checks():
    policy = eq.tolerance_policy("float32", 2, 3)
    ok = eq.ParamError("w", 0.0, 0.0, 1e-7, 1e-7, 1.0, 1e-6, True)
    assert eq.Verdict().to_dict(policy)["verdict"] == "unchecked"
    assert eq.Verdict(checks=[eq.StepCheck(0, [ok], True, True)]).to_dict(policy)["verdict"] == "equivalent"
    diverged = eq.Verdict(checks=[eq.StepCheck(0, [ok], True, True)],
                          first_divergence=eq.Divergence(0, "w", 1.0, 1e-6, 1e7, "summed"))
    assert diverged.to_dict(policy)["verdict"] == "different"
    assert eq.Verdict(checks=[eq.StepCheck(0, [ok], True, True)], replicas_identical=False).to_dict(policy)["verdict"] == "different"


# -- watchdog -------------------------------------------------------------------------------------------
def _beat(dog: Watchdog, rank: int, seq: int, step: int, phase: str, age_s: float = 0.0) -> None:
    (dog.dir / f"rank{rank}.json").write_text(json.dumps(
        {"rank": rank, "seq": seq, "step": step, "phase": phase, "wall": time.time() - age_s}))


@pytest.fixture
def dog(tmp_path, monkeypatch) -> Watchdog:
    monkeypatch.setenv("DPCOMPARE_HEARTBEAT_DIR", str(tmp_path))
    d = Watchdog(rank=0, world_size=3, job_id="torchrun-job/1", timeout_s=10)  # not started: no thread
    assert d.dir.parent == tmp_path
    return d


def test_watchdog_names_the_rank_that_is_behind(dog):
    _beat(dog, 0, 12, 2, "forward")
    _beat(dog, 1, 7, 1, "reduce", age_s=30)
    _beat(dog, 2, 12, 2, "forward")
    culprits = dog.culprits()
    assert culprits.startswith("rank(s) 1 (stuck at step 1 'reduce', silent 30 s)"), culprits
    assert "0 (" not in culprits and "2 (" not in culprits


def test_watchdog_names_ranks_it_cannot_see(dog):
    _beat(dog, 0, 12, 2, "forward")
    _beat(dog, 1, 12, 2, "forward")
    _beat(dog, 2, 12, 2, "forward", age_s=3600)  # left over from an earlier launch with the same job id
    culprits = dog.culprits()
    assert "no rank is ahead of another" in culprits
    assert "rank(s) 2 not visible" in culprits


def test_watchdog_heartbeat_stays_after_a_failure_and_goes_after_a_clean_finish(dog):
    dog.beat("forward", 0)
    heartbeat = dog.dir / "rank0.json"
    dog.stop(clean=False)
    assert heartbeat.exists(), "the ranks still running need it to name who fell behind"
    dog.stop()
    assert not heartbeat.exists() and not dog.dir.exists()


def test_watchdog_with_all_ranks_level_blames_the_collective(dog):
    for rank in range(3):
        _beat(dog, rank, 5, 1, "reduce")
    culprits = dog.culprits()
    assert culprits.startswith("no rank is ahead of another") and "not visible" not in culprits


# -- global-batch BatchNorm --------------------------------------------------------------------------------
def _bn_pair(allreduce) -> tuple[nn.BatchNorm2d, syncbn.GlobalBatchNorm]:
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(4).double()
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    return bn, syncbn.GlobalBatchNorm(copy.deepcopy(bn), allreduce)


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_global_batchnorm_with_one_replica_is_batchnorm2d():
    bn, gbn = _bn_pair(lambda t: t)
    for step in range(3):
        x = torch.randn(6, 4, 5, 5, dtype=torch.float64) * (step + 1) + step
        upstream = torch.randn(6, 4, 5, 5, dtype=torch.float64)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = bn(xa), gbn(xb)
        _close(yb, ya)
        (ya * upstream).sum().backward()
        (yb * upstream).sum().backward()
        _close(xb.grad, xa.grad)
        _close(gbn.weight.grad, bn.weight.grad)
        _close(gbn.bias.grad, bn.bias.grad)
        bn.zero_grad()
        gbn.zero_grad()
        _close(gbn.running_mean, bn.running_mean)
        _close(gbn.running_var, bn.running_var)
        assert int(gbn.num_batches_tracked) == int(bn.num_batches_tracked) == step + 1
    bn.eval()
    gbn.eval()
    x = torch.randn(2, 4, 5, 5, dtype=torch.float64)
    _close(gbn(x), bn(x))


def test_global_batchnorm_over_two_replicas_is_batchnorm_of_the_global_batch():
    """Twin: with a second (identical) replica in the all-reduce, the unbiased running variance counts
    2n samples, so it no longer equals the one-replica BatchNorm but equals BatchNorm of the global batch."""
    bn, gbn = _bn_pair(lambda t: 2 * t)
    global_bn = copy.deepcopy(bn)
    x = torch.randn(3, 4, 2, 2, dtype=torch.float64)
    y = gbn(x)
    _close(y, global_bn(torch.cat([x, x]))[:3])
    _close(gbn.running_var, global_bn.running_var)
    bn(x)
    with pytest.raises(AssertionError):
        _close(gbn.running_var, bn.running_var)


def test_convert_replaces_every_batchnorm_and_keeps_the_parameters():
    model = workloads.cnn(1).model
    params_before = [id(p) for p in model.parameters()]
    converted = syncbn.convert_global_batchnorm(model, lambda t: t)
    assert syncbn.has_batchnorm(workloads.cnn(1).model)
    assert not syncbn.has_batchnorm(converted)
    assert sum(isinstance(m, syncbn.GlobalBatchNorm) for m in converted.modules()) == 2
    assert [id(p) for p in converted.parameters()] == params_before


# -- registry -------------------------------------------------------------------------------------------
def test_registry_loads_names_and_paths():
    assert registry.load("mlp", registry.MODELS, "model") is workloads.mlp
    assert registry.load("dpcompare.run.workloads:cnn", registry.MODELS, "model") is workloads.cnn


@pytest.mark.parametrize(("spec", "error", "message"), [
    ("nope", ValueError, "unknown backend 'nope': choose one of ddp, deepspeed, dp, fsdp, horovod, reference"),
    ("no_such_package_xyz:Adapter", ValueError, "cannot import module 'no_such_package_xyz'"),
    ("dpcompare.run.workloads:NoSuchThing", ValueError, "has no attribute 'NoSuchThing'"),
    # compare's way of naming a variant, given to a run: the run's own way of asking for it
    ("deepspeed:zero2", ValueError, "for one run give --backend deepspeed --opt zero_stage=2"),
    ("deepspeed:zero9", ValueError, "deepspeed has no variant 'zero9' .its variants: zero0, zero1, zero2, zero3"),
])
def test_registry_errors_say_what_is_available(spec, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(")):
        registry.load(spec, registry.BACKENDS, "backend")


def test_registry_names_the_install_command_for_a_missing_backend():
    table = {"horovod": "no_such_horovod_xyz.torch:HorovodAdapter"}
    with pytest.raises(ImportError, match="scripts/setup.sh"):
        registry.load("horovod", table, "backend")


# -- result schema ----------------------------------------------------------------------------------------
def _valid_payload() -> dict:
    policy = eq.tolerance_policy("float32", 1, 3)
    return json_files.sanitize(json_files.base_payload(
        backend="reference", launcher="python", world_size=1, device="cpu", model="mlp", global_batch=24,
        local_batch=24, scaling="strong", steps=1, tag=None, config=RunConfig().to_dict(),
        equivalence=eq.Verdict().to_dict(policy), env=json_files.environment(), created_unix=0.0))


def test_schema_accepts_a_well_formed_result():
    payload = _valid_payload()
    validate_result(payload)
    result_writer.validate(payload)  # the product's own check agrees


@pytest.mark.parametrize("break_it", [
    pytest.param(lambda p: p["equivalence"].pop("verdict"), id="missing-verdict"),
    pytest.param(lambda p: p["equivalence"].__setitem__("verdict", "probably"), id="unknown-verdict"),
    pytest.param(lambda p: p.__setitem__("launcher", "srun"), id="unknown-launcher"),
    pytest.param(lambda p: p["equivalence"].__setitem__("first_divergence", {"step": 0}), id="divergence-without-reason"),
])
def test_schema_rejects_a_malformed_result(break_it):
    import jsonschema

    payload = _valid_payload()
    break_it(payload)
    with pytest.raises(jsonschema.ValidationError):
        validate_result(payload)
    with pytest.raises(jsonschema.ValidationError):
        result_writer.validate(payload)


# -- DDP's buffer-sync keyword -----------------------------------------------------------------------------------
def _ddp_warnings(tmp_path, kwargs: dict) -> tuple[list[str], nn.parallel.DistributedDataParallel]:
    """Construct DDP over a one-rank gloo group with `kwargs`; the FutureWarnings it raised, and the model."""
    import warnings

    import torch.distributed as dist

    tmp_path.mkdir(parents=True, exist_ok=True)
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = nn.parallel.DistributedDataParallel(nn.Linear(2, 2), **kwargs)
        return [str(w.message) for w in caught if issubclass(w.category, FutureWarning)], model
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("every_forward", [True, False])
def test_ddp_buffer_sync_uses_the_keyword_ddp_does_not_deprecate(tmp_path, every_forward) -> None:
    from dpcompare.adapters.ddp import _buffer_sync

    said, model = _ddp_warnings(tmp_path, _buffer_sync(every_forward))
    assert said == [] and model.forward_sync_buffers is every_forward
    # the twin: the deprecated keyword this replaced warns on every construction (when torch has the new one)
    if "forward_sync_buffers" in _buffer_sync(every_forward):
        said, _ = _ddp_warnings(tmp_path / "old", {"broadcast_buffers": every_forward})
        assert any("`broadcast_buffers` is deprecated" in s for s in said)


# -- --collectives is read before the run ----------------------------------------------------------------------
@pytest.mark.parametrize(("content", "message"), [
    (None, "cannot be read"), ("not json", "is not JSON"), ('{"sizes": []}', "no 'entries' list"),
    ('{"entries": []}', None),  # a bench-collectives result passes
])
def test_collectives_file_is_checked_before_the_run(tmp_path, content, message) -> None:
    path = tmp_path / "collectives.json"
    if content is not None:
        path.write_text(content)
    cfg = RunConfig(collectives=str(path))
    if message is None:
        cfg.check_inputs()
    else:
        with pytest.raises(ValueError, match=message):
            cfg.check_inputs()


# -- child processes find the environment's tools first ----------------------------------------------------------
def test_child_env_puts_the_virtual_environments_bin_first_once(monkeypatch) -> None:
    import os
    import sys
    from pathlib import Path

    from dpcompare.run import launchers

    bin_dir = str(Path(sys.executable).parent)
    monkeypatch.setenv("PATH", os.pathsep.join(["/usr/bin", bin_dir, "/bin"]))
    monkeypatch.setattr(sys, "prefix", "/some/venv")
    monkeypatch.setattr(sys, "base_prefix", "/usr")
    assert launchers.child_env()["PATH"].split(os.pathsep) == [bin_dir, "/usr/bin", "/bin"]
    # outside a virtual environment PATH is left as it is (a system Python's bin must not shadow /usr/local/bin)
    monkeypatch.setattr(sys, "prefix", "/usr")
    assert launchers.child_env()["PATH"] == os.pathsep.join(["/usr/bin", bin_dir, "/bin"])
    # an explicit PATH override still wins
    assert launchers.child_env({"PATH": "/x"})["PATH"] == "/x"


# -- the trajectory check: a faithful float32 run passes, one that drifts fails --------------------------------
def _trajectory_and_a_run(lr_factor: float = 1.0, nudge: float = 0.0):
    """Two steps of the mlp beside the reference trajectory; the 'run' is a float32 single process stepping with
    lr x lr_factor, and `nudge` added to one weight after the last step (a fault between checks)."""
    from dpcompare.verify.oracle.gradient_oracle import global_pieces
    from dpcompare.verify.trajectory.reference_trajectory import Trajectory

    w = workloads.mlp(7)
    factory = lambda params, **kw: torch.optim.SGD(params, lr=kw.get("lr", 0.05), momentum=0.9)  # noqa: E731
    trajectory = Trajectory(w.model, w.loss_fn, factory, "float32", torch.device("cpu"), depth=3)
    run = copy.deepcopy(w.model).float()
    optimizer = torch.optim.SGD(run.parameters(), lr=0.05 * lr_factor, momentum=0.9)
    judged = []
    for step in range(2):
        batch = w.make_batch(step, 24)
        trajectory.step(global_pieces(batch))
        optimizer.zero_grad()
        w.loss_fn(run(batch[0]), batch[1]).backward()
        optimizer.step()
        if step == 1 and nudge:
            with torch.no_grad():
                next(run.parameters()).view(-1)[0] += nudge
        judged.append(trajectory.judge(step, run, world_size=1))
    return judged


def test_trajectory_passes_a_faithful_float32_run():
    for entry in _trajectory_and_a_run():
        assert entry["ok"] is True and entry["noise_ratio"] < 10, entry


@pytest.mark.parametrize(("lr_factor", "nudge"), [(1.001, 0.0), (1.0, 1e-3)], ids=["lr-off-by-0.1%", "weight-nudged"])
def test_trajectory_fails_a_run_that_drifts(lr_factor, nudge):
    """The negative twin: a learning rate 0.1 % off, or one weight moved by 1e-3 between checks, is outside the
    trajectory's tolerance at the step it happens, and the worst parameter is named."""
    last = _trajectory_and_a_run(lr_factor, nudge)[-1]
    assert last["ok"] is False and last["rel_param_distance"] > last["tolerance"], last
    assert last["worst_parameter"] == "0.weight" or nudge == 0.0, last
