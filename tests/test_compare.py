"""`python -m dpcompare compare` end to end, and its planning against what the adapters declare.

A real compare run (reference, dp, ddp at world sizes 1 and 2, with the measurement phase, the
microbenchmark and the report) must produce verdicts, the gradient matrix, costs with scaling
efficiency, and every file it promises; `--sweep` must keep the verdict `equivalent` under bucket size,
gradient accumulation and fp16 compression and list the knobs a backend does not have. Planning must
show an uninstalled backend as unavailable with its install command while the others still run, start each
backend under the launcher its adapter declares, and refuse bad run flags with the run's own message.

Without a launcher, from synthetic results (valid against the published schema) and gradient dumps: the
verdict table shows `unverifiable` in yellow with its reason, the update and trajectory figures, and the
first divergence with the check that found it, within 160 columns; the gradient matrix marks a cell
between two runs whose forward draws random numbers at different world sizes as n/a with the reason,
while runs at one world size, and deterministic runs at any, keep their numbers; unused parameters get
one line per way the backends left their gradients; a result written before these checks still renders.
Scaling efficiency is measured against the world-size-1 run whose result declares `scaling_baseline`, and
notes are read by their code, never by their sentence.

Named backend variants and presets, planned without a launcher: `--backends deepspeed:zero2` runs deepspeed with the
`--opt` values its adapter declares for zero2, labelled and filed apart from deepspeed itself; an unknown variant is
one line naming the backend's variants; a user's `package.module:Class` is still a backend, not a variant; `--suite
sharding` plans ddp, ZeRO 0-3 and fsdp under AdamW, flags given beside it win, and a backend it names that this
dpcompare lacks is listed unavailable. End to end (slow), the suite is equivalent everywhere and each stage shards more.

Mixed precision, planned without a launcher: `--amp` reaches every run and adds deepspeed's engine recipe at
each world size (fp16 without CUDA lists it as skipped, with the reason); the fp16 runs at one world size must
skip the same steps, and a run that skipped others is named with its steps.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from conftest import SYNTHETIC_TOLERANCE, UNVERIFIABLE_REASON, checked_equivalence, validate_result
from dpcompare.commands import compare
from dpcompare.commands.compare import compare_output as render, entries, matrix, plan
from dpcompare.commands.compare import spec as compare_spec
from dpcompare.commands.compare.spec import CompareSpec
from dpcompare.commands.compare.compare_json import run_entry
from dpcompare.result_view import RunResult
from dpcompare.run import launchers, registry
from dpcompare.run.config import RunConfig

REPO = Path(__file__).resolve().parents[1]


def _run(args: list[str], tmp_path: Path, timeout: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "dpcompare", "compare", "--out", str(tmp_path), *args],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path)


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_compare_produces_verdicts_matrix_costs_and_report(tmp_path):
    # World size 2 only: the one-process backends run at 1 whatever the world sizes, and reference/1 is the baseline.
    proc = _run(["--backends", "reference,dp,ddp", "--world-sizes", "2", "--steps", "2", "--measure-steps", "5",
                 "--warmup-steps", "1"], tmp_path, 540)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir() and not p.is_symlink()]
    assert (tmp_path / "latest").resolve() == run_dir.resolve()  # what README's `project results/latest` reads
    summary = json.loads((run_dir / "compare.json").read_text())
    labels = [r["label"] for r in summary["runs"]]
    assert labels == ["reference/1", "dp/1", "ddp/2"]
    assert all(r["verdict"] == "equivalent" for r in summary["runs"])
    # The matrix: every pair at step 0; runs from identical weights at ws 1 are bitwise equal.
    step0 = summary["matrix"]["per_step"]["0"]
    assert step0["reference/1"]["rel_err"]["dp/1"] == 0.0
    assert 0 < step0["ddp/2"]["rel_err"]["oracle"] < 1e-5
    # Scaling efficiency against the reference measured in the same invocation.
    eff = {row["label"]: row["efficiency"] for row in summary["scaling"]}
    assert eff["reference/1"] == pytest.approx(1.0)
    assert eff["ddp/2"] is not None and 0 < eff["ddp/2"] < 2
    # The microbenchmark ran and ddp/2 quotes its busbw at its own message size.
    assert summary["collectives"] and Path(summary["collectives"]).exists()
    ddp2 = json.loads(Path(next(r["result_path"] for r in summary["runs"] if r["label"] == "ddp/2")).read_text())
    assert ddp2["metrics"]["microbench_busbw_gbps"] and ddp2["metrics"]["comm_exposed_ms"] is not None
    assert 0 < ddp2["metrics"]["mfu"] < 1 and "MFU" in proc.stdout  # against the measured matmul peak
    for name in ("report.md", "throughput_vs_world_size.png", "step_breakdown.png", "busbw_vs_message_size.png",
                 "grad_error_heatmap.png"):
        assert (run_dir / name).stat().st_size > 1000, name
    for word in ("is it the same computation?", "gradient matrix", "what does it cost?"):
        assert word in proc.stdout
    # Every launch's fence is closed once compare stopped waiting for it: nothing late lands in run_dir.
    assert sorted(p.name for p in (run_dir / "logs").glob("*.closed")) == [
        "ddp-ws2.closed", "dp-ws1.closed", "reference-ws1.closed"]


@pytest.mark.multiproc
@pytest.mark.deep  # ~100 s end to end; the sweep's plan, batch and notes are tested in-process in the default tier
@pytest.mark.timeout(600)
def test_sweep_stays_equivalent_and_names_what_does_not_apply(tmp_path):
    # What does not apply is decided by the plan, before anything runs: a backend with no buckets skips that knob.
    planned = plan.plan(_ns(backends="ddp,deepspeed", world_sizes="2", collectives="none", sweep=True,
                            sweep_bucket_mb="0.01", sweep_accum="2", sweep_compression="fp16"), tmp_path / "plan")
    assert any(s["backend"] == "deepspeed" and s["knob"].startswith("bucket_mb") for s in planned.sweep_skipped)
    assert not any(s["backend"] == "ddp" for s in planned.sweep_skipped)
    proc = _run(["--backends", "ddp", "--world-sizes", "2", "--steps", "2", "--measure-steps", "3",
                 "--warmup-steps", "1", "--collectives", "none", "--no-report", "--sweep",
                 "--sweep-bucket-mb", "0.01", "--sweep-accum", "2", "--sweep-compression", "fp16"], tmp_path, 540)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir() and not p.is_symlink() and p.name != "plan"]
    summary = json.loads((run_dir / "compare.json").read_text())
    variants = {(r["backend"], r["knob"]): r["verdict"] for r in summary["runs"]}
    assert variants[("ddp", "bucket_mb=0.01")] == "equivalent"
    assert variants[("ddp", "grad_accum=2")] == "equivalent"
    assert variants[("ddp", "compression=fp16")] == "equivalent"
    # The fp16 run's error is reported, larger than float32 noise but inside the widened tolerance.
    fp16 = next(r for r in summary["runs"] if r["knob"] == "compression=fp16")
    result = json.loads(Path(fp16["result_path"]).read_text())
    assert result["equivalence"]["max_rel_fro_err"] > 1e-5
    assert result["equivalence"]["tolerance"]["compression"] == "fp16"


@pytest.mark.multiproc
@pytest.mark.deep
@pytest.mark.timeout(600)
def test_the_sharding_suite_checks_every_zero_stage_and_shows_what_each_shards(tmp_path):
    """`compare --suite sharding` as a user types it (a few minutes on two cores): ddp, ZeRO 0-3 and fsdp under AdamW
    are each the same computation, and each rank's model state shrinks as the stage shards more."""
    if not registry.availability("deepspeed")[0]:
        pytest.skip("deepspeed is not installed (bash scripts/setup.sh installs it): the suite is mostly its stages")
    proc = _run(["--suite", "sharding"], tmp_path, 590)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir() and not p.is_symlink()]
    summary = json.loads((run_dir / "compare.json").read_text())
    assert (summary["suite"], summary["optimizer"], summary["model"], summary["unavailable"]) == (
        "sharding", "adamw", "mlp-wide", [])
    assert [r["label"] for r in summary["runs"]] == SHARDING_JOBS == summary["matrix"]["labels"]
    failed = [(r["label"], r["verdict"], r["error"]) for r in summary["runs"] if r["verdict"] != "equivalent"]
    assert failed == []
    results = {r["label"]: json.loads(Path(r["result_path"]).read_text()) for r in summary["runs"]}
    assert len({r["result_path"] for r in summary["runs"]}) == len(SHARDING_JOBS)  # one file per run
    for label, result in results.items():
        assert result["tag"] == label and result["config"]["optimizer"] == "adamw"
        stage = label.partition(":zero")[2].partition("/")[0]
        assert result["config"]["options"].get("zero_stage") == (stage or None), label
    state = {label: r["metrics"]["model_state_mib"] for label, r in results.items()}
    # At world size 2 stage 1 shards the optimizer state, stage 3 the parameters too, FSDP all of them.
    assert state["deepspeed:zero1/2"]["optimizer"] < state["deepspeed:zero0/2"]["optimizer"]
    assert state["deepspeed:zero3/2"]["params"] < state["deepspeed:zero2/2"]["params"]
    assert state["fsdp/2"]["total"] < state["ddp/2"]["total"]
    md = (run_dir / "report.md").read_text()
    for stage in (1, 2, 3):  # each a row of its own; stage 0, deepspeed's default, is its baseline row
        assert f"| deepspeed | 2 | zero_stage={stage} |" in md
    assert "| deepspeed | 2 | deepspeed |" in md and "| deepspeed | 2 | zero_stage=0 |" not in md


