"""Equivalence: is the backend's reduced gradient the gradient of the global-batch loss?

Owns: the float64 oracle, the run-precision reference (the noise floor), the forwards a step's gradient is
recomputed from (the global batch, or each replica's as the backend split it) and fingerprints for replica
consistency. Imports no adapter: it receives tensors, state dicts and gathered fingerprints.

The metrics, the tolerance policy and the power of each check are written once, in
dpcompare.verify.judgement.tolerance: the reduced gradient is judged against the run-precision reference split as the ranks
split it (floor: what data parallelism alone changes, measured by a second run-precision computation), and its
distance from the float64 oracle is stated beside it. The per-step check records and the verdict they add up to
are dpcompare.verify.judgement.verdict's; the names of the two that the checks use are importable from here too (`__all__`).
The diagnosis of a failed check is dpcompare.verify.diagnosis.diagnose's.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import nn

from dpcompare.contract import batches
from dpcompare.contract.compiling import compile_forward
from dpcompare.contract.sparse import make_dense
from dpcompare.verify.oracle.module_boundaries import module_boundaries
from dpcompare.verify.oracle import float64_paths, weights_on_use
from dpcompare.verify.oracle.model_dtypes import as_input, float_dtype
from dpcompare.verify.randomness.draw_recording import MaskReplayer
from dpcompare.verify.judgement.precision_recipe import NONE as NO_RECIPE, Recipe
from dpcompare.verify.judgement.held_values import Compact, releasable, release
from dpcompare.verify.randomness.random_modules import each_rank_from_start
from dpcompare.verify.judgement.tolerance import (TOLERANCE_FACTOR, UNIT_ROUNDOFF, WIRE_DTYPE, ParamError, compare, coverage,
                                        flat, min_detectable, rel_fro, wire_roundoff)
from dpcompare.verify.judgement.verdict import Divergence, StepCheck, UpdateCheck, Verdict, tolerance_policy

__all__ = [
    "DTYPES", "Grads", "Masks", "RECOMPUTE_ATTRIBUTE", "Layout", "Oracle", "Piece", "accumulate_gradient", "accumulate_raw", "depth_of",
    "finish_gradient", "first_mismatch", "global_pieces", "grad_digests", "loaded", "param_digests", "replica_pieces",
    "tensor_digest", "same_forwards", "same_sum", "verification_copy",
    # the tolerance policy's (dpcompare.verify.judgement.tolerance)
    "TOLERANCE_FACTOR", "UNIT_ROUNDOFF", "WIRE_DTYPE", "ParamError", "compare", "coverage", "flat", "min_detectable",
    "rel_fro", "wire_roundoff",
    # the records and the verdict (dpcompare.verify.judgement.verdict)
    "Divergence", "StepCheck", "UpdateCheck", "Verdict", "tolerance_policy",
]

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}

Grads = dict[str, torch.Tensor]


# -- fingerprints ----------------------------------------------------------------------------------
def tensor_digest(t: Any) -> str:
    """A tensor's digest, computed where it is: on the CPU its own buffer hashed in place (blake2b, no copy of its
    bytes), on any other device `device_digest`'s 16 bytes hashed (a parameter never leaves its device for its
    digest). Digests are compared between tensors on one kind of device (a rank's at two steps, the ranks'). A batch's:
    its tensors' digests'."""
    if not torch.is_tensor(t):
        return hashlib.blake2b("".join(map(tensor_digest, batches.leaves(t))).encode(), digest_size=8).hexdigest()
    flat = t.detach().reshape(-1).contiguous()
    data = flat.view(torch.uint8).numpy() if flat.device.type == "cpu" else device_digest(flat)
    return hashlib.blake2b(data, digest_size=8).hexdigest()


_DIGEST_CHUNK = 1 << 20
_MIX = (-7046029254386353131, -4658895280553007687)  # 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9 as signed int64
_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def device_digest(flat: torch.Tensor) -> bytes:
    """16 bytes that change with any bit of `flat` (contiguous, one dimension), computed on its device by its own
    kernels: its bytes read as 64-bit words (the last 0-7 bytes apart), each word mixed with its own shift and
    weighted by an odd constant of its position, summed in two lanes with wrap-around (an integer sum, so in any
    order the same), a chunk of 2^20 words at a time. A single changed word changes both lanes (its weight is odd);
    what is returned to the host is the two sums and the tail."""
    raw = flat.view(torch.uint8)
    whole = raw.numel() // 8 * 8
    words = raw[:whole].view(torch.int64) if whole and raw.storage_offset() % 8 == 0 else raw[:whole].clone().view(
        torch.int64)
    weights = _digest_weights(flat.device)
    lanes = torch.zeros(2, dtype=torch.int64, device=flat.device)
    for k in range(0, words.numel(), _DIGEST_CHUNK):
        w = words[k:k + _DIGEST_CHUNK]
        w = w ^ (w >> 27)
        m = weights[:w.numel()]
        lanes[0] += (w * m).sum() * (2 * (k // _DIGEST_CHUNK) + 1)
        lanes[1] += (w * (m * 3 + 2 * (k // _DIGEST_CHUNK))).sum()
    first, second = lanes.tolist()
    return (first.to_bytes(8, "little", signed=True) + second.to_bytes(8, "little", signed=True)
            + bytes(raw[whole:].tolist()))


def _digest_weights(device: torch.device) -> torch.Tensor:
    """The odd position weights of `device_digest`, made once per device."""
    weights = _WEIGHTS.get(device)
    if weights is None:
        m = torch.arange(_DIGEST_CHUNK, dtype=torch.int64, device=device) * _MIX[0]
        m ^= m >> 31
        m *= _MIX[1]
        m ^= m >> 29
        weights = _WEIGHTS[device] = m | 1
    return weights


def param_digests(params: nn.Module | Mapping[str, torch.Tensor]) -> list[str]:
    """A digest per parameter (a module's, or full values by name as `Adapter.full_params()` gives them)."""
    named = params.items() if isinstance(params, Mapping) else params.named_parameters()
    return [tensor_digest(p) for _, p in named]


def grad_digests(grads: nn.Module | Mapping[str, torch.Tensor | None], names: list[str] | None = None) -> list[str]:
    """A digest per parameter's gradient ("none" for None): a module's `.grad`, or `grads` by name in the order of
    `names` (as `Adapter.reduced_grads()` gives them)."""
    if not isinstance(grads, Mapping):
        return [tensor_digest(p.grad) if p.grad is not None else "none" for _, p in grads.named_parameters()]
    return [tensor_digest(g) if (g := grads.get(n)) is not None else "none" for n in (names or list(grads))]


def first_mismatch(per_rank: list[list[str]], names: list[str]) -> tuple[int, str] | None:
    """(rank, parameter) of the first entry where a rank disagrees with rank 0, or None when identical."""
    for rank, digests in enumerate(per_rank[1:], start=1):
        for name, mine, ref in zip(names, digests, per_rank[0]):
            if mine != ref:
                return rank, name
    return None


# -- metrics ---------------------------------------------------------------------------------------
def depth_of(module: nn.Module) -> int:
    """Layers with parameters: the length of the longest chain rounding errors can compound along."""
    return sum(1 for m in module.modules() if any(True for _ in m.parameters(recurse=False)))


# -- the oracle ------------------------------------------------------------------------------------
Masks = dict[str, list[torch.Tensor]]
"""Recorded random draws of one forward: "module|op" -> the op's numbers in call order (dpcompare.verify.randomness.draw_recording)."""


@dataclass(frozen=True, slots=True)
class Piece:
    """One forward the oracle runs: inputs, targets, the weight of its loss in the step's gradient, and the
    dropout masks the backend drew for exactly these samples (None: the forward draws nothing)."""

    x: Any  # inputs and targets: a tensor or any structure of tensors (dpcompare.contract.batches)
    y: Any
    weight: float
    masks: Masks | None = None
    rank: int = 0
    position: int | None = None
    """Which forward of the `Layout` it is (its index in `Layout.positions`); None: a forward the backend did not
    run as such (the global batch in one forward), which one process computes whole."""


def computed_by(grads: object, slot: str, pieces: list[Piece]) -> bool:
    """Whether `grads` were computed by the oracle's `slot` copy ("64", "run") from the forwards `pieces` (their
    `source`, which Oracle sets)."""
    source = getattr(grads, "source", None)
    return source is not None and source[0] == slot and same_forwards(source[2], pieces)


def same_forwards(a: list[Piece], b: list[Piece]) -> bool:
    """Whether `a` and `b` are the same forwards, summed in the same order: equal inputs, targets, weights and draws,
    piece by piece. Two gradients computed from them at the same weights by the same copy are the same computation."""
    if len(a) != len(b):
        return False
    for p, q in zip(a, b):
        if p is q:
            continue
        if p.weight != q.weight or not (batches.equal(p.x, q.x) and batches.equal(p.y, q.y)):
            return False
        if (p.masks is None) != (q.masks is None):
            return False
        if p.masks is not None and (p.masks.keys() != q.masks.keys() or any(
                len(p.masks[k]) != len(q.masks[k]) or not all(torch.equal(m, n) for m, n in zip(p.masks[k], q.masks[k]))
                for k in p.masks)):
            return False
    return True


def same_sum(a: list[Piece], b: list[Piece]) -> bool:
    """Whether gradients summed over `a` and over `b` are the same computation: the same forwards in the same order
    (`same_forwards`), or two ranks' forwards, one each, in the other order. Their sum is then one addition of the
    same two gradients, whose order floating point does not see (a + b is b + a, to the bit): a regrouped twin of two
    ranks' forwards only recomputes them."""
    if same_forwards(a, b):
        return True
    return len(a) == 2 and a[0].rank != a[1].rank and same_forwards(a, list(reversed(b)))


@dataclass(frozen=True, slots=True)
class Layout:
    """How a step's global batch was split into the forwards the backend ran: rank r's shard (strided, like
    DistributedSampler), its `grad_accum` micro-batches (contiguous chunks of the shard), and, for a backend
    that replicates one process's model over devices (nn.DataParallel), each micro-batch scattered over
    `replicas` devices (contiguous chunks, as DataParallel's scatter cuts them)."""

    world_size: int = 1
    grad_accum: int = 1
    replicas: int = 1
    items: Callable[[torch.Tensor], int] | None = None
    """How many items a forward's targets hold, for a loss that is a mean over items (tokens not ignored:
    dpcompare.contract.normalisation); None: a mean over samples."""
    global_count: bool = False
    """--loss-normalisation global: every forward's sum over items is divided by the step's count, not its own."""

    def positions(self, batch_size: int) -> list[tuple[int, int, int, torch.Tensor]]:
        """(rank, micro-batch, replica, positions in the global batch) of every forward, in the order each
        rank ran them."""
        out = []
        for rank in range(self.world_size):
            own = torch.arange(rank, batch_size, self.world_size)
            for micro, part in enumerate(own.chunk(self.grad_accum)):
                for replica, piece in enumerate(part.chunk(self.replicas)):
                    out.append((rank, micro, replica, piece))
        return out

    def shares(self, y: torch.Tensor, chosen: list[tuple[int, int, int, torch.Tensor]]) -> list[float]:
        """The weight of each forward of `chosen` (entries of `positions`) in the step's gradient, the forward's loss
        being its own mean: its share of the chosen samples (a mean over samples); for a loss over items, normalised as
        the run normalises it: by each rank's micro-batch's own count (its replicas' parts by their items, since the
        loss sees the micro-batch gathered), or with `global_count` by the step's count over every forward. Chosen
        forwards of some ranks only: weighted as those ranks' own gradient is before the backend averages them."""
        n_chosen = sum(len(p[3]) for p in chosen)
        if self.items is None or (self.replicas == 1 and not self.global_count):
            return [len(p[3]) / n_chosen for p in chosen]
        count = {(p[0], p[1], p[2]): self.items(batches.take(y, p[3])) for p in self.positions(batches.rows(y))}
        if self.global_count:
            total = sum(count.values())
            ranks = len({p[0] for p in chosen})
            return [count[p[:3]] * self.world_size / (total * ranks) if total else 0.0 for p in chosen]
        micro: dict[tuple[int, int], int] = {}
        for (rank, j, _), c in count.items():
            micro[rank, j] = micro.get((rank, j), 0) + c
        micro_samples = {(p[0], p[1]): 0 for p in chosen}
        for p in chosen:
            micro_samples[p[0], p[1]] += len(p[3])
        return [micro_samples[p[0], p[1]] / n_chosen * (count[p[:3]] / micro[p[0], p[1]] if micro[p[0], p[1]] else 0.0)
                for p in chosen]

    def share_of(self, y: torch.Tensor, idx: torch.Tensor) -> float:
        """The weight of one forward of the samples `idx` of the step's targets `y` whose loss is its own mean, where
        the ranks' forwards of those samples are joined into it: their share of the samples, or of the step's items
        (a loss over items)."""
        if self.items is None:
            return len(idx) / batches.rows(y)
        total = self.items(y)
        return self.items(batches.take(y, idx)) / total if total else 0.0

    @property
    def splits_the_batch(self) -> bool:
        """More than one forward per step: statistics over the batch (BatchNorm) see only part of it."""
        return self.world_size * self.grad_accum * self.replicas > 1


def global_pieces(batch: tuple[torch.Tensor, torch.Tensor], masks: Masks | None = None) -> list[Piece]:
    """The global batch in one forward: the gradient of the global-batch loss itself."""
    return [Piece(batch[0], batch[1], 1.0, masks)]


def replica_pieces(batch: tuple[torch.Tensor, torch.Tensor], layout: Layout,
                   masks: list[Masks | None] | None = None, ranks: Iterable[int] | None = None) -> list[Piece]:
    """What the backend computed, forward by forward: each rank's micro-batches (each replica's part of them),
    weighted by their share of the global batch, with the masks that forward drew (`masks[i]` for the i-th
    forward of `layout.positions`). The weighted sum of their gradients is the data-parallel gradient: the
    global-batch gradient for a model without cross-sample coupling, and for a model with BatchNorm the mean
    of the losses each replica normalised with its own statistics. `ranks`: only those ranks' forwards,
    weighted as a share of their own samples (a rank's local gradient)."""
    x, y = batch
    n = batches.rows(x)
    chosen = None if ranks is None else set(ranks)
    positions = [(i, p) for i, p in enumerate(layout.positions(n)) if chosen is None or p[0] in chosen]
    weights = layout.shares(y, [p for _, p in positions])
    # a forward holding no item adds nothing (and its own mean, 0/0, is no number)
    return [Piece(batches.take(x, idx), batches.take(y, idx), w, masks[i] if masks else None, rank, i)
            for (i, (rank, _, _, idx)), w in zip(positions, weights) if w > 0 or layout.items is None]


def accumulate_gradient(model: nn.Module, loss_fn: Callable, pieces: list[Piece], device: torch.device,
                        replayer: MaskReplayer | None = None, recipe: Recipe = NO_RECIPE,
                        loss_scale: float = 1.0, ranks: int | None = None) -> tuple[Grads, frozenset[str]]:
    """Sum over pieces of weight * grad(loss(piece)) at the model's current parameters, each piece's forward
    replaying the random numbers its rank drew (`replayer`, a MaskReplayer of `model`). Returns the gradients
    (read in float64 on the CPU, held in the model's dtype; zeros where autograd left None) and the names whose gradient
    stayed None.

    Under a mixed-precision `recipe` each piece runs as its rank ran it (dpcompare.verify.judgement.precision_recipe): forward and
    loss under the recipe, the loss multiplied in the graph by `loss_scale` and by the rank's own share (the
    piece's weight times the number of ranks in `pieces`, or `ranks` where the pieces are one rank's of several),
    and the summed gradients divided by both afterwards."""
    raw, none, undo, _ = accumulate_raw(model, loss_fn, pieces, device, replayer, recipe, loss_scale, ranks)
    return finish_gradient(raw, undo), none


def accumulate_raw(model: nn.Module, loss_fn: Callable, pieces: list[Piece], device: torch.device,
                   replayer: MaskReplayer | None = None, recipe: Recipe = NO_RECIPE, loss_scale: float = 1.0,
                   ranks: int | None = None) -> tuple[dict[str, torch.Tensor], frozenset[str], float, float]:
    """accumulate_gradient's sum as autograd leaves it in the model's gradients (its dtype, its device; zeros where
    None), the names left None, what the sum is to be multiplied by (1 / (ranks x loss scale)) and the pieces' losses
    weighted as their gradients are: the shares dpcompare.verify.memory.divider adds across ranks."""
    ranks = (ranks or len({p.rank for p in pieces})) if recipe.active else 1
    model.train()
    model.zero_grad(set_to_none=True)
    loss = 0.0
    with recipe.gathering(model), module_boundaries(model, recipe.module_boundaries):
        for piece in each_rank_from_start(model, pieces):  # a forward that moves its buffers: each rank from its own
            loss += piece.weight * accumulate_piece(model, loss_fn, piece, device, replayer, recipe,
                                                    piece.weight * ranks * loss_scale)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    none = frozenset(n for n, p in named if p.grad is None)
    return ({n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in named}, none,
            1.0 / (ranks * loss_scale), loss)


def finish_gradient(raw: dict[str, torch.Tensor], undo: float) -> Grads:
    """The gradients accumulate_gradient returns from the sum autograd left (`raw`, times `undo`)."""
    if undo != 1.0:
        return {n: g.detach().double() * undo for n, g in raw.items()}
    # Held in the copy's own dtype (a float32 reference costs 4 bytes an element, not 8), read in float64: the
    # caller drops the model's .grad, so these tensors are the gradients' only holders.
    return Compact(raw, copy=False)


def accumulate_piece(model: nn.Module, loss_fn: Callable, piece: Piece, device: torch.device,
                     replayer: MaskReplayer | None, recipe: Recipe, in_graph: float) -> float:
    """One piece's backward into the model's gradients, its loss multiplied in the graph by `in_graph`; returns the
    loss (not multiplied)."""
    x = as_input(piece.x, model, device)
    # backward inside: a model that recomputes activations draws again there, and takes the same numbers
    with replayer.applying(piece.masks) if replayer is not None else contextlib.nullcontext():
        with recipe.autocast():
            loss = loss_fn(batches.call(model, x), batches.to(piece.y, device))
        value = float(loss.detach())
        if in_graph != 1.0:
            # the product in at least float32, as loss scalers take it (a 16-bit loss times 2^16 would overflow)
            loss = loss.to(torch.promote_types(loss.dtype, torch.float32)) * in_graph
        loss.backward()
    return value


RECOMPUTE_ATTRIBUTE = "recompute_activations"
"""A model (or any of its modules) with this boolean attribute recomputes its activations in backward
instead of keeping them when it is True (activation checkpointing). The verification copies switch it on:
recomputation on the same device draws the same random numbers and rounds the same way, so the gradient is
unchanged while a float64 copy of a large model keeps one block's activations instead of all of them. The
ranks' own models are never switched: the run is measured as the user would run it."""


def loaded(model: nn.Module, state: Mapping[str, torch.Tensor],
           on_use: bool = True) -> contextlib.AbstractContextManager:
    """`model` (a releasable copy) loaded from `state` for the duration: its parameters made from `state` as its ops
    use them, never whole (dpcompare.verify.oracle.weights_on_use), where `on_use` and the model allows it; else loaded
    whole (load_state_dict), as before. The gradients its backward leaves are the same to the bit either way."""
    if on_use and weights_on_use.eligible(model):
        return weights_on_use.made_from(model, state)
    model.load_state_dict(state)
    return contextlib.nullcontext()


def _through(g: torch.Tensor, dtype: torch.dtype, loss_scale: float) -> torch.Tensor:
    """`g` (float64) as `dtype` holds it when it is stored or sent multiplied by `loss_scale`."""
    return (g * loss_scale).to(dtype).double() / loss_scale if loss_scale != 1.0 else g.to(dtype).double()


def verification_copy(template: nn.Module, device: torch.device, dtype: torch.dtype,
                      alternatives: bool = True, sparse: bool = False) -> nn.Module:
    """A plain copy of the workload's model for checking, its floating parameters and buffers in `dtype` (integer and
    bool ones as the model built them) on `device`, recomputing activations in backward where the model offers it
    (`RECOMPUTE_ATTRIBUTE`). A float64 copy computes an op with no float64 kernel on the model's own alternative path,
    or else in float32 (dpcompare.verify.oracle.float64_paths); `alternatives` False: always the latter. Its tables' gradients
    are dense (contract.sparse.make_dense), unless `sparse` (the probe's copy, which finds the model's sparse ones)."""
    model = copy.deepcopy(template).to(device=device, dtype=dtype)
    model = model if sparse else make_dense(model)
    for m in model.modules():
        if isinstance(getattr(m, RECOMPUTE_ATTRIBUTE, None), bool):
            setattr(m, RECOMPUTE_ATTRIBUTE, True)
    return float64_paths.prepare(model, alternatives) if dtype == torch.float64 else model


class Oracle:
    """Recomputes gradients of the step's loss on rank 0 from the run's current parameters.

    It holds two plain copies of the workload's model (no wrapper, no global BatchNorm): one in float64
    (the oracle) and one that computes as the run does (the noise floor): in the run dtype, or under the run's
    mixed-precision recipe (autocast on float32 weights, or 16-bit weights loaded from the fp32 master values).
    Each check loads the run's state dict into them (its master weights where it keeps them apart), so no error
    carries over from earlier steps, and runs the pieces it is given (the global batch, or each replica's
    forwards with the dropout masks they drew). Only trainable parameters are checked (`names`); frozen ones
    (requires_grad=False) are listed apart. Work here never advances the run's generators.
    """

    def __init__(self, template: nn.Module, loss_fn: Callable, dtype: str, device: torch.device,
                 recipe: Recipe = NO_RECIPE) -> None:
        self.loss_fn = loss_fn
        self.device = device
        self.recipe = recipe
        self.template, self.run_dtype = template, recipe.weights_dtype or DTYPES[dtype]
        # Loaded from the run's state before every use, so they hold their parameters only while they compute.
        self.model64 = releasable(verification_copy(template, device, torch.float64))
        self.model_run = releasable(verification_copy(template, device, self.run_dtype))
        self.replay64, self.replay_run = MaskReplayer(self.model64), MaskReplayer(self.model_run)
        self._compiled: tuple[nn.Module, MaskReplayer] | None = None
        self.names = [n for n, p in template.named_parameters() if p.requires_grad]
        self.none: frozenset[str] = frozenset()
        """Parameters whose oracle gradient was None at the last `oracle_of` call (not in the loss)."""
        self.divider = None
        """Where the ranks share the arithmetic: rank 0's dpcompare.verify.memory.divider.Divider (None: this process computes
        every forward)."""

    def _grad(self, model: nn.Module, replayer: MaskReplayer, state: dict, pieces: list[Piece],
              recipe: Recipe = NO_RECIPE, loss_scale: float = 1.0, ranks: int | None = None
              ) -> tuple[Grads, frozenset[str]]:
        slot = "64" if model is self.model64 else "run" if model is self.model_run else None
        if self.divider is not None and slot is not None and self.divider.holds(pieces):
            # every rank runs its own forwards at `state`, or rank 0 the global batch alone; the sums held in ranges by
            # the parameters' owners (dpcompare.verify.memory.divider)
            out = self.divider.gradient(slot, model, replayer, state, pieces, self.loss_fn, self.device, recipe,
                                        loss_scale, ranks)
        else:
            with loaded(model, state, slot is not None and not recipe.active):
                out = accumulate_gradient(model, self.loss_fn, pieces, self.device, replayer, recipe, loss_scale, ranks)
            model.zero_grad(set_to_none=True)  # the float64 gradients live on in `grads`; a run-dtype copy is freed
            if isinstance(out[0], Compact) and not recipe.active and loss_scale == 1.0:
                out[0].source = (slot, state, pieces, out[1])  # dpcompare.verify.trajectory.reference_trajectory.Trajectory.take
        if slot is not None:
            release(model)
        return out

    def oracle_of(self, state: dict, pieces: list[Piece]) -> Grads:
        grads, self.none = self._grad(self.model64, self.replay64, state, pieces)
        return grads

    def loss_of(self, state: dict, pieces: list[Piece]) -> float:
        """The float64 copy's loss over `pieces` at `state`, weighted as their gradients are: forwards alone, no
        backward (what tells whether the ranks' shards still compute the global batch's loss)."""
        with loaded(self.model64, state), torch.no_grad():
            self.model64.train()
            loss = sum(p.weight * float(self.loss_fn(batches.call(self.model64,
                                                                  as_input(p.x, self.model64, self.device)),
                                                     batches.to(p.y, self.device))) for p in pieces)
        release(self.model64)
        return loss

    def floor_of(self, state: dict, pieces: list[Piece], loss_scale: float = 1.0, compiled: bool = False) -> Grads:
        """The run's own recipe on one process (`pieces`: as the ranks split the batch, under a recipe); `compiled`:
        by a third run-precision copy whose forward is compiled in place (made on first use), whose kernels round as a
        compiled run's do (fused, reordered reductions; BatchNorm decomposed) where the eager copy's do not."""
        if compiled:
            if self._compiled is None:
                model = verification_copy(self.template, self.device, self.run_dtype)
                compile_forward(model)
                self._compiled = (model, MaskReplayer(model))
            return self._grad(*self._compiled, state, pieces, self.recipe, loss_scale)[0]
        return self._grad(self.model_run, self.replay_run, state, pieces, self.recipe, loss_scale)[0]

    def wire_floor_of(self, state: dict, pieces: list[Piece], wire: torch.dtype, loss_scale: float = 1.0, *,
                      regrouped: bool = False, unsent: Grads | None = None,
                      wired: frozenset[str] | None = None) -> Grads:
        """The run's own recipe on one process with the ranks' shares of the mean sent through a `wire` narrower than
        the gradients, as the backend sends them: cast to the wire dtype at the loss scale they travel at.

        As the reference: each rank's pieces accumulated as that rank does, then summed in the ranks' order with the
        partial sum rounded to the wire after every addition (a ring). `regrouped`, for its floor, the other ways a
        data-parallel backend legitimately groups the same sum: micro-batch by micro-batch (a backend that reduces
        every micro-batch), the ranks in reverse order, summed exactly and rounded once (a reduction in wider
        arithmetic), the micro-batches then accumulated in the gradients' dtype. Every piece's gradient is
        recomputed, so a nondeterministic kernel shows in the floor too. `unsent`, when given, receives the same
        shares summed without the wire (what the wire itself changed is the difference). `wired`: the parameters whose
        gradients travel on the wire where only some do (None: all); the others are sent in the gradients' dtype."""
        order = list(dict.fromkeys(p.rank for p in pieces))
        by_rank = {r: [p for p in pieces if p.rank == r] for r in order}
        accumulate = float_dtype(self.model_run)

        def on(name: str) -> torch.dtype:
            return wire if wired is None or name in wired else accumulate

        def share(group: list[Piece]) -> Grads:
            return self._grad(self.model_run, self.replay_run, state, group, self.recipe, loss_scale, len(order))[0]

        total: Grads = {}
        if not regrouped:
            for rank in order:
                for name, g in share(by_rank[rank]).items():
                    if unsent is not None:
                        unsent[name] = g if name not in unsent else unsent[name] + g
                    sent = _through(g, on(name), loss_scale)
                    total[name] = sent if name not in total else _through(total[name] + sent, on(name), loss_scale)
            return total
        for k in range(max(len(g) for g in by_rank.values())):
            micro: Grads = {}
            for rank in reversed(order):
                if k < len(by_rank[rank]):
                    for name, g in share([by_rank[rank][k]]).items():
                        micro[name] = g if name not in micro else micro[name] + g
            for name, g in micro.items():
                sent = _through(g, on(name), loss_scale)
                total[name] = sent if name not in total else _through(total[name] + sent, accumulate, loss_scale)
        return total

    def oracle(self, state: dict, x: Any, y: Any) -> Grads:
        return self.oracle_of(state, global_pieces((x, y)))

    def floor(self, state: dict, x: Any, y: Any) -> Grads:
        return self.floor_of(state, global_pieces((x, y)))
