"""`dpcompare report`: checks the report against synthetic JSON results written here, whose figures are
chosen so the expected values are known by hand (reference 100 samples/s, ddp/2 150 -> efficiency 0.75).

Checks: the pure helpers (scaling efficiency, newest run per backend and world size, the rest of a step,
the gradient-matrix panels) against hand-computed values; that a full set of inputs (runs, a compare
summary, collectives benchmarks) gives four valid PNGs of plausible size and a report.md with the verdict
and cost tables, every null as n/a with its reason; that missing inputs skip a plot and say why; that bad
inputs (no directory, no results, malformed JSON) give a one-line error or a warning, never a traceback.
The verdict table shows the update and trajectory figures beside the gradient's, `unverifiable` in bold
with its reason; a result written before those checks shows them as n/a with why. The scaling baseline is the
world-size-1 run that declares capabilities.scaling_baseline, whatever its backend is called; a result without
capabilities is never one. Runs are ordered as dpcompare.run.registry.BACKENDS lists the backends, and verdict
notes load whether written as {code, text} objects or as plain strings. A run that changes a knob from its backend's
baseline is a row of its own, named by the knobs it recorded when it was written (the report reads them back, never
derives them from the tag or the options); a result written before knobs were recorded is named by its sweep flags and
its recorded variant.
"""

from __future__ import annotations

import argparse
import json
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import UNVERIFIABLE_REASON, checked_equivalence, validate_result
from dpcompare.commands import report
from dpcompare.measure.scaling import other_ms, scaling_efficiency
from dpcompare.result_view import RunResult
from dpcompare.run.registry import BACKENDS

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PLOTS = (report.PLOT_THROUGHPUT, report.PLOT_BREAKDOWN, report.PLOT_BUSBW, report.PLOT_HEATMAP)
MIB = 2**20


def capabilities(scaling_baseline: bool = False, multi_process: bool = False) -> dict[str, Any]:
    """`capabilities` as a run writes it: what its backend's adapter declares."""
    return {"multi_process": multi_process, "native_launcher": "torchrun" if multi_process else "python",
            "scaling_baseline": scaling_baseline}


BASELINE = capabilities(scaling_baseline=True)  # what the reference backend declares


# -- fixtures: what trainer, compare and bench-collectives write -----------------------------------------
def metrics(**overrides: Any) -> dict[str, Any]:
    m = {
        "samples_per_s": 100.0, "tokens_per_s": None, "step_ms_p50": 10.0, "step_ms_p90": 12.0, "step_ms_mean": 10.5,
        "warmup_steps": 2, "measured_steps": 20, "rank_spread_ms_p50": 0.4, "stragglers": [],
        "compute_ms_p50": 6.0, "comm_exposed_ms": 3.0, "comm_total_ms": 4.0, "comm_total_method": "ddp logging",
        "overlap_fraction": 0.25, "grad_bytes_per_step": 4 * MIB, "bucket_bytes": 1 * MIB, "algbw_gbps": 1.0,
        "busbw_gbps": 1.0, "microbench_busbw_gbps": 2.0, "tcomm_model_ms": 3.5, "peak_mem_mib": 512.0,
        "model_state_mib": {"params": 4.0, "grads": 4.0, "optimizer": 0.0, "comm_buffers": 4.0, "total": 12.0},
        "scaling": "strong", "reasons": {"tokens_per_s": "the mlp workload has no tokens"},
    }
    m.update(overrides)
    return m


def run_result(backend: str, world_size: int, created_unix: float = 1_700_000_000.0, *,
               metrics_: dict[str, Any] | None = None, verdict: str = "equivalent", **fields: Any) -> dict[str, Any]:
    payload = {
        "schema_version": 1, "backend": backend, "launcher": "torchrun" if world_size > 1 else "python",
        "world_size": world_size, "device": "cpu", "model": "mlp", "global_batch": 24,
        "local_batch": 24 // world_size, "scaling": "strong", "steps": 22, "tag": f"{backend}/{world_size}",
        "created_unix": created_unix, "config": {},
        "equivalence": {"verdict": verdict, "checked_steps": [0], "max_rel_err": 1e-7, "max_rel_fro_err": 2.5e-8,
                        "noise_floor_rel_fro": 2e-8, "noise_ratio": 1.25, "first_divergence": None,
                        "replicas_identical": True, "initial_weights_identical": True, "tolerance": {},
                        "drift": [], "notes": []},
        "env": {"dpcompare": "0.1.0", "python": "3.11.9", "torch": "2.13.0", "cuda": None, "nccl": None,
                "gloo": True, "deepspeed": "0.19.8", "horovod": None, "mpi": "Open MPI 4.1.4", "mpi4py": None,
                "host": "testhost", "device_names": ["x86_64"]},
    }
    if metrics_ is not None:
        payload["metrics"] = metrics_
    payload.update(fields)
    return payload


def compare_summary(labels: list[str], steps: int = 2) -> dict[str, Any]:
    per_step = {}
    for step in range(steps):
        rows = {}
        for i, a in enumerate(labels):
            floor = 1e-8
            rel = {"oracle": 1.5e-8 * (i + 1) * (step + 1)}
            rel.update({b: 0.0 if (a == b or {a, b} == {"ddp/2", "deepspeed/2"}) else 5e-9 * (step + 1) for b in labels})
            rows[a] = {"rel_err": rel, "noise_floor": floor, "in_noise_floors": {k: v / floor for k, v in rel.items()}}
        per_step[str(step)] = rows
    return {
        "schema_version": 1, "kind": "compare", "created_unix": 1_700_000_100.0, "scaling_mode": "strong",
        "matrix": {"labels": labels, "steps": list(range(steps)), "per_step": per_step},
        "runs": [{"label": lb, "backend": lb.split("/")[0], "world_size": int(lb.split("/")[1]), "status": "equivalent",
                  "verdict": "equivalent"} for lb in labels]
        + [{"label": "horovod/2", "backend": "horovod", "world_size": 2, "status": "failed", "verdict": None,
            "error": "gloo: connection refused (log: logs/horovod-ws2.log)"}],
        "unavailable": [{"backend": "deepspeed-gpu", "reason": "deepspeed is not installed: pip install deepspeed"}],
    }