def _ns(**kw) -> CompareSpec:
    """compare's spec with compare's defaults but for `kw` (by dest, as its parser stores them)."""
    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)
    ns = parser.parse_args([])
    for k, v in kw.items():
        setattr(ns, k, v)
    return compare_spec.parse(ns)


def test_ranks_sharing_a_gpu_run_over_gloo_or_are_left_out_saying_why(tmp_path, monkeypatch):
    """Where the ranks outnumber the node's GPUs, ddp and deepspeed get --opt dist_backend=gloo (NCCL refuses two
    ranks on one device), fsdp and horovod (which cannot share one) are listed, not launched."""
    monkeypatch.setattr(plan, "_cuda_devices", lambda: 1)
    planned = plan.plan(_ns(backends="ddp,deepspeed,fsdp,horovod", collectives="none"), tmp_path)
    jobs = {j.label: j.command for j in planned.jobs}
    assert set(jobs) == {"ddp/1", "ddp/2", "deepspeed/1", "deepspeed/2", "fsdp/1", "horovod/1"}, jobs
    assert "dist_backend=gloo" in " ".join(jobs["ddp/2"]) and "dist_backend=gloo" in " ".join(jobs["deepspeed/2"])
    assert not any("dist_backend" in " ".join(jobs[k]) for k in ("ddp/1", "deepspeed/1", "fsdp/1"))
    reasons = {u["backend"]: u["reason"] for u in planned.unavailable}
    assert "FSDP cannot put two ranks on one GPU" in reasons["fsdp/2"], reasons
    assert "Horovod cannot put two ranks on one GPU" in reasons["horovod/2"], reasons
    # On the CPU nothing changes (every rank runs over gloo already): asked for, or on a host without CUDA.
    planned = plan.plan(_ns(backends="ddp,fsdp", collectives="none", run_arg=["--device=cpu"]), tmp_path)
    assert [j.label for j in planned.jobs] == ["ddp/1", "ddp/2", "fsdp/1", "fsdp/2"] and not planned.unavailable
    monkeypatch.setattr(plan, "_cuda_devices", lambda: 0)
    assert len(plan.plan(_ns(backends="ddp,fsdp", collectives="none"), tmp_path).jobs) == 4


def test_uninstalled_backend_is_unavailable_with_install_command(tmp_path, monkeypatch):
    real = registry.availability
    monkeypatch.setattr(registry, "availability",
                        lambda b: (False, "horovod is not installed: bash scripts/setup.sh") if b == "horovod" else real(b))
    planned = plan.plan(_ns(backends="reference,ddp,horovod", collectives="none"), tmp_path)
    assert [u["backend"] for u in planned.unavailable] == ["horovod"]
    assert "scripts/setup.sh" in planned.unavailable[0]["reason"]
    assert [j.label for j in planned.jobs] == ["reference/1", "ddp/1", "ddp/2"]
    # The unavailable row still names the launcher the adapter declares.
    text = _rendered([], unavailable=planned.unavailable)[0]
    assert "horovodrun" in next(line for line in text.splitlines() if line.startswith("│ horovod"))


def test_each_backend_runs_under_the_launcher_its_adapter_declares(tmp_path):
    planned = plan.plan(_ns(backends="reference,dp,ddp", collectives="none"), tmp_path)
    by_label = {j.label: j for j in planned.jobs}
    assert list(by_label) == ["reference/1", "dp/1", "ddp/1", "ddp/2"]  # one process: world size 1 only
    assert by_label["reference/1"].command[:3] == [sys.executable, "-m", "dpcompare"]
    ddp2 = by_label["ddp/2"]
    assert ddp2.launcher == "torchrun" and ddp2.command[1:3] == ["--standalone", "--nproc_per_node=2"]
    assert ddp2.command[ddp2.command.index("--backend") + 1] == "ddp"
    args = ddp2.command[ddp2.command.index("--backend"):]
    assert ddp2.command == launchers.native_command("torchrun", 2, args)
    assert _ns().backends == ",".join(registry.BACKENDS)  # default: every registered backend, in order


