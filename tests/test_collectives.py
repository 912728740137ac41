"""bench-collectives, checked against nccl-tests' definitions, exact arithmetic, and real launches.

- Bandwidth arithmetic against nccl-tests doc/PERFORMANCE.md: algbw = S/t in GB/s (1e9 bytes/s); all-reduce
  busbw = algbw * 2(n-1)/n, so it equals algbw at n=2 and is 1.5x algbw at n=4.
- busbw_at against hand-computed log-log interpolation, and against its refusals (outside the measured
  range, wrong transport, wrong world size, sizes whose result was wrong).
- Each transport's worker command starts under the native launcher of the backend whose link it measures
  (the adapter's declared capability; mpirun for mpi), built by the shared launcher table.
- The size sweep against nccl-tests' -b/-e/-f (min * factor**k up to max); bad input against the
  project's error rule (ValueError saying the fix; the CLI prints one line and exits 2).
- The correctness check against exact sums: the fill pattern sums exactly in float32 in any order, and
  a one-unit change anywhere, including the last element of a long buffer, is caught.
- Real launches: every transport under its own launcher (torchrun, mpirun, horovodrun, deepspeed) at N=2
  with small messages gives correct sums, positive finite bandwidths and the documented JSON; and the
  negative case: a wrong result planted on rank 1 (hidden --corrupt) gives correct=false for every size,
  names rank 1, and a non-zero exit.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dpcompare import cli
from dpcompare.commands import bench_collectives as collectives
from dpcompare.commands.bench_collectives import orchestrate, transports
from dpcompare.commands.bench_collectives.sweep import PATTERN_PERIOD, Sweep, check_sum, parse_bytes, pattern
from dpcompare.measure.bandwidth import algbw_gbps, busbw_at, busbw_gbps
from dpcompare.run import launchers, registry

REPO = Path(__file__).resolve().parents[1]
KiB, MiB = 1 << 10, 1 << 20

# What each transport needs importable; its process test is skipped only when this is missing.
PACKAGE = {"torch": "torch", "mpi": "mpi4py", "horovod": "horovod", "deepspeed": "deepspeed"}


# -- bandwidth arithmetic ---------------------------------------------------------------------------
def test_algbw_is_bytes_per_second_in_decimal_gigabytes():
    assert algbw_gbps(1e9, 1.0) == 1.0
    assert algbw_gbps(256 * MiB, 0.5) == pytest.approx(2 * 256 * MiB / 1e9)


def test_busbw_factor_is_two_n_minus_one_over_n():
    assert busbw_gbps(3.0, 2) == 3.0
    assert busbw_gbps(2.0, 4) == pytest.approx(3.0)
    assert busbw_gbps(1.0, 8) == pytest.approx(1.75)
    assert busbw_gbps(5.0, 1) == 0.0  # one rank moves nothing over a link


def test_bandwidth_rejects_impossible_inputs():
    with pytest.raises(ValueError, match="positive number of seconds"):
        algbw_gbps(1024, 0.0)
    with pytest.raises(ValueError, match="at least 1"):
        busbw_gbps(1.0, 0)


# -- busbw_at ---------------------------------------------------------------------------------------
def _doc(sizes, transport="torch", world_size=2):
    return {"kind": "collectives", "entries": [{"transport": transport, "world_size": world_size, "sizes": [
        {"bytes": b, "busbw_gbps": bw, "correct": ok} for b, bw, ok in sizes]}]}


def test_busbw_at_interpolates_in_log_log():
    doc = _doc([(1 * MiB, 1.0, True), (4 * MiB, 4.0, True), (16 * MiB, 8.0, True)])
    assert busbw_at(doc, "torch", 2, 1 * MiB) == 1.0  # a measured size is returned as measured
    assert busbw_at(doc, "torch", 2, 16 * MiB) == 8.0
    # log-log: busbw ~ bytes**1 between 1 and 4 MiB, so 2 MiB -> 2.0; bytes**0.5 between 4 and 16 MiB.
    assert busbw_at(doc, "torch", 2, 2 * MiB) == pytest.approx(2.0, rel=1e-12)
    assert busbw_at(doc, "torch", 2, 8 * MiB) == pytest.approx(4.0 * math.sqrt(2), rel=1e-12)


def test_busbw_at_refuses_to_extrapolate_or_guess():
    doc = _doc([(1 * MiB, 1.0, True), (4 * MiB, 4.0, True)])
    assert busbw_at(doc, "torch", 2, 512 * KiB) is None
    assert busbw_at(doc, "torch", 2, 8 * MiB) is None
    assert busbw_at(doc, "mpi", 2, 2 * MiB) is None
    assert busbw_at(doc, "torch", 4, 2 * MiB) is None
    with pytest.raises(ValueError):
        busbw_at(doc, "torch", 2, 0)


def test_busbw_at_skips_sizes_with_a_wrong_result():
    doc = _doc([(1 * MiB, 1.0, True), (4 * MiB, 100.0, False), (16 * MiB, 16.0, True)])
    assert busbw_at(doc, "torch", 2, 4 * MiB) == pytest.approx(4.0, rel=1e-12)


# -- the sweep and its inputs -----------------------------------------------------------------------
def test_default_sweep_is_1KiB_to_256MiB_in_powers_of_4():
    sizes = Sweep().sizes()
    assert sizes == [KiB * 4**k for k in range(10)]
    assert sizes[-1] == 256 * MiB


def test_sweep_follows_nccl_tests_b_e_f():
    assert Sweep(min_bytes=8, max_bytes=100, factor=2).sizes() == [8, 16, 32, 64]
    assert Sweep(min_bytes=4 * KiB, max_bytes=4 * KiB, factor=1).sizes() == [4 * KiB]


def test_large_sizes_run_fewer_iterations_but_at_least_three():
    sweep = Sweep(iters=50, warmup=5, target_s=0.2)
    assert sweep.plan(1e-5, "timed") == 50
    assert sweep.plan(0.01, "timed") == 20
    assert sweep.plan(0.4, "timed") == 3
    assert sweep.plan(1e-5, "warmup") == 5
    assert sweep.plan(0.4, "warmup") == 2
    assert Sweep(iters=1, warmup=1).plan(0.4, "timed") == 1  # an explicit --iters below 3 is obeyed


def test_parse_bytes_uses_binary_suffixes():
    assert parse_bytes("4096") == 4096
    assert parse_bytes("1K") == parse_bytes("1KiB") == parse_bytes("1k") == KiB
    assert parse_bytes("256MiB") == parse_bytes("256 M") == 256 * MiB
    assert parse_bytes("1G") == 1 << 30
    assert parse_bytes("64B") == 64
    for ambiguous in ("1.5M", "1MB", "1kB", "-4"):
        with pytest.raises(ValueError, match="e.g. 4096, 4K"):
            parse_bytes(ambiguous)


@pytest.mark.parametrize("fields, fix", [
    ({"min_bytes": 3}, "multiple of 4"),
    ({"min_bytes": 4 * KiB, "max_bytes": KiB}, "raise --max-bytes"),
    ({"factor": 1}, "at least 2"),
    ({"iters": 0}, "at least 1"),
    ({"warmup": 0}, "at least 1"),
    ({"target_s": 0.0}, "positive number of seconds"),
])
def test_bad_sweep_is_a_value_error_that_says_the_fix(fields, fix):
    with pytest.raises(ValueError, match=fix):
        Sweep(**fields)


@pytest.mark.parametrize("argv, fix", [
    (["--min-bytes", "3"], "multiple of 4"),
    (["--max-bytes", "lots"], "not understood"),
    (["--transports", "torch,nccl"], "choose from torch, mpi, horovod, deepspeed"),
    (["--world-sizes", "two"], "comma-separated whole numbers"),
    (["--worker"], "--worker needs --transport"),
])
def test_cli_turns_bad_input_into_one_line_and_exit_2(argv, fix, capsys):
    assert cli.main(["bench-collectives", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dpcompare: error:") and fix in err[0]


# -- the correctness check --------------------------------------------------------------------------
def test_pattern_sums_exactly_in_float32_in_any_order():
    world_size = 8
    per_rank = [pattern(10_000) * np.float32(r + 1) for r in range(world_size)]
    forward, backward = np.zeros(10_000, np.float32), np.zeros(10_000, np.float32)
    for r in range(world_size):
        forward += per_rank[r]
        backward += per_rank[world_size - 1 - r]
    pairwise = (per_rank[0] + per_rank[7]) + (per_rank[1] + per_rank[6]) + (per_rank[2] + per_rank[5]) + \
        (per_rank[3] + per_rank[4])
    assert check_sum(forward, world_size) and check_sum(backward, world_size) and check_sum(pairwise, world_size)


def test_check_catches_one_wrong_element_anywhere():
    count = 3 * PATTERN_PERIOD * 4096 + 17  # several check chunks and a ragged tail
    reduced = pattern(count) * np.float32(3)  # n=2: 1+2
    assert check_sum(reduced, 2)
    for index in (0, count // 2, count - 1):
        wrong = reduced.copy()
        wrong[index] += 1
        assert not check_sum(wrong, 2), index
    assert not check_sum(pattern(count) * np.float32(3), 3)  # the n=3 sum is 6x pattern


# -- launchers --------------------------------------------------------------------------------------
@pytest.mark.parametrize("transport, backend, expected", [
    ("torch", "ddp", "torchrun"),
    ("horovod", "horovod", "horovodrun"),
    ("deepspeed", "deepspeed", "deepspeed"),
    ("mpi", None, "mpirun"),  # mpi4py is no dpcompare backend
])
def test_each_transport_starts_under_the_launcher_its_backend_declares(transport, backend, expected, monkeypatch,
                                                                       tmp_path):
    monkeypatch.setattr(launchers, "launcher_bin", lambda name: name)  # no launcher need be installed
    if backend is not None:
        assert registry.load(backend, registry.BACKENDS, "backend").capabilities.native_launcher == expected
    assert transports.launcher(transport) == expected
    parser = argparse.ArgumentParser()
    collectives.add_arguments(parser)
    command = orchestrate.worker_command(parser.parse_args([]), transport, 2, tmp_path / "result.json")
    assert command[0] == expected
    program = command[command.index("bench-collectives"):]
    assert program[:4] == ["bench-collectives", "--worker", "--transport", transport]
    assert program[program.index("--result-file") + 1] == str(tmp_path / "result.json")
    # The deepspeed launcher is told once not to put --local_rank before the subcommand.
    assert command.count("--no_local_rank") == (1 if expected == "deepspeed" else 0)


# -- real launches ----------------------------------------------------------------------------------
def _bench(tmp_path: Path, transport: str, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    if importlib.util.find_spec(PACKAGE[transport]) is None:
        pytest.skip(f"{PACKAGE[transport]} is not installed")
    out = tmp_path / "collectives.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "dpcompare", "bench-collectives", "--transports", transport,
                           "--world-sizes", "2", "--out", str(out), *extra],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=280)
    assert out.exists(), f"no JSON written\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc, json.loads(out.read_text())


def _tiered(transport: str):
    """torch (gloo) in the default tier, mpi and horovod in the `slow` one, deepspeed (its launcher and ranks import
    DeepSpeed: a minute on two cores) in the `deep` one; the sums-correctly test runs it in `slow`."""
    tier = {"torch": (), "deepspeed": pytest.mark.deep}.get(transport, pytest.mark.slow)
    return pytest.param(transport, id=transport, marks=tier)


# All `slow` (deepspeed's, `deep`): in the default tier, compare end to end (test_compare.py) runs the torch transport's microbenchmark
# and checks that its runs quote it, the positive twin of the wrong-result test below.
@pytest.mark.multiproc
@pytest.mark.timeout(300)  # the first deepspeed launch on a machine compiles its shm comm op (~1.5 min)
@pytest.mark.parametrize("transport", [pytest.param(t, marks=pytest.mark.deep if t == "deepspeed" else pytest.mark.slow)
                                       for t in transports.TRANSPORTS])
def test_each_transport_sums_correctly_under_its_own_launcher(tmp_path, transport):
    proc, doc = _bench(tmp_path, transport, "--max-bytes", "1MiB", "--iters", "10")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert doc["schema_version"] >= 1 and doc["kind"] == "collectives"
    assert {"torch", "python", "host"} <= set(doc["env"])
    assert doc["unavailable"] == []
    (entry,) = doc["entries"]
    assert entry["transport"] == transport and entry["world_size"] == 2 and entry["status"] == "ok"
    assert entry["backend"] == {"torch": "gloo", "deepspeed": "gloo", "mpi": "mpi", "horovod": "gloo"}[transport]
    assert entry["device"] == "cpu"
    assert entry["launcher"] == transports.launcher(transport)
    assert entry["link"]["transport"] == entry["backend"]  # the facts beside its busbw (dpcompare.measure.link)
    assert entry["link"].get("algorithm") == "Ring" if entry["backend"] == "gloo" else "Open MPI" in entry["link"]["library"]
    assert [s["bytes"] for s in entry["sizes"]] == [KiB * 4**k for k in range(6)]
    for s in entry["sizes"]:
        assert s["correct"] is True, s
        for key in ("time_us_mean", "time_us_p50", "algbw_gbps", "busbw_gbps"):
            assert math.isfinite(s[key]) and s[key] > 0, (key, s)
        assert s["algbw_gbps"] == pytest.approx(s["bytes"] / (s["time_us_mean"] * 1e-6) / 1e9)
        assert s["busbw_gbps"] == pytest.approx(s["algbw_gbps"])  # n=2
        assert 3 <= s["iters"] <= 10
    assert busbw_at(doc, transport, 2, 1 * MiB) == entry["sizes"][-1]["busbw_gbps"]


@pytest.mark.slow  # breadth: the default tier keeps this capability's other test
@pytest.mark.multiproc
@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", [_tiered(t) for t in transports.TRANSPORTS])
def test_a_wrong_result_on_one_rank_fails_the_run(tmp_path, transport):
    proc, doc = _bench(tmp_path, transport, "--min-bytes", "4KiB", "--max-bytes", "16KiB", "--iters", "3",
                       "--corrupt")
    assert proc.returncode != 0
    (entry,) = doc["entries"]
    assert entry["status"] == "incorrect"
    assert len(entry["sizes"]) == 2
    for s in entry["sizes"]:
        assert s["correct"] is False and s["incorrect_ranks"] == [1]
    assert busbw_at(doc, transport, 2, 8 * KiB) is None  # a wrong size is never quoted
