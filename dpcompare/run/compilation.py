"""--compile: the C++ compiler it needs, and what torch.compile did during the run's own steps.

Owns: the check for the compiler TorchInductor builds its kernels with (refused in one line before anything starts),
and the `CompileLog`, which reads Dynamo's global counters (torch._dynamo.utils.counters, compilation_time_metrics,
guard_failures) around the run's steps and keeps what compiled there apart from what the checks compiled (rank 0's
compiled reference copy): compile seconds, Dynamo graphs, graphs the backend compiler built (DDPOptimizer's
pieces each count), graph breaks with their reasons, recompilations, and which steps compiled anything (measurement
leaves those out of the step time). Reads private torch counters: every read is guarded, a counter torch no longer
keeps is reported as null, never as 0.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterator

COMPILER_HINT = ("install one (Debian/Ubuntu: `apt-get install g++`; RHEL/Fedora: `dnf install gcc-c++`; conda: "
                 "`conda install -c conda-forge gxx`) or name one with CXX=/path/to/g++, or leave --compile out")


def require_compiler() -> str:
    """The C++ compiler TorchInductor will build its kernels with (its own search: $CXX, then g++), or ImportError
    with how to install one. On CUDA Triton also builds its launcher with the host compiler, so it is checked on
    every device."""
    try:
        from torch._inductor import cpp_builder

        return cpp_builder.get_cpp_compiler()
    except ImportError as exc:
        raise ImportError(f"--compile needs TorchInductor (torch._inductor), which this torch lacks ({exc}): "
                          "install a torch >= 2.1 or leave --compile out") from None
    except Exception:  # torch._inductor.exc.InvalidCxxCompiler (a RuntimeError): none of $CXX, g++ runs
        raise ImportError(f"--compile needs a C++ compiler for TorchInductor's kernels and none was found "
                          f"(torch looked for $CXX, then g++): {COMPILER_HINT}") from None


@dataclass(slots=True)
class _Reading:
    compile_s: float | None
    graphs: int | None
    compiled_graphs: int | None
    frames: int | None
    recompiles: int | None
    breaks: Counter = field(default_factory=Counter)

    def minus(self, other: "_Reading") -> "_Reading":
        def sub(a, b):
            return None if a is None or b is None else a - b

        return _Reading(sub(self.compile_s, other.compile_s), sub(self.graphs, other.graphs),
                        sub(self.compiled_graphs, other.compiled_graphs), sub(self.frames, other.frames),
                        sub(self.recompiles, other.recompiles), self.breaks - other.breaks)

    def plus(self, other: "_Reading") -> "_Reading":
        def add(a, b):
            return None if a is None or b is None else a + b

        return _Reading(add(self.compile_s, other.compile_s), add(self.graphs, other.graphs),
                        add(self.compiled_graphs, other.compiled_graphs), add(self.frames, other.frames),
                        add(self.recompiles, other.recompiles), self.breaks + other.breaks)

    def activity(self) -> tuple:
        """What changes when anything compiles (a frame converted, a graph built, a guard failed)."""
        return (self.frames, self.graphs, self.compiled_graphs, self.recompiles, self.compile_s)


def read() -> _Reading:
    """Dynamo's counters now (process-wide, cumulative)."""
    try:
        from torch._dynamo import utils
    except ImportError:
        return _Reading(None, None, None, None, None)
    counters = utils.counters
    times = getattr(utils, "compilation_time_metrics", None)
    # "_compile.compile_inner": one entry per frame Dynamo converts, with the backend's compile (AOTAutograd's
    # forward and, where it is built eagerly, backward; Inductor) inside it.
    compile_s = float(sum(times.get("_compile.compile_inner", []))) if isinstance(times, dict) else None
    failures = getattr(utils, "guard_failures", None)
    recompiles = sum(len(v) for v in failures.values()) if isinstance(failures, dict) else None
    return _Reading(compile_s=compile_s, graphs=int(counters["stats"]["unique_graphs"]),
                    compiled_graphs=int(counters["aot_autograd"]["total"]), frames=int(counters["frames"]["total"]),
                    recompiles=recompiles, breaks=Counter({_first_line(k): v for k, v in counters["graph_break"].items()}))


def _first_line(reason: str) -> str:
    """A graph break's reason without Dynamo's hints and links: its first line, and its explanation line."""
    lines = [line.strip() for line in str(reason).splitlines() if line.strip()]
    explanation = next((line for line in lines[1:] if line.startswith("Explanation:")), "")
    return f"{lines[0]} ({explanation})" if lines and explanation else (lines[0] if lines else str(reason))


class CompileLog:
    """What torch.compile did in the run's steps on this rank: `start()` before the first step, `aside()` around the
    checks (their compiles are not the run's), `step_compiled()` whether a step just compiled anything."""

    def __init__(self) -> None:
        self._start: _Reading | None = None
        self._aside = _Reading(0.0, 0, 0, 0, 0)
        self._mark: tuple | None = None

    def start(self) -> None:
        self._start = read()

    @contextlib.contextmanager
    def aside(self) -> Iterator[None]:
        before = read()
        try:
            yield
        finally:
            self._aside = self._aside.plus(read().minus(before))

    def own(self) -> _Reading:
        """The run's own compile activity since `start()`, the checks' left out."""
        assert self._start is not None
        return read().minus(self._start).minus(self._aside)

    def mark(self) -> None:
        """Before a measured step."""
        self._mark = self.own().activity()

    def step_compiled(self) -> bool:
        """After a measured step: whether it compiled or recompiled anything since `mark()`."""
        return self._mark is not None and self.own().activity() != self._mark

    def to_dict(self) -> dict[str, Any]:
        r = self.own()
        return {"compile_s": r.compile_s, "graphs": r.graphs, "compiled_graphs": r.compiled_graphs,
                "frames": r.frames, "recompiles": r.recompiles, "graph_breaks": sum(r.breaks.values()),
                "graph_break_reasons": [{"reason": k, "count": v} for k, v in r.breaks.most_common()]}