def collectives(transport: str = "torch", world_size: int = 2) -> dict[str, Any]:
    sizes = []
    for exp in range(10, 27, 2):  # 1 KiB .. 64 MiB
        busbw = 3.0 * (2**exp) / (2**exp + 2**20)
        sizes.append({"bytes": 2**exp, "time_us_mean": 10.0, "time_us_p50": 9.0, "algbw_gbps": busbw / 1.0,
                      "busbw_gbps": busbw, "correct": exp != 12})
    return {"kind": "collectives", "entries": [{"transport": transport, "backend": "gloo", "world_size": world_size,
                                                "device": "cpu", "sizes": sizes}]}


def write(path: Path, obj: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))
    return path


@pytest.fixture
def full_dir(tmp_path: Path) -> Path:
    """A compare run directory: reference/1, ddp/2 (an older and a newer result), deepspeed/2 with nulls,
    a compare summary and a collectives benchmark."""
    d = tmp_path / "results" / "20260101-000000"
    write(d / "runs" / "reference-ws1.json", run_result("reference", 1, capabilities=BASELINE, metrics_=metrics(
        comm_exposed_ms=0.0, comm_total_ms=None, comm_total_method=None, bucket_bytes=None, busbw_gbps=None,
        algbw_gbps=None, microbench_busbw_gbps=None, reasons={"comm_total_ms": "one process: no communication",
                                                              "bucket_bytes": "one process: no communication",
                                                              "busbw_gbps": "one process: no communication",
                                                              "algbw_gbps": "one process: no communication",
                                                              "microbench_busbw_gbps": "one process: no communication",
                                                              "tokens_per_s": "the mlp workload has no tokens"})))
    write(d / "runs" / "ddp-ws2-old.json", run_result("ddp", 2, 1_600_000_000.0, metrics_=metrics(samples_per_s=10.0),
                                                      capabilities=capabilities(multi_process=True)))
    write(d / "runs" / "ddp-ws2.json", run_result("ddp", 2, capabilities=capabilities(multi_process=True), metrics_=metrics(
        samples_per_s=150.0, stragglers=[{"rank": 1, "slowest_fraction": 0.8, "excess_ms_mean": 1.5}])))
    write(d / "runs" / "deepspeed-ws2.json", run_result("deepspeed", 2, metrics_=metrics(
        samples_per_s=120.0, compute_ms_p50=None, comm_total_ms=None, comm_total_method=None, bucket_bytes=8 * MIB,
        reasons={"compute_ms_p50": "deepspeed engine cannot switch gradient sync off at stage 0",
                 "comm_total_ms": "DeepSpeed keeps no communication counter on gloo"})))
    write(d / "compare.json", compare_summary(["reference/1", "ddp/2", "deepspeed/2"]))
    write(d / "bench" / "collectives-torch.json", collectives())
    mpi = collectives("mpi", 2)
    mpi["entries"].append({"transport": "mpi", "backend": None, "world_size": 4, "device": None, "sizes": [],
                           "status": "timeout", "error": "no result within 600 s"})
    mpi["unavailable"] = [{"transport": "horovod", "reason": "horovod is not installed"}]
    write(d / "bench" / "collectives-mpi.json", mpi)
    return d


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path.name} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


# -- pure helpers ---------------------------------------------------------------------------------
def test_scaling_efficiency_is_throughput_over_n_times_single_process() -> None:
    assert scaling_efficiency(150.0, 2, 100.0) == pytest.approx(0.75)
    assert scaling_efficiency(100.0, 1, 100.0) == pytest.approx(1.0)
    assert scaling_efficiency(None, 2, 100.0) is None
    assert scaling_efficiency(150.0, 2, None) is None
    assert scaling_efficiency(150.0, 2, 0.0) is None
    with pytest.raises(ValueError, match="world size"):
        scaling_efficiency(1.0, 0, 1.0)


def test_newest_run_per_backend_and_world_size_wins() -> None:
    old, new = run_result("ddp", 2, 100.0, tag="old"), run_result("ddp", 2, 200.0, tag="new")
    undated = run_result("ddp", 4, tag="undated")
    del undated["created_unix"]
    dated = run_result("ddp", 4, 1.0, tag="dated")
    ref = run_result("reference", 1, 50.0)
    chosen = report.newest_per_backend_world_size(map(RunResult, [new, old, undated, dated, ref]))
    assert [(r.backend, r.world_size, r.tag) for r in chosen] == [
        ("reference", 1, "reference/1"), ("ddp", 2, "new"), ("ddp", 4, "dated")]


def test_runs_are_ordered_as_the_registry_lists_backends_unknown_ones_after() -> None:
    names = ["zeta", *reversed(BACKENDS), "alpha"]
    chosen = report.newest_per_backend_world_size([RunResult(run_result(b, 1)) for b in names])
    assert [r.backend for r in chosen] == [*BACKENDS, "alpha", "zeta"]


def test_other_time_is_step_minus_compute_minus_exposed_floored_at_zero() -> None:
    assert other_ms(10.0, 6.0, 3.0) == pytest.approx(1.0)
    assert other_ms(10.0, 8.0, 3.0) == 0.0  # separate p50s can add up to more than the step
    assert other_ms(10.0, None, 3.0) is None
    assert other_ms(None, 6.0, 3.0) is None


def test_format_bytes_uses_binary_units() -> None:
    assert [report.format_bytes(b) for b in (512, 1024, 1536 * 1024, 64 * MIB, 2**30)] == [
        "512 B", "1 KiB", "1.5 MiB", "64 MiB", "1 GiB"]


