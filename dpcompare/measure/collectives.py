"""Communication by kind: what a step sends as all-reduce, reduce-scatter, all-gather (and broadcast, reduce), measured
where Python dispatches collectives and predicted from what the backend shards.

Owns: `CollectiveRecorder`, which for one measured window wraps the collective functions of `torch.distributed`
(and the `distributed_c10d` module they live in) to count each call's bytes per kind and time it, restoring the
originals when the window ends. The prediction and the figures are in dpcompare.measure.volume (no torch there, so
the report can use them). Imports no adapter.

Where the wrappers see the traffic (read in the installed sources, torch 2.13 / DeepSpeed 0.19):
  * DeepSpeed's `deepspeed.comm` calls `torch.distributed.all_reduce`, `.broadcast`, `.reduce`, `.all_gather`,
    `.reduce_scatter` through the module attribute; its all_gather_into_tensor and reduce_scatter_tensor go through
    references its TorchBackend took at init (`all_gather_function`, `reduce_scatter_function`), which are torch's
    deprecated aliases: they call `distributed_c10d.all_gather_single` / `reduce_scatter_single` by their module
    globals, which the recorder wraps too. ZeRO-1/2's gradient "reduce-scatter" is, with DeepSpeed's defaults
    (use_multi_rank_bucket_allreduce), an all-reduce of each bucket (`allreduce_and_scatter`), or with it off a
    `reduce` to each partition's owner; the updated parameters come back by all_gather_into_tensor.
  * FSDP2 (`torch.distributed.fsdp._fully_shard._fsdp_collectives`) calls `dist.all_gather_single` and
    `dist.reduce_scatter_single` through `torch.distributed`.
  * DDP's Reducer all-reduces in C++ and Horovod in its own runtime: nothing passes the wrappers.
A call made inside another wrapped call (`all_gather_into_tensor` -> `all_gather_single`) counts once, as the outer.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import time
from typing import Any, Callable, Iterator

import torch

from dpcompare.measure.volume import union_ms

WRAPPED: dict[str, tuple[str, tuple[str, ...]]] = {
    # torch.distributed function -> (kind, the arguments whose tensors are nccl-tests' byte count: the full buffer)
    "all_reduce": ("all_reduce", ("tensor",)),
    "all_reduce_coalesced": ("all_reduce", ("tensors",)),
    "reduce_scatter_single": ("reduce_scatter", ("input",)),
    "reduce_scatter_tensor": ("reduce_scatter", ("input",)),
    "_reduce_scatter_base": ("reduce_scatter", ("input",)),
    "reduce_scatter": ("reduce_scatter", ("input_list",)),
    "all_gather_single": ("all_gather", ("output_tensor",)),
    "all_gather_into_tensor": ("all_gather", ("output_tensor",)),
    "_all_gather_base": ("all_gather", ("output_tensor",)),
    "all_gather": ("all_gather", ("tensor_list",)),
    "all_gather_coalesced": ("all_gather", ("output_tensor_lists",)),
    "broadcast": ("broadcast", ("tensor",)),
    "reduce": ("reduce", ("tensor",)),
}

def _nbytes(value: Any) -> int:
    if torch.is_tensor(value):
        t = value.to_local() if callable(getattr(value, "to_local", None)) else value
        return t.numel() * t.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


# -- the recorder ---------------------------------------------------------------------------------------------
_TIMED_WORK: type | None = None


def _timed_work_class() -> type:
    """A torch.distributed.Work that forwards everything to the Work it wraps and calls back when wait() returns
    (a subclass, so `isinstance(work, dist.Work)` still holds where FSDP2 checks it)."""
    global _TIMED_WORK
    if _TIMED_WORK is None:
        import torch.distributed as dist

        class TimedWork(dist.Work):
            def __init__(self, inner: Any, on_done: Callable[[], None]) -> None:
                super().__init__()
                self._inner, self._on_done = inner, on_done

            def wait(self, *args: Any, **kwargs: Any) -> Any:
                try:
                    return self._inner.wait(*args, **kwargs)
                finally:
                    done, self._on_done = self._on_done, None
                    if done is not None:
                        done()

        def forward(name: str) -> Callable[..., Any]:
            return lambda self, *a, **k: getattr(self._inner, name)(*a, **k)

        for name in dir(dist.Work):
            if not name.startswith("_") and name != "wait" and callable(getattr(dist.Work, name, None)):
                setattr(TimedWork, name, forward(name))
        _TIMED_WORK = TimedWork
    return _TIMED_WORK


def _is_real_work(result: Any) -> bool:
    """A Work to wait on (not None, not the placeholder a call inside a coalescing manager returns)."""
    import torch.distributed as dist

    return isinstance(result, dist.Work) and type(result).__name__ != "_IllegalWork"


class _Call:
    __slots__ = ("kind", "step", "nbytes", "start", "end", "returned", "waited")

    def __init__(self, kind: str, step: int, nbytes: int, start: Any) -> None:
        self.kind, self.step, self.nbytes, self.start = kind, step, nbytes, start
        self.end: Any = None
        self.returned: Any = None
        self.waited = False


class CollectiveRecorder:
    """Counts and times the collectives Python dispatches between begin() and end() (one measured window), per
    measured step (step() after each). On CUDA each call is bracketed by events on the stream current at the call
    (resolved once at end()); on CPU by a monotonic clock. A synchronous call ends when it returns; an asynchronous
    one (async_op=True) when the caller's wait() on its Work returns, so its time includes whatever the caller did
    before waiting. A step's time per kind is the union of its calls' intervals (concurrent calls counted once)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._patched: list[tuple[Any, str, Any]] = []
        self._calls: list[_Call] = []
        self._step = 0
        self._local = threading.local()
        self._paused = False
        self._unparsed = 0
        self._ref: Any = None

    # -- the window -------------------------------------------------------------------------------------------
    def begin(self) -> None:
        import torch.distributed as dist

        if not dist.is_available():  # a torch built without distributed: nothing to wrap, nothing to count
            return
        from torch.distributed import distributed_c10d as c10d

        self._ref = self._now()
        wrappers: dict[int, Callable[..., Any]] = {}
        try:
            for module in (dist, c10d):
                for name, (kind, args) in WRAPPED.items():
                    original = getattr(module, name, None)
                    if original is None or not callable(original):
                        continue
                    if id(original) not in wrappers:
                        wrappers[id(original)] = self._wrap(original, kind, args)
                    self._patched.append((module, name, original))
                    setattr(module, name, wrappers[id(original)])
        except BaseException:
            self._restore()
            raise

    def step(self) -> None:
        self._step += 1

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Calls made inside are not counted (the memory census between the timed segments of a step)."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    def end(self, steps: int) -> dict[str, Any]:
        """Restore the originals and return this rank's record: {'method', 'steps', 'kinds': {kind: {'bytes',
        'calls', 'ms'}: per-step lists}, 'unwaited', 'unparsed'}."""
        self._restore()
        return self.record(steps)

    def close(self) -> None:
        """Restore the originals (idempotent): for the finally of a window that failed."""
        self._restore()

    def _restore(self) -> None:
        while self._patched:
            module, name, original = self._patched.pop()
            setattr(module, name, original)

    # -- one call ---------------------------------------------------------------------------------------------
    def _now(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter_ns()

    def _wrap(self, original: Callable[..., Any], kind: str, args: tuple[str, ...]) -> Callable[..., Any]:
        try:
            signature: inspect.Signature | None = inspect.signature(original)
        except (TypeError, ValueError):
            signature = None
        recorder = self

        @functools.wraps(original)
        def wrapper(*a: Any, **k: Any) -> Any:
            local = recorder._local
            if recorder._paused or getattr(local, "depth", 0):
                return original(*a, **k)  # inside another wrapped call: counted there
            nbytes, is_async = recorder._parse(signature, a, k, args)
            call = _Call(kind, recorder._step, nbytes, recorder._now())
            local.depth = 1
            try:
                result = original(*a, **k)
            finally:
                local.depth = 0
            call.returned = recorder._now()
            recorder._calls.append(call)
            if is_async and _is_real_work(result):
                def done() -> None:
                    call.end, call.waited = recorder._now(), True
                return _timed_work_class()(result, done)
            call.end = call.returned
            return result

        return wrapper

    def _parse(self, signature: inspect.Signature | None, a: tuple, k: dict, names: tuple[str, ...]) -> tuple[int, bool]:
        if signature is None:
            self._unparsed += 1
            return 0, bool(k.get("async_op"))
        try:
            bound = signature.bind(*a, **k)
        except TypeError:
            self._unparsed += 1
            return 0, bool(k.get("async_op"))
        arguments = bound.arguments
        return sum(_nbytes(arguments.get(n)) for n in names), bool(arguments.get("async_op", False))

    # -- the record -------------------------------------------------------------------------------------------
    def _ms(self, point: Any) -> float:
        return self._ref.elapsed_time(point) if self.cuda else (point - self._ref) / 1e6

    def record(self, steps: int) -> dict[str, Any]:
        if self.cuda and self._calls:
            torch.cuda.synchronize()
        steps = max(steps, 1)
        per: dict[str, dict[str, list]] = {}
        intervals: dict[tuple[str, int], list[tuple[float, float]]] = {}
        unwaited = 0
        for call in self._calls:
            step = min(call.step, steps - 1)
            entry = per.setdefault(call.kind, {"bytes": [0] * steps, "calls": [0] * steps, "ms": [0.0] * steps})
            entry["bytes"][step] += call.nbytes
            entry["calls"][step] += 1
            end = call.end
            if end is None:  # an async call nobody waited for through its Work: its host-side launch only
                unwaited += 1
                end = call.returned
            intervals.setdefault((call.kind, step), []).append((self._ms(call.start), self._ms(end)))
        for (kind, step), spans in intervals.items():
            per[kind]["ms"][step] = union_ms(spans)
        clock = "CUDA events on the stream current at each call" if self.cuda else "host monotonic clock"
        method = (f"torch.distributed Python collectives wrapped over the measured window ({clock}); an async call "
                  "ends when its Work's wait() returns (host-side, so the time includes what the caller did before "
                  "waiting); per step the union of the calls' intervals")
        return {"method": method, "steps": steps, "kinds": per, "unwaited": unwaited, "unparsed": self._unparsed}
