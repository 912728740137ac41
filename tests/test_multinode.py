"""Multi-node launches, exercised on one host: two launcher agents (torchrun --nnodes=2, started twice), Horovod
with two "hosts" (localhost and 127.0.0.1), mpirun with a two-line hostfile, and the Slurm scripts under a
stand-in `srun`.

Each must reach `equivalent` at world size 2 with the result written exactly once, although every "node"
has its own local rank 0 (local_rank != rank on the second node). A rank that hangs on one node is named
by the other through the shared heartbeat directory (DPCOMPARE_HEARTBEAT_DIR), within the --timeout-s bound.
The Slurm script also runs as written, 2 nodes x 8 ranks with the global batch it picks for 16 ranks (slow tier).

The two-host horovodrun launch and the mpirun hostfile launch are the equivalence matrix's horovod and
ddp-under-mpirun runs at world size 2 (same checks: assert_equivalent); the Slurm script's two torchrun
agents are the two-agent ddp launch.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import child_env, finished, validate_result
from test_equivalence_matrix import assert_equivalent
from dpcompare.run import launchers

MODEL_ARGS = ["--model", "mlp", "--steps", "2", "--measure-steps", "0"]
AGENT_TIMEOUT_S = 240


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The environment a user's shell would give the launcher: no launcher variables from the process running
    the tests (conftest.child_env), the virtual environment first on PATH, the test's own heartbeat directory."""
    return {**child_env(tmp_path), **extra}


def _only_result(out: Path) -> dict:
    files = sorted(out.glob("*.json"))
    assert len(files) == 1, f"expected exactly one result, found {[f.name for f in files]}"
    payload = json.loads(files[0].read_text())
    validate_result(payload)
    return payload


def _two_torchrun_agents(tmp_path: Path, backend: str, extra: list[str], timeout_s: float = AGENT_TIMEOUT_S):
    """Start the same torchrun command twice, as two nodes would, with a c10d rendezvous on 127.0.0.1."""
    port = launchers.free_port()
    out = tmp_path / "out"
    cmd = [launchers.launcher_bin("torchrun"), "--nnodes=2", "--nproc_per_node=1", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=dpcompare-test-{port}", "-m", "dpcompare", "run",
           "--backend", backend, *MODEL_ARGS, "--out", str(out), *extra]
    cwd = tmp_path / "cwd"
    cwd.mkdir(exist_ok=True)
    with ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(launchers.run_process, cmd, timeout_s=timeout_s, capture=True, env=_env(tmp_path), cwd=cwd)
                for _ in range(2)]
        done = [r.result() for r in runs]
    return done, out


def _assert_equivalent(result: dict, backend: str, launcher: str) -> None:
    assert (result["backend"], result["world_size"], result["launcher"]) == (backend, 2, launcher)
    e = result["equivalence"]
    assert e["verdict"] == "equivalent", e["notes"]
    assert e["replicas_identical"] is True and e["initial_weights_identical"] is True


@pytest.mark.multiproc
@pytest.mark.deep
@pytest.mark.timeout(AGENT_TIMEOUT_S + 60)
@pytest.mark.parametrize("backend", ["deepspeed"], indirect=True)
def test_two_torchrun_agents_on_one_host(tmp_path: Path, backend: str) -> None:
    done, out = _two_torchrun_agents(tmp_path, backend, [])
    for d in done:
        assert not d.timed_out and d.returncode == 0, d.stdout[-3000:] + d.stderr[-3000:]
    _assert_equivalent(_only_result(out), backend, "torchrun")
    # one agent's rank printed the summary line; the other agent's rank (local rank 0, rank 1) wrote nothing
    assert sum("ws=2" in d.stdout for d in done) == 1


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.timeout(AGENT_TIMEOUT_S + 60)
def test_a_hang_on_the_other_node_is_named_within_the_timeout(tmp_path: Path) -> None:
    timeout_s = 20
    done, out = _two_torchrun_agents(tmp_path, "ddp", ["--steps", "3", "--inject-fault", "hang:1:1",
                                                       "--timeout-s", str(timeout_s)])
    for d in done:
        assert not d.timed_out and d.returncode != 0
    assert not list(out.glob("*.json")), "a failed run wrote a result"
    said = "\n".join(d.stderr for d in done)
    assert "culprit: rank(s) 1 (stuck at step 1" in said or "rank 1 " in said, said[-4000:]
    slowest = max(d.wall_s for d in done)
    assert slowest < timeout_s + 45, f"the launch took {slowest:.0f} s for a {timeout_s} s timeout"