@pytest.mark.parametrize("kw, match", [
    ({"backends": "reference,nccl"}, "unknown nccl"),
    ({"world_sizes": "1,x"}, "--world-sizes"),
    ({"world_sizes": "0,2"}, "--world-sizes"),
    ({"steps": 0}, "--steps=0 is invalid: run at least one step"),
    ({"warmup_steps": -1}, "--warmup-steps=-1 is invalid"),
])
def test_bad_compare_input_is_one_clear_error(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        plan.plan(_ns(collectives="none", **kw), tmp_path)


@pytest.mark.parametrize(("world_sizes", "sweep", "expected"), [
    ("1,2", False, 2048), ("1,2,4,8", False, 2048), ("1,6", False, 2052), ("1,3", False, 2049), ("1,16", False, 2048),
    ("2", True, 2048), ("1,3", True, 2052)])
def test_without_a_global_batch_compare_picks_one_every_world_size_divides(tmp_path, world_sizes, sweep, expected):
    spec = _ns(collectives="none", backends="reference,ddp", world_sizes=world_sizes, sweep=sweep)
    # Picked once, when compare reads its command line: what compare.json records and compare prints.
    assert (spec.global_batch, spec.picked_global_batch, spec.run.global_batch) == (expected, True, expected)
    planned = plan.plan(spec, tmp_path)
    for job in planned.jobs:
        assert job.command[job.command.index("--global-batch") + 1] == str(expected)
        accum = job.command[job.command.index("--grad-accum") + 1] if "--grad-accum" in job.command else "1"
        assert expected % (job.world_size * int(accum)) == 0, job.label


def test_a_global_batch_the_world_sizes_cannot_shard_is_refused_with_the_runs_own_message(tmp_path):
    with pytest.raises(ValueError) as refused:
        plan.plan(_ns(collectives="none", world_sizes="1,5", global_batch=24), tmp_path)
    with pytest.raises(ValueError) as run_says:
        RunConfig(global_batch=24).batch_sizes(5)
    assert str(refused.value) == str(run_says.value)
    assert "--global-batch=24 is not divisible by world size 5" in str(refused.value)
    # One process per replica only: world sizes no planned job runs at are not checked.
    assert [j.label for j in plan.plan(_ns(backends="reference,dp", world_sizes="1,5"), tmp_path).jobs] == [
        "reference/1", "dp/1"]
    # From the command line: that one line and the usage exit status, before anything starts.
    proc = _run(["--backends", "reference,ddp", "--world-sizes", "1,5", "--global-batch", "24"], tmp_path, 120)
    assert proc.returncode == 2 and proc.stderr.strip() == f"dpcompare: error: {run_says.value}"
    assert not any(tmp_path.iterdir())


# -- the verdict table and the matrix, from synthetic results --------------------------------------------
TOLERANCE = SYNTHETIC_TOLERANCE
ORACLE = np.linspace(-1.0, 1.0, 16)
FLOOR = ORACLE + 1e-7  # a noise floor of 1e-7 / ||oracle|| relative


def _equivalence(verdict: str = "equivalent", *, stochastic: bool = False, **overrides) -> dict:
    return checked_equivalence(verdict, stochastic=stochastic, **overrides)


DECLARED = object()
"""_job's default capabilities: what the backend's adapter declares, as a run records them."""


def _declared(backend: str) -> dict:
    caps = plan.capabilities(backend)
    return {"multi_process": caps.multi_process, "native_launcher": caps.native_launcher,
            "scaling_baseline": caps.scaling_baseline}


def _job(tmp_path: Path, backend: str, world_size: int, equivalence: dict, reduced: np.ndarray | None = None, *,
         capabilities: dict | None | object = DECLARED, metrics: dict | None = None) -> plan.Job:
    """A finished job: its schema-valid result (capabilities None: a result written before they were recorded),
    and a gradient dump of step 0 unless `reduced` is None."""
    result = {"schema_version": 1, "backend": backend, "launcher": plan.capabilities(backend).native_launcher,
              "world_size": world_size, "device": "cpu", "model": "mlp", "global_batch": 24,
              "local_batch": 24 // world_size, "steps": 3, "config": {}, "equivalence": equivalence,
              "env": {"python": "3.11", "torch": "2.13.0", "deepspeed": None, "horovod": None, "mpi": None,
                      "host": "testhost", "device_names": ["x86_64"]}}
    if capabilities is not None:
        result["capabilities"] = _declared(backend) if capabilities is DECLARED else capabilities
    if metrics is not None:
        result["metrics"] = metrics
    validate_result(result)
    label = f"{backend}/{world_size}"
    dump = tmp_path / f"{backend}-ws{world_size}.npz"
    if reduced is not None:
        np.savez(dump, **{"0/reduced/w": reduced, "0/oracle/w": ORACLE, "0/floor/w": FLOOR})
    return plan.Job(backend, world_size, [], label, dump, tmp_path / f"{label}.log", status=equivalence["verdict"],
                    result=RunResult(result), wall_s=3.0)


def _rendered(jobs: list[plan.Job], *, width: int = 160, unavailable: list[dict] | None = None) -> tuple[str, str]:
    """(plain text, text with ANSI colours) of compare's console output."""
    console = Console(file=io.StringIO(), width=width, record=True, force_terminal=True, color_system="standard")
    render.render(console, jobs, unavailable or [], matrix.build_matrix(jobs), matrix.unused_parameter_grads(jobs),
                  matrix.skipped_steps([j.result for j in jobs if j.result]))
    return console.export_text(clear=False), console.export_text(styles=True)


def test_unverifiable_run_is_yellow_with_its_reason_and_every_check_figure(tmp_path):
    jobs = [_job(tmp_path, "reference", 1, _equivalence(), ORACLE + 1e-8),
            _job(tmp_path, "ddp", 2, _equivalence(
                "unverifiable", unverifiable_reason=UNVERIFIABLE_REASON, noise_ratio=None, max_rel_fro_err=None,
                noise_floor_rel_fro=None, checked_steps=[], drift=[],
                checks={c: {"status": "unverifiable", "noise_ratio": None} for c in ("gradient", "update", "trajectory")}))]
    text, coloured = _rendered(jobs, unavailable=[{"backend": "horovod", "reason": "horovod is not installed"}])
    assert max(len(line) for line in text.splitlines()) <= 160
    reference_row = next(line for line in text.splitlines() if line.startswith("│ reference"))
    cells = [c.strip() for c in reference_row.split("│")[1:-1]]
    # gradient rel err, floor, x floor; update x floor, norm ratio; trajectory x floor
    assert cells[4:10] == ["2.50e-08", "2.00e-08", "1.25", "3.50", "1.0010", "2.25"]
    assert "\x1b[33munverifiable" in coloured and "\x1b[32mequivalent" in coloured  # yellow; green
    # At 160 columns the note folds; on a wide console the reason reads as one line.
    assert UNVERIFIABLE_REASON in _rendered(jobs, width=400)[0]


def test_note_prefers_the_divergence_then_the_unverifiable_reason_then_the_error(tmp_path):
    divergence = {"step": 1, "parameter": "fc1.weight", "reason": "the update is twice the reference's",
                  "check": "update", "cause": "lr_scaled", "parameters": ["fc1.weight"]}
    different = _job(tmp_path, "ddp", 2, _equivalence("different", first_divergence=divergence,
                                                      unverifiable_reason=UNVERIFIABLE_REASON))
    assert render._note(different) == "step 1 (update check), fc1.weight: the update is twice the reference's"
    unverifiable = _job(tmp_path, "ddp", 2, _equivalence("unverifiable", unverifiable_reason=UNVERIFIABLE_REASON))
    unverifiable.error = "exit status 1"
    assert render._note(unverifiable) == UNVERIFIABLE_REASON
    failed = plan.Job("ddp", 2, [], "ddp/2", tmp_path / "none.npz", tmp_path / "log", status="failed",
                         error="gloo: connection refused")
    assert render._note(failed) == "gloo: connection refused"


def test_random_forward_at_different_world_sizes_is_not_comparable(tmp_path):
    jobs = [_job(tmp_path, "reference", 1, _equivalence(stochastic=True), ORACLE + 1e-8),
            _job(tmp_path, "ddp", 2, _equivalence(stochastic=True), ORACLE + 3e-8),
            _job(tmp_path, "horovod", 2, _equivalence(stochastic=True), ORACLE + 3e-8),
            # stopped before its first check: an empty dump, which must not empty the matrix
            _job(tmp_path, "deepspeed", 2, _equivalence("unverifiable", unverifiable_reason=UNVERIFIABLE_REASON,
                                                        stochastic=True), None)]
    np.savez(jobs[-1].dump)
    built = matrix.build_matrix(jobs)
    assert built["labels"] == ["reference/1", "ddp/2", "horovod/2"] and built["steps"] == [0]
    step0 = built["per_step"]["0"]
    for a, b in (("reference/1", "ddp/2"), ("ddp/2", "reference/1"), ("horovod/2", "reference/1")):
        assert step0[a]["in_noise_floors"][b] is None and step0[a]["rel_err"][b] is None
        assert "different masks" in step0[a]["not_comparable"][b]
    # Same world size: the same per-rank seeds, the same masks: a number (here bitwise equal).
    assert step0["ddp/2"]["rel_err"]["horovod/2"] == 0.0
    assert all(step0[a]["in_noise_floors"]["oracle"] > 0 for a in built["labels"])
    text, _ = _rendered(jobs)
    matrix_rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
                   for line in text.splitlines() if line.startswith("│ ") and "/" in line.split("│")[1]
                   and len(line.split("│")) == 7}  # run, oracle and three runs
    assert matrix_rows["ddp/2"][1] == "n/a" and matrix_rows["ddp/2"][2:] == ["0", "0"]
    assert matrix_rows["reference/1"][0] != "n/a" and matrix_rows["reference/1"][2:] == ["n/a", "n/a"]
    assert "n/a: not comparable: the forward draws random numbers" in text


def _per_replica(forwards: int) -> dict:
    return {"semantics": "per_replica", "modules": ["1"], "local_batch": 24 // forwards, "forwards": forwards,
            "step": 0, "distance_rel_fro": 0.1, "floors": 4e5}


