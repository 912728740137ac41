"""How a float64 copy of the model computes where the model's kernels have no float64 implementation.

Owns: the preparation of every float64 verification copy (`prepare`) and the account of what it changed
(`report`, the result's `equivalence.oracle_precision`):
  - the model's own alternative path, where it offers one: transformers models whose experts dispatch through
    `@use_experts_implementation` (Mixtral, Qwen-MoE, ...) default to `grouped_mm`, which has no float64 kernel;
    the copy's experts are switched to transformers' `eager` loop over the experts (the same function, written with
    ordinary matmuls), through the model's own `set_experts_implementation`. Any module exposing that method is
    switched, whatever the family;
  - otherwise, per call: a function of the forward that raises with float64 inputs (no float64 kernel, e.g.
    `torch._grouped_mm`, or a float32 tensor the model creates itself) runs again with those inputs in float32,
    TF32 off, and its floating outputs cast back to float64 (`Float32Fallback`, a TorchFunctionMode active inside the
    copy's module calls, including a recomputation in backward). Autograd records the two casts, so the backward of
    that op runs in float32 too. Every such op is recorded with the modules that called it and the precision it ran
    at; a call that fails in float32 as well raises its original error.
  - a cast of a float64 tensor to float32 written as an upcast for half precision (`.float()`, `.to(torch.float32)`,
    `dtype=torch.float32`: transformers' RMSNorm, softmax and loss_function) stays float64, recorded as such.
Only the failing call is moved: every other op of the copy stays float64, and the run-precision copies keep the
model's own paths (they compute as the run does). Imports no adapter.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

__all__ = ["Float32Fallback", "FALLBACK_DTYPE", "phrases", "prepare", "report", "switch_alternative_paths"]

FALLBACK_DTYPE = torch.float32
ALTERNATIVES = (("set_experts_implementation", "get_experts_implementation", "eager",
                 "transformers' fused experts kernels (grouped_mm) have no float64 kernel; its eager loop over the "
                 "experts computes the same function with ordinary float64 matmuls"),)
"""(setter, getter, value, why): a model's own switch to a path with float64 kernels, tried on every module."""


@dataclass(slots=True)
class Switched:
    module: str
    setting: str
    was: str
    now: str
    why: str

    def to_dict(self) -> dict:
        return {"module": self.module or "(the model)", "setting": self.setting, "from": self.was, "to": self.now,
                "why": self.why}


@dataclass(slots=True)
class FallbackOp:
    op: str
    modules: list[str] = field(default_factory=list)
    calls: int = 0
    error: str = ""

    def to_dict(self) -> dict:
        return {"op": self.op, "modules": self.modules, "calls": self.calls,
                "precision": str(FALLBACK_DTYPE).removeprefix("torch."), "tf32": False,
                "unit_roundoff": torch.finfo(FALLBACK_DTYPE).eps / 2, "error": self.error}


def _floating64(x) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype == torch.float64


def _name(func) -> str:
    name = getattr(func, "__name__", None) or repr(func)
    owner = getattr(func, "__objclass__", None) or getattr(func, "__self__", None)
    return f"Tensor.{name}" if owner is torch.Tensor or owner is torch._C.TensorBase else name


