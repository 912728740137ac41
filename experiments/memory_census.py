"""Where the checks' memory is: each rank's live heap by part of the checks, and the tensors alive at its peak.

    OMP_NUM_THREADS=1 python experiments/memory_census.py --backend reference --model hf:DIR --seq-len 16 \\
        --global-batch 2 --steps 2 --measure-steps 2 --warmup-steps 1 --optimizer adamw --out /tmp/census
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 experiments/memory_census.py --backend ddp ...

Runs `python -m dpcompare` with the same arguments in this process, beside a thread that reads glibc's `mallinfo2`
every half millisecond: the bytes the allocator has handed out and not had back (not the resident pages it keeps, which
`verify_above_start_mib` measures). Each reading is labelled with the part of the checks running (the verifier's
parts, the reference trajectory's and a helper rank's own steps), and at each new high the tensors alive are listed
by what holds them: a walk from the verifier's (or helper's) objects and the main thread's frames, then the models
and optimizers found. Each rank prints both when it exits. A tool for finding what to hold smaller
(docs/results/2026-11-29-update-state-ranges-cpu.md); it patches the verifier's methods in its own process only.
glibc only.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import os
import runpy
import sys
import threading
import time
import types
from collections import deque

import torch
from torch import nn

from dpcompare.verify import divided, trajectory, verifier


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                                 "uordblks", "fordblks", "keepcost")]


_LIBC = ctypes.CDLL("libc.so.6")
_LIBC.mallinfo2.restype = _MallInfo2
MIB = 2**20
RANK = os.environ.get("RANK", "0")
_stack: list[str] = ["-"]
_peaks: dict[str, float] = {}
_best = [0.0, ""]
_last = [f"rank {RANK}: no census"]
_reported = [False]
_started = time.monotonic()


def live_mib() -> float:
    info = _LIBC.mallinfo2()
    return (info.uordblks + info.hblkhd) / MIB


@contextlib.contextmanager
def _label(name: str):
    _stack.append(name)
    try:
        yield
    finally:
        _stack.pop()


def _labelled(cls: type, method: str) -> None:
    original = getattr(cls, method)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        with _label(method):
            return original(*args, **kwargs)
    setattr(cls, method, wrapper)


def _patch() -> None:
    part = verifier.Verifier._part

    @contextlib.contextmanager
    def labelled_part(self, name):
        with part(self, name), _label(name):
            yield
    verifier.Verifier._part = labelled_part
    for method in ("_accumulate", "_step_both", "_hold", "take", "judge", "follow"):
        _labelled(trajectory.Trajectory, method)
    for method in ("_answer", "_hold", "_reduce", "_send_held"):
        _labelled(divided.Helper, method)


def _walk(roots: list[tuple[str, object]], owners: dict[int, str]) -> None:
    """Every tensor reachable from `roots` (attributes, slots, containers; modules' parameters and buffers, optimizers'
    state), named by the first path that reaches it."""
    queue, seen = deque((name, obj, 0) for name, obj in roots), set()
    while queue:
        path, obj, depth = queue.popleft()
        if id(obj) in seen or depth > 7:
            continue
        seen.add(id(obj))
        if torch.is_tensor(obj):
            if obj.device.type == "cpu" and obj.untyped_storage().nbytes():
                owners.setdefault(obj.untyped_storage().data_ptr(), f"{path} ({str(obj.dtype)[6:]})")
            if isinstance(obj, nn.Parameter) and obj.grad is not None:
                owners.setdefault(obj.grad.untyped_storage().data_ptr(), f"{path}.grad")
            continue
        if isinstance(obj, (str, bytes, int, float, bool, type(None), types.ModuleType, type, types.FunctionType)):
            continue
        if isinstance(obj, nn.Module):
            queue.extend((f"{path}:params", p, 7) for p in obj.parameters())
            queue.extend((f"{path}:buffers", b, 7) for b in obj.buffers())
            continue
        if isinstance(obj, torch.optim.Optimizer):
            queue.extend((f"{path}:state.{k}", v, 7) for s in obj.state.values() for k, v in s.items())
            continue
        if isinstance(obj, dict):
            items = [(str(k)[:24] if depth < 2 else "*", v) for k, v in obj.items()]
        elif isinstance(obj, (list, tuple, set, frozenset)):
            items = [("[]", v) for v in obj]
        else:
            items = list(getattr(obj, "__dict__", {}).items())
            items += [(s, getattr(obj, s)) for c in type(obj).__mro__ for s in getattr(c, "__slots__", ())
                      if isinstance(s, str) and hasattr(obj, s)]
        queue.extend((f"{path}.{k}" if len(path) < 90 else path, v, depth + 1) for k, v in items)


def census() -> str:
    """The tensors alive now, by what holds them, the largest first."""
    owners: dict[int, str] = {}
    frame, roots = sys._current_frames().get(threading.main_thread().ident), []
    while frame is not None:
        roots.append((f"frame:{frame.f_code.co_name}", dict(frame.f_locals)))
        frame = frame.f_back
    held = [o for o in gc.get_objects() if type(o).__name__ in ("Verifier", "Helper")]
    _walk([(type(o).__name__, o) for o in held] + roots, owners)
    sizes: dict[str, int] = {}
    counted: set[int] = set()
    for obj in gc.get_objects():
        if torch.is_tensor(obj) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in counted:
                counted.add(storage.data_ptr())
                name = owners.get(storage.data_ptr(), f"unattributed ({str(obj.dtype)[6:]})")
                sizes[name] = sizes.get(name, 0) + storage.nbytes()
    lines = [f"rank {RANK}: at {_best[0]:.0f} MiB live, in {_best[1]}: tensors {sum(sizes.values()) / MIB:.0f} MiB"]
    lines += [f"  {b / MIB:8.1f}  {name}" for name, b in sorted(sizes.items(), key=lambda kv: -kv[1])[:30]]
    return "\n".join(lines)


def _sample() -> None:
    while True:
        now, label = live_mib(), "/".join(_stack[-3:])
        _peaks[label] = max(_peaks.get(label, 0.0), now)
        if now > _best[0] + 8 and time.monotonic() - _started > 4 and (len(_stack) > 1 or RANK != "0"):
            _best[:] = [now, label]
            try:
                _last[0] = census()
            except Exception as exc:  # noqa: BLE001 - objects changing under the walk: the next high tries again
                _last[0] = f"rank {RANK}: census failed ({exc})"
        time.sleep(0.0005)


def _report() -> None:
    if _reported[0]:
        return
    _reported[0] = True
    print(_last[0], file=sys.stderr)
    print(f"rank {RANK}: live MiB at its highest, by part of the checks", file=sys.stderr)
    for label, mib in sorted(_peaks.items(), key=lambda kv: -kv[1])[:20]:
        print(f"  {mib:8.0f}  {label}", file=sys.stderr)
    sys.stderr.flush()


def main() -> None:
    _patch()
    threading.Thread(target=_sample, daemon=True).start()
    leave = os._exit

    def report_then_exit(code: int) -> None:  # dpcompare leaves through os._exit under a launcher
        _report()
        leave(code)
    os._exit = report_then_exit
    sys.argv = ["dpcompare", *sys.argv[1:]]
    try:
        runpy.run_module("dpcompare", run_name="__main__")
    finally:
        _report()


if __name__ == "__main__":
    main()
