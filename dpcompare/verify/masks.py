"""Dropout masks: record the masks a rank drew, ship them packed, apply them in other copies of the model.

Owns: the capture of every dropout mask a rank draws in a training step (on CPU or CUDA, directly or through
DistributedDataParallel and nn.DataParallel replicas), each one proven against the module's own output and packed
for transit (one bit per element: dpcompare.verify.mask_transit), and a checkpointed block's recomputation in
backward held to the masks its forward drew (never recorded twice; a redrawn mask is reported); their replay inside a verification copy of the
model (float64, float32) so that the copy computes the very random function the rank computed; the assembly of a
whole batch's masks from the masks of its shards; and the check that a model draws no random numbers outside the
modules whose masks are captured. Masks are captured, never re-drawn from seeds in the copies: a seed replayed
on another dtype, device or tensor layout need not give the same mask. Recording never changes what the run
computes or draws. Imports no adapter.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.nn import functional as F

from dpcompare.verify.mask_transit import MaskRecord, PackedMask

CAPTURABLE: tuple[type, ...] = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)
"""Modules whose training-mode output is input * mask / (1 - p) with a 0/1 mask: capturable."""

# The functional form each capturable module calls: the mask is regenerated with it, from the same generator state.
_FUNCTIONAL: tuple[tuple[type, Callable[..., torch.Tensor]], ...] = (
    (nn.Dropout1d, F.dropout1d), (nn.Dropout2d, F.dropout2d), (nn.Dropout3d, F.dropout3d), (nn.Dropout, F.dropout))


class MaskMismatch(RuntimeError):
    """A captured mask cannot be applied (wrong shape, missing, not batch-first). `.module` is the module's name."""

    def __init__(self, module: str, reason: str):
        super().__init__(f"{module or '(the model itself)'}: {reason}")
        self.module = module
        self.reason = reason

    def __reduce__(self):  # picklable across processes although __init__ takes two arguments
        return (type(self), (self.module, self.reason))


@dataclass(slots=True)
class _Saved:
    """The generator states right before a module drew its mask."""

    cpu: torch.Tensor
    cuda: torch.Tensor | None


def _draws(module: nn.Module) -> bool:
    return module.training and module.p > 0


def _functional(module: nn.Module) -> Callable[..., torch.Tensor]:
    return next(fn for kind, fn in _FUNCTIONAL if isinstance(module, kind))


def _recomputing() -> bool:
    """Inside backward: a checkpointed block recomputing its forward (torch.utils.checkpoint with
    preserve_rng_state=True restores the generator state, so it redraws the very mask of the forward call it repeats)."""
    return torch._C._current_graph_task_id() != -1


@contextlib.contextmanager
def _hooked(targets: dict[str, nn.Module], before: Callable[..., Any], after: Callable[..., Any]) -> Iterator[None]:
    """Inside, `before(name, module, args)` and `after(name, module, args, output)` hook every target's forward;
    on leaving, even on an error, every hook is removed."""
    handles = []
    try:
        for name, m in targets.items():
            handles.append(m.register_forward_pre_hook(functools.partial(before, name)))
            handles.append(m.register_forward_hook(functools.partial(after, name)))
        yield
    finally:
        for handle in handles:
            handle.remove()


def _ones_aligned_like(x: torch.Tensor) -> torch.Tensor:
    """Ones of x's shape and strides, and on CUDA at x's pointer alignment: CUDA's dropout kernel vectorises by the
    input's alignment, and which random number lands on which element follows the vector width. (The proof in
    `_after` still checks the mask; this only makes a misaligned view capturable.)"""
    ones = torch.ones_like(x)
    if x.device.type != "cuda" or not x.is_contiguous():
        return ones
    shift = (x.data_ptr() % 16) // x.element_size()
    if shift == 0:
        return ones
    return torch.ones(shift + x.numel(), dtype=x.dtype, device=x.device)[shift:].view(x.shape)


def _contradicts(mask: torch.Tensor, module: nn.Module, x: torch.Tensor, output: torch.Tensor) -> bool:
    """Does the module's output (from input `x`) contradict `mask`? The proof: kept where the output is nonzero,
    dropped where a nonzero input became zero. Non-finite values prove nothing (a dropped NaN stays NaN)."""
    out = output.detach()
    wrong = (out != 0) & out.isfinite() & ~mask
    if not getattr(module, "inplace", False):
        # With inplace=True the input was overwritten by the output: only the output half can be checked.
        x = x.detach()
        wrong |= (x != 0) & x.isfinite() & (out == 0) & mask
    return bool(wrong.any())


