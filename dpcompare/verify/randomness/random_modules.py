"""Randomness in the forward pass: find it, switch it off, give every rank its own stream, fingerprint each rank's state.

Owns: which modules of a model draw random numbers in training (by type, and as the probe's recording found them,
with their ops), --no-dropout (every dropout probability a model holds set to 0, and the note on what still draws),
the per-rank seed (seed 000: the same seed for the weights, a different one per replica for dropout and
augmentation), and the capture of a rank's generator state before its forward, whose digest tells ranks that would
draw the same numbers (the numbers themselves are recorded by dpcompare.verify.randomness.draw_recording). Also `isolated()`: rank 0's
verification work runs on a forked generator, so checking a run never changes the random numbers the run itself
draws. Also what is not randomness though two forwards differ: a forward that moves buffers it reads, without drawing
(spectral_norm's power iteration moves its `_u` and `_v` at every training-mode forward): `buffers_restorer` starts a
second forward from the first's buffers, and `each_rank_from_start` runs the ranks' forwards of one step on one copy
each from the buffers the step started from, as each rank's own forward starts from its own. Imports no adapter.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch
from torch import nn

from dpcompare.contract import ModelFacts
from dpcompare.verify.randomness.packed_draws import MaskRecord

_DROPOUT_TYPES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def rank_seed(seed: int, rank: int) -> int:
    """The generator seed of `rank` for everything after the weights are built: distinct per rank."""
    return int(np.random.SeedSequence([seed, rank, 0x5EED]).generate_state(1, dtype=np.uint32)[0])


def seed_rank(seed: int, rank: int) -> None:
    torch.manual_seed(rank_seed(seed, rank))  # seeds the CPU generator and every CUDA device's


@dataclass(frozen=True, slots=True)
class RngState:
    """A rank's generator state right before its forward: the CPU generator, and its CUDA device's."""

    cpu: bytes
    cuda: bytes | None = None

    @property
    def digest(self) -> str:
        return hashlib.blake2b(self.cpu + (self.cuda or b""), digest_size=8).hexdigest()


def capture(device: torch.device) -> RngState:
    cuda = torch.cuda.get_rng_state(device).numpy().tobytes() if device.type == "cuda" else None
    return RngState(torch.get_rng_state().numpy().tobytes(), cuda)


def _devices(device: torch.device) -> list[int]:
    return [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []


@contextlib.contextmanager
def isolated(device: torch.device) -> Iterator[None]:
    """Random numbers drawn inside do not advance the run's generators."""
    with torch.random.fork_rng(devices=_devices(device)):
        yield


def random_modules(module: nn.Module) -> list[str]:
    """Names of the modules declared to draw random numbers in training mode (dropout with p > 0, attention dropout,
    RReLU), by their type alone; what a forward really draws is found by recording it (`drawing_modules`)."""
    names = []
    for name, m in module.named_modules():
        if isinstance(m, _DROPOUT_TYPES) and m.p > 0:
            names.append(name or type(m).__name__)
        elif isinstance(m, nn.MultiheadAttention) and m.dropout > 0:
            names.append(f"{name} (attention dropout)")
        elif isinstance(m, nn.RReLU):
            names.append(name)
    return names


def _root(module: nn.Module, name: str) -> str:
    return name or type(module).__name__


def drawing_modules(model: nn.Module, keys: Iterable[str]) -> list[str]:
    """The modules of `model` named in recorded keys ("module|op" or a module's name), each once, in order (the root
    by its type)."""
    return list(dict.fromkeys(_root(model, key.rpartition("|")[0] if "|" in key else key) for key in keys))


def draws_described(model: nn.Module, record: MaskRecord) -> list[str]:
    """Each recorded key as "module (Type) op" (the op without its overload)."""
    types = {name: type(m).__name__ for name, m in model.named_modules()}
    out = []
    for key in record.masks:
        name, _, op = key.rpartition("|")
        packet = op.rsplit(".", 1)[0] if op.count(".") > 1 else op
        out.append(f"{_root(model, name)} ({types.get(name, '?')}) {packet}")
    return list(dict.fromkeys(out))


_DROP_NAME = re.compile(r"(\w*dropout\w*|\w*layerdrop|(\w+_)?drop(_?path)?(_?(prob|rate|p))?)")
"""Float attributes that hold a dropout probability: dropout, dropout_p, attention_dropout, hidden_dropout_prob,
drop_prob, drop_rate, drop_path_rate, attn_drop, proj_drop, layerdrop (timm, transformers, hand-written attention)."""