def test_batchnorm_split_differently_is_not_comparable(tmp_path):
    """BatchNorm per replica: ws=1 normalises the global batch, ws=2 each shard, --grad-accum 2 each micro-batch:
    three functions. Twin: two backends that split alike are compared."""
    jobs = [_job(tmp_path, "reference", 1, _equivalence(), ORACLE + 1e-8),
            _job(tmp_path, "ddp", 2, _equivalence(batchnorm=_per_replica(2)), ORACLE + 3e-8),
            _job(tmp_path, "horovod", 2, _equivalence(batchnorm=_per_replica(2)), ORACLE + 3e-8)]
    step0 = matrix.build_matrix(jobs)["per_step"]["0"]
    assert step0["ddp/2"]["rel_err"]["reference/1"] is None
    assert "split the global batch into different forwards" in step0["ddp/2"]["not_comparable"]["reference/1"]
    assert step0["ddp/2"]["rel_err"]["horovod/2"] == 0.0 and "horovod/2" not in step0["ddp/2"]["not_comparable"]


def test_deterministic_runs_at_different_world_sizes_stay_comparable(tmp_path):
    jobs = [_job(tmp_path, "reference", 1, _equivalence(stochastic=False), ORACLE + 1e-8),
            _job(tmp_path, "ddp", 2, _equivalence(stochastic=False), ORACLE + 3e-8)]
    step0 = matrix.build_matrix(jobs)["per_step"]["0"]
    assert step0["reference/1"]["in_noise_floors"]["ddp/2"] == pytest.approx(2e-8 / 1e-7, rel=1e-6)
    assert step0["ddp/2"]["in_noise_floors"]["reference/1"] == pytest.approx(2e-8 / 1e-7, rel=1e-6)
    assert step0["ddp/2"]["not_comparable"] == {}
    assert "n/a" not in _rendered(jobs)[0]


def test_unused_parameters_get_one_line_per_way_the_backends_left_them(tmp_path):
    def unused(form_weight: str, form_bias: str) -> dict:
        return {"unused": ["aux_head.weight", "aux_head.bias"], "frozen": [],
                "unused_grad": {"aux_head.weight": form_weight, "aux_head.bias": form_bias}}

    jobs = [_job(tmp_path, "ddp", 2, _equivalence(parameters=unused("none", "none"))),
            _job(tmp_path, "horovod", 2, _equivalence(parameters=unused("zero", "zero"))),
            _job(tmp_path, "deepspeed", 2, _equivalence(parameters=unused("zero", "nonzero")))]
    entries = matrix.unused_parameter_grads(jobs)
    assert [e["line"] for e in entries] == [
        "unused parameters aux_head.weight: gradient None under ddp ws=2; zero under horovod ws=2, deepspeed ws=2",
        "unused parameters aux_head.bias: gradient None under ddp ws=2; zero under horovod ws=2; NONZERO under "
        "deepspeed ws=2"]
    assert entries[0]["gradient"] == {"none": ["ddp/2"], "zero": ["horovod/2", "deepspeed/2"]}
    json.dumps(entries)  # it goes into compare.json
    text, _ = _rendered(jobs, width=400)
    assert entries[1]["line"] in text
    # Alike everywhere: one line for both parameters; none listed: no line.
    jobs[2].result.raw["equivalence"]["parameters"] = unused("zero", "zero")
    assert [e["parameters"] for e in matrix.unused_parameter_grads(jobs)] == [["aux_head.weight", "aux_head.bias"]]
    assert matrix.unused_parameter_grads([_job(tmp_path, "ddp", 2, _equivalence())]) == []


def test_a_result_written_before_the_new_checks_still_renders(tmp_path):
    old = _equivalence(first_divergence={"step": 0, "parameter": "fc1.weight", "reason": "summed, not averaged"},
                       verdict="different")
    for key in ("unverifiable_reason", "checks", "stochastic", "parameters"):
        del old[key]
    jobs = [_job(tmp_path, "reference", 1, _equivalence(stochastic=True), ORACLE + 1e-8),
            _job(tmp_path, "ddp", 2, old, ORACLE + 3e-8)]
    text, _ = _rendered(jobs, width=400)
    ddp_row = next(line for line in text.splitlines() if line.startswith("│ ddp "))
    cells = [c.strip() for c in ddp_row.split("│")[1:-1]]
    assert cells[3] == "different" and cells[6] == "1.25"
    assert cells[7:10] == ["-", "-", "-"]  # no update or trajectory figures recorded
    assert cells[-1] == "step 0 (gradient check), fc1.weight: summed, not averaged"
    # An old result says nothing about randomness; its partner's random forward still makes the cell n/a.
    assert matrix.build_matrix(jobs)["per_step"]["0"]["ddp/2"]["in_noise_floors"]["reference/1"] is None
    assert matrix.unused_parameter_grads(jobs) == []


# -- scaling baseline and notes: read from what the results declare -----------------------------------------
def _measured(samples_per_s: float) -> dict:
    return {"samples_per_s": samples_per_s}


def test_scaling_baseline_is_the_world_size_1_run_that_declares_it(tmp_path):
    baseline = {"multi_process": False, "native_launcher": "python", "scaling_baseline": True}
    jobs = [_job(tmp_path, "dp", 1, _equivalence(), capabilities=baseline, metrics=_measured(100.0)),
            _job(tmp_path, "ddp", 1, _equivalence(), metrics=_measured(90.0)),
            _job(tmp_path, "ddp", 2, _equivalence(), metrics=_measured(150.0))]
    eff = {row["label"]: row["efficiency"] for row in matrix.scaling_rows(jobs, "strong")}
    assert eff == {"dp/1": pytest.approx(1.0), "ddp/1": pytest.approx(0.9), "ddp/2": pytest.approx(0.75)}
    # At world size 2 a run declaring it is not the baseline (throughput_1 is a single process's).
    jobs[0].world_size = 2
    assert all(row["efficiency"] is None for row in matrix.scaling_rows(jobs, "strong"))


def test_a_reference_run_that_declares_nothing_is_not_the_scaling_baseline(tmp_path):
    jobs = [_job(tmp_path, "reference", 1, _equivalence(), capabilities=None, metrics=_measured(100.0)),
            _job(tmp_path, "ddp", 2, _equivalence(), metrics=_measured(150.0))]
    rows = matrix.scaling_rows(jobs, "strong")
    assert [row["efficiency"] for row in rows] == [None, None]
    assert all("scaling_baseline" in row["reason"] for row in rows)
    # The same run as a run writes it now: the reference declares itself the baseline.
    jobs[0].result.raw["capabilities"] = _declared("reference")
    assert [row["efficiency"] for row in matrix.scaling_rows(jobs, "strong")] == [pytest.approx(1.0), pytest.approx(0.75)]


PASS_THROUGH = ("dp: no CUDA device, so DataParallel is a pass-through (no parallelism on CPU): this run is the "
                "reference computation, not a speed-up")


def test_pass_through_is_read_from_the_note_code_not_its_sentence(tmp_path):
    coded = _job(tmp_path, "dp", 1, _equivalence(notes=[{"code": "no_parallelism", "text": PASS_THROUGH}]))
    assert render._note(coded) == "no parallelism on CPU (pass-through)"
    assert "no parallelism on CPU (pass-through)" in _rendered([coded], width=400)[0]
    other = _job(tmp_path, "dp", 1, _equivalence(notes=[{"code": "dp.replicas", "text": PASS_THROUGH}]))
    assert render._note(other) == ""
    old = _job(tmp_path, "dp", 1, _equivalence(notes=[PASS_THROUGH]))  # a plain string: no code to match
    assert render._note(old) == ""


