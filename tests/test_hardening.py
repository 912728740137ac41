"""Hardening of the failure paths, unit by unit: naming a dead or stopped rank from its heartbeat, pruning
stale heartbeat directories, leaving the error line where torchrun's report reads it, and the exit codes.

Each check has its twin that must come out the other way: a live process is not called dead, a rank on
another host is not judged by a local pid, a fresh heartbeat directory is kept, an existing error file is
not overwritten.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dpcompare import cli
from dpcompare.contract import launch_env as launch
from dpcompare.run import watchdog


def _beat(pid: int, host: str | None = None) -> dict:
    return {"rank": 1, "seq": 3, "step": 1, "phase": "forward", "wall": time.time(), "pid": pid,
            "host": host or socket.gethostname()}


def test_a_dead_rank_is_named_dead() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert watchdog._not_running(_beat(proc.pid)) == f"died: its process {proc.pid} is gone"


def test_a_stopped_rank_is_named_stopped_and_a_running_one_is_not_blamed() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert watchdog._not_running(_beat(proc.pid)) is None
        os.kill(proc.pid, signal.SIGSTOP)
        deadline = time.time() + 5
        while watchdog._not_running(_beat(proc.pid)) is None and time.time() < deadline:
            time.sleep(0.05)
        assert "is stopped" in (watchdog._not_running(_beat(proc.pid)) or "")
    finally:
        proc.kill()
        proc.wait()


def test_a_rank_on_another_host_is_judged_by_its_heartbeat_only() -> None:
    assert watchdog._not_running(_beat(2**22 + 12345, host="some-other-host")) is None


def test_culprits_put_the_dead_rank_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DPCOMPARE_HEARTBEAT_DIR", str(tmp_path))
    dog = watchdog.Watchdog(rank=0, world_size=2, job_id="culprit-test", timeout_s=60)
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    for step in range(4):  # this rank got as far as the dead one (seq 3), so the dead one explains the stall
        dog.beat("forward", step)
    dog._write()
    (dog.dir / "rank1.json").write_text(json.dumps(_beat(proc.pid)))
    said = dog.culprits()
    assert said.startswith(f"rank 1 died: its process {proc.pid} is gone"), said
    assert "no rank is ahead" not in said
    # a dead peer that had got further than this rank is not why this rank is stuck
    (dog.dir / "rank1.json").write_text(json.dumps(dict(_beat(proc.pid), seq=99)))
    assert "died" not in dog.culprits()


def test_a_peer_still_dying_when_the_collective_fails_is_named_once_it_is_gone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A killed peer's sockets close before its process is gone, so the collective's failure can reach this
    rank while the peer still shows as running: the failure path waits for it to go, then names it. A peer that
    stays alive is not blamed, however long the wait."""
    monkeypatch.setenv("DPCOMPARE_HEARTBEAT_DIR", str(tmp_path))
    dog = watchdog.Watchdog(rank=0, world_size=2, job_id="dying-peer", timeout_s=60)
    for step in range(4):
        dog.beat("forward", step)
    dog._write()
    dying = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.7)"])
    try:
        (dog.dir / "rank1.json").write_text(json.dumps(_beat(dying.pid)))
        assert "died" not in dog.culprits()  # at the moment of the failure it still runs
        reaper = __import__("threading").Thread(target=dying.wait)
        reaper.start()
        said = dog.culprits_after_failure(settle_s=10)
        reaper.join()
        assert said.startswith(f"rank 1 died: its process {dying.pid}"), said
    finally:
        dying.kill()
        dying.wait()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (dog.dir / "rank1.json").write_text(json.dumps(_beat(alive.pid)))
        started = time.monotonic()
        said = dog.culprits_after_failure(settle_s=0.5)
        assert "died" not in said and said.startswith("rank(s) 1 (stuck at step 1"), said
        assert time.monotonic() - started >= 0.5
    finally:
        alive.kill()
        alive.wait()


