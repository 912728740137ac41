"""Every backend, under its native launcher, computes the gradient of the global-batch loss.

Checks, for each backend x world size {1, 2, 3} x built-in model {mlp, cnn, lm, mlp-dropout, mlp-unused}
(reference and dp only at world size 1: they are single-process backends), the JSON result that rank 0
writes against the float64 oracle that dpcompare recomputes from the run's own parameters: the verdict is
`equivalent`, no divergence is named, every rank started from and ended with the same weights, and the
worst reduced-gradient error, the worst update error (against a float64 optimizer step) and the worst
trajectory drift (against a float64 single process) all stay below 10x their noise floors (the ratios are
printed at the end of the session). mlp-dropout draws dropout masks: the check replays each rank's
generator; mlp-unused has a head forward never calls and a frozen layer. The result must also say which launcher and world size actually ran, so a run that silently
fell back to one process (`hvd.init()` without a launcher) cannot pass as a distributed one.

The negative twins (the same checks coming out `different` on planted faults) are in test_negative.py.
The cnn runs use --sync-bn at world size > 1: without it BatchNorm normalises per shard, which
test_negative.py shows is (rightly) `different`.
"""

from __future__ import annotations

import pytest

MODELS = ("mlp", "cnn", "lm", "mlp-dropout", "mlp-unused")
STEPS = ["--steps", "2"]


def _cases() -> list:
    cases = []
    for model in MODELS:
        cases.append(("reference", 1, model, "python"))
        cases.append(("dp", 1, model, "python"))
        for ws in (1, 2, 3):
            cases.append(("ddp", ws, model, "torchrun"))
            # horovodrun's gloo controller at 1-2 ranks; Open MPI's mpirun (Horovod's MPI controller) at 3.
            cases.append(("horovod", ws, model, "horovodrun" if ws < 3 else "mpirun"))
            cases.append(("deepspeed", ws, model, "torchrun"))
    return [pytest.param(*c, id=f"{c[0]}-ws{c[1]}-{c[2]}-{c[3]}") for c in cases]


def run_args(model: str, world_size: int) -> list[str]:
    return STEPS + (["--sync-bn"] if model == "cnn" and world_size > 1 else [])


def assert_equivalent(proc, result: dict | None, *, backend: str, world_size: int, model: str, launcher: str) -> None:
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
    assert e["checked_steps"] == [0, 1]
    assert all(s["grads_identical_across_ranks"] for s in e["per_step"]), "ranks hold different reduced gradients"
    assert e["noise_ratio"] is not None and e["noise_ratio"] < 10, f"noise ratio {e['noise_ratio']}"
    for check in ("gradient", "update", "trajectory"):
        c = e["checks"][check]
        assert c["status"] == "pass" and c["noise_ratio"] is not None and c["noise_ratio"] < 10, (check, c)
    assert abs(e["checks"]["update"]["norm_ratio"] - 1) < 1e-3, e["checks"]["update"]
    assert len(e["drift"]) == 2 and all(d["ok"] for d in e["drift"]), e["drift"]
    summary = f"{backend} ws={world_size} {model} [{launcher}]: equivalent"
    assert summary in proc.stdout, proc.stdout[-2000:]


@pytest.mark.multiproc
@pytest.mark.timeout(330)
@pytest.mark.parametrize(("backend", "world_size", "model", "launcher"), _cases(), indirect=["backend"])
def test_backend_is_equivalent_to_the_float64_oracle(backend, world_size, model, launcher, launch, record_noise_ratio):
    proc, result = launch(backend, world_size, model, run_args(model, world_size), launcher)
    assert_equivalent(proc, result, backend=backend, world_size=world_size, model=model, launcher=launcher)
    record_noise_ratio(result)
    if model == "mlp-dropout":
        assert result["equivalence"]["stochastic"] == {"stochastic": True, "modules": ["2", "5"], "replayed": True,
                                                       "reason": None}
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
    """`deepspeed --num_gpus 2 --module dpcompare`: the launcher appends --local_rank and sets CROSS_RANK."""
    proc, result = launch(backend, 2, "mlp", STEPS, "deepspeed")
    assert_equivalent(proc, result, backend=backend, world_size=2, model="mlp", launcher="deepspeed")
    record_noise_ratio(result)


@pytest.mark.multiproc
@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["ddp"], indirect=True)
def test_ddp_under_mpirun(backend, launch, record_noise_ratio):
    """`mpirun -np 2 python -m dpcompare --backend ddp`: rank 0's address and port travel through mpi4py."""
    proc, result = launch(backend, 2, "mlp", STEPS, "mpirun")
    assert_equivalent(proc, result, backend=backend, world_size=2, model="mlp", launcher="mpirun")
    record_noise_ratio(result)
