"""Watchdog: a failing or hung rank never leaves the others hanging.

Owns: a per-rank heartbeat (one small file per rank in a directory shared by the ranks of one launch) and
a daemon thread that ends the process when this rank has made no progress for `timeout_s`, naming the
ranks that fell silent or stopped advancing. Launchers already kill the survivors when a rank exits
with an error (torchrun, horovodrun, mpirun, deepspeed); the watchdog covers the case they cannot see: a
rank that hangs, or a collective that waits forever for a dead peer.

A rank that leaves on an error it says itself (its model raised, a setting the run refused) marks its heartbeat
first (`say_leaving`): a peer whose collective then fails on the lost connection, or that the launcher stops, leaves
without a line of its own (`peer_said`), and a rank other than 0 that failed the same way leaves the line to rank 0
(`wait_for_said`).

Multi-host: set DPCOMPARE_HEARTBEAT_DIR to a directory every host sees; without it, ranks on other hosts
show as "not visible" (the timeout still fires, it just cannot name them). Imports no adapter.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

# Imported here, never lazily: the launcher's SIGTERM handler asks psutil about peers, and a signal that lands
# while the main thread is half-way through a first `import psutil` would find the module half-initialised.
import psutil

from dpcompare.json_files import atomic_file
from dpcompare.contract import launch_env as launch

EXIT_PEER_FAILURE = 3
"""The exit status of a rank the watchdog stopped (docs/failures.md)."""


def heartbeat_dir(job_id: str) -> Path:
    base = os.environ.get("DPCOMPARE_HEARTBEAT_DIR") or os.path.join(tempfile.gettempdir(), "dpcompare-heartbeat")
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in job_id)[:120]
    return Path(base) / safe


class Watchdog:
    def __init__(self, *, rank: int, world_size: int, job_id: str, timeout_s: float, poll_s: float = 1.0) -> None:
        self.rank, self.world_size, self.timeout_s, self.poll_s = rank, world_size, timeout_s, poll_s
        self.dir = heartbeat_dir(job_id)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._last_progress = time.monotonic()
        self._started_wall = time.time()
        self._phase, self._step, self._seq = "start", -1, 0
        self._said = False
        self._writing = threading.Lock()  # the watchdog thread and say_leaving() both write the heartbeat
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dpcompare-watchdog", daemon=True)
        self._dumped_at = -1  # the heartbeat's seq at the last half-way dump
        self.dump_to: Path | None = None
        """Where a timed-out rank writes its Flight Recorder dump (None: nowhere)."""

    def start(self) -> "Watchdog":
        if self.rank == 0:
            prune_stale(self.dir.parent)
        self.beat("start", -1)
        self._write()
        self._written = self._seq
        self._thread.start()
        return self

    def beat(self, phase: str, step: int) -> None:
        """Record progress: this rank reached `phase` of `step`. Memory only (it sits in the training loop);
        the watchdog thread writes the heartbeat file when it polls."""
        self._phase, self._step, self._seq = phase, step, self._seq + 1
        self._last_progress = time.monotonic()

    def _write(self) -> None:
        with self._writing, atomic_file(self.dir / f"rank{self.rank}.json", durable=False) as f:
            f.write(json.dumps({"rank": self.rank, "seq": self._seq, "step": self._step, "phase": self._phase,
                                "wall": time.time(), "pid": os.getpid(), "host": socket.gethostname(),
                                "said": self._said}))

    def say_leaving(self) -> None:
        """This rank is about to say why the run ends and leave: written now, before its peers can see it gone."""
        self._said = True
        self._write()

    def peer_said(self) -> int | None:
        """A peer that said why the run ends (`say_leaving`), or None."""
        return next((r for r, p in self.peers().items() if r != self.rank and p is not None and p.get("said")), None)

    def wait_for_said(self, rank: int, within_s: float, poll_s: float = 0.05) -> bool:
        """Whether `rank` says why the run ends within `within_s` seconds."""
        deadline = time.monotonic() + within_s
        while True:
            beat = self.peers().get(rank)
            if beat is not None and beat.get("said"):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(poll_s)

    def peers(self) -> dict[int, dict | None]:
        out: dict[int, dict | None] = {}
        for r in range(self.world_size):
            try:
                beat = json.loads((self.dir / f"rank{r}.json").read_text())
            except (OSError, ValueError):
                beat = None
            # A file older than this launch is left over from an earlier one with the same job id.
            out[r] = beat if beat is not None and beat["wall"] >= self._started_wall - 30 else None
        return out

    def culprits(self) -> str:
        """Name the ranks that are behind (lowest step/phase) or silent."""
        peers = self.peers()
        now = time.time()
        missing = [r for r, p in peers.items() if p is None]
        seen = {r: p for r, p in peers.items() if p is not None}
        parts = []
        gone = self._not_running_peers(seen)
        if gone:
            parts.append("; ".join(f"rank {r} {why} (last at step {seen[r]['step']} '{seen[r]['phase']}')"
                                   for r, why in gone.items()))
        if seen and not gone:
            lowest = min(p["seq"] for p in seen.values())
            behind = [r for r, p in seen.items() if p["seq"] == lowest]
            if len(behind) < len(seen):
                parts.append("rank(s) " + ", ".join(
                    f"{r} (stuck at step {seen[r]['step']} '{seen[r]['phase']}', silent {now - seen[r]['wall']:.0f} s)"
                    for r in behind))
            else:
                parts.append("no rank is ahead of another; the stall is in a collective all ranks entered "
                             "or in a rank that died inside it")
        if missing:
            parts.append(f"rank(s) {', '.join(map(str, missing))} not visible (never started, or on another host "
                         "without a shared DPCOMPARE_HEARTBEAT_DIR)")
        return "; ".join(parts)

    def culprits_or_why_not(self) -> str:
        """`culprits()` for a rank on its way out: naming the culprit must not cost the line that says why the
        rank stopped, so a failure to read the peers' state is reported in its place."""
        try:
            return self.culprits()
        except Exception as exc:  # noqa: BLE001 - any failure here would lose the error line itself
            return f"unknown (the peers' state could not be read: {type(exc).__name__}: {exc})"

    def _not_running_peers(self, seen: dict[int, dict]) -> dict[int, str]:
        """Peers visibly not running, with why. A peer that is gone or suspended explains the stall only if it
        was not ahead of this rank (a peer that got further and then exited, its own watchdog having fired, is
        not why this rank is stuck)."""
        out = {}
        for r, beat in seen.items():
            why = _not_running(beat) if r != self.rank and beat["seq"] <= self._seq else None
            if why is not None:
                out[r] = why
        return out

    def lost_peers(self) -> dict[int, str]:
        """The peers not ahead of this rank that are visibly not running now (gone, exited, suspended), with why."""
        return self._not_running_peers({r: p for r, p in self.peers().items() if p is not None})

    def culprits_after_failure(self, settle_s: float = 3.0, poll_s: float = 0.05) -> str:
        """`culprits()` for a collective that just failed on a lost peer. The peer that broke it may still be
        dying: its sockets close before its process is gone, so the failure can reach this rank first. Wait up
        to `settle_s` for a peer that was not ahead of this rank to be visibly not running, then name it."""
        deadline = time.monotonic() + settle_s
        while time.monotonic() < deadline:
            try:
                if self._not_running_peers({r: p for r, p in self.peers().items() if p is not None}):
                    break
            except Exception:  # noqa: BLE001 - culprits_or_why_not reports it
                break
            time.sleep(poll_s)
        return self.culprits_or_why_not()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            if self._seq != self._written:
                self._written = self._seq
                self._write()
            idle = time.monotonic() - self._last_progress
            if idle > self.timeout_s / 2 and self._dumped_at != self._seq:
                # Half-way: the launcher may end this rank without a word once a peer gives up first (a rank blocked
                # in a collective cannot run its SIGTERM handler), so the evidence is written now; a rank that goes
                # on finds a dump of a wait that ended, which the next half-way idle writes over.
                self._dumped_at = self._seq
                self.dump_collectives()
            if idle > self.timeout_s:
                self.give_up(f"dpcompare: error: rank {self.rank} made no progress for {idle:.0f} s (timeout "
                             f"{self.timeout_s:g} s, last at step {self._step} '{self._phase}'); culprit: "
                             f"{self.culprits_or_why_not()}.{self.dump_collectives()} Raise --timeout-s if steps are "
                             "legitimately this slow.", EXIT_PEER_FAILURE)

    def dump_collectives(self) -> str:
        """Write this rank's collectives as PyTorch's Flight Recorder holds them (TORCH_FR_BUFFER_SIZE, which the run
        sets) to `dump_to`/rank<R>.json; the sentence saying where and which collective was last, or why there is no
        dump."""
        if self.dump_to is None:
            return ""
        try:
            from torch._C._distributed_c10d import _dump_fr_trace_json

            entries = json.loads(_dump_fr_trace_json()).get("entries") or []
        except Exception as exc:  # noqa: BLE001 - the rank is ending: the reason is said instead
            return f" No Flight Recorder dump: {type(exc).__name__}: {exc}."
        if not entries:
            return (" No Flight Recorder dump: no collective was recorded (TORCH_FR_BUFFER_SIZE unset or 0, or a "
                    "backend whose collectives are not torch.distributed's, as Horovod's).")
        path = self.dump_to / f"rank{self.rank}.json"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_file(path) as f:
                f.write(json.dumps({"rank": self.rank, "entries": entries}, default=str))
        except OSError as exc:
            return f" No Flight Recorder dump: writing {path} failed ({exc})."
        last = entries[-1]
        return (f" Its collectives (Flight Recorder): {path}, the last {last.get('profiling_name')} "
                f"#{last.get('collective_seq_id')} ({last.get('state')}).")

    def give_up(self, line: str, status: int) -> None:
        """End this rank now: say `line` (stderr and the launcher's error file), end suspended peers, exit."""
        try:
            print(line, file=sys.stderr, flush=True)
            launch.tell_launcher(line)
            self.end_stopped_peers()
        except Exception:  # noqa: BLE001 - the line is said; nothing may keep this rank from ending
            pass
        finally:
            os._exit(status)

    def name_the_culprit_on_sigterm(self) -> None:
        """A launcher ends every rank with SIGTERM once one rank fails (torchrun, mpirun): before going, say
        which rank failed, from the heartbeats. Only the main thread may install a handler."""
        if threading.current_thread() is not threading.main_thread():
            return

        def stopped(signum: int, _frame) -> None:
            if self.peer_said() is not None:  # the launcher ends the run a peer has said why it ends
                os._exit(128 + signum)
            self.give_up(f"dpcompare: error: [rank {self.rank}] stopped by the launcher "
                         f"({signal.Signals(signum).name}); culprit: {self.culprits_or_why_not()}", 128 + signum)

        self._previous_sigterm = signal.signal(signal.SIGTERM, stopped)

    def quiet_on_sigterm(self) -> None:
        """Back to the handler before `name_the_culprit_on_sigterm`: a rank leaving on an error rank 0 says for every
        rank (CommandLineError) is ended by the launcher without a word of its own."""
        previous = getattr(self, "_previous_sigterm", None)
        if previous is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, previous)

    def end_stopped_peers(self) -> None:
        """A suspended rank cannot act on the launcher's SIGTERM, so the launcher would wait out its grace period
        (30 s and more) before the launch ends: the run is over, so end such a rank on this host now."""
        for r, beat in self.peers().items():
            if r != self.rank and beat is not None and _process_state(beat) == "stopped":
                try:
                    os.kill(beat["pid"], signal.SIGKILL)
                    print(f"dpcompare: rank {r} was suspended; ended it (pid {beat['pid']}) so the launch can end "
                          "now", file=sys.stderr, flush=True)
                except OSError:
                    pass

    def stop(self, clean: bool = True) -> None:
        """Stop watching; on a clean finish remove this rank's heartbeat (on failure it stays, so the
        ranks still running can name who fell behind)."""
        self._stop.set()
        if not clean:
            self._write()  # the last state, for the ranks still running
            return
        try:
            (self.dir / f"rank{self.rank}.json").unlink(missing_ok=True)
            if self.rank == 0:
                self.dir.rmdir()
        except OSError:
            pass
        if self.dump_to is not None and self._dumped_at >= 0:  # a slow step's half-way dump: the run went on
            (self.dump_to / f"rank{self.rank}.json").unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                self.dump_to.rmdir()
                self.dump_to.parent.rmdir()


