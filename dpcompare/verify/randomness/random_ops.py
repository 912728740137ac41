"""Random ops at the dispatcher: which calls draw random numbers, what of each is recorded, how it is replayed, and
which module of the model made it.

Owns: the rule for each random aten op (`rule_of`): the ops tagged `torch.Tag.nondeterministic_seeded` (bernoulli,
rand, randn, randint, normal, uniform, native_dropout, rrelu_with_noise, ...) and any op with a positive dropout
argument. An op whose output is its random numbers (`values`) is recorded as it returned them and replayed by writing
the recorded numbers, cast to the copy's dtype, into the copy's own output; a dropout kernel (`dropout`) is recorded
by its mask and replayed as input * mask / (1 - p) in the copy's dtype; rrelu by its noise. An op that draws inside a
fused kernel (`kernel`: CUDA flash, memory-efficient and cuDNN attention with dropout_p > 0, cuDNN RNN dropout, an
unknown tagged op) cannot be replayed: its numbers come from the kernel's own Philox stream and never leave it.

Also `Attribution`: forward hooks on every module of a model that keep, per thread, the stack of modules whose
forward runs (a call's module is the innermost one), and enter a dispatch mode at each thread's outermost call, so
nn.DataParallel's replicas (their own threads, sharing the hooks of the modules they copy) and a checkpointed block's
recomputation in backward are seen too. Imports no adapter.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

Kind = Literal["values", "dropout", "rrelu", "kernel"]

_VALUES = frozenset({
    "bernoulli", "bernoulli_", "binomial", "cauchy", "cauchy_", "exponential", "exponential_", "geometric",
    "geometric_", "log_normal", "log_normal_", "multinomial", "normal", "normal_", "normal_functional", "poisson",
    "rand", "rand_like", "randint", "randint_like", "randn", "randn_like", "randperm", "random", "random_", "uniform",
    "uniform_", "_sample_dirichlet", "_standard_gamma"})
"""Ops whose output is the random numbers themselves (what they draw does not depend on an input's values' rounding)."""
_MASKS = frozenset({"bernoulli", "bernoulli_"})
"""Of those, the ones that draw 0/1: shipped at one bit per element."""
_DROPOUT = frozenset({"native_dropout", "_fused_dropout"})
_RRELU = frozenset({"rrelu_with_noise", "rrelu_with_noise_", "rrelu_with_noise_functional"})
_DROPOUT_ARGS = ("dropout_p", "dropout", "p_dropout", "dropout_prob")
_TRAIN_ARGS = ("train", "training")


@dataclass(frozen=True, slots=True)
class Rule:
    """How one random op is recorded and replayed."""

    op: str
    kind: Kind
    schema: Any

    @property
    def mask(self) -> bool:
        return self.kind == "dropout" or self.schema.name.split("::")[-1] in _MASKS

    def _arg(self, args: tuple, kwargs: dict, names: tuple[str, ...]) -> tuple[bool, Any]:
        for i, a in enumerate(self.schema.arguments):
            if a.name in names:
                if a.name in kwargs:
                    return True, kwargs[a.name]
                if i < len(args) and not a.kwarg_only:
                    return True, args[i]
                return True, a.default_value if a.has_default_value() else None
        return False, None

    def draws(self, args: tuple, kwargs: dict) -> bool:
        """Does this call draw random numbers (a dropout in eval mode or with p == 0 in a fused kernel does not)?"""
        has_train, train = self._arg(args, kwargs, _TRAIN_ARGS)
        if has_train and train is False:
            return False
        if self.kind != "kernel":
            return True
        found, p = self._arg(args, kwargs, _DROPOUT_ARGS)
        return not found or (isinstance(p, (int, float)) and p > 0)

    def dropout_p(self, args: tuple, kwargs: dict) -> float | None:
        found, p = self._arg(args, kwargs, _DROPOUT_ARGS)
        return float(p) if found and isinstance(p, (int, float)) else None

    def values(self, args: tuple, kwargs: dict, out: Any) -> torch.Tensor:
        """The random numbers of a call that returned `out`."""
        if self.kind == "dropout":
            return out[1]
        if self.kind == "rrelu":
            return out[1] if isinstance(out, tuple) else args[1]
        return out

    def replay(self, func: Callable, args: tuple, kwargs: dict, value: torch.Tensor) -> Any:
        """The call's result with `value` (the recorded numbers) in place of the ones it would draw."""
        if self.kind == "rrelu":  # output = input * noise in training (noise 1 where the input is positive)
            x, noise = args[0], args[1] if len(args) > 1 else kwargs["noise"]
            if self.op.startswith("aten.rrelu_with_noise_functional"):
                drawn = value.to(device=x.device, dtype=x.dtype)
                return x * drawn, drawn
            noise.copy_(value)
            return x.mul_(noise) if self.op.startswith("aten.rrelu_with_noise_.") else x * noise
        out = func(*args, **kwargs)  # the copy draws its own (the caller isolates its generator); overwritten below
        if self.kind == "values":
            _fill(out, value, self.op)
            return out
        output, mask = out
        _fill(mask, value, self.op)
        x, p = args[0], float(args[1] if len(args) > 1 else kwargs["p"])
        keep = 1.0 - p if self.op.startswith("aten.native_dropout") else p  # _fused_dropout's p keeps
        output.copy_(_dropped(x, mask, keep))
        return out