SIGTERM_RANK = """
import json, os, signal, subprocess, sys, time
from dpcompare.run import watchdog
dead = subprocess.Popen([sys.executable, "-c", "pass"]); dead.wait()
dog = watchdog.Watchdog(rank=0, world_size=2, job_id="sigterm-" + str(os.getpid()), timeout_s=60)
for step in range(4):
    dog.beat("forward", step)
dog._write()
(dog.dir / "rank1.json").write_text(json.dumps({"rank": 1, "seq": 3, "step": 1, "phase": "forward",
    "wall": time.time(), "pid": dead.pid, "host": __import__("socket").gethostname()}))
if sys.argv[1] == "broken":  # what a half-initialised psutil did: the peers' state cannot be read
    def broken(beat):
        raise AttributeError("partially initialized module 'psutil' has no attribute 'NoSuchProcess'")
    watchdog._process_state = broken
dog.name_the_culprit_on_sigterm()
print("ready", flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("peers", ["readable", "broken"])
def test_a_rank_stopped_by_its_launcher_always_says_so_in_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, peers: str) -> None:
    """The launcher's SIGTERM gets dpcompare's line naming the dead peer; when the peers' state cannot be read
    (a signal that once landed during psutil's first import), the line still comes, saying the culprit is
    unknown and why, and no traceback takes its place."""
    monkeypatch.setenv("DPCOMPARE_HEARTBEAT_DIR", str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-c", SIGTERM_RANK, peers], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("dpcompare: error: [rank 0] stopped by the launcher (SIGTERM); culprit: "), err
    if peers == "readable":
        assert "rank 1 died: its process" in lines[0], err
    else:
        assert "culprit: unknown (the peers' state could not be read: AttributeError: partially" in lines[0], err


def test_psutil_is_loaded_with_the_watchdog_not_when_a_signal_needs_it() -> None:
    code = "import sys; from dpcompare.run import watchdog; print('psutil' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "True", out.stderr


def test_stale_heartbeat_directories_are_pruned_fresh_ones_kept(tmp_path: Path) -> None:
    old, fresh = tmp_path / "old-job", tmp_path / "fresh-job"
    for d in (old, fresh):
        d.mkdir()
        (d / "rank0.json").write_text("{}")
    past = time.time() - 2 * watchdog.STALE_AFTER_S
    os.utime(old / "rank0.json", (past, past))
    os.utime(old, (past, past))
    assert watchdog.prune_stale(tmp_path) == [old]
    assert not old.exists() and fresh.exists()


def test_the_error_line_lands_in_torchruns_error_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    launch.tell_launcher("dpcompare: error: first")
    launch.tell_launcher("dpcompare: error: second")  # the first error of a process wins
    data = json.loads(error_file.read_text())
    assert data["message"]["message"] == "dpcompare: error: first"
    assert data["message"]["extraInfo"]["py_callstack"] == "dpcompare: error: first"
    assert int(data["message"]["extraInfo"]["timestamp"]) > 0


def test_without_torchrun_no_error_file_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    monkeypatch.chdir(tmp_path)
    launch.tell_launcher("dpcompare: error: x")
    assert list(tmp_path.iterdir()) == []


def test_exit_codes_are_distinct() -> None:
    codes = {cli.EXIT_USAGE, watchdog.EXIT_PEER_FAILURE, cli.EXIT_RUN_FAILURE, cli.EXIT_INTERRUPTED}
    assert len(codes) == 4 and 0 not in codes and 1 not in codes


def test_a_suspended_peer_is_ended_when_the_watchdog_fires_a_running_one_is_not(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DPCOMPARE_HEARTBEAT_DIR", str(tmp_path))
    dog = watchdog.Watchdog(rank=0, world_size=3, job_id="end-stopped", timeout_s=60)
    stopped = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(stopped.pid, signal.SIGSTOP)
        deadline = time.time() + 5
        while "is stopped" not in (watchdog._not_running(_beat(stopped.pid)) or "") and time.time() < deadline:
            time.sleep(0.05)
        (dog.dir / "rank1.json").write_text(json.dumps(_beat(stopped.pid)))
        (dog.dir / "rank2.json").write_text(json.dumps(dict(_beat(running.pid), rank=2)))
        dog.end_stopped_peers()
        assert stopped.wait(timeout=10) == -signal.SIGKILL
        assert running.poll() is None
    finally:
        for p in (stopped, running):
            p.kill()
            p.wait()


@pytest.mark.slow  # breadth: the default tier keeps this capability's other test
@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_sigterm_to_compare_ends_every_rank_it_started(tmp_path: Path) -> None:
    import psutil

    from dpcompare.run import launchers

    out = tmp_path / "results"
    proc = subprocess.Popen([sys.executable, "-m", "dpcompare", "compare", "--backends", "ddp", "--world-sizes", "2",
                             "--model", "mlp-wide", "--steps", "2000", "--measure-steps", "0", "--collectives", "none",
                             "--no-report", "--out", str(out)], env=launchers.child_env(), cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def ranks() -> list[psutil.Process]:
        found = []
        for p in psutil.process_iter(["cmdline"]):
            cmdline = " ".join(p.info["cmdline"] or [])
            if str(out) in cmdline and p.pid != proc.pid:
                found.append(p)
        return found

    deadline = time.time() + 120
    while len(ranks()) < 3 and time.time() < deadline:  # torchrun and its two ranks
        time.sleep(0.5)
    assert len(ranks()) >= 3, "the ranks never started"
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    time.sleep(1)
    left = [p for p in ranks() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, f"left behind: {[(p.pid, p.cmdline()[:6]) for p in left]}"