class Float32Fallback(TorchFunctionMode):
    """Runs a call that raises with float64 inputs again in float32 (TF32 off) and casts its results back; records
    it under the innermost module of `stack` (names of the copy's modules being called, innermost last)."""

    def __init__(self, stack: list[str], ops: dict[str, FallbackOp], kept: dict[str, FallbackOp] | None = None) -> None:
        super().__init__()
        self.stack, self.ops = stack, ops
        self.kept = kept if kept is not None else {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kept = _kept_float64(func, args, kwargs)
        if kept is not None:
            entry = self.kept.setdefault(_name(func), FallbackOp(_name(func)))
            entry.calls += 1
            where = self.stack[-1] if self.stack else "(outside the model's modules)"
            if where not in entry.modules:
                entry.modules.append(where)
            args, kwargs = kept
            if args is None:  # Tensor.float() of a float64 tensor: the tensor itself, as .double() returns it
                return kwargs
        try:
            return func(*args, **kwargs)
        except (RuntimeError, NotImplementedError, TypeError) as exc:
            if not _nested64(args, kwargs):
                raise
            try:
                out = _in_float32(func, args, kwargs)
            except Exception:
                raise exc from None
            entry = self.ops.setdefault(_name(func), FallbackOp(_name(func), error=str(exc).splitlines()[0][:200]))
            entry.calls += 1
            where = self.stack[-1] if self.stack else "(outside the model's modules)"
            if where not in entry.modules:
                entry.modules.append(where)
            return out


def _kept_float64(func, args, kwargs):
    """A cast of a float64 tensor to float32 (`.float()`, `.to(torch.float32)`, `dtype=torch.float32`: the upcast a model
    writes for half precision, transformers' RMSNorm and loss_function among them) kept in float64: the call's
    arguments with float64 for float32 ((None, the tensor) for `.float()`), or None where the call casts nothing."""
    name = _name(func)
    if name == "Tensor.float" and args and _floating64(args[0]):
        return None, args[0]
    if kwargs.get("dtype") is torch.float32 and _nested64(args, {}):
        return args, {**kwargs, "dtype": torch.float64}
    if name in ("Tensor.to", "Tensor.type") and args and _floating64(args[0]) and any(a is torch.float32 for a in args[1:]):
        return tuple(torch.float64 if a is torch.float32 else a for a in args), kwargs
    return None


def _nested64(args, kwargs) -> bool:
    found = []
    tree_map(lambda t: found.append(True) if _floating64(t) else None, (args, kwargs))
    return bool(found)


def _in_float32(func, args, kwargs):
    """`func` on float32 copies of its float64 tensor arguments, with TF32 off; floating results back in float64. An
    in-place call (`Tensor.x_`, or `out=`) writes its result back into the float64 tensors it was given."""
    low_args, low_kwargs = tree_map(lambda t: t.to(FALLBACK_DTYPE) if _floating64(t) else t, (args, kwargs))
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    saved = (matmul.allow_tf32, cudnn.allow_tf32, torch.get_float32_matmul_precision())
    try:
        matmul.allow_tf32, cudnn.allow_tf32 = False, False
        torch.set_float32_matmul_precision("highest")
        out = func(*low_args, **low_kwargs)
    finally:
        matmul.allow_tf32, cudnn.allow_tf32 = saved[0], saved[1]
        torch.set_float32_matmul_precision(saved[2])
    if kwargs.get("out") is not None:
        _write_back(kwargs["out"], low_kwargs["out"])
        return kwargs["out"]
    if _name(func).endswith("_") and args and _floating64(args[0]):
        _write_back(args[0], low_args[0])
        return args[0]
    return tree_map(lambda t: t.to(torch.float64) if isinstance(t, torch.Tensor) and t.dtype == FALLBACK_DTYPE else t,
                    out)


def _write_back(target, source) -> None:
    if isinstance(target, torch.Tensor) and isinstance(source, torch.Tensor):
        if target is not source:
            target.copy_(source)
    elif isinstance(target, (list, tuple)) and isinstance(source, (list, tuple)):
        for t, s in zip(target, source):
            _write_back(t, s)


class _Paths:
    """What `prepare` did to one copy: the switches it made and the calls that fell back."""

    def __init__(self) -> None:
        self.switched: list[Switched] = []
        self.ops: dict[str, FallbackOp] = {}
        self.kept: dict[str, FallbackOp] = {}
        """The casts of float64 tensors to float32 the copy kept in float64 (`_kept_float64`)."""
        self.local = threading.local()

    def stack(self) -> list[str]:
        if not hasattr(self.local, "stack"):
            self.local.stack = []
            self.local.mode = None
        return self.local.stack


_PREPARED: "weakref.WeakKeyDictionary[nn.Module, _Paths]" = weakref.WeakKeyDictionary()


def switch_alternative_paths(model: nn.Module) -> list[Switched]:
    """Switch every module that offers it (outermost first) to its path with float64 kernels (`ALTERNATIVES`); a
    switch is recorded only where the module's own getter then reads the new value (a class that cannot switch at run
    time leaves it, and its ops fall back per call instead)."""
    done: list[Switched] = []
    for setter, getter, value, why in ALTERNATIVES:
        for name, m in model.named_modules():
            if not callable(getattr(m, setter, None)) or not callable(getattr(m, getter, None)):
                continue
            before = _settings(m, getter)
            current = {k: v for k, v in before.items() if v is not None and v != value}
            if not current:
                continue
            try:
                getattr(m, setter)(value)
            except (RuntimeError, ValueError, ImportError):
                continue  # a path locked at load time (transformers' deepgemm_megamoe): the per-call fallback
            if any(v != value for k, v in _settings(m, getter).items() if k in current):
                continue
            was = ", ".join(sorted(set(current.values())))
            done.append(Switched(name, setter.removeprefix("set_"), was, value, why))
    return done


def _settings(module: nn.Module, getter: str) -> dict:
    try:
        got = getattr(module, getter)()
    except (AttributeError, TypeError, ValueError):
        return {}
    return dict(got) if isinstance(got, dict) else {"": got}


def prepare(model: nn.Module, alternatives: bool = True) -> nn.Module:
    """Make a float64 copy compute where its kernels have no float64 implementation (see the module docstring);
    `alternatives` False: no switch to the model's own alternative path, every such op falls back per call (the
    probe's copy, which must take the run's own path: an eager expert loop skips the experts no token reaches)."""
    paths = _Paths()
    paths.switched = switch_alternative_paths(model) if alternatives else []
    for name, module in model.named_modules():
        module.register_forward_pre_hook(_enter(paths, f"{name or '(the model)'} ({type(module).__name__})"))
        module.register_forward_hook(_leave(paths), always_call=True)
    _PREPARED[model] = paths
    return model


def _enter(paths: _Paths, name: str):
    def hook(module, args):
        stack = paths.stack()
        if not stack:
            paths.local.mode = Float32Fallback(stack, paths.ops, paths.kept).__enter__()
        stack.append(name)
    return hook


def _leave(paths: _Paths):
    def hook(module, args, output):
        stack = paths.stack()
        if stack:
            stack.pop()
            if not stack and paths.local.mode is not None:
                paths.local.mode.__exit__(None, None, None)
                paths.local.mode = None
    return hook


def report(*models: nn.Module) -> dict | None:
    """Where the float64 copies did not compute the model's own ops in float64 (merged over `models`): the paths
    switched and the ops that ran in float32; None where every op of every copy ran in float64 on the model's own
    path."""
    switched: dict[tuple, dict] = {}
    ops: dict[str, FallbackOp] = {}
    kept: dict[str, FallbackOp] = {}
    for model in models:
        paths = _PREPARED.get(model)
        if paths is None:
            continue
        for s in paths.switched:
            switched.setdefault((s.module, s.setting), s.to_dict())
        for into, found in ((ops, paths.ops), (kept, paths.kept)):
            for op in found.values():
                merged = into.setdefault(op.op, FallbackOp(op.op, error=op.error))
                merged.calls += op.calls
                merged.modules += [m for m in op.modules if m not in merged.modules]
    if not switched and not ops and not kept:
        return None
    return {"switched": list(switched.values()), "float32_ops": [op.to_dict() for op in ops.values()],
            "float32_casts_kept_float64": [{"op": op.op, "modules": op.modules, "calls": op.calls}
                                           for op in kept.values()]}


def phrases(recorded: dict | None) -> list[str]:
    """The run line's account of `report`'s record: each path switched and each op computed in float32."""
    if not recorded:
        return []
    out = [f"float64 oracle with {s['setting']}={s['to']} in {s['module']} (the run-precision copies keep the run's "
           f"{s['from']})" for s in recorded.get("switched", [])]
    ops = recorded.get("float32_ops", [])
    if ops:
        shown = "; ".join(f"{op['op']} in {', '.join(op['modules'][:3])}{' and more' if len(op['modules']) > 3 else ''}"
                          for op in ops)
        out.append(f"ORACLE IN FLOAT32 (TF32 off, unit roundoff {ops[0]['unit_roundoff']:.1e}) where float64 has no "
                   f"kernel: {shown}")
    return out