STALE_AFTER_S = 24 * 3600.0
"""Heartbeat directories of failed runs (kept so the surviving ranks could name the culprit) are removed
by the next run's rank 0 once nothing in them has changed for this long."""


def prune_stale(base: Path, older_than_s: float = STALE_AFTER_S) -> list[Path]:
    """Remove the heartbeat directories under `base` whose files are all older than `older_than_s`."""
    removed = []
    cutoff = time.time() - older_than_s
    try:
        candidates = [d for d in base.iterdir() if d.is_dir()]
    except OSError:
        return removed
    for d in candidates:
        try:
            files = list(d.iterdir())
            if all(f.is_file() and f.stat().st_mtime < cutoff for f in files) and d.stat().st_mtime < cutoff:
                for f in files:
                    f.unlink()
                d.rmdir()
                removed.append(d)
        except OSError:
            continue  # another run's directory, in use or not ours to remove
    return removed


def _process_state(beat: dict) -> str | None:
    """"gone", "exited" (a zombie) or "stopped" when the rank that wrote `beat` visibly cannot be making
    progress; None when it runs or cannot be seen from here (a rank on another host is judged by its heartbeat)."""
    pid, host = beat.get("pid"), beat.get("host")
    if not isinstance(pid, int) or host != socket.gethostname():
        return None
    try:
        status = psutil.Process(pid).status()
    except psutil.NoSuchProcess:
        return "gone"
    except psutil.Error:
        return None
    return {psutil.STATUS_ZOMBIE: "exited", psutil.STATUS_STOPPED: "stopped"}.get(status)


_STATE_WORDS = {"gone": "died: its process {pid} is gone", "exited": "died: its process {pid} has exited",
                "stopped": "is stopped: its process {pid} was suspended (SIGSTOP or a debugger)"}


def _not_running(beat: dict) -> str | None:
    """Why the rank that wrote `beat` cannot be making progress, in words, or None (see _process_state)."""
    state = _process_state(beat)
    return None if state is None else _STATE_WORDS[state].format(pid=beat["pid"])
