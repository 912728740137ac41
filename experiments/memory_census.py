"""Where the checks' memory is: each rank's live heap by part of the checks, and the tensors alive at its peak.

    OMP_NUM_THREADS=1 python experiments/memory_census.py --backend reference --model hf:DIR --seq-len 16 \\
        --global-batch 2 --steps 2 --measure-steps 2 --warmup-steps 1 --optimizer adamw --out /tmp/census
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 experiments/memory_census.py --backend ddp ...

Runs `python -m dpcompare` with the same arguments in this process, beside a thread that reads glibc's `mallinfo2`
every half millisecond: the bytes the allocator has handed out and not had back (not the resident pages it keeps, which
`verify_above_start_mib` measures). Each reading is labelled with the part of the checks running (the verifier's
parts, the reference trajectory's and a helper rank's own steps), and at each new high the tensors alive are listed
by what holds them: a walk from the verifier's (or helper's) objects and the main thread's frames, then the models
and optimizers found, summed by kind (`kind`: the run's own, the copies the checks' forwards load, the checking state
held); a census every second keeps the one with the most checking state. Each rank prints them when it exits. A tool
for finding what to hold smaller (docs/results/2026-11-29-update-state-ranges-cpu.md,
docs/results/2026-11-29-checks-per-rank-cpu.md); it patches the verifier's methods in its own process only. glibc
only.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import os
import sys
import threading
import time
import types
from collections import deque

import torch
from torch import nn

from dpcompare.verify.memory import divider
from dpcompare.verify.trajectory import reference_trajectory
from dpcompare.verify.phase import verifier
try:
    from experiments.in_process import run_dpcompare
except ModuleNotFoundError:  # run as a script (python experiments/NAME.py, torchrun experiments/NAME.py): beside it
    from in_process import run_dpcompare


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
_most_checking: list = [0, ""]
EVERY_S = 1.0
"""Between the censuses taken for the checking state's high (each walks every live object: tenths of a second)."""
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
        _labelled(reference_trajectory.Trajectory, method)
    for method in ("_answer", "_hold", "_reduce", "_send_held"):
        _labelled(divider.Helper, method)


def _gathered(objects: list) -> set[int]:
    """The reference trajectory's parameters a rank does not own (dpcompare.verify.trajectory.trajectory_ranges): allocated only while its
    copies are gathered whole for their forwards, so copies, whatever label the census is taken under."""
    out = set()
    for t in objects:
        if type(t).__name__ == "Trajectory" and getattr(t, "ranges", None) is not None:
            for model in (t.model64, t.model_run):
                out.update(id(p) for n, p in model.named_parameters() if not t.ranges.mine(n))
    return out


def _walk(roots: list[tuple[str, object]], owners: dict[int, str], gathered: frozenset[int] = frozenset()) -> None:
    """Every tensor reachable from `roots` (attributes, slots, containers; modules' parameters and buffers, optimizers'
    state), named by the first path that reaches it; a parameter in `gathered` (and its gradient) named so."""
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
            queue.extend((f"{path}:params{' (gathered)' if id(p) in gathered else ''}", p, 7) for p in obj.parameters())
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


KINDS = ("run", "copies", "checking", "unattributed")
_RUN = ("frame:run.", ".wrapped.", "bench.module:", "bench.optimizer:", "frame:compute.reduced", "frame:step.",
        "frame:after_reduce.gathered", "frame:after_reduce.x", "frame:after_reduce.before")
_COPIES = ("model:params", "models.", ".raw", "frame:load.module", "frame:_load_from_state_dict", "frame:forward.self",
           "frame:_save_to_state_dict", "to_owners.p ", "to_owners.part", "irecv.tensor", "frame:backward.",
           ".state.", "frame:_receive_into")
"""A copy's parameters and its gradient as autograd leaves them (`raw`, and what is sent of it), the state the copies
load (a `state` the step's forwards run from: the run's parameters snapshotted once)."""
_TRAJECTORY_STEP = ("_step_both", "_accumulate")


def kind(name: str, label: str) -> str:
    """What a tensor held under `name` (a census path), in the part of the checks `label`, is for: the run's own (its
    model, gradients, optimizer state, batch: what a run without the checks holds), the copies the checks' forwards
    load (a float64 or run-precision copy whole, its gradient as autograd leaves it, the state it loads; the reference
    trajectory's copies only while it steps, gathered whole for its forwards), the checking state held (ranges, sums,
    offsets, the trajectory's ranges, held reads), or unattributed. By the path's words: a tool's reading, checked by
    reading the census it prints, not a measurement of record by itself."""
    if name.startswith("unattributed"):
        return "unattributed"
    if name.startswith("run:") or any(w in name for w in _RUN):
        return "run"
    if "params (gathered)" in name:
        return "copies"
    stepping = "trajectory.model" in name or name.startswith("frame:_step_both.self.model")  # its copies, gathered
    if stepping or "trajectory.opt" in name:
        return "copies" if any(w in label for w in _TRAJECTORY_STEP) and stepping else "checking"
    if "oracle.model64:params" in name or "oracle.model_run:params" in name:
        return "copies"  # the oracle's copies: loaded before each use, released after it (held.releasable)
    if any(w in name for w in _COPIES) and "offsets" not in name and "_remotes" not in name and "_held" not in name:
        return "copies"
    return "checking"


