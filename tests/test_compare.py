"""`python -m dpcompare compare` end to end, and its planning against what the adapters declare.

A real compare run (reference, dp, ddp at world sizes 1 and 2, with the measurement phase, the
microbenchmark and the report) must produce verdicts, the gradient matrix, costs with scaling
efficiency, and every file it promises; `--sweep` must keep the verdict `equivalent` under bucket size,
gradient accumulation and fp16 compression and list the knobs a backend does not have. Planning must
show an uninstalled backend as unavailable with its install command while the others still run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dpcompare import compare, registry

REPO = Path(__file__).resolve().parents[1]


def _run(args: list[str], tmp_path: Path, timeout: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "dpcompare", "compare", "--out", str(tmp_path), *args],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path)


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_compare_produces_verdicts_matrix_costs_and_report(tmp_path):
    proc = _run(["--backends", "reference,dp,ddp", "--world-sizes", "1,2", "--steps", "2", "--measure-steps", "5",
                 "--warmup-steps", "1"], tmp_path, 540)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    summary = json.loads((run_dir / "compare.json").read_text())
    labels = [r["label"] for r in summary["runs"]]
    assert labels == ["reference/1", "dp/1", "ddp/1", "ddp/2"]
    assert all(r["verdict"] == "equivalent" for r in summary["runs"])
    # The matrix: every pair at step 0; runs from identical weights at ws 1 are bitwise equal.
    step0 = summary["matrix"]["per_step"]["0"]
    assert step0["reference/1"]["rel_err"]["ddp/1"] == 0.0
    assert 0 < step0["ddp/2"]["rel_err"]["oracle"] < 1e-5
    # Scaling efficiency against the reference measured in the same invocation.
    eff = {row["label"]: row["efficiency"] for row in summary["scaling"]}
    assert eff["reference/1"] == pytest.approx(1.0)
    assert eff["ddp/2"] is not None and 0 < eff["ddp/2"] < 2
    # The microbenchmark ran and ddp/2 quotes its busbw at its own message size.
    assert summary["collectives"] and Path(summary["collectives"]).exists()
    ddp2 = json.loads(Path(next(r["result_path"] for r in summary["runs"] if r["label"] == "ddp/2")).read_text())
    assert ddp2["metrics"]["microbench_busbw_gbps"] and ddp2["metrics"]["comm_exposed_ms"] is not None
    for name in ("report.md", "throughput_vs_world_size.png", "step_breakdown.png", "busbw_vs_message_size.png",
                 "grad_error_heatmap.png"):
        assert (run_dir / name).stat().st_size > 1000, name
    for word in ("is it the same computation?", "gradient matrix", "what does it cost?"):
        assert word in proc.stdout


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_sweep_stays_equivalent_and_names_what_does_not_apply(tmp_path):
    backends = "ddp,deepspeed" if registry.availability("deepspeed")[0] else "ddp"
    proc = _run(["--backends", backends, "--world-sizes", "2", "--steps", "2", "--measure-steps", "3",
                 "--warmup-steps", "1", "--collectives", "none", "--no-report", "--sweep",
                 "--sweep-bucket-mb", "0.01", "--sweep-accum", "2", "--sweep-compression", "fp16"], tmp_path, 540)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    summary = json.loads((run_dir / "compare.json").read_text())
    variants = {(r["backend"], r["variant"]): r["verdict"] for r in summary["runs"]}
    assert variants[("ddp", "bucket_mb=0.01")] == "equivalent"
    assert variants[("ddp", "grad_accum=2")] == "equivalent"
    assert variants[("ddp", "compression=fp16")] == "equivalent"
    if "deepspeed" in backends:
        assert any(s["backend"] == "deepspeed" and s["knob"].startswith("bucket_mb") for s in summary["sweep_skipped"])
    # The fp16 run's error is reported, larger than float32 noise but inside the widened tolerance.
    fp16 = next(r for r in summary["runs"] if r["variant"] == "compression=fp16")
    result = json.loads(Path(fp16["result_path"]).read_text())
    assert result["equivalence"]["max_rel_fro_err"] > 1e-5
    assert result["equivalence"]["tolerance"]["compression"] == "fp16"


def _ns(**kw) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)
    ns = parser.parse_args([])
    for k, v in kw.items():
        setattr(ns, k, v)
    return ns


def test_uninstalled_backend_is_unavailable_with_install_command(tmp_path, monkeypatch):
    real = registry.availability
    monkeypatch.setattr(registry, "availability",
                        lambda b: (False, "horovod is not installed: bash scripts/setup.sh") if b == "horovod" else real(b))
    jobs, unavailable = compare.plan(_ns(backends="reference,ddp,horovod", collectives="none"), tmp_path)
    assert [u["backend"] for u in unavailable] == ["horovod"]
    assert "scripts/setup.sh" in unavailable[0]["reason"]
    assert [j.label for j in jobs] == ["reference/1", "ddp/1", "ddp/2"]


def test_native_commands_are_the_users_commands():
    assert compare.native_command("torchrun", 2, ["--backend", "ddp"])[1:4] == ["--standalone", "--nproc_per_node=2", "-m"]
    hvd = compare.native_command("horovodrun", 3, ["--backend", "horovod"])
    assert hvd[1:6] == ["--gloo", "-np", "3", "-H", "localhost:3"]
    ds = compare.native_command("deepspeed", 2, ["--backend", "deepspeed"])
    assert ds[1:3] == ["--num_gpus", "2"] and "--module" in ds
    with pytest.raises(ValueError, match="unknown launcher"):
        compare.native_command("srun", 2, [])


@pytest.mark.parametrize("kw, match", [
    ({"backends": "reference,nccl"}, "unknown nccl"),
    ({"world_sizes": "1,x"}, "--world-sizes"),
    ({"world_sizes": "1,5", "global_batch": 24}, "not divisible by world size 5"),
])
def test_bad_compare_input_is_one_clear_error(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        compare.plan(_ns(collectives="none", **kw), tmp_path)
