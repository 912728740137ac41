"""`python -m dpcompare project`: the alpha-beta formulas, the fit, bad input and the validation printout."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from dpcompare import SCHEMA_VERSION, cli
from dpcompare.commands.project import model
from dpcompare.commands.project.fit import BACKWARD_SHARE, oversubscription, sched_slice_s

ALPHA, BETA = 50e-6, 1e9  # 50 us, 1 GB/s
GRAD = 4_000_000  # bytes per step, one bucket
C0, C1 = 5.0, 0.05  # compute ms = C0 + C1 * per-rank batch
GLOBAL = 2400
OVERLAP = 0.25


# -- the formulas against hand-computed values ------------------------------------------------------------
def test_ring_allreduce_by_hand():
    # N=4, S=1 MB, alpha 10 us, beta 1 GB/s: 2*3*10 us + 2*3/4 * 1e6/1e9 s = 60 us + 1.5 ms
    assert model.ring_allreduce_s(1e6, 4, 10e-6, 1e9) == pytest.approx(60e-6 + 1.5e-3)
    assert model.ring_allreduce_s(1e6, 1, 10e-6, 1e9) == 0.0


def test_tree_allreduce_by_hand():
    # N=8: 2*3*alpha + 2*S/beta; N=5: ceil(log2 5) = 3
    assert model.tree_allreduce_s(1e6, 8, 10e-6, 1e9) == pytest.approx(60e-6 + 2e-3)
    assert model.tree_allreduce_s(1e6, 5, 10e-6, 1e9) == pytest.approx(60e-6 + 2e-3)


def test_halves_and_auto_choice():
    assert model.ring_half_s(1e6, 4, 10e-6, 1e9) == pytest.approx(30e-6 + 0.75e-3)
    # a small message at N=512: the tree's log latency wins; a large one at N=4: the ring's 1/N saving wins
    t, algo = model.collective_s("all_reduce", 1e3, 512, 10e-6, 1e9, "auto")
    assert algo == "tree" and t == pytest.approx(2 * 9 * 10e-6 + 2e-6)
    assert model.collective_s("all_reduce", 1e8, 4, 10e-6, 1e9, "auto")[1] == "ring"
    with pytest.raises(ValueError):
        model.collective_s("all_to_all", 1e3, 4, 1e-6, 1e9)


def _entry(n, alpha=ALPHA, beta=BETA, transport="torch"):
    sizes = []
    for s in (1024 * 4 ** i for i in range(8)):
        t = model.ring_allreduce_s(s, n, alpha, beta)
        sizes.append({"bytes": s, "time_us_p50": t * 1e6, "busbw_gbps": s * 2 * (n - 1) / n / t / 1e9})
    return {"transport": transport, "backend": "gloo", "world_size": n, "status": "ok", "sizes": sizes}


def test_fit_recovers_known_alpha_beta():
    link = model.link_from_collectives("synthetic", [_entry(2), _entry(3), _entry(4)], None)
    assert link.alpha_s == pytest.approx(ALPHA, rel=1e-6)
    assert link.beta_Bps == pytest.approx(BETA, rel=1e-6)
    assert link.fit_rms_rel_error == pytest.approx(0, abs=1e-9)
    only2 = model.link_from_collectives("synthetic", [_entry(2), _entry(4, alpha=1.0)], {2})
    assert only2.alpha_s == pytest.approx(ALPHA, rel=1e-6)  # the world-size-4 entry is kept out


def test_oversubscribed_compute_takes_the_fullest_core_and_the_slice_scales_with_the_cpus():
    """3 ranks on 2 cores run as 2 + 1: a step takes two ranks' work (not 1.5); the kernel's base slice is
    0.75 ms * (1 + ilog2(min(cpus, 8)))."""
    assert [oversubscription(n, 2) for n in (1, 2, 3, 4, 5)] == [1.0, 1.0, 2.0, 2.0, 3.0]
    assert oversubscription(64, None) == 1.0  # one device per rank
    assert [sched_slice_s(c) * 1e3 for c in (1, 2, 4, 8, 64)] == pytest.approx([0.75, 1.5, 2.25, 3.0, 3.0])


def test_fit_needs_two_sizes():
    with pytest.raises(ValueError, match="at least 2 message sizes"):
        model.fit_alpha_beta([(2, 1e3, 1e-3)])


# -- synthetic results ----------------------------------------------------------------------------------------
def _truth(n, slots):
    compute = (C0 + C1 * GLOBAL / n) * math.ceil(n / slots)
    t_comm = model.ring_allreduce_s(GRAD, n, ALPHA, BETA) * 1e3
    if n > slots:  # oversubscribed: every ring step waits one scheduler slice
        t_comm += 2 * (n - 1) * sched_slice_s(slots) * 1e3
    exposed = max(0.0, t_comm - min(OVERLAP * t_comm, BACKWARD_SHARE * compute))
    return compute, t_comm, exposed


def _run(backend, n, slots, launcher="torchrun", skew=1.0):
    compute, t_comm, exposed = _truth(n, slots)
    metrics = {"scaling": "strong", "step_ms_p50": (compute + exposed) * skew, "grad_bytes_per_step": GRAD,
               "bucket_bytes": GRAD}
    if n > 1:
        metrics.update(compute_ms_p50=compute, comm_total_ms=t_comm, comm_exposed_ms=exposed, overlap_fraction=OVERLAP)
    return {"schema_version": SCHEMA_VERSION, "backend": backend, "world_size": n, "device": "cpu",
            "global_batch": GLOBAL, "local_batch": GLOBAL // n, "scaling": "strong", "config": {}, "tag": None,
            "capabilities": {"native_launcher": launcher}, "env": {"cpu_count": slots}, "created_unix": 1.0 + n,
            "metrics": metrics}


def _folder(tmp_path: Path, slots=8, sizes=(1, 2, 3, 4), skew4=1.0) -> Path:
    d = tmp_path / "results" / "20260101-000000"
    (d / "runs").mkdir(parents=True)
    for backend in ("ddp", "horovod"):
        for n in sizes:
            run = _run(backend, n, slots, "torchrun" if backend == "ddp" else "horovodrun",
                       skew4 if n == 4 else 1.0)
            (d / "runs" / f"{backend}-ws{n}.json").write_text(json.dumps(run))
    coll = {"schema_version": 1, "kind": "collectives",
            "entries": [_entry(n, transport=t) for n in sizes if n > 1 for t in ("torch", "horovod")]}
    (d / "collectives.json").write_text(json.dumps(coll))
    return d


def test_projection_recovers_the_synthetic_truth(tmp_path, capsys):
    d = _folder(tmp_path)
    assert cli.main(["project", str(d), "--world-sizes", "8,64", "--link", "measured", "--fit-world-sizes", "1,2"]) == 0
    out = capsys.readouterr().out
    payload = json.loads((d / "projection.json").read_text())
    assert payload["kind"] == "projection" and payload["held_out_world_sizes"] == [3, 4]
    assert payload["link"]["alpha_us"] == pytest.approx(ALPHA * 1e6, rel=1e-6)
    for p in payload["predictions"]:
        compute, t_comm, exposed = _truth(p["world_size"], 8)
        assert p["step_ms"] == pytest.approx(compute + exposed, rel=1e-6)
        assert p["comm_exposed_ms"] == pytest.approx(exposed, rel=1e-6)
    v = payload["validation"]
    assert v["within_target"] and v["max_abs_error"] == pytest.approx(0, abs=1e-6)
    assert {(r["backend"], r["world_size"]) for r in v["rows"]} == {(b, n) for b in ("ddp", "horovod") for n in (3, 4)}
    assert "validation" in out and "within the 15% goal" in out and "assumptions:" in out


def test_validation_printout_flags_a_miss(tmp_path, capsys):
    d = _folder(tmp_path, skew4=1.5)  # the measured world size 4 is 50 % slower than the model
    assert cli.main(["project", str(d), "--world-sizes", "8", "--link", "ib-ndr", "--validate"]) == 0
    out = capsys.readouterr().out
    v = json.loads((d / "projection.json").read_text())["validation"]
    assert v["link"] == "measured" and not v["within_target"]
    errs = {(r["backend"], r["world_size"]): r["error"] for r in v["rows"]}
    assert errs[("ddp", 4)] == pytest.approx(1 / 1.5 - 1, rel=1e-6)
    assert errs[("ddp", 3)] == pytest.approx(0, abs=1e-6)
    assert "NOT within the 15% goal" in out and "-33.3 %" in out


def test_oversubscription_stretches_compute(tmp_path):
    d = _folder(tmp_path, slots=2)
    assert cli.main(["project", str(d), "--world-sizes", "4", "--link", "measured", "--fit-world-sizes", "1,2"]) == 0
    payload = json.loads((d / "projection.json").read_text())
    assert payload["slots"] == 2
    assert payload["validation"]["max_abs_error"] == pytest.approx(0, abs=1e-6)
    assert payload["predictions"][0]["compute_ms"] == pytest.approx((C0 + C1 * GLOBAL / 4) * 2)


def test_a_preset_link_is_accepted_and_states_its_sources(tmp_path):
    d = _folder(tmp_path, sizes=(1, 2))
    out = tmp_path / "p.json"
    assert cli.main(["project", str(d), "--world-sizes", "8,512", "--link", "nvlink4", "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert payload["validation"] is None and payload["link"]["beta_GBps"] == pytest.approx(450)
    assert any("H100" in line for line in payload["assumptions"])
    assert all(p["efficiency"] is not None and 0 < p["efficiency"] <= 1.0 + 1e-9 for p in payload["predictions"])


def test_device_moves_the_compute_by_the_measured_peak_over_the_datasheet_and_leaves_validation_alone(tmp_path, capsys):
    d = _folder(tmp_path, sizes=(1, 2, 3))
    for path in (d / "runs").glob("*.json"):  # the runs' matmul peak: 0.1 TFLOP/s in fp32
        run = json.loads(path.read_text())
        run["metrics"].update(peak_tflops_measured=0.1, compute_dtype="fp32")
        path.write_text(json.dumps(run))
    as_measured, moved = tmp_path / "a.json", tmp_path / "b.json"
    args = ["project", str(d), "--world-sizes", "8", "--link", "nvlink4", "--fit-world-sizes", "1,2"]
    assert cli.main([*args, "--out", str(as_measured)]) == 0
    assert cli.main([*args, "--out", str(moved), "--device", "h100-sxm"]) == 0
    a, b = json.loads(as_measured.read_text()), json.loads(moved.read_text())
    scale = 0.1 / 67.0  # H100 SXM: 67 TFLOP/s fp32, dense
    assert b["predictions"][0]["compute_ms"] == pytest.approx(a["predictions"][0]["compute_ms"] * scale, rel=1e-9)
    assert b["device"] == "h100-sxm" and any("compute moved to H100 SXM" in line for line in b["assumptions"])
    assert b["validation"]["rows"] == a["validation"]["rows"]  # held-out runs are judged on the box they ran on
    for path in (d / "runs").glob("*.json"):  # the twin: results without the peak cannot be moved
        run = json.loads(path.read_text())
        del run["metrics"]["peak_tflops_measured"]
        path.write_text(json.dumps(run))
    capsys.readouterr()
    assert cli.main([*args, "--out", str(moved), "--device", "h100-sxm"]) == 2
    err = capsys.readouterr().err
    assert "no run records peak_tflops_measured" in err and "Traceback" not in err


@pytest.mark.parametrize("args, says", [
    (["--link", "infiniband-xdr"], "unknown link"),
    (["--link", "ib-ndr", "--world-sizes", "8,x"], "comma-separated"),
])
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, args, says):
    d = _folder(tmp_path, sizes=(1, 2))
    try:
        status = cli.main(["project", str(d), *args])
    except SystemExit as exc:  # argparse's errors leave through SystemExit(2)
        status = exc.code
    assert status == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0]


def test_missing_or_empty_folder_exits_2(tmp_path, capsys):
    assert cli.main(["project", str(tmp_path / "nope"), "--link", "ib-ndr"]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert cli.main(["project", str(tmp_path / "empty"), "--link", "ib-ndr"]) == 2
    assert "no run result above world size 1" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    d = _folder(tmp_path, sizes=(1, 2))
    assert cli.main(["project", str(d), "--link", str(bad)]) == 2
    assert "no bench-collectives JSON" in capsys.readouterr().err


def test_a_collectives_file_is_a_link(tmp_path):
    d = _folder(tmp_path, sizes=(1, 2))
    assert cli.main(["project", str(d), "--world-sizes", "8", "--link", str(d / "collectives.json")]) == 0
    payload = json.loads((d / "projection.json").read_text())
    assert payload["link"]["measured"] and payload["algorithm"] == "ring"


def test_report_draws_the_projection(tmp_path):
    from dpcompare.commands.report import build_report

    d = _folder(tmp_path)
    assert cli.main(["project", str(d), "--world-sizes", "8", "--link", "measured", "--validate"]) == 0
    md = build_report(d).read_text()
    assert (d / "projected_scaling.png").stat().st_size > 0
    assert "### Projected scaling" in md and "held out" in md


@pytest.mark.slow
def test_end_to_end_on_a_small_compare(tmp_path):
    out = tmp_path / "cmp"
    cmd = [sys.executable, "-m", "dpcompare", "compare", "--backends", "reference,ddp", "--world-sizes", "1,2",
           "--measure-steps", "5", "--steps", "1", "--no-report", "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600)
    run_dir = out / "latest"  # as the README's quickstart names it
    done = subprocess.run([sys.executable, "-m", "dpcompare", "project", str(run_dir), "--world-sizes", "8,64",
                           "--link", "ib-ndr"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    payload = json.loads((run_dir / "projection.json").read_text())
    assert {p["backend"] for p in payload["predictions"]} == {"ddp"}
    assert all(math.isfinite(p["step_ms"]) for p in payload["predictions"])