def test_matrix_panels_first_step_and_max_over_steps() -> None:
    panels = report.matrix_panels(compare_summary(["ddp/2", "deepspeed/2"], steps=3)["matrix"])
    assert [p.title for p in panels] == ["step 0", "max over steps 0-2"]
    first, worst = panels
    assert first.columns == ["oracle", "ddp/2", "deepspeed/2"]
    assert first.values[0, 0] == pytest.approx(1.5)  # 1.5e-8 / 1e-8
    assert worst.values[1, 0] == pytest.approx(9.0)  # 3e-8 * step 3 / 1e-8
    assert first.values[0, 1] == 0.0 and worst.values[0, 2] == 0.0  # bitwise equal stays 0
    assert len(report.matrix_panels(compare_summary(["ddp/2"], steps=1)["matrix"])) == 1


def test_matrix_panels_unknown_floor_is_nan() -> None:
    matrix = {"labels": ["ddp/2"], "steps": [0], "per_step": {"0": {"ddp/2": {
        "rel_err": {"oracle": 1e-8, "ddp/2": 0.0}, "noise_floor": 0.0, "in_noise_floors": {"oracle": None, "ddp/2": None}}}}}
    (panel,) = report.matrix_panels(matrix)
    assert np.isnan(panel.values[0, 0]) and panel.values[0, 1] == 0.0