def _drop_like(m: nn.Module) -> bool:
    kind = type(m).__name__.lower()
    return "drop" in kind or "stochasticdepth" in kind  # DropPath, DropBlock, torchvision's StochasticDepth


def switch_off_dropout(module: nn.Module) -> list[str]:
    """Set every dropout probability to 0 (what --no-dropout does): the p of nn.Dropout and its kin and of drop-path
    modules, and every float attribute named like a dropout probability (the `dropout` of nn.MultiheadAttention and
    nn.LSTM, a `dropout_p` a forward hands to scaled_dot_product_attention, a `drop_prob` a drop path reads). Returns
    what changed: a module's name, or module.attribute. Random ops that no probability switches off (RReLU, noise
    drawn with torch.randn) still draw: the probe finds them (`no_dropout_note`)."""
    changed = []
    for name, m in module.named_modules():
        for attr, value in list(vars(m).items()):
            if isinstance(value, bool) or not isinstance(value, float) or not 0 < value <= 1:
                continue
            if (attr == "p" and _drop_like(m)) or _DROP_NAME.fullmatch(attr):
                setattr(m, attr, 0.0)
                changed.append(_root(module, name) if attr == "p" else f"{name}.{attr}" if name else attr)
    return changed


def no_dropout_note(switched: list[str], facts: ModelFacts) -> str:
    """The dropout_off note: what --no-dropout switched off, and what the forward still draws (the probe's record)."""
    text = f"--no-dropout: dropout switched off in {', '.join(switched) or 'nothing (no dropout probability found)'}"
    if not facts.stochastic:
        return text
    still = ", ".join(facts.random_ops or facts.random_modules) or "an operation in forward"
    fate = (f"not replayable ({facts.uncaptured})" if facts.uncaptured else
            "recorded on every rank and replayed in the oracle")
    return f"{text}; the forward still draws random numbers: {still}, {fate}"


def buffers_restorer(model: nn.Module) -> Callable[[], list[str]]:
    """A copy of `model`'s buffers now; calling what is returned puts a copy of it in the place of each buffer that
    has moved since (a new tensor, not written into the old: a backward still to run may have saved the old one, as
    BatchNorm's saves its running statistics) and returns their names; one that has not moved is left as it is. Two
    forwards of one input that start from the same buffers differ only by what they draw."""
    saved = {name: b.detach().clone() for name, b in model.named_buffers()}

    def restore() -> list[str]:
        moved = [n for n, b in model.named_buffers() if n in saved and not torch.equal(b, saved[n])]
        for name in moved:
            owner, _, leaf = name.rpartition(".")
            model.get_submodule(owner)._buffers[leaf] = saved[name].clone()
        return moved

    return restore


def each_rank_from_start(model: nn.Module, pieces: list[Any]) -> Iterator[Any]:
    """`pieces` (forwards with a `rank`) in their order, `model` holding each rank's own buffers at its forwards: a
    rank's first forward starts from the buffers the first piece started from (every rank holds the step's buffers
    before its forward, as rank 0's state says; a forward of the global batch alike), its later ones (its micro-batches)
    from what its own last forward left; after the last piece, `model` holds the first rank's buffers as its forwards
    left them, as rank 0 does. Of one rank, or a model without buffers: the pieces as they are, nothing copied."""
    ranks = list(dict.fromkeys(p.rank for p in pieces))
    if len(ranks) < 2 or next(model.buffers(), None) is None:
        yield from pieces
        return
    start = {name: b.detach().clone() for name, b in model.named_buffers()}
    held: dict[int, dict[str, torch.Tensor]] = {}
    current = ranks[0]
    for piece in pieces:
        if piece.rank != current:  # what the rank's forwards moved is kept (a constant buffer is not copied again)
            held[current] = {n: b.detach().clone() for n, b in model.named_buffers()
                             if n not in start or not torch.equal(b, start[n])}
            _load_buffers(model, {**start, **held.pop(piece.rank, {})})
            current = piece.rank
        yield piece
    if current != ranks[0]:
        _load_buffers(model, {**start, **held[ranks[0]]})


def _load_buffers(model: nn.Module, values: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name in values and not torch.equal(b, values[name]):
                b.copy_(values[name])