def test_sweep_note_shows_the_text_of_knob_not_applicable_notes(tmp_path):
    text = "deepspeed: --bucket-mb does not apply to ZeRO stage 0"
    notes = [{"code": "deepspeed.gradient_clipping", "text": "deepspeed: gradient_clipping set to 0.0 (does not apply)"},
             {"code": "knob_not_applicable", "text": text}]
    job = _job(tmp_path, "deepspeed", 2, _equivalence(notes=notes))
    job.knob = "bucket_mb=0.01"
    console = Console(file=io.StringIO(), width=400, record=True)
    render.render_sweep(console, [job], [{"backend": "ddp", "knob": "compression=bf16", "reason": "ddp offers fp16"}])
    out = console.export_text()
    row = next(line for line in out.splitlines() if "bucket_mb=0.01" in line)
    assert row.split("│")[-2].strip() == text
    assert "ddp offers fp16" in out


# -- mixed precision: --amp in every run, deepspeed's engine recipe, and the steps the loss scalers skipped ------
def _every_backend_available(monkeypatch) -> None:
    monkeypatch.setattr(registry, "availability", lambda b: (True, ""))


def test_amp_reaches_every_run_and_deepspeed_also_runs_its_engine_recipe(tmp_path, monkeypatch):
    _every_backend_available(monkeypatch)
    kw = dict(backends="reference,ddp,deepspeed", world_sizes="1,2", collectives="none")
    planned = plan.plan(_ns(amp="bf16", **kw), tmp_path)
    by_label = {j.label: j for j in planned.jobs}
    assert list(by_label) == ["reference/1", "ddp/1", "ddp/2", "deepspeed/1", "deepspeed/2",
                              "deepspeed/1 amp_recipe=engine", "deepspeed/2 amp_recipe=engine"]
    for job in planned.jobs:
        assert job.command[job.command.index("--amp") + 1] == "bf16", job.label
    for ws in (1, 2):
        engine = by_label[f"deepspeed/{ws} amp_recipe=engine"]
        assert engine.knob == "amp_recipe=engine" and engine.world_size == ws
        assert engine.command[engine.command.index("--opt") + 1] == "amp_recipe=engine"
        assert "--opt" not in by_label[f"deepspeed/{ws}"].command  # the baseline runs the autocast recipe
    assert planned.sweep_skipped == []
    # Twin: without --amp, today's jobs and run arguments, to the token (a launcher may pick another free port).
    before = plan.plan(_ns(**kw), tmp_path)
    assert [j.label for j in before.jobs] == list(by_label)[:5] and before.sweep_skipped == []
    for old, new in zip(before.jobs, planned.jobs):
        old_args, new_args = (j.command[j.command.index("--backend"):] for j in (old, new))
        assert "--amp" not in old_args
        at = new_args.index("--amp")
        assert old_args == new_args[:at] + new_args[at + 2:], old.label
    # No deepspeed among the backends (or not installed): no engine recipe, and nothing to say it was left out.
    without = plan.plan(_ns(amp="fp16", backends="reference,ddp", collectives="none"), tmp_path)
    assert [j.label for j in without.jobs] == ["reference/1", "ddp/1", "ddp/2"] and without.sweep_skipped == []


def test_fp16_engine_recipe_without_fp16_weights_is_listed_as_skipped_with_its_reason(tmp_path, monkeypatch):
    """The plan asks DeepSpeed's own accelerator, as the run does (`Adapter.precision_refusal`): without fp16 weights
    the engine recipe is left out with DeepSpeed's reason; with them (a CUDA device, or a CPU with AVX512-FP16) it runs."""
    pytest.importorskip("deepspeed")
    from deepspeed.accelerator import get_accelerator

    _every_backend_available(monkeypatch)
    accelerator = type(get_accelerator())
    ns = dict(backends="ddp,deepspeed", world_sizes="2", collectives="none", amp="fp16")
    monkeypatch.setattr(accelerator, "is_fp16_supported", lambda self: False)
    planned = plan.plan(_ns(**ns), tmp_path)
    assert [j.label for j in planned.jobs] == ["ddp/2", "deepspeed/2"]
    assert all(j.command[j.command.index("--amp") + 1] == "fp16" for j in planned.jobs)
    name = get_accelerator().device_name()
    assert planned.sweep_skipped == [{"backend": "deepspeed", "knob": "amp_recipe=engine", "reason":
                                      f"DeepSpeed's {name} accelerator does not support fp16 weights here "
                                      "(is_fp16_supported() is False); the backend's default recipe runs"}]
    console = Console(file=io.StringIO(), width=400, record=True)
    render.render_sweep(console, [], planned.sweep_skipped)
    row = next(line for line in console.export_text().splitlines() if "amp_recipe=engine" in line)
    assert "deepspeed" in row and "does not support fp16 weights here" in row
    # Twin: where the accelerator holds fp16 weights the engine recipe runs, and nothing is skipped.
    monkeypatch.setattr(accelerator, "is_fp16_supported", lambda self: True)
    planned = plan.plan(_ns(**ns), tmp_path)
    assert [j.label for j in planned.jobs] == ["ddp/2", "deepspeed/2", "deepspeed/2 amp_recipe=engine"]
    assert planned.sweep_skipped == []


def _fp16(skipped: list[int], steps: int = 3) -> dict:
    """equivalence.precision of an fp16 run whose loss scaler skipped `skipped` of its checked steps."""
    return {"amp": "fp16", "recipe": "autocast", "description": "fp16 autocast", "wire": "none",
            "loss_scaler": "torch.amp.GradScaler", "initial_scale": 2.0 ** 24, "skipped_steps": skipped,
            "steps": [{"step": s, "scale": 2.0 ** (24 - s), "predicted_overflow": s in skipped,
                       "reduced_non_finite": s in skipped, "skipped": s in skipped} for s in range(steps)]}


def test_every_backend_at_a_world_size_skips_the_same_steps(tmp_path):
    runs = [_job(tmp_path, "reference", 1, _equivalence(precision=_fp16([0, 1]))),
            _job(tmp_path, "ddp", 2, _equivalence(precision=_fp16([0, 1]))),
            _job(tmp_path, "horovod", 2, _equivalence(precision=_fp16([0, 1]))),
            _job(tmp_path, "deepspeed", 2, _equivalence(precision=_fp16([0, 1])))]
    runs[-1].result.raw["tag"] = "deepspeed/2 amp_recipe=engine"
    entries = matrix.skipped_steps([j.result for j in runs])
    assert [(e["world_size"], e["agree"]) for e in entries] == [(1, True), (2, True)]
    assert entries[1]["runs"] == {"ddp/2": [0, 1], "horovod/2": [0, 1], "deepspeed/2 amp_recipe=engine": [0, 1]}
    assert entries[1]["line"] == "loss scaler: every backend at world size 2 skipped steps 0, 1 (fp16 overflow)"
    json.dumps(entries)  # it goes into compare.json
    text, _ = _rendered(runs, width=400)
    assert entries[0]["line"] in text and entries[1]["line"] in text


def test_a_backend_that_skips_other_steps_is_named_with_its_steps(tmp_path):
    runs = [_job(tmp_path, "ddp", 2, _equivalence(precision=_fp16([0, 1]))),
            _job(tmp_path, "horovod", 2, _equivalence(precision=_fp16([0])))]
    (entry,) = matrix.skipped_steps([j.result for j in runs])
    assert entry["agree"] is False and entry["runs"] == {"ddp/2": [0, 1], "horovod/2": [0]}
    assert entry["line"] == "loss scaler: backends at world size 2 skip different steps: ddp/2 [0, 1], horovod/2 [0]"
    console = Console(file=io.StringIO(), width=400, record=True, force_terminal=True, color_system="standard")
    render.render(console, runs, [], matrix.build_matrix(runs), [], [entry])
    assert entry["line"] in console.export_text(clear=False)
    assert "\x1b[1;31mloss scaler" in console.export_text(styles=True)  # bold red