@pytest.mark.slow  # horovodrun's default-tier cell: horovod-ws2-mlp-unused in test_equivalence_matrix.py
@pytest.mark.multiproc
@pytest.mark.timeout(AGENT_TIMEOUT_S + 60)
@pytest.mark.parametrize("backend", ["horovod"], indirect=True)
def test_horovodrun_with_two_hosts(tmp_path: Path, backend: str, record_noise_ratio) -> None:
    out = tmp_path / "out"
    cmd = [launchers.launcher_bin("horovodrun"), "--gloo", "--network-interface", "lo", "-np", "2",
           "-H", "localhost:1,127.0.0.1:1", sys.executable, "-m", "dpcompare", "run", "--backend", backend,
           *MODEL_ARGS, "--out", str(out)]
    d = finished(launchers.run_process(cmd, timeout_s=AGENT_TIMEOUT_S, capture=True, env=_env(tmp_path), cwd=tmp_path))
    assert d.returncode == 0, d.output[-6000:]
    result = _only_result(out)
    assert_equivalent(d, result, backend=backend, world_size=2, model="mlp", launcher="horovodrun")
    record_noise_ratio(result)


@pytest.mark.multiproc
@pytest.mark.timeout(AGENT_TIMEOUT_S + 60)
@pytest.mark.parametrize("backend", ["ddp"], indirect=True)
def test_mpirun_with_a_two_line_hostfile(tmp_path: Path, backend: str, record_noise_ratio) -> None:
    if shutil.which("mpirun") is None:
        pytest.skip("no mpirun: bash scripts/setup.sh installs Open MPI")
    # Open MPI resolves both names to this one host and refuses two slot counts for it ("multiple definitions of
    # the slot count"); one line per slot is its form for that, so the hostfile path is exercised with one
    # node of two slots. Two real nodes need a second host.
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost\n127.0.0.1\n")
    out = tmp_path / "out"
    cmd = ["mpirun", "--allow-run-as-root", "--hostfile", str(hostfile), "-np", "2", "--mca", "btl_tcp_if_include", "lo",
           "--mca", "oob_tcp_if_include", "lo", sys.executable, "-m", "dpcompare", "run", "--backend",
           backend, *MODEL_ARGS, "--out", str(out)]
    d = finished(launchers.run_process(cmd, timeout_s=AGENT_TIMEOUT_S, capture=True, env=_env(tmp_path), cwd=tmp_path))
    assert d.returncode == 0, d.output[-6000:]
    result = _only_result(out)
    assert_equivalent(d, result, backend=backend, world_size=2, model="mlp", launcher="mpirun")
    record_noise_ratio(result)


# -- the Slurm scripts, under a stand-in srun ----------------------------------------------------------------
STAND_IN_SRUN = """#!/usr/bin/env bash
# Runs the command once per node of SLURM_NNODES, concurrently, as srun would (one task per node).
set -u
pids=()
for ((n = 0; n < SLURM_NNODES; n++)); do
  SLURM_NODEID=$n SLURM_PROCID=$n SLURM_LOCALID=0 "$@" &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit $rc
"""
STAND_IN_SCONTROL = """#!/usr/bin/env bash
# `scontrol show hostnames LIST`: one host name per line.
echo 127.0.0.1
echo 127.0.0.1
"""


