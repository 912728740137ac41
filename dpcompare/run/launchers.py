"""Launchers: the one table of how `python -m dpcompare ARGS` is started under each launcher a user types,
and the one subprocess runner every command (and the test suite) starts runs with.

Owns: the command line per launcher (python, torchrun, horovodrun, deepspeed, mpirun), finding a launcher's
executable, a free loopback port, and `run_process`: a child in a session of its own, its output in a log
file or captured, and a timeout that kills the whole process tree (a launcher that hangs takes every rank
it started with it). Which launcher is a backend's own is the adapter's declared capability
(`Capabilities.native_launcher`), not a table here. Imports no adapter, no torch and no command.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from dpcompare.contract.launch_env import free_port

LAUNCHERS = ("python", "torchrun", "horovodrun", "deepspeed", "mpirun")


def launcher_bin(name: str) -> str:
    """The launcher's executable: next to this Python first (a virtual environment), else on PATH."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise RuntimeError(f"launcher {name!r} not found next to {sys.executable} or on PATH: run bash scripts/setup.sh")
    return found


def native_command(launcher: str, world_size: int, args: Sequence[str], launcher_args: Sequence[str] = ()) -> list[str]:
    """The command a user would type to start `python -m dpcompare ARGS` with `world_size` ranks under
    `launcher` on this one host (loopback rendezvous) on this host; `launcher_args` go to the launcher itself (before the program). The deepspeed
    launcher is told --no_local_rank: LOCAL_RANK, which it also sets, is read instead, and an argument
    before a subcommand would hide the subcommand."""
    py = [sys.executable, "-m", "dpcompare"]
    extra = list(launcher_args)
    if launcher == "python":
        if world_size != 1:
            raise ValueError(f"a plain python launch has exactly one process, not {world_size}")
        return py + list(args)
    if launcher == "torchrun":
        return [launcher_bin("torchrun"), "--standalone", f"--nproc_per_node={world_size}", *extra,
                "-m", "dpcompare", *args]
    if launcher == "horovodrun":
        return [launcher_bin("horovodrun"), "--gloo", "--network-interface", "lo", "-np", str(world_size),
                "-H", f"localhost:{world_size}", *extra, *py, *args]
    if launcher == "deepspeed":
        # --master_port: its default (29500) collides with any other job on this host.
        return [launcher_bin("deepspeed"), "--no_local_rank", "--num_gpus", str(world_size), "--master_addr",
                "127.0.0.1", "--master_port", str(free_port()), *extra, "--module", "dpcompare", *args]
    if launcher == "mpirun":
        root = ["--allow-run-as-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []
        # --bind-to none: Open MPI pins each rank to a core when there are <= 2 ranks, which on a small
        # shared machine puts the ranks' helper threads on one core. Loopback only: all ranks are on this host.
        return [launcher_bin("mpirun"), *root, "--oversubscribe", "--bind-to", "none", "--mca", "btl_tcp_if_include",
                "lo", "--mca", "oob_tcp_if_include", "lo", "-np", str(world_size), *extra, *py, *args]
    raise ValueError(f"unknown launcher {launcher!r}: use {', '.join(LAUNCHERS)}")


@dataclass(slots=True)
class Finished:
    """A finished (or killed) child process."""

    command: list[str]
    returncode: int | None
    """None: it ran past the timeout and its process tree was killed."""
    wall_s: float
    stdout: str = ""
    """Captured output (capture=True), else empty: the output is in the log file."""
    stderr: str = ""

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


def child_env(overrides: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a child run: one thread per rank unless told otherwise, unbuffered, and
    inside a virtual environment its bin directory first on PATH, as `activate` would put it. The tools a
    backend calls by name then come from the environment dpcompare runs in: DeepSpeed JIT-builds its CPU
    communication op with the first `ninja` on PATH, and the PyPI ninja in the environment and a system one
    (Debian's ninja-build) read each other's build log as stale, so alternating between them rebuilt the op
    (~40 s on two cores) on every switch."""
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONUNBUFFERED="1")
    if sys.prefix != sys.base_prefix:
        bin_dir = str(Path(sys.executable).parent)
        rest = [p for p in env.get("PATH", "").split(os.pathsep) if p and p != bin_dir]
        env["PATH"] = os.pathsep.join([bin_dir, *rest])
    env.update(overrides or {})
    return env


def _kill(procs) -> None:
    """SIGKILL processes by psutil handle (a recycled pid is not ours: psutil compares creation times)."""
    import psutil

    alive = []
    for proc in procs:
        try:
            if proc.is_running():
                proc.kill()
                alive.append(proc)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=10)


class _Tree:
    """A child and every process it started, sampled while it runs: launchers start ranks in sessions of their
    own (torchrun, horovodrun), which neither the child's process group nor, once the launcher has exited,
    its descendants reach; a rank seen once is still known by pid when it has to be killed."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.seen: dict[int, object] = {}

    def sample(self) -> None:
        import psutil

        try:
            self.seen.update((c.pid, c) for c in psutil.Process(self.proc.pid).children(recursive=True))
        except psutil.NoSuchProcess:
            pass

    def kill(self) -> None:
        self.sample()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        _kill(list(self.seen.values()))


def run_process(command: Sequence[str], *, timeout_s: float, log: Path | None = None, capture: bool = False,
                env: Mapping[str, str] | None = None, cwd: Path | None = None,
                cancel: threading.Event | None = None) -> Finished:
    """Run `command` to completion in a session of its own. Its output goes to `log` (with the command line
    first) or, with capture=True, is returned. Past `timeout_s`, or once `cancel` is set (by another thread: a
    session of its own gets no Ctrl-C), the whole tree is killed and the result has returncode None; ranks a launcher
    leaves behind are killed either way."""
    command = [str(c) for c in command]
    env = dict(env) if env is not None else child_env()
    if not capture and log is None:
        raise ValueError("run_process needs a log file or capture=True")
    start = time.monotonic()
    sink = None
    if not capture:
        log.parent.mkdir(parents=True, exist_ok=True)
        sink = log.open("w")
        sink.write("$ " + " ".join(command) + "\n")
        sink.flush()
    pipe = subprocess.PIPE if capture else sink
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=pipe, stderr=subprocess.PIPE if capture else subprocess.STDOUT,
                            text=True, start_new_session=True)
    tree = _Tree(proc)
    out = err = ""
    code: int | None = None
    try:
        while True:
            try:
                out, err = proc.communicate(timeout=0.5)  # retrying loses no output
                code = proc.returncode
                break
            except subprocess.TimeoutExpired:
                tree.sample()
                if time.monotonic() - start > timeout_s or (cancel is not None and cancel.is_set()):
                    tree.kill()
                    out, err = proc.communicate()
                    break
    finally:
        if proc.poll() is None:  # interrupted (Ctrl-C, SIGTERM): the tree as it is now, all of it
            tree.kill()
            proc.wait()
        else:
            _kill(list(tree.seen.values()))  # ranks left behind by a launcher that has exited
        if sink is not None:
            sink.close()
    return Finished(command, code, time.monotonic() - start, out or "", err or "")