def test_runs_without_loss_scaler_steps_are_left_out_of_the_skipped_steps(tmp_path):
    bf16 = {**_fp16([]), "amp": "bf16", "loss_scaler": None, "initial_scale": None, "steps": []}
    old = _equivalence()
    old.pop("precision", None)  # a result written before --amp
    runs = [_job(tmp_path, "ddp", 2, _equivalence(precision=None)), _job(tmp_path, "horovod", 2, old),
            _job(tmp_path, "deepspeed", 2, _equivalence(precision=bf16))]
    assert matrix.skipped_steps([j.result for j in runs]) == []
    # With one fp16 run among them, only it is judged: nothing skipped, and no disagreement with the others.
    runs.append(_job(tmp_path, "ddp", 1, _equivalence(precision=_fp16([]))))
    assert matrix.skipped_steps([j.result for j in runs]) == [
        {"world_size": 1, "runs": {"ddp/1": []}, "agree": True,
         "line": "loss scaler: every backend at world size 1 skipped no step"}]


# -- named backend variants (--backends deepspeed:zero2) and the --suite presets, planned without a launcher ------
def _args(job: plan.Job) -> list[str]:
    return job.command[job.command.index("--backend"):]


def _opts(job: plan.Job) -> list[str]:
    args = _args(job)
    return [args[i + 1] for i, word in enumerate(args) if word == "--opt"]


def test_a_backend_variant_runs_with_the_options_its_adapter_declares_under_its_own_name(tmp_path, monkeypatch):
    _every_backend_available(monkeypatch)
    assert entries.backend_variants("deepspeed")["zero2"] == {"zero_stage": 2}  # the adapter's VARIANTS: data, not a name
    planned = plan.plan(_ns(backends="ddp,deepspeed,deepspeed:zero2,deepspeed:zero3", world_sizes="1,2",
                            collectives="none"), tmp_path)
    by_label = {j.label: j for j in planned.jobs}
    assert list(by_label) == ["ddp/1", "ddp/2", "deepspeed/1", "deepspeed/2", "deepspeed:zero2/1", "deepspeed:zero2/2",
                              "deepspeed:zero3/1", "deepspeed:zero3/2"]
    zero2 = by_label["deepspeed:zero2/2"]
    assert (zero2.backend, zero2.backend_variant, zero2.entry, zero2.options) == (
        "deepspeed", "zero2", "deepspeed:zero2", {"zero_stage": 2})
    assert zero2.knob == "baseline"  # a backend of its own in the matrix and the tables, not a sweep knob
    assert zero2.launcher == "deepspeed" and zero2.world_size == 2
    # The command the user would type: the plain backend, its variant's --opt, the job's label as the tag.
    args = _args(zero2)
    assert args[:2] == ["--backend", "deepspeed"] and _opts(zero2) == ["zero_stage=2"]
    assert args[args.index("--tag") + 1] == "deepspeed:zero2/2"
    assert zero2.command[-len(args):] == args  # under the deepspeed launcher (which picks a free port)
    assert _opts(by_label["deepspeed:zero3/1"]) == ["zero_stage=3"]
    # Twin: the plain backend passes no --opt; its command differs from the variant's only in the option and names.
    plain = by_label["deepspeed/2"]
    assert _opts(plain) == [] and plain.backend_variant == "" and plain.entry == "deepspeed"
    without_opt = [w for i, w in enumerate(args) if w != "--opt" and args[i - 1] != "--opt"]
    assert [w.replace("deepspeed:zero2", "deepspeed").replace("deepspeed-zero2", "deepspeed")
            for w in without_opt] == _args(plain)
    # Every job writes its own dump, log and fence, and its run its own tag (how compare finds its result).
    for attr in ("dump", "log", "fence"):
        paths = [getattr(j, attr) for j in planned.jobs]
        assert len(set(paths)) == len(paths), attr
    assert zero2.dump.name == "deepspeed-zero2-ws2.npz" and zero2.fence.name == "deepspeed-zero2-ws2.closed"
    # compare.json keeps the variant apart from the backend.
    entry = run_entry(zero2)
    assert (entry["label"], entry["backend"], entry["entry"], entry["backend_variant"], entry["options"]) == (
        "deepspeed:zero2/2", "deepspeed", "deepspeed:zero2", "zero2", {"zero_stage": 2})
    assert run_entry(plain)["backend_variant"] is None


def test_a_variant_keeps_its_name_in_the_matrix_the_tables_and_the_sweep(tmp_path, monkeypatch):
    (tmp_path / "v").mkdir()
    jobs = [_job(tmp_path, "deepspeed", 2, _equivalence(), ORACLE + 1e-8),
            _job(tmp_path / "v", "deepspeed", 2, _equivalence(), ORACLE + 2e-8)]
    jobs[1].backend_variant, jobs[1].label = "zero2", "deepspeed:zero2/2"
    built = matrix.build_matrix(jobs)
    assert built["labels"] == ["deepspeed/2", "deepspeed:zero2/2"]
    assert built["per_step"]["0"]["deepspeed:zero2/2"]["rel_err"]["deepspeed/2"] > 0
    text = _rendered(jobs, width=400)[0]
    rows = [line.split("│")[1].strip() for line in text.splitlines() if line.startswith("│ deepspeed")]
    assert rows[:2] == ["deepspeed", "deepspeed:zero2"]  # the verdict table names the variant, the twin does not
    _every_backend_available(monkeypatch)
    planned = plan.plan(_ns(backends="deepspeed:zero2", world_sizes="2", collectives="none", sweep=True,
                            sweep_bucket_mb="25", sweep_accum="2", sweep_compression="fp16"), tmp_path)
    assert [j.label for j in planned.jobs] == ["deepspeed:zero2/2", "deepspeed:zero2/2 grad_accum=2",
                                               "deepspeed:zero2/2 compression=fp16"]
    assert all(_opts(j) == ["zero_stage=2"] for j in planned.jobs)
    assert planned.sweep_skipped[0]["backend"] == "deepspeed:zero2"
    assert planned.sweep_skipped[0]["knob"] == "bucket_mb=25"


@pytest.mark.parametrize(("backends", "match"), [
    ("ddp,deepspeed:zero9", "--backends 'deepspeed:zero9': deepspeed has no variant 'zero9'; choose one of "
                            "deepspeed:zero0, deepspeed:zero1, deepspeed:zero2, deepspeed:zero3"),
    ("deepspeed:", "deepspeed has an empty variant; choose one of deepspeed:zero0"),
    ("deepspeed:zero2:x", "deepspeed has no variant 'zero2:x'"),
    ("reference:fast", r"reference declares no variants \(its adapter's VARIANTS is empty\)"),
    ("ddp,deepspeed:zero2,deepspeed:zero2", "deepspeed:zero2 is given twice"),
    ("nccl:zero2", "cannot import module 'nccl'"),  # not a registered name: a package.module:Class of the user's
])
def test_an_unknown_variant_is_one_clear_error_naming_the_backends_variants(tmp_path, monkeypatch, backends, match):
    _every_backend_available(monkeypatch)
    with pytest.raises(ValueError, match=match):
        plan.plan(_ns(backends=backends, collectives="none"), tmp_path)


def test_an_unknown_variant_on_the_command_line_exits_2_before_anything_starts(tmp_path):
    proc = _run(["--backends", "ddp,deepspeed:zero9"], tmp_path, 120)
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("dpcompare: error: --backends 'deepspeed:zero9': deepspeed has no variant 'zero9'")
    assert "deepspeed:zero3" in line and not any(tmp_path.iterdir())