# -- the full report ---------------------------------------------------------------------------------
def test_full_report_has_four_plots_and_the_tables(full_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    path = report.build_report(full_dir, out)
    assert path == out / "report.md"
    for name in PLOTS:
        width, height = png_size(out / name)
        assert 600 <= width <= 4000 and 300 <= height <= 3000, (name, width, height)
        assert (out / name).stat().st_size > 15_000, name
    md = path.read_text()
    for heading in ("# dpcompare report", "## Environment", "## Is it the same computation?",
                    "## Unavailable backends", "## What does it cost?", "## Plots"):
        assert heading in md
    for name in PLOTS:
        assert f"]({name})" in md
    # verdict table: first divergence none, the failed horovod job from compare.json, the unavailable backend
    ddp_row = next(ln for ln in md.splitlines() if ln.startswith("| ddp | 2 | torchrun | mlp |"))
    assert ddp_row.startswith("| ddp | 2 | torchrun | mlp | equivalent | 1.25 | 2.50e-08 | n/a[^")
    assert ddp_row.endswith(" | none |")
    assert "**failed**" in md and "gloo: connection refused" in md
    assert "deepspeed is not installed: pip install deepspeed" in md
    # cost: efficiency from the newest ddp/2 (150, not 10) against reference/1 (100)
    assert "| ddp | 2 | 150 | 0.75 | 10.0 | 12.0 | 6.00 | 3.00 | 1.00 |" in md
    assert "| deepspeed | 2 | 120 | 0.60 |" in md
    assert "| reference | 1 | 100 | 1.00 |" in md
    assert "1 older result(s) for the same backend and world size superseded" in md
    assert "rank 1 (80% slowest, +1.5 ms)" in md
    assert "4.00 (ddp logging)" in md and "| 0.50 |" in md  # busbw / microbench = 1 / 2
    assert "tokens/s" not in md  # every run has it null: the column is left out
    assert "testhost" in md and "2.13.0" in md
    # microbenchmarks: best correct busbw per curve, the failed launch and the unavailable transport
    assert "| torch | gloo | 2 | cpu | ok | 9 | 2.95 | 64 MiB | 4 KiB |" in md
    assert "| mpi | - | 4 | - | timeout: no result within 600 s | 0 |" in md
    assert "unavailable: horovod is not installed" in md
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # no temporary file left behind


def checked_run(backend: str, world_size: int, equivalence: dict[str, Any], **fields: Any) -> dict[str, Any]:
    payload = run_result(backend, world_size, equivalence=equivalence, **fields)
    validate_result(payload)
    return payload


def _footnotes(md: str) -> dict[str, str]:
    return {ln.split(":", 1)[0]: ln.split(":", 1)[1].strip() for ln in md.splitlines() if ln.startswith("[^")}


def test_unverifiable_is_bold_with_its_reason_beside_the_update_and_trajectory_figures(tmp_path: Path) -> None:
    nothing_checked = {c: {"status": "unverifiable", "noise_ratio": None} for c in ("gradient", "update", "trajectory")}
    write(tmp_path / "runs" / "reference.json", checked_run("reference", 1, checked_equivalence()))
    write(tmp_path / "runs" / "ddp.json", checked_run("ddp", 2, checked_equivalence(
        "unverifiable", unverifiable_reason=UNVERIFIABLE_REASON, noise_ratio=None, max_rel_fro_err=None,
        noise_floor_rel_fro=None, checked_steps=[], drift=[], checks=nothing_checked)))
    write(tmp_path / "runs" / "deepspeed.json", checked_run("deepspeed", 2, checked_equivalence(
        "different", first_divergence={"step": 1, "parameter": "fc1.weight", "reason": "the update is twice the "
                                       "reference's: lr scaled by world size", "check": "update", "cause": "lr_scaled",
                                       "parameters": ["fc1.weight"]},
        checks={**checked_equivalence()["checks"], "update": {"status": "fail", "noise_ratio": 9.0e6,
                                                              "norm_ratio": 2.0}})))
    write(tmp_path / "runs" / "ddp-accum.json", checked_run("ddp", 2, checked_equivalence(
        "unverifiable", unverifiable_reason=UNVERIFIABLE_REASON), config={"grad_accum": 4}))
    md = report.build_report(tmp_path).read_text()
    assert "| reference | 1 | python | mlp | equivalent | 1.25 | 2.50e-08 | 3.50 | 1.0010 | 2.25 | 3e-06 | none |" in md
    assert ("| deepspeed | 2 | torchrun | mlp | **different** | 1.25 | 2.50e-08 | 9000000.00 | 2.0000 | 2.25 | 3e-06 | step 1 "
            "(update check), `fc1.weight`: the update is twice the reference's: lr scaled by world size |") in md
    ddp_row = next(ln for ln in md.splitlines() if ln.startswith("| ddp | 2 | torchrun |"))
    cells = ddp_row.strip("| ").split(" | ")
    assert cells[4] == "**unverifiable**" and cells[-1] == UNVERIFIABLE_REASON
    assert all(c.startswith("n/a[^") for c in cells[5:10]), cells
    assert {_footnotes(md)[c[3:]] for c in cells[5:10]} == {UNVERIFIABLE_REASON}  # one reason, one footnote
    assert "the update against a float64 optimizer step" in md and "catches:" in md  # the checks are explained
    assert "| ddp | 2 | grad_accum=4 | **unverifiable** |" in md  # the sweep table too


def test_what_a_backend_computes_beside_a_single_process_is_listed_under_the_verdicts(tmp_path: Path) -> None:
    """Per-replica BatchNorm and buffers that differ by rank are equivalent and stated; other notes stay out, and a
    run without them adds no list (the twin)."""
    per_replica = "BatchNorm without --sync-bn (2 module(s): 1, 4): ... 4.31e+05x the float32 noise floor"
    notes = [{"code": "per_replica_batchnorm", "text": per_replica},
             {"code": "buffers_per_rank", "text": "module buffers differ across ranks after the step: 1.running_mean"},
             {"code": "division_order", "text": "ddp divides each gradient by 3 before summing"}]
    write(tmp_path / "runs" / "ddp.json", checked_run("ddp", 2, checked_equivalence(notes=notes)))
    md = report.build_report(tmp_path).read_text()
    assert f"- ddp ws=2 mlp (`per_replica_batchnorm`): {per_replica}" in md
    assert "- ddp ws=2 mlp (`buffers_per_rank`): module buffers differ across ranks" in md
    assert "division_order" not in md
    write(tmp_path / "runs" / "ddp.json", checked_run("ddp", 2, checked_equivalence()))
    assert "What the backends compute beside the single process" not in report.build_report(tmp_path).read_text()


def test_a_result_written_before_the_update_and_trajectory_checks_is_na_with_why(tmp_path: Path) -> None:
    old = run_result("ddp", 2)  # no checks, unverifiable_reason, stochastic or parameters
    assert "checks" not in old["equivalence"]
    write(tmp_path / "old.json", old)
    write(tmp_path / "new.json", checked_run("reference", 1, checked_equivalence(
        checks={**checked_equivalence()["checks"], "trajectory": {"status": "off", "noise_ratio": None}})))
    md = report.build_report(tmp_path).read_text()
    footnotes = _footnotes(md)
    old_cells = next(ln for ln in md.splitlines() if ln.startswith("| ddp | 2 |")).strip("| ").split(" | ")
    assert old_cells[5:7] == ["1.25", "2.50e-08"]  # the gradient figures it has
    assert all(footnotes[c[3:]].startswith("this result has no equivalence.checks (written before") for c in old_cells[7:10])
    new_cells = next(ln for ln in md.splitlines() if ln.startswith("| reference | 1 |")).strip("| ").split(" | ")
    assert new_cells[7:9] == ["3.50", "1.0010"]
    assert footnotes[new_cells[9][3:]] == "the trajectory check did not run (checks.trajectory.status: off)"


def test_report_console_summary_shows_unverifiable_in_yellow(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    write(tmp_path / "ddp.json", checked_run("ddp", 2, checked_equivalence(
        "unverifiable", unverifiable_reason=UNVERIFIABLE_REASON)))
    write(tmp_path / "ref.json", checked_run("reference", 1, checked_equivalence()))
    monkeypatch.setenv("FORCE_COLOR", "1")  # rich colours a captured stream only when forced
    monkeypatch.setenv("TERM", "xterm")
    assert report.main(argparse.Namespace(dir=str(tmp_path), out=None, link_peak_gbps=None)) == 0
    out = capsys.readouterr().out
    assert "\x1b[33munverifiable" in out and "\x1b[32mequivalent" in out


def test_matrix_panels_cell_not_comparable_is_nan() -> None:
    # Random forwards at different world sizes: compare writes null for the pair, with the reason beside it.
    matrix = {"labels": ["reference/1", "ddp/2"], "steps": [0], "per_step": {"0": {
        "reference/1": {"rel_err": {"oracle": 1e-8, "reference/1": 0.0, "ddp/2": None}, "noise_floor": 1e-8,
                        "in_noise_floors": {"oracle": 1.0, "reference/1": 0.0, "ddp/2": None},
                        "not_comparable": {"ddp/2": "different masks"}},
        "ddp/2": {"rel_err": {"oracle": 2e-8, "reference/1": None, "ddp/2": 0.0}, "noise_floor": 1e-8,
                  "in_noise_floors": {"oracle": 2.0, "reference/1": None, "ddp/2": 0.0},
                  "not_comparable": {"reference/1": "different masks"}}}}}
    (panel,) = report.matrix_panels(matrix)
    assert np.isnan(panel.values[0, 2]) and np.isnan(panel.values[1, 1])
    assert panel.values[0, 0] == pytest.approx(1.0) and panel.values[1, 2] == 0.0


def test_nulls_are_na_with_their_reason_as_footnote(full_dir: Path) -> None:
    md = report.build_report(full_dir).read_text()
    lines = md.splitlines()
    footnotes = {ln.split(":", 1)[0]: ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("[^")}
    deepspeed_row = next(ln for ln in lines if ln.startswith("| deepspeed | 2 | 120 |"))
    compute_cell = deepspeed_row.split(" | ")[6]
    assert compute_cell.startswith("n/a[^")
    assert footnotes[compute_cell[3:]] == "deepspeed engine cannot switch gradient sync off at stage 0"
    assert "DeepSpeed keeps no communication counter on gloo" in footnotes.values()
    assert any(v.startswith("other = step_ms_p50 - compute_ms_p50 - comm_exposed_ms needs all three; n/a: compute_ms_p50")
               for v in footnotes.values())
    # the same reason twice is one footnote
    assert list(footnotes.values()).count("one process: no communication") == 1


def test_results_without_metrics_are_all_na_and_throughput_plot_is_skipped(tmp_path: Path) -> None:
    write(tmp_path / "a.json", run_result("reference", 1))
    write(tmp_path / "b.json", run_result("ddp", 2))
    md = report.build_report(tmp_path).read_text()
    assert "this result has no metrics" in md
    assert f"Skipped `{report.PLOT_THROUGHPUT}`: no run recorded samples_per_s" in md
    assert not (tmp_path / report.PLOT_THROUGHPUT).exists()
    write(tmp_path / "b.json", run_result("ddp", 2, metrics=None))  # measurement phase off
    assert "the run measured nothing (metrics: null)" in report.build_report(tmp_path).read_text()
    assert f"Skipped `{report.PLOT_HEATMAP}`: no compare summary" in md


def test_missing_collectives_skips_the_busbw_plot_and_says_why(full_dir: Path) -> None:
    for f in (full_dir / "bench").iterdir():
        f.unlink()
    md = report.build_report(full_dir).read_text()
    assert not (full_dir / report.PLOT_BUSBW).exists()
    assert f"Skipped `{report.PLOT_BUSBW}`: no collectives microbenchmark" in md
    assert (full_dir / report.PLOT_THROUGHPUT).exists()


def test_peak_line_is_given_or_best_observed(full_dir: Path, tmp_path: Path) -> None:
    md = report.build_report(full_dir).read_text()
    assert "best bus bandwidth any microbenchmark reached" in md
    md = report.build_report(full_dir, tmp_path / "given", link_peak_gbps=25.0).read_text()
    assert "link peak given with --link-peak-gbps: 25 GB/s" in md
    with pytest.raises(ValueError, match="--link-peak-gbps"):
        report.build_report(full_dir, link_peak_gbps=0.0)


def test_malformed_json_is_skipped_with_a_warning(full_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    broken = write(full_dir / "runs" / "broken.json", {})
    broken.write_text('{"schema_version": 1, "backend": ')
    write(full_dir / "runs" / "bad-ws.json", {**run_result("ddp", 2), "world_size": 0})
    write(full_dir / "runs" / "bad-metric.json", run_result("dp", 1, metrics_=metrics(samples_per_s="fast", stragglers=[None])))
    write(full_dir / "ds_config.json", {"train_batch_size": 8})  # someone else's JSON: ignored quietly
    md = report.build_report(full_dir).read_text()
    err = capsys.readouterr().err
    assert f"dpcompare: warning: skipped {broken}: not readable JSON" in err
    assert "bad-ws.json: world_size 0 is not a positive whole number" in err
    assert "## Inputs not used" in md and "broken.json" in md
    assert "metrics.samples_per_s is 'fast', not a number" in md  # a wrong type is n/a with why, not a crash
    assert "1 JSON file(s) that are not dpcompare results were ignored" in md


def test_collectives_only_directory_still_reports(tmp_path: Path) -> None:
    write(tmp_path / "c.json", collectives())
    md = report.build_report(tmp_path).read_text()
    assert (tmp_path / report.PLOT_BUSBW).exists()
    assert "### Collective microbenchmarks" in md and "No run results" in md


def test_mixed_batches_are_flagged_for_strong_scaling_only(tmp_path: Path) -> None:
    write(tmp_path / "strong" / "a.json", run_result("reference", 1, metrics_=metrics()))
    write(tmp_path / "strong" / "b.json", run_result("ddp", 2, metrics_=metrics(), global_batch=48))
    assert "the runs mix global batches (24, 48)" in report.build_report(tmp_path / "strong").read_text()
    weak = {"scaling": "weak", "local_batch": 24}
    write(tmp_path / "weak" / "a.json", run_result("reference", 1, metrics_=metrics(scaling="weak"), **weak))
    write(tmp_path / "weak" / "b.json", run_result("ddp", 2, metrics_=metrics(scaling="weak"), global_batch=48, **weak))
    md = report.build_report(tmp_path / "weak").read_text()
    assert "scaling: weak" in md and "the runs mix" not in md


def test_report_imports_no_torch_and_no_adapter() -> None:
    code = ("import sys, dpcompare.commands.report; bad = [m for m in sys.modules if m == 'torch' or "
            "m.startswith('dpcompare.adapters')]; print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_empty_or_missing_directory_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="holds no dpcompare result JSON"):
        report.build_report(tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        report.build_report(tmp_path / "nowhere")


# -- the scaling baseline and verdict notes ------------------------------------------------------------
def _row(md: str, start: str) -> list[str]:
    return next(ln for ln in md.splitlines() if ln.startswith(start)).strip("| ").split(" | ")


def test_a_world_size_1_run_that_declares_itself_the_scaling_baseline_is_the_baseline_whatever_its_name(
        tmp_path: Path) -> None:
    write(tmp_path / "mine-ws1.json", run_result("mine", 1, capabilities=BASELINE,
                                                 metrics_=metrics(samples_per_s=50.0)))
    write(tmp_path / "mine-ws2.json", run_result("mine", 2, capabilities=capabilities(True, multi_process=True),
                                                 metrics_=metrics(samples_per_s=80.0)))  # world size 2: never one
    write(tmp_path / "reference-ws1.json", run_result("reference", 1, metrics_=metrics()))  # declares nothing
    write(tmp_path / "ddp-ws2.json", run_result("ddp", 2, capabilities=capabilities(multi_process=True),
                                                metrics_=metrics(samples_per_s=150.0)))
    inputs = report.load_inputs(tmp_path)
    baseline = report.scaling_baseline(report.newest_per_backend_world_size(inputs.runs))
    assert (baseline.run.backend, baseline.run.world_size, baseline.throughput) == ("mine", 1, 50.0)
    md = report.build_report(tmp_path).read_text()
    assert _row(md, "| ddp | 2 | 150 |")[3] == "1.50"  # 150 / (2 x 50)
    assert _row(md, "| reference | 1 | 100 |")[3] == "2.00"
    assert _row(md, "| mine | 1 | 50.0 |")[3] == "1.00"
    assert _row(md, "| mine | 2 | 80.0 |")[3] == "0.80"
    assert "the scaling baseline's (mine/1) samples/s" in md
    # two declare it at world size 1: the newest is the baseline
    write(tmp_path / "other-ws1.json", run_result("other", 1, 1_800_000_000.0, capabilities=BASELINE,
                                                  metrics_=metrics(samples_per_s=75.0)))
    md = report.build_report(tmp_path).read_text()
    assert _row(md, "| ddp | 2 | 150 |")[3] == "1.00"  # 150 / (2 x 75)


@pytest.mark.parametrize("declared", [None, capabilities(scaling_baseline=False)], ids=["no-capabilities", "false"])
def test_a_reference_run_that_does_not_declare_itself_the_scaling_baseline_is_not_one(
        tmp_path: Path, declared: dict[str, Any] | None) -> None:
    fields = {} if declared is None else {"capabilities": declared}
    write(tmp_path / "reference-ws1.json", run_result("reference", 1, metrics_=metrics(), **fields))
    write(tmp_path / "ddp-ws2.json", run_result("ddp", 2, capabilities=capabilities(multi_process=True),
                                                metrics_=metrics(samples_per_s=150.0)))
    md = report.build_report(tmp_path).read_text()
    footnotes = _footnotes(md)
    for start in ("| reference | 1 | 100 |", "| ddp | 2 | 150 |"):
        efficiency = _row(md, start)[3]
        assert efficiency.startswith("n/a[^"), efficiency
        reason = footnotes[efficiency[3:]]
        assert reason.startswith("no run at world size 1 declares itself the scaling baseline "
                                 "(capabilities.scaling_baseline)"), reason
        assert "python -m dpcompare --backend reference" in reason
    assert "No ideal line: no run at world size 1 declares itself the scaling baseline" in md
    assert "0.75" not in md


def test_a_scaling_baseline_without_samples_per_s_says_so(tmp_path: Path) -> None:
    write(tmp_path / "reference-ws1.json", run_result("reference", 1, capabilities=BASELINE,
                                                      metrics_=metrics(samples_per_s=None, reasons={})))
    write(tmp_path / "ddp-ws2.json", run_result("ddp", 2, metrics_=metrics(samples_per_s=150.0)))
    md = report.build_report(tmp_path).read_text()
    efficiency = _row(md, "| ddp | 2 | 150 |")[3]
    assert _footnotes(md)[efficiency[3:]].startswith("the scaling baseline reference/1 has no samples_per_s: ")


def test_verdict_notes_load_as_objects_and_as_plain_strings(tmp_path: Path) -> None:
    coded = [{"code": "ddp.bucket_order", "text": "DDP reduces buckets in reverse registration order"}]
    plain = ["written before notes carried a code"]
    write(tmp_path / "ddp.json", checked_run("ddp", 2, checked_equivalence(notes=coded)))
    write(tmp_path / "reference.json", checked_run("reference", 1, checked_equivalence(notes=plain),
                                                   capabilities=BASELINE))
    inputs = report.load_inputs(tmp_path)
    assert not inputs.skipped and inputs.ignored == 0
    notes = {r.backend: r.equivalence.notes for r in inputs.runs}
    assert [(n.code, n.text) for n in notes["ddp"]] == [("ddp.bucket_order", coded[0]["text"])]
    assert [(n.code, n.text) for n in notes["reference"]] == [(None, plain[0])]
    md = report.build_report(tmp_path).read_text()
    assert _row(md, "| ddp | 2 | torchrun |")[4] == "equivalent"
    assert _row(md, "| reference | 1 | python |")[4] == "equivalent"


# -- command line ----------------------------------------------------------------------------------------
def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dpcompare", "report", *args], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).parent.parent)


def test_cli_nonexistent_directory_is_one_error_line_exit_2() -> None:
    proc = _cli("/nonexistent")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dpcompare: error:"), proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_cli_writes_the_report_and_prints_its_path(full_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "cli-out"
    proc = _cli(str(full_dir), "--out", str(out), "--link-peak-gbps", "10")
    assert proc.returncode == 0, proc.stderr
    assert f"report: {out / 'report.md'}" in proc.stdout
    assert "0.75" in proc.stdout
    assert all((out / name).exists() for name in PLOTS)


# -- trajectory drift plot ---------------------------------------------------------------------------
def drift_entries(world_size: int, steps: int = 6, *, fail_from: int | None = None) -> list[dict[str, Any]]:
    """Drift as a run writes it: distance growing with the step, the float32 floor shared by every run, the
    tolerance growing with world size; from step `fail_from` on the distance is 100x the tolerance (ok: false)."""
    entries = []
    for step in range(steps):
        floor, tolerance = 2e-8 * (step + 1), 4 * (2e-8 * (step + 1) + (step + 1) * world_size * 2.0**-24)
        distance = 1.5 * floor if fail_from is None or step < fail_from else 100 * tolerance
        entries.append({"step": step, "rel_param_distance": distance, "floor_rel_param_distance": floor,
                        "noise_ratio": distance / floor, "tolerance": tolerance, "ok": distance <= tolerance,
                        "worst_parameter": "fc1.weight"})
    return entries


def _section(md: str, heading: str) -> str:
    start = md.index(heading)
    end = md.find("\n## ", start + len(heading))
    return md[start:end if end >= 0 else len(md)]


def test_trajectory_drift_plot_is_drawn_and_referenced_beside_the_verdict(tmp_path: Path) -> None:
    write(tmp_path / "runs" / "reference.json", checked_run("reference", 1, checked_equivalence(drift=drift_entries(1))))
    write(tmp_path / "runs" / "ddp.json", checked_run("ddp", 2, checked_equivalence(
        "different", drift=drift_entries(2, fail_from=3))))
    md = report.build_report(tmp_path).read_text()
    png = tmp_path / report.PLOT_TRAJECTORY
    width, height = png_size(png)
    assert 600 <= width <= 4000 and 300 <= height <= 3000, (width, height)
    assert png.stat().st_size > 15_000
    section = _section(md, "## Is it the same computation?")
    assert f"![Trajectory drift]({report.PLOT_TRAJECTORY})" in section
    assert section.index("| reference | 1 |") < section.index(report.PLOT_TRAJECTORY)  # after the verdict table
    assert "parameter distance to a float64 single process" in section


def test_no_drift_values_skips_the_trajectory_plot_and_says_why(tmp_path: Path) -> None:
    null = [{"step": 0, "rel_param_distance": None, "floor_rel_param_distance": None, "noise_ratio": None,
             "tolerance": None, "ok": None, "worst_parameter": None}]
    write(tmp_path / "reference.json", checked_run("reference", 1, checked_equivalence(drift=null)))
    write(tmp_path / "ddp.json", checked_run("ddp", 2, checked_equivalence(drift=[])))
    (tmp_path / report.PLOT_TRAJECTORY).write_bytes(PNG_SIGNATURE)  # a stale plot from an earlier report
    md = report.build_report(tmp_path).read_text()
    assert not (tmp_path / report.PLOT_TRAJECTORY).exists()
    why = report.plot_trajectory_drift(report.load_inputs(tmp_path).runs, tmp_path / "unused.png")
    assert why and not (tmp_path / "unused.png").exists()
    assert f"Skipped `{report.PLOT_TRAJECTORY}`: {why}." in _section(md, "## Is it the same computation?")


def test_old_style_drift_entries_still_plot(tmp_path: Path) -> None:
    old = [{"step": s, "rel_param_distance": 3e-8 * (s + 1)} for s in range(4)]
    write(tmp_path / "ddp.json", checked_run("ddp", 2, checked_equivalence(drift=old)))
    write(tmp_path / "reference.json", run_result("reference", 1))  # drift: [] beside it
    md = report.build_report(tmp_path).read_text()
    width, height = png_size(tmp_path / report.PLOT_TRAJECTORY)
    assert width >= 600 and height >= 300
    assert f"]({report.PLOT_TRAJECTORY})" in md


@pytest.mark.parametrize(("floors", "calm"), [(0.0, True), (0.67, True), (3.0, True), (10.0, True), (10.5, False),
                                              (400.0, False), (5e6, False)])
def test_heatmap_colours_are_calm_within_tolerance_and_alarming_outside(floors: float, calm: bool) -> None:
    from dpcompare.commands.report.plots_verify import heatmap_scale

    norm, cmap = heatmap_scale(10.0)
    r, g, b, _ = cmap(norm(np.array([floors])))[0]
    assert (g > r) == calm, (floors, r, g, b)  # green within tolerance, red beyond it


def test_heatmap_tolerance_comes_from_the_runs() -> None:
    from dpcompare.commands.report.plots_verify import tolerance_floors

    assert tolerance_floors([RunResult({"equivalence": {"tolerance": {"factor": 25.0}}}), RunResult({})]) == 25.0
    assert tolerance_floors([RunResult({})]) == 10.0


def test_deepspeeds_engine_recipe_changes_a_knob_and_shows_its_master_copies() -> None:
    """compare --amp runs deepspeed's engine recipe beside its autocast run: the engine run records the knob it
    changes (its own row, with its fp32 master copies), never the baseline the cost tables report; the autocast run
    records none and is the baseline."""
    from dpcompare.commands.report.markdown_sweep import sweep_section

    engine = RunResult({"backend": "deepspeed", "world_size": 2, "knobs": {"amp_recipe": "engine"},
                        "config": {"amp": "bf16", "options": {"amp_recipe": "engine"}},
                        "equivalence": {"verdict": "equivalent", "max_rel_fro_err": 4.6e-3},
                        "metrics": {"model_state_mib": {"total": 10.6, "master_params": 3.03}}})
    autocast = RunResult({"backend": "deepspeed", "world_size": 2, "knobs": {},
                          "config": {"amp": "bf16", "options": {"amp_recipe": "autocast"}}})
    assert engine.knob_label == "amp_recipe=engine"
    assert autocast.knob_label == "" and RunResult({"config": {}}).knob_label == ""
    text = "\n".join(sweep_section([engine]))
    assert "amp_recipe=engine" in text and "10.6 (3.03 fp32 master)" in text, text


def test_the_verdicts_say_which_runs_ran_under_which_precision_recipe() -> None:
    """A bf16 run's errors are ~1e-3: the report says which recipe each run ran, so its floor reads right; runs
    without --amp add no line (the twin)."""
    from dpcompare.commands.report.markdown_verdict import _precision_lines

    def run(backend: str, ws: int, precision: dict | None) -> RunResult:
        return RunResult({"backend": backend, "world_size": ws, "equivalence": {"precision": precision}})

    bf16 = {"amp": "bf16", "recipe": "autocast", "description": "torch.autocast(bfloat16), float32 weights and optimizer",
            "loss_scaler": None, "skipped_steps": []}
    fp16 = {"amp": "fp16", "recipe": "autocast", "description": "torch.autocast(float16), float32 weights and optimizer",
            "loss_scaler": "torch.amp.GradScaler", "skipped_steps": [0, 1]}
    lines = _precision_lines([run("ddp", 2, bf16), run("horovod", 2, bf16), run("ddp", 1, fp16),
                              run("reference", 1, None)])
    text = "\n".join(lines)
    assert "`--amp bf16`, autocast recipe (torch.autocast(bfloat16), float32 weights and optimizer): ddp ws=2, horovod ws=2" in text
    assert "`--amp fp16`, autocast recipe" in text and "ddp ws=1 (skipped 0, 1)" in text and "reference" not in text
    assert _precision_lines([run("ddp", 2, None), run("ddp", 1, {"amp": "none"})]) == []


# -- runs that change a knob (compare --backends deepspeed:zero2, --sweep, --amp's engine recipe) ------------------
def _deepspeed(stage: int | None, created_unix: float, samples: float, state_total: float, **fields: Any):
    """A deepspeed result as a run writes it: its named variant and the knobs it changes (zero_stage away from its
    default 0) recorded."""
    tag = f"deepspeed:zero{stage}/2" if stage is not None else "deepspeed/2"
    options = {} if stage is None else {"zero_stage": stage}
    return run_result("deepspeed", 2, created_unix, capabilities=capabilities(multi_process=True), tag=tag,
                      variant=f"zero{stage}" if stage else "", knobs={"zero_stage": stage} if stage else {},
                      config={"optimizer": "adamw", "options": options},
                      metrics_=metrics(samples_per_s=samples, model_state_mib={
                          "params": 3.0, "grads": 1.5, "optimizer": 3.0, "comm_buffers": 3.0, "total": state_total}),
                      **fields)


def test_a_zero_stage_run_is_its_own_row_never_the_deepspeed_baseline(tmp_path: Path) -> None:
    """compare --backends deepspeed:zero0,deepspeed:zero2 (--opt zero_stage=N): stage 2 records the knob it changes and
    is a row of its own named `deepspeed ... zero_stage=2`, even when it is the newest deepspeed run at world size 2;
    stage 0, deepspeed's default, records none and is the deepspeed row of the cost tables."""
    write(tmp_path / "reference-ws1.json", run_result("reference", 1, capabilities=BASELINE, metrics_=metrics()))
    write(tmp_path / "zero0.json", _deepspeed(0, 1_700_000_000.0, 120.0, 15.0))
    write(tmp_path / "zero2.json", _deepspeed(2, 1_700_000_100.0, 90.0, 12.1))  # the newer one
    sel = report.build.select(report.load_inputs(tmp_path))
    assert [(r.backend, r.world_size, r.tag) for r in sel.runs] == [
        ("reference", 1, "reference/1"), ("deepspeed", 2, "deepspeed:zero0/2")]
    assert [(r.tag, r.knob_label) for r in sel.knob_runs] == [("deepspeed:zero2/2", "zero_stage=2")]
    md = report.build_report(tmp_path).read_text()
    assert "| deepspeed | 2 | 120 | 0.60 |" in md and "| deepspeed | 2 | 90.0 |" not in md  # costs: stage 0
    costs, sweep = md.split("## Sweep", 1)
    assert _row(sweep, "| deepspeed | 2 | zero_stage=2 |")[-1] == "12.1"  # its own row, with its model state
    memory = costs[costs.index("### Memory (MiB)"):]
    assert _row(memory, "| deepspeed | 2 | zero_stage=2 |"), "the knob's run has a row of its own in the memory table"
    assert "| backend | ws | knob | peak |" in memory
    assert "1 run(s) with a knob changed" in md and "0 older result(s)" in md
    # Twin: a run that recorded no knob is the baseline, whatever its tag says (the report reads, never derives).
    write(tmp_path / "zero2.json", {**_deepspeed(2, 1_700_000_100.0, 90.0, 12.1), "knobs": {}})
    sel = report.build.select(report.load_inputs(tmp_path))
    assert [r.tag for r in sel.runs] == ["reference/1", "deepspeed:zero2/2"] and sel.knob_runs == []


@pytest.mark.parametrize(("fields", "expected"), [
    ({"knobs": {"zero_stage": 2}}, "zero_stage=2"),
    ({"knobs": {"amp_recipe": "engine", "zero_stage": 3}}, "amp_recipe=engine zero_stage=3"),  # in the order recorded
    ({"knobs": {"reshard_after_forward": False}}, "reshard_after_forward=false"),  # as --opt takes it
    ({"knobs": {"bucket_mb": 0.01}}, "bucket_mb=0.01"), ({"knobs": {"bucket_mb": 25.0}}, "bucket_mb=25"),
    ({"knobs": {"grad_accum": 4, "compression": "fp16"}}, "grad_accum=4 compression=fp16"),
    # The record is what counts: a tag, a variant and options that say otherwise are not read.
    ({"knobs": {}, "tag": "deepspeed:zero2/2", "variant": "zero2", "config": {"options": {"zero_stage": 2}}}, ""),
    # Written before knobs were recorded: the sweep flags (their defaults of then) and the named variant.
    ({"variant": "hybrid", "config": {"grad_accum": 2}}, "variant=hybrid grad_accum=2"),
    ({"config": {"bucket_mb": 25.0, "compression": "none"}}, "bucket_mb=25"),
    ({"tag": "fsdp:hybrid/2", "config": {"options": {"mesh": "2x1"}}}, ""),
])
def test_a_runs_knobs_are_read_as_it_recorded_them(fields, expected) -> None:
    assert RunResult({"backend": "deepspeed", "world_size": 2, **fields}).knob_label == expected


def test_a_failed_variant_job_is_listed_though_its_backend_succeeded(tmp_path: Path) -> None:
    """deepspeed:zero2/2 failed and deepspeed/2 (stage 0) wrote its result: the failure is a row of its own (jobs are
    matched by label, not by backend and world size); the successful label is not listed as failed."""
    write(tmp_path / "runs" / "deepspeed-ws2.json", run_result("deepspeed", 2, metrics_=metrics()))
    summary = compare_summary(["deepspeed/2"])
    summary["runs"] = [{"label": "deepspeed/2", "entry": "deepspeed", "backend": "deepspeed", "world_size": 2,
                        "status": "equivalent", "verdict": "equivalent"},
                       {"label": "deepspeed:zero2/2", "entry": "deepspeed:zero2", "backend": "deepspeed", "world_size": 2,
                        "status": "failed", "verdict": None, "error": "ZeRO-2 rank 1 exited 4"}]
    write(tmp_path / "compare.json", summary)
    md = report.build_report(tmp_path).read_text()
    assert any(ln.startswith("| deepspeed:zero2 | 2 |") and "ZeRO-2 rank 1 exited 4" in ln for ln in md.splitlines()), md
    assert not any(ln.startswith("| deepspeed | 2 |") and "failed" in ln.lower() for ln in md.splitlines())
