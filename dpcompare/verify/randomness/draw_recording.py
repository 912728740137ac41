"""Random numbers of the forward: record what a rank drew, ship it packed, replay it in other copies of the model.

Owns: the capture of every random number a rank's forward draws in a training step (MaskRecorder), at the dispatcher:
each call of a random op (dpcompare.verify.randomness.random_ops: bernoulli, rand, randn, native_dropout, ...) made while a module
of the model runs its forward is recorded, in order, under its key (the innermost module running and the op), on CPU
or CUDA, directly or through DistributedDataParallel, FSDP and nn.DataParallel replicas, packed for transit
(dpcompare.verify.randomness.packed_draws). So nn.Dropout, functional dropout, drop path (torch.rand in a function), dropout
inside scaled_dot_product_attention's math path and any other random op are one case. A checkpointed block's
recomputation in backward is held to the numbers its forward drew (never recorded twice; a redrawn one is reported).
The replay (MaskReplayer) inside a verification copy of the model (float64, the run's precision): each random op's
call takes the next numbers recorded under its key, cast to the copy's dtype, so the copy computes the very random
function the rank computed, its downstream arithmetic in its own dtype. Also the assembly of a whole batch's draws from
those of its shards (`combine`), and the probe's question whether a forward draws random numbers that no replay
reaches (`uncaptured`). Numbers are captured, never re-drawn from seeds in the copies: a seed replayed on another
dtype, device or tensor layout need not give the same numbers. Recording never changes what the run computes or
draws. While recording or replaying, scaled_dot_product_attention runs on its math path, where its dropout is an
ordinary random op (the fused kernels draw inside themselves). Imports no adapter.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from dpcompare.contract.activation_checkpointing import checkpointed_blocks
from dpcompare.contract import batches
from dpcompare.verify.randomness import random_ops
from dpcompare.verify.randomness import random_modules
from dpcompare.verify.randomness.packed_draws import MaskRecord, PackedDraw

__all__ = ["MaskMismatch", "MaskRecord", "MaskRecorder", "MaskReplayer", "PackedDraw", "combine", "uncaptured"]


class MaskMismatch(RuntimeError):
    """Recorded draws cannot be applied (missing, of another shape, unused, not batch-first, drawn inside a kernel).
    `.module` is the module's name."""

    def __init__(self, module: str, reason: str):
        super().__init__(f"{module or '(the model itself)'}: {reason}")
        self.module = module
        self.reason = reason

    def __reduce__(self):  # picklable across processes although __init__ takes two arguments
        return (type(self), (self.module, self.reason))


def unreplayable(rule: random_ops.Rule, args: tuple, kwargs: dict) -> str:
    """Why a `kernel` op's call cannot be replayed, naming the op."""
    p = rule.dropout_p(args, kwargs)
    if p is not None:
        return (f"calls {rule.op} with dropout {p:g}, which draws its random numbers inside the kernel (its own Philox "
                "stream), where they can be neither recorded nor replayed")
    return f"calls {rule.op}, which draws random numbers by a rule no replay here knows"


def _replica(t: torch.Tensor) -> int:
    return t.device.index if t.device.type == "cuda" and t.device.index is not None else 0


@contextlib.contextmanager
def _attributed(attribution: random_ops.Attribution) -> Iterator[None]:
    """Inside: the model's modules hooked, its mode active on this thread (so the backward's recomputations are seen
    too, where a checkpoint calls a block's forward past its hooks), sdpa on its math path."""
    handles = attribution.hook()
    try:
        with sdpa_kernel(SDPBackend.MATH), attribution.make_mode():
            yield
    finally:
        for handle in handles:
            handle.remove()