def test_a_users_package_module_class_is_a_backend_not_a_variant(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))  # tests.faulty_adapters imports as a user's module
    spec = "tests.faulty_adapters:SummingDDP"
    assert entries.split_entry(spec) == (spec, None) and entries.split_entry("deepspeed:zero2") == ("deepspeed", "zero2")
    planned = plan.plan(_ns(backends=f"ddp,{spec}", world_sizes="2", collectives="none"), tmp_path)
    user = planned.jobs[1]
    assert (user.backend, user.backend_variant, user.label) == (spec, "", f"{spec}/2")
    assert _args(user)[:2] == ["--backend", spec] and _opts(user) == [] and user.launcher == "torchrun"
    assert user.dump.name == "tests.faulty_adapters-SummingDDP-ws2.npz"
    # Its class may declare variants too: package.module:Class:variant.
    cls = registry.load(spec, registry.BACKENDS, "backend")
    monkeypatch.setattr(cls, "VARIANTS", {"viewed": {"gradient_as_bucket_view": True}})
    (viewed,) = plan.plan(_ns(backends=f"{spec}:viewed", world_sizes="2", collectives="none"), tmp_path).jobs
    assert (viewed.backend, viewed.backend_variant, viewed.label) == (spec, "viewed", f"{spec}:viewed/2")
    assert _opts(viewed) == ["gradient_as_bucket_view=true"]
    with pytest.raises(ValueError, match=r"SummingDDP has no variant 'fast'; choose one of .*SummingDDP:viewed"):
        plan.plan(_ns(backends=f"{spec}:fast", world_sizes="2", collectives="none"), tmp_path)
    # A variant whose option its adapter does not declare is the adapter's mistake, said before anything runs.
    monkeypatch.setattr(cls, "VARIANTS", {"odd": {"no_such_option": 1}})
    with pytest.raises(ValueError, match="the variant sets no_such_option, an option .* does not declare"):
        plan.plan(_ns(backends=f"{spec}:odd", world_sizes="2", collectives="none"), tmp_path)


def test_a_run_arg_opt_must_not_undo_what_a_variant_sets(tmp_path, monkeypatch):
    _every_backend_available(monkeypatch)
    kw = dict(backends="ddp,deepspeed:zero2", world_sizes="2", collectives="none")
    for run_arg in (["--opt=zero_stage=3"], ["--opt", "zero_stage=1"]):
        with pytest.raises(ValueError, match=r"--run-arg --opt zero_stage=\d contradicts --backends deepspeed:zero2"):
            plan.plan(_ns(run_arg=run_arg, **kw), tmp_path)
    # Twins: the same value, or another option, reach every run beside the variant's own.
    for run_arg, given in ((["--opt=zero_stage=2"], {"zero_stage": "2"}),
                           (["--opt=gradient_clipping=1.0"], {"gradient_clipping": "1.0"})):
        ddp, zero2 = plan.plan(_ns(run_arg=run_arg, **kw), tmp_path).jobs
        assert RunConfig.from_args(_args(ddp)).options == given
        assert RunConfig.from_args(_args(zero2)).options == {"zero_stage": "2", **given}
        assert _opts(zero2)[0] == "zero_stage=2"


@pytest.mark.parametrize(("run_arg", "says"), [
    (["--no-such-flag"], "--run-arg '--no-such-flag': unrecognized arguments: --no-such-flag"),
    (["--steps", "x"], "argument --steps: expected a whole number, got 'x'"),
    (["--tag=mine"], "--run-arg --tag: compare sets it for each run itself; drop it"),
    (["--out", "elsewhere"], "--run-arg --out: compare sets it for each run itself"),
])
def test_a_run_arg_is_read_as_the_runs_own_flags_before_anything_starts(tmp_path, run_arg, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        _ns(backends="reference", run_arg=run_arg)
    # Twin: a run flag compare does not forward reaches every run, after compare's own settings.
    jobs = plan.plan(_ns(backends="reference,ddp", world_sizes="2", collectives="none",
                         run_arg=["--sync-bn", "--steps=3"]), tmp_path).jobs
    for job in jobs:
        run = RunConfig.from_args(_args(job))
        assert (run.sync_bn, run.steps, run.model) == (True, 3, "mlp-wide"), job.label


def _parsed(*argv: str) -> CompareSpec:
    """compare's spec as its command line parses `argv` (what records the flags given beside --suite)."""
    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)
    return compare_spec.parse(parser.parse_args(list(argv)))


SHARDING_JOBS = ["ddp/1", "ddp/2", *(f"deepspeed:zero{n}/{ws}" for n in range(4) for ws in (1, 2)), "fsdp/1", "fsdp/2"]


def test_the_sharding_suite_runs_ddp_every_zero_stage_and_fsdp_under_adamw(tmp_path, monkeypatch):
    _every_backend_available(monkeypatch)
    ns = _parsed("--suite", "sharding", "--collectives", "none")
    planned = plan.plan(ns, tmp_path)
    assert [j.label for j in planned.jobs] == SHARDING_JOBS and planned.unavailable == []
    assert [_opts(j) for j in planned.jobs if j.backend == "deepspeed"] == [[f"zero_stage={n}"] for n in range(4)
                                                                              for _ in (1, 2)]
    for job in planned.jobs:
        args = _args(job)
        for flag, value in (("--optimizer", "adamw"), ("--model", "mlp-wide"), ("--global-batch", "256"),
                            ("--steps", "2"), ("--warmup-steps", "1"), ("--measure-steps", "5")):
            assert args[args.index(flag) + 1] == value, (job.label, flag)
    assert (ns.run.model, ns.run.optimizer, ns.global_batch, ns.world_sizes) == ("mlp-wide", "adamw", 256, (1, 2))
    # Twin: without --suite, compare's own defaults, and no --optimizer on any command (the run's sgd).
    plain = plan.plan(_parsed("--backends", "ddp", "--collectives", "none"), tmp_path)
    assert all("--optimizer" not in _args(j) for j in plain.jobs)
    assert _args(plain.jobs[0])[_args(plain.jobs[0]).index("--measure-steps") + 1] == "20"
    # --help says what the preset runs.
    from dpcompare import cli

    help_text = " ".join(cli.parser_for("compare").format_help().split())
    for words in ("--suite {sharding,questions,checkpoint}", "deepspeed ZeRO stages 0-3 (deepspeed:zero0..zero3) and fsdp", "AdamW",
                  "flags given beside it win"):
        assert words in help_text, words


def test_flags_given_beside_a_suite_win_even_at_their_default(tmp_path, monkeypatch):
    _every_backend_available(monkeypatch)
    # --measure-steps 20 is compare's default, given on purpose: it must win over the preset's 5.
    ns = _parsed("--suite", "sharding", "--world-sizes", "2", "--measure-steps", "20", "--optimizer", "sgd",
                 "--backends", "ddp,deepspeed:zero3", "--collectives", "none")
    planned = plan.plan(ns, tmp_path)
    assert [j.label for j in planned.jobs] == ["ddp/2", "deepspeed:zero3/2"]
    for job in planned.jobs:
        args = _args(job)
        assert args[args.index("--measure-steps") + 1] == "20" and "--optimizer" not in args
        assert args[args.index("--steps") + 1] == "2" and args[args.index("--global-batch") + 1] == "256"  # preset
    # Backends given beside the preset are the user's: an unknown one is refused, not skipped.
    with pytest.raises(ValueError, match="unknown nccl"):
        plan.plan(_parsed("--suite", "sharding", "--backends", "ddp,nccl", "--collectives", "none"), tmp_path)


def test_a_suite_backend_this_dpcompare_lacks_is_listed_unavailable_not_refused(tmp_path, monkeypatch):
    real = registry.availability
    monkeypatch.delitem(registry.BACKENDS, "fsdp", raising=False)
    missing = (False, "deepspeed is not installed: pip install deepspeed")
    monkeypatch.setattr(registry, "availability", lambda b: missing if b == "deepspeed" else real(b))
    planned = plan.plan(_parsed("--suite", "sharding", "--collectives", "none"), tmp_path)
    assert [j.label for j in planned.jobs] == ["ddp/1", "ddp/2"]
    # One line per backend, however many of its variants were asked for, each with the launcher it declares.
    assert [(u["backend"], u["launcher"]) for u in planned.unavailable] == [("fsdp", "-"), ("deepspeed", "deepspeed")]
    assert "not a registered backend" in planned.unavailable[0]["reason"]
    text = _rendered([], unavailable=planned.unavailable, width=400)[0]
    assert "not a registered backend" in text and "pip install deepspeed" in text