def _key(name: str) -> tuple[str, int]:
    # nn.DataParallel runs each replica's forward in its own thread: a pre-hook and its forward hook meet by thread
    return (name, threading.get_ident())


class MaskRecorder:
    """Records the dropout masks a module draws while it runs, without changing what it computes or draws.

    The mask is not read from the module (it never exposes it): it is regenerated from the generator state saved
    right before the module drew, on a forked generator, and then proven against the module's input and output.
    """

    def __init__(self, module: nn.Module) -> None:
        self._targets = {name: m for name, m in module.named_modules() if isinstance(m, CAPTURABLE) and m.p > 0}
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, int], _Saved] = {}
        self._masks: dict[str, list[PackedMask]] = {}
        self._problems: dict[str, str] = {}
        self._redrawn: dict[str, str] = {}
        self._active = False

    @property
    def modules(self) -> list[str]:
        return list(self._targets)

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Inside, every training-mode call of a capturable module records its mask; outside, nothing is hooked."""
        if self._active:
            raise RuntimeError("MaskRecorder.recording() is already active")
        self._active = True
        try:
            with _hooked(self._targets, self._before, self._after):
                yield
        finally:
            with self._lock:
                self._pending.clear()
            self._active = False

    def take(self) -> MaskRecord:
        """The masks recorded since the last take(); clears them.

        A module with a problem keeps none of its masks: a partial list would shift its later calls onto the
        wrong masks, where a missing list makes the replay fail loudly.
        """
        with self._lock:
            masks, problems, redrawn = self._masks, self._problems, self._redrawn
            self._masks, self._problems, self._redrawn = {}, {}, {}
        return MaskRecord({name: calls for name, calls in masks.items() if name not in problems}, problems, redrawn)

    def _check_recomputed(self, name: str, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        """A checkpointed block recomputing its forward in backward calls the module again. That call draws no new
        mask to record; its output must be its input times one of the masks the module's forward calls drew this
        step, else the recomputation redrew the mask (no generator state restored) and the backward differentiates
        another function than the forward computed: said in the record's `redrawn`. A recomputation that stops once
        its last saved tensor is back (non-reentrant checkpoint's early stop) leaves the module it stops in unhooked:
        a block's last dropout is not seen here when nothing after it saves a tensor, the others are."""
        if not args or not isinstance(args[0], torch.Tensor) or not isinstance(output, torch.Tensor):
            return
        with self._lock:
            if name in self._problems or name in self._redrawn:
                return
            calls = list(self._masks.get(name, ()))
        # the latest first: a micro-batch's backward recomputes the forward just before it
        for packed in reversed(calls):
            if packed.shape == tuple(output.shape) and not _contradicts(
                    packed.unpack().to(output.device), module, args[0], output):
                return
        with self._lock:
            self._redrawn.setdefault(name, f"its output in the recomputation fits none of the {len(calls)} mask(s) "
                                           "its forward drew this step")

    def _problem(self, name: str, reason: str) -> None:
        with self._lock:
            self._problems.setdefault(name, reason)

    def _before(self, name: str, module: nn.Module, args: tuple[Any, ...]) -> None:
        if not _draws(module) or _recomputing():
            return None  # a recomputation repeats a call already recorded (its output is checked in `_after`)
        if not args or not isinstance(args[0], torch.Tensor):
            self._problem(name, "called without a tensor as its first positional argument")
            return None
        x = args[0]
        cuda = torch.cuda.get_rng_state(x.device) if x.device.type == "cuda" else None
        saved = _Saved(torch.get_rng_state(), cuda)
        with self._lock:
            self._pending[_key(name)] = saved
        return None

    def _after(self, name: str, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if _recomputing():
            if _draws(module):
                self._check_recomputed(name, module, args, output)
            return None
        with self._lock:
            saved = self._pending.pop(_key(name), None)
        if saved is None:
            return None
        x = args[0]
        if not isinstance(output, torch.Tensor) or output.shape != x.shape:
            self._problem(name, "its output is not a tensor of its input's shape")
            return None
        devices = [x.device.index] if x.device.type == "cuda" else []
        # fork_rng puts the run's generators back afterwards: the run goes on to draw what it would have drawn unhooked
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            torch.set_rng_state(saved.cpu)
            if saved.cuda is not None:
                torch.cuda.set_rng_state(saved.cuda, x.device)
            mask = _functional(module)(_ones_aligned_like(x), p=module.p, training=True, inplace=False) != 0
            if _contradicts(mask, module, x, output):
                self._problem(name, "the mask regenerated from the generator state before the call does not match "
                                    "its output: it draws other random numbers, or draws differently for this tensor")
                return None
            packed = PackedMask.of(mask, x.device.index if x.device.type == "cuda" else 0)
        with self._lock:
            if name not in self._problems:
                self._masks.setdefault(name, []).append(packed)
        return None


class _Replay:
    """The state of one `applying()` block: which mask each module takes next."""

    def __init__(self, masks: dict[str, list[torch.Tensor]]) -> None:
        self.masks = masks
        self.used: dict[str, int] = {}
        self.recomputed: dict[str, int] = {}
        """Calls made by a checkpointed block's recomputation in backward: they repeat forward calls, in order."""
        self.inputs: dict[tuple[str, int], torch.Tensor] = {}
        self.lock = threading.Lock()

    def before(self, name: str, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if not _draws(module) or not args or not isinstance(args[0], torch.Tensor):
            return None
        x = args[0]
        with self.lock:
            self.inputs[_key(name)] = x
        if getattr(module, "inplace", False):
            return (x.clone(), *args[1:])  # the module's own in-place draw must not overwrite the input we replay on
        return None

    def after(self, name: str, module: nn.Module, args: tuple[Any, ...], output: Any) -> torch.Tensor | None:
        with self.lock:
            x = self.inputs.pop(_key(name), None)
            if x is None:
                return None
            calls = self.masks.get(name)
            if calls is None:
                raise MaskMismatch(name, "no mask was captured for this module")
            counter = self.recomputed if _recomputing() else self.used
            i = counter.get(name, 0)
            if i >= len(calls):
                raise MaskMismatch(name, f"called {i + 1} times, but {len(calls)} masks were captured")
            counter[name] = i + 1
        mask = calls[i]
        if tuple(mask.shape) != tuple(x.shape):
            raise MaskMismatch(name, f"call {i + 1}: captured mask has shape {tuple(mask.shape)}, "
                                     f"input has shape {tuple(x.shape)}")
        p = float(module.p)
        if p >= 1:
            return x * 0.0  # p == 1 drops everything: F.dropout returns zeros too
        keep = mask.to(device=x.device, dtype=x.dtype, copy=True)
        if x.is_cuda:  # the fused kernel: input * mask * scale in its opmath type, rounded once
            return x * keep * (1.0 / (1.0 - p))
        # ATen's CPU dropout: a noise tensor of the input's dtype, divided by 1 - p in that dtype (1/0.9 is 1.109375 in
        # bf16), times the input: in a 16-bit forward the scale's own rounding is part of what the run computes.
        return x * keep.div_(1.0 - p)

    def unused(self) -> tuple[str, str] | None:
        for name, calls in self.masks.items():
            if self.used.get(name, 0) < len(calls):
                return name, f"{len(calls) - self.used.get(name, 0)} of {len(calls)} captured masks were not used"
        return None


class MaskReplayer:
    """Applies captured masks in a verification copy of the model (same module names)."""

    def __init__(self, model: nn.Module) -> None:
        self._targets = {name: m for name, m in model.named_modules() if isinstance(m, CAPTURABLE)}

    @contextlib.contextmanager
    def applying(self, masks: dict[str, list[torch.Tensor]] | None) -> Iterator[None]:
        """Inside: every call of each capturable module (by name) takes the next mask of its list and returns
        the input times the mask scaled by 1 / (1 - p) as the device's kernel rounds it (on CUDA the fused kernel's
        input * mask * scale in its opmath type; on the CPU a noise tensor of the input's dtype divided by 1 - p),
        instead of drawing. masks None or {}: nothing is hooked. Raises MaskMismatch when a
        module is called more times than it has masks, when a mask's shape differs from the input's, and, on leaving
        the block without an exception in flight, when masks were left unused (name the module).

        Only training-mode calls with p > 0 take a mask, as only those were recorded. The module's own forward still
        runs (its output is discarded) and draws: the caller isolates the generator.
        """
        if not masks:
            yield
            return
        for name in masks:
            if name not in self._targets:
                raise MaskMismatch(name, "the model has no capturable module of this name")
        replay = _Replay(masks)
        with _hooked(self._targets, replay.before, replay.after):
            yield
        left = replay.unused()
        if left is not None:
            raise MaskMismatch(*left)


def combine(pieces: list[dict[str, list[torch.Tensor]]], index: list[torch.Tensor],
            batch: int) -> dict[str, list[torch.Tensor]]:
    """Masks for one forward of a whole batch, assembled from the masks of its pieces (each rank's micro-batches):
    piece i held the samples `index[i]` (a LongTensor of positions in the whole batch). Every module must have been
    called the same number of times in each piece, and each mask must be batch-first (shape[0] == len(index[i]));
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
    for name in dict.fromkeys(name for piece in pieces for name in piece):
        counts = [len(piece.get(name, ())) for piece in pieces]
        if len(set(counts)) > 1:
            raise MaskMismatch(name, f"called {counts} times in the pieces: no single forward of the batch matches")
        calls = []
        for c in range(counts[0]):
            parts = [piece[name][c] for piece in pieces]
            rest = None
            for i, (mask, rows_i) in enumerate(zip(parts, index)):
                if mask.dim() == 0 or mask.shape[0] != len(rows_i):
                    raise MaskMismatch(name, f"call {c + 1}: piece {i}'s mask has shape {tuple(mask.shape)}, not "
                                             f"batch-first for its {len(rows_i)} samples")
                if rest is None:
                    rest = tuple(mask.shape[1:])
                elif tuple(mask.shape[1:]) != rest:
                    raise MaskMismatch(name, f"call {c + 1}: the pieces' masks differ beyond the batch dimension "
                                             f"({rest} vs {tuple(mask.shape[1:])})")
            whole = parts[0].new_zeros((batch, *(rest or ())))
            for mask, rows_i in zip(parts, index):
                whole[rows_i.to(whole.device)] = mask.to(whole.device, whole.dtype)
            calls.append(whole)
        out[name] = calls
    return out


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        for item in value:
            found = _first_tensor(item)
            if found is not None:
                return found
    return None


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    return []


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Equal up to the rounding of the replayed scale (computed in float64, the module's own in the tensor's dtype);
    a different random draw differs by the size of the values themselves."""
    if a is None or b is None:
        return a is b
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.is_floating_point() or a.numel() == 0:
        return torch.equal(a, b)
    a64, b64 = a.double(), b.double()
    if not torch.equal(a64.isnan(), b64.isnan()):
        return False
    a64, b64 = a64.nan_to_num(0.0), b64.nan_to_num(0.0)
    tolerance = min(64 * torch.finfo(a.dtype).eps, 0.1)
    return bool((a64 - b64).abs().max() <= tolerance * b64.abs().max())


@contextlib.contextmanager
def _watching(model: nn.Module) -> Iterator[list[tuple[str, torch.Tensor | None]]]:
    """Records each module's output (its first tensor, copied: later in-place ops must not change it) as it fires."""
    seen: list[tuple[str, torch.Tensor | None]] = []

    def hook(name: str, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        tensor = _first_tensor(output)
        seen.append((name, None if tensor is None else tensor.detach().clone()))

    handles = [m.register_forward_hook(functools.partial(hook, name)) for name, m in model.named_modules()]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def uncaptured(model: nn.Module, x: torch.Tensor) -> str | None:
    """Does `model`'s training-mode forward draw random numbers outside capturable modules? Runs the forward on `x`
    twice: first recording masks with a MaskRecorder, then applying them with a MaskReplayer (both on this same model,
    generator not reset between). Forward hooks on every module record outputs (first tensor of the output) in
    execution order in both passes. Returns None when the two final outputs are equal; else the name of the first
    module (in hook-firing order, i.e. innermost first) whose output differs, with its type, e.g.
    "blocks.0.attn (CausalSelfAttention)" — or "the model's own forward (Net)" when only the root's differs.
    Runs inside torch.random.fork_rng (devices of x if CUDA) so the caller's generator is untouched, and under
    torch.no_grad(). Leaves the model's training flag as it found it; module buffers may change (caller passes a copy).

    A capturable module whose mask could not be captured (or replayed) is named too: its randomness is not captured.
    """
    types = {name: type(m).__name__ for name, m in model.named_modules()}

    def describe(name: str) -> str:
        return f"{name} ({types.get(name, '?')})" if name else f"the model's own forward ({types['']})"

    flags = {m: m.training for m in model.modules()}
    devices = [x.device.index] if x.device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            model.train()
            recorder = MaskRecorder(model)
            with recorder.recording(), _watching(model) as first:
                out1 = model(x)
            record = recorder.take()
            if record.problems:
                return describe(next(iter(record.problems)))
            try:
                # the replayer's hooks are installed before the watcher's, so the watcher sees the replayed output
                with MaskReplayer(model).applying(record.calls()), _watching(model) as second:
                    out2 = model(x)
            except MaskMismatch as e:
                return describe(e.module)
    finally:
        for m, training in flags.items():
            m.training = training
    final1, final2 = _tensors(out1), _tensors(out2)
    if len(final1) == len(final2) and all(_same(a, b) for a, b in zip(final1, final2)):
        return None
    for (name, a), (name2, b) in zip(first, second):
        if name != name2 or not _same(a, b):
            return describe(name)
    return describe("")