class MaskRecorder:
    """Records the random numbers a model's forward draws while it runs, without changing what it computes or draws:
    each random op runs as it would, and its output (a dropout kernel's mask, rrelu's noise) is copied."""

    def __init__(self, module: nn.Module) -> None:
        self._attribution = random_ops.Attribution(module, lambda: random_ops.DrawMode(self._attribution, self._on_draw))
        self._lock = threading.Lock()
        self._masks: dict[str, list[PackedDraw]] = {}
        self._problems: dict[str, str] = {}
        self._redrawn: dict[str, str] = {}
        self._forwards: dict[int, int] = {}
        """Forwards of the model begun since the last take(), per replica."""
        self._local = threading.local()
        self._active = False
        self._bypassed = False

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Inside, every training forward of the model records its draws; outside, nothing is hooked."""
        if self._active:
            raise RuntimeError("MaskRecorder.recording() is already active")
        self._active = True
        self._bypassed = bool(checkpointed_blocks(self._attribution.model))
        root = self._attribution.model.register_forward_pre_hook(self._begin, with_kwargs=True)
        try:
            with _attributed(self._attribution):
                yield
        finally:
            root.remove()
            self._active = False

    def _begin(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """A forward of the model begins (a micro-batch; on nn.DataParallel, a replica's part of one)."""
        if random_ops.recomputing():
            return
        first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        replica = _replica(first) if first is not None else 0
        with self._lock:
            self._local.forward = self._forwards.get(replica, 0)
            self._forwards[replica] = self._local.forward + 1

    def take(self) -> MaskRecord:
        """The draws recorded since the last take(); clears them.

        A module with a problem keeps none of its draws: a partial list would shift its later calls onto the wrong
        numbers, where a missing list makes the replay fail loudly.
        """
        with self._lock:
            masks, problems, redrawn = self._masks, self._problems, self._redrawn
            self._masks, self._problems, self._redrawn, self._forwards = {}, {}, {}, {}
        return MaskRecord({k: calls for k, calls in masks.items() if random_ops.module_of(k) not in problems},
                          problems, redrawn)

    def _on_draw(self, func: Callable, rule: random_ops.Rule, args: tuple, kwargs: dict) -> Any:
        out = func(*args, **kwargs)
        module = self._attribution.current()
        again = random_ops.recomputing()
        # Outside the model's forward: the loss, the backend's own work. In backward outside every module's hooks: a
        # block that checkpoint_blocks recomputes by calling its forward past them (its own draws are checked).
        if module is None and not (again and self._bypassed):
            return out
        if rule.kind == "kernel":
            if not again:  # a recomputation repeats a forward call, already named
                with self._lock:
                    self._problems.setdefault(module, unreplayable(rule, args, kwargs))
            return out
        values = rule.values(args, kwargs, out)
        packed = PackedDraw.of(values, _replica(values), mask=rule.mask, forward=getattr(self._local, "forward", 0))
        if again:
            self._check_recomputed(module, rule.op, packed)
        else:
            with self._lock:
                self._masks.setdefault(random_ops.key_of(module, rule.op), []).append(packed)
        return out

    def _check_recomputed(self, module: str | None, op: str, packed: PackedDraw) -> None:
        """A checkpointed block recomputing its forward in backward draws again. That call records nothing; its numbers
        must be those of one of the calls of the same op its forward made this step (with the forward's generator state
        restored, they are), else the recomputation redrew them and the backward differentiates another function than
        the forward computed: said in the record's `redrawn`. (Non-reentrant checkpoint stops recomputing once its last
        saved tensor is back: a block's last draw is not always seen again.)"""
        with self._lock:
            if module is None:  # past the hooks: one of the modules that drew with this op and shape, if any did
                module = " or ".join(dict.fromkeys(random_ops.module_of(k) for k, calls in self._masks.items()
                                                   if random_ops.op_of(k) == op and any(p.shape == packed.shape
                                                                                   for p in calls)))
                if not module:
                    return  # it repeats no forward call
            if module in self._problems or module in self._redrawn:
                return
            forward = [p for k, calls in self._masks.items() if random_ops.op_of(k) == op for p in calls]
            mine = sum(len(calls) for k, calls in self._masks.items()
                       if random_ops.op_of(k) == op and random_ops.module_of(k) in module.split(" or "))
        if any(packed.same(p) for p in reversed(forward)):  # the latest first: a micro-batch's backward follows it
            return
        with self._lock:
            self._redrawn.setdefault(module, f"its {op} in the recomputation fits none of the {mine} draw(s) its "
                                             "forward made this step")


class _Replay:
    """The state of one `applying()` block: which recorded draw each key takes next, and which one each generator state
    was handed in forward (a checkpointed recomputation in backward repeats forward calls from their states)."""

    def __init__(self, masks: dict[str, list[torch.Tensor]], attribution: random_ops.Attribution) -> None:
        self.masks = masks
        self.attribution = attribution
        self.used: dict[str, int] = {}
        self.recomputed: dict[str, int] = {}
        """Recomputed calls whose generator state no forward call had: they repeat forward calls in order, per key."""
        self.handed: dict[tuple[bytes | None, str], torch.Tensor] = {}
        self.lock = threading.Lock()

    def on_draw(self, func: Callable, rule: random_ops.Rule, args: tuple, kwargs: dict) -> Any:
        module = self.attribution.current()
        again = random_ops.recomputing()
        if module is None and not again:
            return func(*args, **kwargs)  # outside the model's forward: the run recorded nothing there either
        if rule.kind == "kernel":
            raise MaskMismatch(module or "", unreplayable(rule, args, kwargs))
        mark = random_ops.generator_mark(rule, args, kwargs)
        value = self.handed.get((mark, rule.op)) if again and mark is not None else None
        if value is None:
            if module is None:
                raise MaskMismatch("", f"a recomputation in backward calls {rule.op} outside any module's forward, "
                                       "from a generator state no forward call had")
            value, i = self._next(module, rule.op, again)
            if not again:
                self.handed[(mark, rule.op)] = value
        try:
            return rule.replay(func, args, kwargs, value)
        except ValueError as exc:
            raise MaskMismatch(module or "", str(exc)) from None

    def _next(self, module: str, op: str, again: bool) -> tuple[torch.Tensor, int]:
        key = random_ops.key_of(module, op)
        with self.lock:
            calls = self.masks.get(key)
            if calls is None:
                raise MaskMismatch(module, f"calls {op}, but the run recorded no draw of it in this module")
            counter = self.recomputed if again else self.used
            i = counter.get(key, 0)
            if i >= len(calls):
                raise MaskMismatch(module, f"calls {op} {i + 1} times, but {len(calls)} draws were recorded")
            counter[key] = i + 1
        return calls[i], i

    def unused(self) -> tuple[str, str] | None:
        for key, calls in self.masks.items():
            if self.used.get(key, 0) < len(calls):
                return random_ops.module_of(key), (f"{len(calls) - self.used.get(key, 0)} of {len(calls)} recorded draws "
                                              f"of {random_ops.op_of(key)} were not used")
        return None


class MaskReplayer:
    """Replays recorded draws in a verification copy of the model (same module names)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._names = {name for name, _ in model.named_modules()}

    @contextlib.contextmanager
    def applying(self, masks: dict[str, list[torch.Tensor]] | None) -> Iterator[None]:
        """Inside: each call of a random op while a module of the model runs its forward takes the next draw recorded
        under its key ("module|op") instead of its own numbers: the recorded values cast to the copy's dtype (a dropout
        kernel's output is the input times the mask scaled by 1 / (1 - p) as the device's kernel rounds it). masks
        None: nothing is hooked. Raises MaskMismatch when a module draws where nothing was recorded, more often than
        recorded, with another shape, inside a kernel that cannot be replayed, and, on leaving the block without an
        exception in flight, when draws were left unused (naming the module).

        The op itself still runs (its numbers are overwritten) and draws: the caller isolates the generator.
        """
        if masks is None:
            yield
            return
        for key in masks:
            if random_ops.module_of(key) not in self._names:
                raise MaskMismatch(random_ops.module_of(key), "the model has no module of this name")
        replay: _Replay | None = None
        attribution = random_ops.Attribution(self.model, lambda: random_ops.DrawMode(attribution, replay.on_draw))
        replay = _Replay(masks, attribution)
        with _attributed(attribution):
            yield
        left = replay.unused()
        if left is not None:
            raise MaskMismatch(*left)


def combine(pieces: list[dict[str, list[torch.Tensor]]], index: list[torch.Tensor],
            batch: int) -> dict[str, list[torch.Tensor]]:
    """Draws for one forward of a whole batch, assembled from the draws of its pieces (each rank's micro-batches):
    piece i held the samples `index[i]` (a LongTensor of positions in the whole batch). Every key must have been
    called the same number of times in each piece, and each draw must be batch-first (shape[0] == len(index[i]));
    else MaskMismatch naming the module. The result's call c has shape (batch, *rest) with rows index[i] taken from
    piece i's call c.

    The pieces must cover the batch exactly once (else ValueError): an uncovered row would silently be dropped.
    """
    if len(pieces) != len(index):
        raise ValueError(f"{len(pieces)} pieces but {len(index)} index tensors")
    index = [torch.as_tensor(i, dtype=torch.long).reshape(-1).cpu() for i in index]
    rows = torch.cat(index) if index else torch.zeros(0, dtype=torch.long)
    if rows.numel() != batch or not torch.equal(rows.sort().values, torch.arange(batch)):
        raise ValueError(f"the pieces' index does not cover each of the {batch} positions of the batch exactly once")
    out: dict[str, list[torch.Tensor]] = {}
    for key in dict.fromkeys(key for piece in pieces for key in piece):
        name, op = random_ops.module_of(key), random_ops.op_of(key)
        counts = [len(piece.get(key, ())) for piece in pieces]
        if len(set(counts)) > 1:
            raise MaskMismatch(name, f"{op} called {counts} times in the pieces: no single forward of the batch matches")
        calls = []
        for c in range(counts[0]):
            parts = [piece[key][c] for piece in pieces]
            rest = None
            for i, (mask, rows_i) in enumerate(zip(parts, index)):
                if mask.dim() == 0 or mask.shape[0] != len(rows_i):
                    raise MaskMismatch(name, f"{op} call {c + 1}: piece {i}'s draw has shape {tuple(mask.shape)}, not "
                                             f"batch-first for its {len(rows_i)} samples")
                if rest is None:
                    rest = tuple(mask.shape[1:])
                elif tuple(mask.shape[1:]) != rest:
                    raise MaskMismatch(name, f"{op} call {c + 1}: the pieces' draws differ beyond the batch dimension "
                                             f"({rest} vs {tuple(mask.shape[1:])})")
            whole = parts[0].new_zeros((batch, *(rest or ())))
            for mask, rows_i in zip(parts, index):
                whole[rows_i.to(whole.device)] = mask.to(whole.device, whole.dtype)
            calls.append(whole)
        out[key] = calls
    return out


def _tensors(value: Any) -> list[torch.Tensor]:
    return batches.leaves(value)


Summary = tuple[tuple[int, ...], torch.dtype, tuple[float, ...]]


def _summaries(value: Any) -> list[Summary]:
    """Each tensor of `value` as its shape, dtype and a few float64 sums (sum, sum of |x|, norm, NaN count): a
    forward that draws other numbers moves them by the size of the values; a model's every activation stays small."""
    out = []
    for t in _tensors(value):
        x = t.detach()
        if x.is_floating_point() or x.is_complex():
            x64 = x.double() if x.is_floating_point() else x.abs().double()
            finite = x64.nan_to_num(0.0, 0.0, 0.0)
            sums = (float(finite.sum()), float(finite.abs().sum()), float(finite.norm()), float(x64.isnan().sum()))
        else:
            sums = (float(x.double().sum()), float(x.double().abs().sum()), 0.0, 0.0)
        out.append((tuple(x.shape), x.dtype, sums))
    return out


def _same(a: list[Summary], b: list[Summary]) -> bool:
    """Equal up to the rounding of a replayed dropout's scale (the kernel's own against input * mask / (1 - p)); a
    different random draw differs by the size of the values themselves."""
    if len(a) != len(b):
        return False
    for (shape, dtype, x), (shape2, dtype2, y) in zip(a, b):
        if shape != shape2 or dtype != dtype2:
            return False
        tolerance = min(64 * torch.finfo(dtype).eps, 0.1) if dtype.is_floating_point else 0.0
        if x[3] != y[3] or any(abs(u - v) > tolerance * max(abs(x[1]), abs(y[1])) for u, v in zip(x[:3], y[:3])):
            return False
    return True


@contextlib.contextmanager
def _watching(model: nn.Module) -> Iterator[list[tuple[str, list[Summary], list[Summary]]]]:
    """Records each module call's tensor inputs and outputs, summarised (`_summaries`), in the order the calls end."""
    seen: list[tuple[str, list[Summary], list[Summary]]] = []
    inputs: dict[tuple[str, int], list[list[Summary]]] = {}

    def before(name: str, module: nn.Module, args: tuple, kwargs: dict) -> None:
        inputs.setdefault((name, id(module)), []).append(_summaries([args, kwargs]))

    def after(name: str, module: nn.Module, args: tuple, output: Any) -> None:
        pending = inputs.get((name, id(module))) or [[]]
        seen.append((name, pending.pop(), _summaries(output)))

    handles = []
    for name, m in model.named_modules():
        handles.append(m.register_forward_pre_hook(random_ops._bound(before, name), with_kwargs=True))
        handles.append(m.register_forward_hook(random_ops._bound(after, name)))
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def uncaptured(model: nn.Module, x: Any) -> str | None:
    """Does `model`'s training-mode forward draw random numbers that recording its random ops does not replay? Runs the
    forward on `x` twice: first recording its draws with a MaskRecorder, then replaying them with a MaskReplayer (both
    on this same model, generator not reset between, each from the same buffers: random_modules.buffers_restorer). Returns
    None when the two outputs are equal; else what draws,
    naming the module with its type, e.g. "blocks.0.attn (Attention) calls aten._scaled_dot_product_flash_attention
    with dropout 0.1, ...": a call the recorder found unreplayable, a replay that failed, or else the module whose
    output differs although its inputs did not (the first such to finish; "the model's own forward (Net)" for the root)
    — the module whose own computation draws, not the first one downstream to see the difference.
    Runs inside torch.random.fork_rng (devices of x if CUDA) so the caller's generator is untouched, and under
    torch.no_grad(). Leaves the model's training flags as it found them; module buffers may change (pass a copy).
    """
    types = {name: type(m).__name__ for name, m in model.named_modules()}

    def describe(name: str) -> str:
        return f"{name} ({types.get(name, '?')})" if name else f"the model's own forward ({types['']})"

    flags = {m: m.training for m in model.modules()}
    devices = sorted({t.device.index for t in batches.leaves(x) if t.device.type == "cuda"})
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            model.train()
            recorder = MaskRecorder(model)
            restore = random_modules.buffers_restorer(model)  # the second forward starts from the first's buffers
            with recorder.recording(), _watching(model) as first:
                out1 = batches.call(model, x)
            record = recorder.take()
            if record.problems:
                name, why = next(iter(record.problems.items()))
                return f"{describe(name)} {why}"
            restore()
            try:
                with MaskReplayer(model).applying(record.calls()), _watching(model) as second:
                    out2 = batches.call(model, x)
            except MaskMismatch as e:
                return f"{describe(e.module)}: {e.reason}"
    finally:
        for m, training in flags.items():
            m.training = training
    if _same(_summaries(out1), _summaries(out2)):
        return None
    outside = " draws random numbers outside torch's random operations (its output differs between two forwards " \
              "that replay every random operation's numbers)"
    differing = [(name, a_in, b_in) for (name, a_in, a_out), (name2, b_in, b_out) in zip(first, second)
                 if name != name2 or not _same(a_out, b_out)]
    for name, a_in, b_in in differing:
        if _same(a_in, b_in):
            return describe(name) + outside
    return describe(differing[0][0] if differing else "") + outside