def _fill(out: torch.Tensor, value: torch.Tensor, op: str) -> None:
    if tuple(out.shape) != tuple(value.shape):
        raise ValueError(f"{op}: the recorded draw has shape {tuple(value.shape)}, this call's {tuple(out.shape)}")
    out.copy_(value.to(out.device))


def _dropped(x: torch.Tensor, mask: torch.Tensor, keep: float) -> torch.Tensor:
    """input * mask / keep as the device's dropout kernel rounds it."""
    if keep <= 0:
        return x * 0.0  # p == 1 drops everything
    kept = mask.to(dtype=x.dtype)
    if x.is_cuda:  # the fused kernel: input * mask * scale in its opmath type, rounded once
        return x * kept * (1.0 / keep)
    # ATen's CPU dropout: a noise tensor of the input's dtype divided by keep in that dtype, times the input
    return x * kept.div_(keep)


_RULES: dict[Any, Rule | None] = {}


def rule_of(func: Any) -> Rule | None:
    """The rule for an op that draws random numbers, or None for one that never does."""
    try:
        return _RULES[func]
    except KeyError:
        pass
    schema = func._schema
    namespace, _, name = schema.name.partition("::")
    kind: Kind | None = None
    if namespace == "aten" and name in _VALUES:
        kind = "values"
    elif namespace == "aten" and name in _DROPOUT:
        kind = "dropout"
    elif namespace == "aten" and name in _RRELU:
        kind = "rrelu"
    elif torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()) or any(
            a.name in _DROPOUT_ARGS for a in schema.arguments):
        kind = "kernel"
    _RULES[func] = Rule(str(func), kind, schema) if kind is not None else None
    return _RULES[func]


def generator_mark(rule: Rule, args: tuple, kwargs: dict) -> bytes | None:
    """A digest of the state of the generator a call is about to draw from (its `generator` argument, else the default
    one of the device it draws on); None where there is none to read. A checkpoint that restores the forward's
    generator state before recomputing makes each repeated call start from the state its forward call started from."""
    _, generator = rule._arg(args, kwargs, ("generator",))
    if generator is None:
        device = kwargs.get("device")
        if device is None:
            first = next((a for a in args if isinstance(a, torch.Tensor)), None)
            device = first.device if first is not None else torch.device("cpu")
        device = torch.device(device)
        if device.type == "cpu":
            generator = torch.default_generator
        elif device.type == "cuda":
            generator = torch.cuda.default_generators[device.index if device.index is not None
                                                      else torch.cuda.current_device()]
        else:
            return None
    return hashlib.blake2b(generator.get_state().numpy().tobytes(), digest_size=16).digest()


def key_of(module: str, op: str) -> str:
    """The key a call's draws are kept under: the innermost module running and the op."""
    return f"{module}|{op}"


def module_of(key: str) -> str:
    return key.rpartition("|")[0]


def op_of(key: str) -> str:
    return key.rpartition("|")[2]


def recomputing() -> bool:
    """Inside backward: a checkpointed block recomputing its forward (its calls repeat forward calls)."""
    return torch._C._current_graph_task_id() != -1


class Attribution:
    """Which module of `model` each op call belongs to, and a dispatch mode (made by `make_mode`) active in every
    thread while a module of `model` runs its forward."""

    def __init__(self, model: nn.Module, make_mode: Callable[[], TorchDispatchMode]) -> None:
        self.model = model
        self.make_mode = make_mode
        self._local = threading.local()

    def _stack(self) -> list[tuple[str, TorchDispatchMode | None]]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def current(self) -> str | None:
        """The innermost module of `model` running its forward in this thread (None: none is)."""
        stack = self._stack()
        return stack[-1][0] if stack else None

    def _active(self) -> bool:
        return any(getattr(m, "attribution", None) is self for m in _get_current_dispatch_mode_stack())

    def _before(self, name: str, module: nn.Module, args: tuple) -> None:
        mode = None
        if not self._active():
            mode = self.make_mode()
            mode.__enter__()
        self._stack().append((name, mode))

    def _after(self, name: str, module: nn.Module, args: tuple, output: Any) -> None:
        stack = self._stack()
        if not stack:
            return  # the hooks came in while this module's forward was running
        _, mode = stack.pop()
        if mode is not None:
            mode.__exit__(None, None, None)

    def hook(self) -> list[Any]:
        """Hooks on every module (the handles): the pre-hook first of its module's, the forward hook called even when
        the forward raises (a non-reentrant checkpoint stops its recomputation by raising)."""
        handles = []
        for name, m in self.model.named_modules():
            handles.append(m.register_forward_pre_hook(_bound(self._before, name), prepend=True))
            handles.append(m.register_forward_hook(_bound(self._after, name), always_call=True))
        return handles


def _bound(fn: Callable, name: str) -> Callable:
    def hook(*args: Any) -> None:
        fn(name, *args)
    return hook


class DrawMode(TorchDispatchMode):
    """A dispatch mode that hands each call of a random op (`rule_of`) to `on_draw(func, rule, args, kwargs)`, whose
    result is the call's; every other call runs as it is."""

    def __init__(self, attribution: Attribution, on_draw: Callable[..., Any]) -> None:
        super().__init__()
        self.attribution = attribution
        self._on_draw = on_draw

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rule = rule_of(func)
        if rule is None or not rule.draws(args, kwargs):
            return func(*args, **kwargs)
        return self._on_draw(func, rule, args, kwargs)
