"""Every backend, under its native launcher, computes the gradient of the global-batch loss.

Checks, for each backend x world size {1, 2, 3} x built-in model {mlp, cnn, lm, mlp-dropout, mlp-unused}
(reference and dp only at world size 1: they are single-process backends; the multi-process ones at world size 1 on
the mlp only, where their launch at one rank is what is new), the JSON result that rank 0
writes against the float64 oracle that dpcompare recomputes from the run's own parameters: the verdict is
`equivalent`, no divergence is named, every rank started from and ended with the same weights, and the
worst reduced-gradient error, the worst update error (against a float64 optimizer step) and the worst
trajectory drift (against a float64 single process) all stay below 10x their noise floors (the ratios are
printed at the end of the session). mlp-dropout draws dropout masks: the check replays each rank's
generator; mlp-unused has a head forward never calls and a frozen layer. The result must also say which launcher and world size actually ran, so a run that silently
fell back to one process (`hvd.init()` without a launcher) cannot pass as a distributed one. At 16 ranks, a
run given no --global-batch picks one its world size divides and comes out `equivalent`.

Tiers: the default tier runs Horovod's cell here (DEFAULT_CASES); ddp, deepspeed and the launchers run once in
other files of the default tier (test_compare.py, DeepSpeed under its own launcher below); the `slow` tier runs
the rest of the matrix and 16 ranks. horovod at world size 2 on the mlp is the two-host horovodrun
launch and ddp under mpirun the hostfile launch of test_multinode.py, which check it with assert_equivalent.

The negative twins (the same checks coming out `different` on planted faults) are in test_negative.py.
The cnn runs use --sync-bn at world size > 1 (one computation with the global batch); without it each
replica normalises its own shard, judged as that per-replica computation in test_semantics.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

MODELS = ("mlp", "cnn", "lm", "mlp-dropout", "mlp-unused")
STEPS = ["--steps", "2"]


# Every backend, launcher and model once in the default tier, with the default tier's other runs (the rest of the
# matrix is `slow`): reference and dp at one rank run in compare end to end (test_compare.py), the cnn under ddp at two
# ranks in test_semantics.py.
DEFAULT_CASES = {"horovod-ws2-mlp-unused-horovodrun"}  # ddp at two ranks: test_compare.py's ddp/2
# deepspeed-ws2-mlp-dropout-torchrun and horovod-ws3-lm-mpirun are slow: deepspeed runs in the default tier under
# its own launcher (test_deepspeed_under_its_own_launcher), and mpirun under test_multinode.py's hostfile launch.
# Launched by test_multinode.py in a multi-host shape, with the same checks (assert_equivalent).
ELSEWHERE = {"horovod-ws2-mlp-horovodrun"}


def _cases() -> list:
    cases = []
    for model in MODELS:
        cases.append(("reference", 1, model, "python"))
        cases.append(("dp", 1, model, "python"))
        # One rank reduces nothing: its launch once, on the mlp. Three ranks (an odd count, and Open MPI's mpirun for
        # Horovod) on the models whose arithmetic differs; dropout masks and unused parameters are per-rank
        # matters that two ranks show.
        for ws in (1, 2, 3) if model == "mlp" else (2, 3) if model in ("cnn", "lm") else (2,):
            cases.append(("ddp", ws, model, "torchrun"))
            # horovodrun's gloo controller at 1-2 ranks; Open MPI's mpirun (Horovod's MPI controller) at 3.
            cases.append(("horovod", ws, model, "horovodrun" if ws < 3 else "mpirun"))
            cases.append(("deepspeed", ws, model, "torchrun"))
    params = []
    for c in cases:
        case_id = f"{c[0]}-ws{c[1]}-{c[2]}-{c[3]}"
        if case_id not in ELSEWHERE:
            # dp on CPU is a pass-through (one device): beyond the mlp its cells repeat reference's, in the deep tier
            # ddp and deepspeed at three ranks repeat their two-rank cells (horovod's three, under mpirun, stay slow)
            tier = (() if case_id in DEFAULT_CASES else
                    pytest.mark.deep if (c[0] == "dp" and c[2] != "mlp") or (c[0] in ("ddp", "deepspeed") and c[1] == 3)
                    else pytest.mark.slow)
            params.append(pytest.param(*c, id=case_id, marks=tier))
    return params


def run_args(model: str, world_size: int) -> list[str]:
    return STEPS + (["--sync-bn"] if model == "cnn" and world_size > 1 else [])


def assert_equivalent(proc, result: dict | None, *, backend: str, world_size: int, model: str, launcher: str,
                      steps: int = 2) -> None:
    assert proc.returncode == 0, proc.output[-6000:]
    assert result is not None
    assert (result["backend"], result["world_size"], result["model"], result["launcher"]) == (
        backend, world_size, model, launcher), "the result does not describe the run that was started"
    e = result["equivalence"]
    detail = f"{e['first_divergence']} notes={e['notes']}"
    assert e["verdict"] == "equivalent", detail
    assert e["first_divergence"] is None, detail
    assert e["replicas_identical"] is True
    assert e["initial_weights_identical"] is True
    assert e["checked_steps"] == list(range(steps))
    assert all(s["grads_identical_across_ranks"] for s in e["per_step"]), "ranks hold different reduced gradients"
    assert e["noise_ratio"] is not None and e["noise_ratio"] < 10, f"noise ratio {e['noise_ratio']}"
    for check in ("gradient", "update", "trajectory"):
        c = e["checks"][check]
        assert c["status"] == "pass" and c["noise_ratio"] is not None and c["noise_ratio"] < 10, (check, c)
    assert abs(e["checks"]["update"]["norm_ratio"] - 1) < 1e-3, e["checks"]["update"]
    assert len(e["drift"]) == steps and all(d["ok"] for d in e["drift"]), e["drift"]
    named = backend + (f":{result['variant']}" if result.get("variant") else "")  # a variant's line names it
    summary = f"{named} ws={world_size} {model} [{launcher}]: equivalent"
    assert summary in proc.stdout, proc.stdout[-2000:]


@pytest.mark.multiproc
@pytest.mark.timeout(330)
@pytest.mark.parametrize(("backend", "world_size", "model", "launcher"), _cases(), indirect=["backend"])
def test_backend_is_equivalent_to_the_float64_oracle(backend, world_size, model, launcher, shared_launch,
                                                     record_noise_ratio):
    proc, result = shared_launch(backend, world_size, model, run_args(model, world_size), launcher)
    assert_equivalent(proc, result, backend=backend, world_size=world_size, model=model, launcher=launcher)
    record_noise_ratio(result)
    if model == "mlp-dropout":
        probe = result["equivalence"]["stochastic"]
        assert {k: probe[k] for k in ("stochastic", "modules", "captured", "reason")} == {
            "stochastic": True, "modules": ["2", "5"], "captured": True, "reason": None}, probe
        # Each rank's masks: its local batch x 64 features, in two dropout modules, packed to bits.
        assert probe["capture_bytes_per_step"] == 2 * ((result["local_batch"] * 64 + 7) // 8), probe
    if model == "cnn" and world_size > 1:
        # --sync-bn: one computation with the global batch, whose statistics every rank holds.
        e = result["equivalence"]
        assert e["batchnorm"] is None and not [n for n in e["notes"] if n["code"] in ("per_replica_batchnorm",
                                                                                     "buffers_per_rank")], e["notes"]
        buffers = {b["name"]: b for b in e["buffers"]}
        assert buffers["1.running_mean"]["ranks_agree"] and buffers["1.running_mean"]["nearest"] == ["global_batch"]
    if model == "mlp-unused":
        p = result["equivalence"]["parameters"]
        assert p["unused"] == ["aux_head.weight", "aux_head.bias"] and p["frozen"] == ["embed.weight", "embed.bias"]
        assert set(p["unused_grad"].values()) <= {"none", "zero"}, p
    if backend == "dp" and result["device"] == "cpu":
        # On CPU DataParallel is a pass-through: the result must say so rather than claim a speed-up.
        assert any(n["code"] == "no_parallelism" and "no parallelism on CPU" in n["text"]
                   for n in result["equivalence"]["notes"])


@pytest.mark.multiproc
@pytest.mark.timeout(330)
@pytest.mark.parametrize("backend", ["deepspeed"], indirect=True)
def test_deepspeed_under_its_own_launcher(backend, launch, record_noise_ratio):
    """`deepspeed --num_gpus 2 --module dpcompare`: the launcher appends --local_rank and sets CROSS_RANK. Its CPU
    shared-memory all-reduce creates a 66 MB /dev/shm segment per rank and never removes it; the adapter's teardown
    does (before_exit), or a test session fills /dev/shm and memory (the kernel's OOM killer ends a later run). A
    segment is named deepspeed_allreduce_buffer_UID_ADDR_PORT_RANK: this run's are those of its --master_port (another
    test or run on the host, under pytest -n 2, makes its own)."""
    def segments() -> set[str]:
        return {p.name for p in Path("/dev/shm").glob("deepspeed_allreduce_buffer_*")}

    before = segments()
    proc, result = launch(backend, 2, "mlp", STEPS, "deepspeed")
    assert_equivalent(proc, result, backend=backend, world_size=2, model="mlp", launcher="deepspeed")
    record_noise_ratio(result)
    port = proc.args[proc.args.index("--master_port") + 1]
    left = sorted(s for s in segments() - before if f"_127.0.0.1_{port}_" in s)
    assert left == [], left


@pytest.mark.multiproc
@pytest.mark.deep
@pytest.mark.timeout(600)
def test_sixteen_ranks_pick_a_global_batch_they_divide(launch, record_noise_ratio):
    """`torchrun --nproc_per_node=16 -m dpcompare --backend ddp --model mlp --steps 1`, as written: with no
    --global-batch the run takes 32 (the smallest multiple of 16 that is at least 24), says so, and is checked."""
    proc, result = launch("ddp", 16, "mlp", ["--steps", "1"], "torchrun", timeout_s=540)
    assert proc.returncode == 0, proc.output[-6000:]
    assert (result["world_size"], result["global_batch"], result["local_batch"]) == (16, 32, 2)
    assert result["config"]["global_batch"] is None
    e = result["equivalence"]
    assert e["verdict"] == "equivalent" and e["replicas_identical"] is True, e["first_divergence"]
    assert e["noise_ratio"] < 10
    assert result["metrics"]["step_ms_p50"] is not None, "a launcher run measures its costs by default"
    assert "global batch 32 chosen for 16 rank(s)" in proc.stdout, proc.stdout[-2000:]
    record_noise_ratio(result)