def _run_slurm_script(tmp_path: Path, name: str, replacements: dict[str, str], timeout_s: float) -> dict:
    """Run experiments/slurm/NAME under the stand-in srun and scontrol (2 "nodes" on this host), with only the
    given text replaced and the rendezvous port made free; return its one result."""
    repo = Path(__file__).resolve().parents[1]
    if not (repo / ".venv" / "bin" / "torchrun").exists():
        pytest.skip("the Slurm scripts call .venv/bin/torchrun: bash scripts/setup.sh makes it")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool, text in (("srun", STAND_IN_SRUN), ("scontrol", STAND_IN_SCONTROL)):
        (bin_dir / tool).write_text(text)
        (bin_dir / tool).chmod(stat.S_IRWXU)
    script = (repo / "experiments/slurm" / name).read_text()
    for old, new in {**replacements, ":29500": f":{launchers.free_port()}"}.items():
        assert old in script, f"{name} no longer contains {old!r}"
        script = script.replace(old, new)
    run_dir = tmp_path / "submit"
    run_dir.mkdir()
    (run_dir / ".venv").symlink_to(repo / ".venv")
    (run_dir / "job.sbatch").write_text(script)
    env = _env(tmp_path, PATH=f"{bin_dir}{os.pathsep}{launchers.child_env()['PATH']}", SLURM_SUBMIT_DIR=str(run_dir),
               SLURM_JOB_NODELIST="node[1-2]", SLURM_JOB_ID="4242", SLURM_NNODES="2")
    d = launchers.run_process(["bash", str(run_dir / "job.sbatch")], timeout_s=timeout_s, capture=True, env=env,
                              cwd=run_dir)
    assert not d.timed_out and d.returncode == 0, d.stdout[-3000:] + d.stderr[-3000:]
    return _only_result(run_dir / "results" / "slurm-4242")


@pytest.mark.slow  # the default tier keeps this capability in a sibling test
@pytest.mark.multiproc
@pytest.mark.timeout(AGENT_TIMEOUT_S + 60)
def test_the_ddp_slurm_script_runs_under_a_stand_in_srun(tmp_path: Path) -> None:
    """The script's own lines with one rank per node and a small model: its launch line is what is under test."""
    result = _run_slurm_script(tmp_path, "ddp.sbatch", {
        "--model lm --measure-steps 50": "--model mlp --steps 2 --measure-steps 0 --device cpu",
        "${SLURM_GPUS_PER_NODE:-8}": "1"}, AGENT_TIMEOUT_S)
    _assert_equivalent(result, "ddp", "torchrun")


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.timeout(AGENT_TIMEOUT_S + 60)
def test_the_fsdp_slurm_script_runs_under_a_stand_in_srun(tmp_path: Path) -> None:
    """FSDP2 runs under Slurm as ddp does: the script's launch line, one rank per node, a small model."""
    result = _run_slurm_script(tmp_path, "fsdp.sbatch", {
        "--model lm --optimizer adamw --measure-steps 50": "--model mlp --optimizer adamw --steps 2 --measure-steps 0 "
                                                          "--device cpu",
        "${SLURM_GPUS_PER_NODE:-8}": "1"}, AGENT_TIMEOUT_S)
    _assert_equivalent(result, "fsdp", "torchrun")


@pytest.mark.multiproc
@pytest.mark.deep
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name, backend", [("ddp.sbatch", "ddp"), ("deepspeed.sbatch", "deepspeed")])
def test_the_slurm_scripts_run_as_written_at_2_nodes_of_8(tmp_path: Path, name: str, backend: str) -> None:
    """2 nodes x 8 ranks, the script's model and measurement unchanged (on CPU here: no GPUs): the run picks a
    global batch 16 ranks divide, is checked, and measures its costs."""
    result = _run_slurm_script(tmp_path, name, {}, 840)
    assert (result["backend"], result["world_size"], result["launcher"], result["model"]) == (backend, 16, "torchrun", "lm")
    assert (result["global_batch"], result["local_batch"]) == (32, 2)
    e = result["equivalence"]
    assert e["verdict"] == "equivalent" and e["replicas_identical"] is True, e["first_divergence"]
    assert result["metrics"]["measured_steps"] == 50 and result["metrics"]["step_ms_p50"] > 0