def test_a_suites_dozen_runs_fit_the_matrix_and_the_cost_table_within_160_columns(tmp_path):
    state = {"params": 1.5, "grads": 1.5, "optimizer": 3.0, "comm_buffers": 3.0, "total": 9.06}
    jobs = []
    for i, label in enumerate(SHARDING_JOBS):
        backend, _, variant = label.partition("/")[0].partition(":")
        ws = int(label.rpartition("/")[2])
        (tmp_path / str(i)).mkdir()
        job = _job(tmp_path / str(i), "deepspeed" if variant else backend, ws, _equivalence(), ORACLE + 1e-8 * ws,
                   metrics={"samples_per_s": 5000.0, "step_ms_p50": 50.0, "model_state_mib": state})
        job.label, job.backend_variant = label, variant
        jobs.append(job)
    text = _rendered(jobs)[0]
    assert "…" not in text, text  # nothing cut short
    assert "column N is the run in row N" in text
    assert "│ 8 deepspeed:zero2/2 " in text and "│ deepspeed:zero2 │ 2 " in text
    console = Console(file=io.StringIO(), width=160, record=True)
    render.render_cost(console, jobs, [])
    cost = console.export_text()
    assert "…" not in cost and "model" in cost and "state MiB" in cost
    assert next(line for line in cost.splitlines() if "deepspeed:zero3/2" in line).rstrip(" │").endswith("9.1")
    # Twin: three runs keep their labels as the matrix's column headers.
    few = _rendered(jobs[:3])[0]
    assert "column N" not in few and "│ ddp/1 " in few and "deepspeed:zero0/1 ┃" in few


# -- the README's quickstart lines ------------------------------------------------------------------------------
def _quickstart_compare_lines() -> list[list[str]]:
    """The `compare` lines of README.md's Quickstart block, as argument lists after `compare` (comments dropped)."""
    import shlex

    text = (REPO / "README.md").read_text()
    block = text.split("## Quickstart", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    lines = []
    for line in block.splitlines():
        words = shlex.split(line.split("#", 1)[0])
        if "compare" in words and "dpcompare" in words:
            lines.append(words[words.index("compare") + 1:])
    return lines


def test_every_quickstart_compare_line_plans_every_run_it_names(tmp_path, monkeypatch):
    """Each compare line of the README's Quickstart parses and plans (every backend, variant and suite it names
    resolves to runs) without launching anything; the slow tier runs the sharded line as written."""
    _every_backend_available(monkeypatch)
    lines = _quickstart_compare_lines()
    assert len(lines) >= 4 and ["--backends", "ddp,deepspeed:zero2,fsdp"] in lines, lines
    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)
    for words in lines:
        planned = plan.plan(compare_spec.parse(parser.parse_args([*words, "--collectives", "none", "--out",
                                                                  str(tmp_path)])), tmp_path)
        assert planned.jobs, words
        if "--backends" in words:
            named = set(words[words.index("--backends") + 1].split(","))
            assert {j.entry for j in planned.jobs} == named, (words, [j.label for j in planned.jobs])


def test_the_quickstart_check_can_fail_on_a_line_that_names_no_backend(tmp_path, monkeypatch):
    _every_backend_available(monkeypatch)
    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)
    with pytest.raises((SystemExit, ValueError)):
        plan.plan(compare_spec.parse(parser.parse_args(["--backends", "ddp,deepspeed:zero9", "--out", str(tmp_path)])),
                  tmp_path)


@pytest.mark.multiproc
@pytest.mark.deep
@pytest.mark.timeout(600)
def test_the_quickstart_line_with_a_zero_stage_runs_as_written_with_the_default_sgd(tmp_path):
    """`compare --backends ddp,deepspeed:zero2,fsdp` exactly as the README shows it (the default SGD, which ZeRO
    refuses unless allowed): every run is the same computation."""
    if not registry.availability("deepspeed")[0]:
        pytest.skip("deepspeed is not installed (bash scripts/setup.sh installs it)")
    (words,) = [w for w in _quickstart_compare_lines() if "deepspeed:zero2" in " ".join(w)]
    proc = _run(words, tmp_path, 590)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir() and not p.is_symlink()]
    summary = json.loads((run_dir / "compare.json").read_text())
    runs = {r["label"]: r for r in summary["runs"]}
    assert "deepspeed:zero2/2" in runs and summary["optimizer"] == "sgd", (list(runs), summary.get("optimizer"))
    assert [(label, r["verdict"], r["error"]) for label, r in runs.items() if r["verdict"] != "equivalent"] == []


def test_clip_grad_norm_reaches_every_job_and_a_bad_value_is_the_runs_own_refusal(tmp_path):
    planned = plan.plan(_ns(backends="reference,ddp,deepspeed", collectives="none", clip_grad_norm=0.05), tmp_path)
    for job in planned.jobs:
        i = job.command.index("--clip-grad-norm")
        assert float(job.command[i + 1]) == 0.05, job.command
    unclipped = plan.plan(_ns(backends="reference,ddp", collectives="none"), tmp_path / "none")
    assert all("--clip-grad-norm" not in job.command for job in unclipped.jobs)
    with pytest.raises(ValueError) as refused:
        plan.plan(_ns(backends="reference,ddp", collectives="none", clip_grad_norm=-1.0), tmp_path / "bad")
    assert str(refused.value).startswith("--clip-grad-norm=-1.0 is invalid: use a positive total norm")


@pytest.mark.multiproc
@pytest.mark.deep  # the plan-level test above checks the pass-through in the default tier
@pytest.mark.timeout(600)
def test_compare_clips_every_backend_by_its_own_mechanism(tmp_path):
    """`compare --clip-grad-norm 0.05`: every run clipped (the unclipped norm above the clip) and equivalent."""
    backends = "ddp,deepspeed:zero2,fsdp" if registry.availability("deepspeed")[0] else "ddp,fsdp"
    proc = _run(["--backends", backends, "--world-sizes", "2", "--measure-steps", "0", "--collectives", "none",
                 "--no-report", "--clip-grad-norm", "0.05"], tmp_path, 540)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir() and not p.is_symlink()]
    summary = json.loads((run_dir / "compare.json").read_text())
    assert summary["clip_grad_norm"] == 0.05
    assert [(r["label"], r["verdict"]) for r in summary["runs"] if r["verdict"] != "equivalent"] == []
    for r in summary["runs"]:
        result = json.loads(Path(r["result_path"]).read_text())
        assert result["config"]["clip_grad_norm"] == 0.05
        assert result["equivalence"]["checks"]["grad_norm"]["clipped_steps"], r["label"]


def test_the_cost_section_prints_the_traces_figure_beside_the_ablations_and_what_nccl_chose(tmp_path):
    metrics = {"comm_exposed_ms": 3.0, "comm_exposed_trace_ms": 1.25, "comm_exposed_trust": "ablation",
               "comm_exposed_trust_why": "the ablation: because", "reasons": {},
               "comm_link": {"transport": "nccl", "version": "2.27.3", "forced": None, "chosen_reason": None,
                             "chosen": {"AllReduce": {"Ring/Simple": 12, "Ring/LL": 3}}}}
    jobs = [_job(tmp_path, "ddp", 2, _equivalence(), ORACLE, metrics=metrics),
            _job(tmp_path, "fsdp", 2, _equivalence(), ORACLE, metrics={"comm_exposed_ms": 3.0, "reasons": {}})]
    console = Console(file=io.StringIO(), width=160, record=True)
    render.render_cost(console, jobs, [])
    text = console.export_text()
    assert "ddp/2: NCCL chose AllReduce Ring/Simple x12, Ring/LL x3" in text
    assert "ddp/2: exposed comm from the trace 1.25 ms (ablation 3.00 ms): trust ablation, the ablation: because" in text
    assert "fsdp/2: exposed comm from the trace" not in text and "fsdp/2: NCCL chose" not in text