PICKED = ("Verifier", "Helper", "Wrapped", "Trajectory")


def _tracked() -> list:
    """The tensors and the objects the census starts from, of every object the collector tracks. The list of them all
    holds a reference to each: a tuple another thread is still growing would fail its resize (CPython raises
    SystemError there), so no other thread runs while that list exists."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(60.0)
    try:
        objects = gc.get_objects()
        picked = [o for o in objects if torch.is_tensor(o) or type(o).__name__ in PICKED]
        del objects
    finally:
        sys.setswitchinterval(interval)
    return picked


def census(where: str = "") -> tuple[str, dict[str, int]]:
    """The tensors alive now, by what holds them, the largest first; and their bytes by `kind`."""
    owners: dict[int, str] = {}
    frame, roots = sys._current_frames().get(threading.main_thread().ident), []
    while frame is not None:
        roots.append((f"frame:{frame.f_code.co_name}", dict(frame.f_locals)))
        frame = frame.f_back
    objects = _tracked()
    held = [o for o in objects if type(o).__name__ in ("Verifier", "Helper")]
    # the run's own first (its model, their gradients, its optimizer's state), whatever else also reaches them
    run = [(f"run:{name}", getattr(o, name)) for o in objects if type(o).__name__ == "Wrapped"
           for name in ("module", "model", "optimizer")]
    run += [(f"run:{k}", v) for name, f_locals in roots if name == "frame:run"
            for k, v in f_locals.items() if isinstance(v, (nn.Module, torch.optim.Optimizer)) or k == "workload"]
    _walk(run, owners)
    _walk([(type(o).__name__, o) for o in held] + roots, owners, frozenset(_gathered(objects)))
    sizes: dict[str, int] = {}
    counted: set[int] = set()
    for obj in _tracked():
        if torch.is_tensor(obj) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in counted:
                counted.add(storage.data_ptr())
                name = owners.get(storage.data_ptr(), f"unattributed ({str(obj.dtype)[6:]})")
                sizes[name] = sizes.get(name, 0) + storage.nbytes()
    kinds: dict[str, int] = {}
    label = "/".join(_stack)
    for name, b in sizes.items():
        kinds[kind(name, label)] = kinds.get(kind(name, label), 0) + b
    lines = [f"rank {RANK}: {where or f'at {_best[0]:.0f} MiB live, in {_best[1]}'}: tensors "
             f"{sum(sizes.values()) / MIB:.0f} MiB",
             f"rank {RANK}: by kind, MiB: " + ", ".join(f"{k} {kinds.get(k, 0) / MIB:.1f}" for k in KINDS)]
    lines += [f"  {b / MIB:8.1f}  {kind(name, label)[:4]}  {name}"
              for name, b in sorted(sizes.items(), key=lambda kv: -kv[1])[:40]]
    return "\n".join(lines), kinds


def _sample() -> None:
    walked = time.monotonic()
    while True:
        now, label = live_mib(), "/".join(_stack[-3:])
        _peaks[label] = max(_peaks.get(label, 0.0), now)
        # only inside a part of the checks, on every rank (a helper's are the requests it serves): a walk while a
        # model is built can meet objects still under construction (CPython then fails the builder's own call)
        ready = time.monotonic() - _started > 4 and len(_stack) > 1
        try:
            if now > _best[0] + 8 and ready:
                _best[:] = [now, label]
                _last[0] = census()[0]
            elif len(_stack) > 1 and time.monotonic() - walked > EVERY_S:
                # the checking state's own high, which need not fall at the heap's: a census every EVERY_S
                walked = time.monotonic()
                text, kinds = census(f"at {now:.0f} MiB live, in {label}, the most checking state seen")
                if kinds.get("checking", 0) > _most_checking[0]:
                    _most_checking[:] = [kinds["checking"], text]
        except Exception as exc:  # noqa: BLE001 - objects changing under the walk: the next one tries again
            _last[0] = f"rank {RANK}: census failed ({exc})"
        time.sleep(0.0005)


def _report() -> None:
    if _reported[0]:
        return
    _reported[0] = True
    print(_last[0], file=sys.stderr)
    if _most_checking[1]:
        print(_most_checking[1], file=sys.stderr)
    print(f"rank {RANK}: live MiB at its highest, by part of the checks", file=sys.stderr)
    for label, mib in sorted(_peaks.items(), key=lambda kv: -kv[1])[:20]:
        print(f"  {mib:8.0f}  {label}", file=sys.stderr)
    sys.stderr.flush()


def main() -> None:
    _patch()
    threading.Thread(target=_sample, daemon=True).start()
    run_dpcompare(sys.argv[1:], _report)

if __name__ == "__main__":
    main()
