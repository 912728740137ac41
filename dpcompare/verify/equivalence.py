"""Equivalence: is the backend's reduced gradient the gradient of the global-batch loss?

Owns: the float64 oracle, the run-precision reference (the noise floor), fingerprints for replica consistency,
the per-step check records and the verdict they add up to. Imports no adapter: it receives
tensors, state dicts and gathered fingerprints.

The metrics, the tolerance policy and the power of each check are written once, in
dpcompare.verify.tolerance: the reduced gradient is judged against the run-precision reference split as the ranks
split it (floor: what data parallelism alone changes, measured by a second run-precision computation), and its
distance from the float64 oracle is stated beside it.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import math
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable, Literal, Mapping

import torch
from torch import nn

from dpcompare.contract import Note
from dpcompare.verify.masks import MaskReplayer
from dpcompare.verify.precision import NONE as NO_RECIPE
from dpcompare.verify.precision import PrecisionReport, Recipe
from dpcompare.verify.tolerance import (MODEL, TOLERANCE_FACTOR, UNIT_ROUNDOFF, WIRE_DTYPE, Coverage, ParamError,  # noqa: F401
                                        compare, coverage, flat, min_detectable, rel_fro, wire_roundoff)
from dpcompare.verify.tolerance import describe as describe_tolerance

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}

Grads = dict[str, torch.Tensor]


# -- fingerprints ----------------------------------------------------------------------------------
def tensor_digest(t: torch.Tensor) -> str:
    return hashlib.blake2b(t.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy().tobytes(), digest_size=8).hexdigest()


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
"""Captured dropout masks of one forward: module name -> bool masks in call order (dpcompare.verify.masks)."""


@dataclass(frozen=True, slots=True)
class Piece:
    """One forward the oracle runs: inputs, targets, the weight of its loss in the step's gradient, and the
    dropout masks the backend drew for exactly these samples (None: the forward draws nothing)."""

    x: torch.Tensor
    y: torch.Tensor
    weight: float
    masks: Masks | None = None
    rank: int = 0


@dataclass(frozen=True, slots=True)
class Layout:
    """How a step's global batch was split into the forwards the backend ran: rank r's shard (strided, like
    DistributedSampler), its `grad_accum` micro-batches (contiguous chunks of the shard), and, for a backend
    that replicates one process's model over devices (nn.DataParallel), each micro-batch scattered over
    `replicas` devices (contiguous chunks, as DataParallel's scatter cuts them)."""

    world_size: int = 1
    grad_accum: int = 1
    replicas: int = 1

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
    n = x.shape[0]
    chosen = None if ranks is None else set(ranks)
    positions = [(i, p) for i, p in enumerate(layout.positions(n)) if chosen is None or p[0] in chosen]
    total = sum(len(p[3]) for _, p in positions)
    return [Piece(x[idx], y[idx], len(idx) / total, masks[i] if masks else None, rank)
            for i, (rank, _, _, idx) in positions]


def accumulate_gradient(model: nn.Module, loss_fn: Callable, pieces: list[Piece], device: torch.device,
                        replayer: MaskReplayer | None = None, recipe: Recipe = NO_RECIPE,
                        loss_scale: float = 1.0, ranks: int | None = None) -> tuple[Grads, frozenset[str]]:
    """Sum over pieces of weight * grad(loss(piece)) at the model's current parameters, each piece's forward
    applying its captured dropout masks (`replayer`, a MaskReplayer of `model`). Returns the gradients
    (float64, CPU; zeros where autograd left None) and the names whose gradient stayed None.

    Under a mixed-precision `recipe` each piece runs as its rank ran it (dpcompare.verify.precision): forward and
    loss under the recipe, the loss multiplied in the graph by `loss_scale` and by the rank's own share (the
    piece's weight times the number of ranks in `pieces`, or `ranks` where the pieces are one rank's of several),
    and the summed gradients divided by both afterwards."""
    dtype = next(model.parameters()).dtype
    ranks = (ranks or len({p.rank for p in pieces})) if recipe.active else 1
    model.train()
    model.zero_grad(set_to_none=True)
    for piece in pieces:
        x = piece.x.to(device)
        if x.is_floating_point():
            x = x.to(dtype)
        in_graph = piece.weight * ranks * loss_scale
        # backward inside: a model that recomputes activations runs its dropout again there, on the same masks
        with replayer.applying(piece.masks) if replayer is not None else contextlib.nullcontext():
            with recipe.autocast():
                loss = loss_fn(model(x), piece.y.to(device))
            if in_graph != 1.0:
                # the product in at least float32, as loss scalers take it (a 16-bit loss times 2^16 would overflow)
                loss = loss.to(torch.promote_types(loss.dtype, torch.float32)) * in_graph
            loss.backward()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    none = frozenset(n for n, p in named if p.grad is None)
    undo = 1.0 / (ranks * loss_scale)
    grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().double().cpu() for n, p in named}
    return ({n: g * undo for n, g in grads.items()} if undo != 1.0 else grads), none


RECOMPUTE_ATTRIBUTE = "recompute_activations"
"""A model (or any of its modules) with this boolean attribute recomputes its activations in backward
instead of keeping them when it is True (activation checkpointing). The verification copies switch it on:
recomputation on the same device draws the same random numbers and rounds the same way, so the gradient is
unchanged while a float64 copy of a large model keeps one block's activations instead of all of them. The
ranks' own models are never switched: the run is measured as the user would run it."""


def _through(g: torch.Tensor, dtype: torch.dtype, loss_scale: float) -> torch.Tensor:
    """`g` (float64) as `dtype` holds it when it is stored or sent multiplied by `loss_scale`."""
    return (g * loss_scale).to(dtype).double() / loss_scale if loss_scale != 1.0 else g.to(dtype).double()


def verification_copy(template: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """A plain copy of the workload's model for checking, in `dtype` on `device`, recomputing activations in
    backward where the model offers it (`RECOMPUTE_ATTRIBUTE`)."""
    model = copy.deepcopy(template).to(device=device, dtype=dtype)
    for m in model.modules():
        if isinstance(getattr(m, RECOMPUTE_ATTRIBUTE, None), bool):
            setattr(m, RECOMPUTE_ATTRIBUTE, True)
    return model


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
        self.model64 = verification_copy(template, device, torch.float64)
        self.model_run = verification_copy(template, device, recipe.weights_dtype or DTYPES[dtype])
        self.replay64, self.replay_run = MaskReplayer(self.model64), MaskReplayer(self.model_run)
        self.names = [n for n, p in template.named_parameters() if p.requires_grad]
        self.none: frozenset[str] = frozenset()
        """Parameters whose oracle gradient was None at the last `oracle_of` call (not in the loss)."""

    def _grad(self, model: nn.Module, replayer: MaskReplayer, state: dict, pieces: list[Piece],
              recipe: Recipe = NO_RECIPE, loss_scale: float = 1.0, ranks: int | None = None
              ) -> tuple[Grads, frozenset[str]]:
        model.load_state_dict(state)
        grads, none = accumulate_gradient(model, self.loss_fn, pieces, self.device, replayer, recipe, loss_scale, ranks)
        model.zero_grad(set_to_none=True)  # the float64 gradients live on in `grads`; a run-dtype copy is freed
        return grads, none

    def oracle_of(self, state: dict, pieces: list[Piece]) -> Grads:
        grads, self.none = self._grad(self.model64, self.replay64, state, pieces)
        return grads

    def floor_of(self, state: dict, pieces: list[Piece], loss_scale: float = 1.0) -> Grads:
        """The run's own recipe on one process (`pieces`: as the ranks split the batch, under a recipe)."""
        return self._grad(self.model_run, self.replay_run, state, pieces, self.recipe, loss_scale)[0]

    def wire_floor_of(self, state: dict, pieces: list[Piece], wire: torch.dtype, loss_scale: float = 1.0, *,
                      regrouped: bool = False, unsent: Grads | None = None) -> Grads:
        """The run's own recipe on one process with the ranks' shares of the mean sent through a `wire` narrower than
        the gradients, as the backend sends them: cast to the wire dtype at the loss scale they travel at.

        As the reference: each rank's pieces accumulated as that rank does, then summed in the ranks' order with the
        partial sum rounded to the wire after every addition (a ring). `regrouped`, for its floor, the other ways a
        data-parallel backend legitimately groups the same sum: micro-batch by micro-batch (a backend that reduces
        every micro-batch), the ranks in reverse order, summed exactly and rounded once (a reduction in wider
        arithmetic), the micro-batches then accumulated in the gradients' dtype. Every piece's gradient is
        recomputed, so a nondeterministic kernel shows in the floor too. `unsent`, when given, receives the same
        shares summed without the wire (what the wire itself changed is the difference)."""
        order = list(dict.fromkeys(p.rank for p in pieces))
        by_rank = {r: [p for p in pieces if p.rank == r] for r in order}

        def share(group: list[Piece]) -> Grads:
            return self._grad(self.model_run, self.replay_run, state, group, self.recipe, loss_scale, len(order))[0]

        total: Grads = {}
        if not regrouped:
            for rank in order:
                for name, g in share(by_rank[rank]).items():
                    if unsent is not None:
                        unsent[name] = g if name not in unsent else unsent[name] + g
                    sent = _through(g, wire, loss_scale)
                    total[name] = sent if name not in total else _through(total[name] + sent, wire, loss_scale)
            return total
        accumulate = next(self.model_run.parameters()).dtype
        for k in range(max(len(g) for g in by_rank.values())):
            micro: Grads = {}
            for rank in reversed(order):
                if k < len(by_rank[rank]):
                    for name, g in share([by_rank[rank][k]]).items():
                        micro[name] = g if name not in micro else micro[name] + g
            for name, g in micro.items():
                sent = _through(g, wire, loss_scale)
                total[name] = sent if name not in total else _through(total[name] + sent, accumulate, loss_scale)
        return total

    def oracle(self, state: dict, x: torch.Tensor, y: torch.Tensor) -> Grads:
        return self.oracle_of(state, global_pieces((x, y)))

    def floor(self, state: dict, x: torch.Tensor, y: torch.Tensor) -> Grads:
        return self.floor_of(state, global_pieces((x, y)))


# -- verdict ---------------------------------------------------------------------------------------
Check = Literal["initial", "gradient", "update", "trajectory", "replicas", "rng", "buffers", "loss_scale"]


@dataclass(slots=True)
class Divergence:
    step: int
    parameter: str
    rel_fro_err: float
    tolerance_rel_fro: float
    noise_ratio: float
    reason: str
    check: Check = "gradient"
    """Which check broke: initial weights, gradient, update, trajectory, replicas, the ranks' generators, the
    module buffers, or the loss scaler (a step skipped, or stepped, against the recipe's overflow)."""
    cause: str = "unknown"
    """The diagnosis' code (dpcompare.verify.diagnosis.Diagnosis.cause)."""
    parameters: list[str] = field(default_factory=list)
    """Every parameter that broke tolerance at that step and check."""


def _power(params: list[ParamError], model: ParamError | None) -> dict:
    cov = coverage(params)
    return {"min_detectable_rel": _finite(min_detectable(params, model)), "coverage": cov.to_dict(),
            "model": _param_dict(model) if model is not None else None}


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _param_dict(p: ParamError) -> dict:
    return {k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in asdict(p).items()}


@dataclass(slots=True)
class UpdateCheck:
    """The parameter update of one checked step against the optimizer replayed on the backend's own parameters,
    reduced gradient and state (float64; its floor the same replay in the run dtype)."""

    params: list[ParamError]
    norm_ratios: dict[str, float]
    """Per parameter ||update_backend|| / ||update_reference||."""
    norm_ratio: float
    """The same over the whole model."""
    model: ParamError | None = None
    """All parameters as one vector."""

    @property
    def noise_ratio(self) -> float:
        return max((p.noise_ratio for p in self.params if p.judged), default=0.0)

    @property
    def max_rel_fro_err(self) -> float:
        return max((p.rel_fro_err for p in self.params), default=0.0)

    @property
    def floor(self) -> float:
        return max((p.floor_rel_fro_err for p in self.params), default=0.0)

    @property
    def min_detectable_rel(self) -> float:
        return min_detectable(self.params, self.model)

    def to_dict(self) -> dict:
        return {"max_rel_fro_err": self.max_rel_fro_err, "noise_floor_rel_fro": self.floor,
                "noise_ratio": self.noise_ratio, "norm_ratio": self.norm_ratio, **_power(self.params, self.model),
                "params": [dict(_param_dict(p), norm_ratio=self.norm_ratios.get(p.parameter)) for p in self.params]}


@dataclass(slots=True)
class StepCheck:
    step: int
    params: list[ParamError]
    replicas_identical: bool
    grads_identical_across_ranks: bool
    mismatch: str | None = None
    update: UpdateCheck | None = None
    model: ParamError | None = None
    """The gradient, all parameters as one vector."""

    @property
    def max_rel_err(self) -> float:
        return max((p.max_rel_err for p in self.params), default=0.0)

    @property
    def max_rel_fro_err(self) -> float:
        return max((p.rel_fro_err for p in self.params), default=0.0)

    @property
    def noise_ratio(self) -> float:
        return max((p.noise_ratio for p in self.params if p.judged), default=0.0)

    @property
    def floor(self) -> float:
        return max((p.floor_rel_fro_err for p in self.params), default=0.0)

    @property
    def judged_floor(self) -> float:
        return max((p.judged_floor_rel_fro for p in self.params if p.judged), default=0.0)

    @property
    def min_detectable_rel(self) -> float:
        return min_detectable(self.params, self.model)


def _worst(values: list[float]) -> float | None:
    return max(values) if values else None


@dataclass(slots=True)
class Verdict:
    checks: list[StepCheck] = field(default_factory=list)
    first_divergence: Divergence | None = None
    replicas_identical: bool = True
    initial_weights_identical: bool = True
    drift: list[dict] = field(default_factory=list)
    """The trajectory, judged: one entry per step (see dpcompare.verify.trajectory)."""
    notes: list[Note] = field(default_factory=list)
    """Known semantic differences and facts stated with the verdict (the adapter's and the checks')."""
    unverifiable: list[str] = field(default_factory=list)
    """Why part of the run could not be checked; any entry turns an `equivalent` into `unverifiable`."""
    stochastic: dict | None = None
    """What randomness the forward draws and how the check handled it (None: not probed)."""
    parameters: dict = field(default_factory=dict)
    """Unused and frozen parameters, and how the backend left the unused ones' gradients."""
    batchnorm: dict | None = None
    """BatchNorm judged per replica (no --sync-bn): its modules, local batch and measured distance from the
    global batch (None: the model has no BatchNorm, it was synchronised, or the batch was not split)."""
    buffers: list[dict] = field(default_factory=list)
    """Every module buffer after the checked steps: do the ranks agree, and which semantics it follows
    (dpcompare.verify.buffers)."""
    precision: "PrecisionReport | None" = None
    """The mixed-precision recipe that ran and what its loss scaler did at every checked step (None: not recorded)."""
    wire_rounding: str = "bounded"
    """How a wire narrower than the gradients is judged: "measured" (the run-precision reference and its floor send
    the ranks' shares through it) or "bounded" (world_size x its unit roundoff added to the floor)."""

    def note(self, code: str, text: str) -> None:
        self.notes.append(Note(code, text))

    def diverge(self, divergence: Divergence) -> None:
        """Record a failed check; the first one recorded is the run's first divergence."""
        if self.first_divergence is None:
            self.first_divergence = divergence

    def status(self) -> str:
        if self.first_divergence is not None or not self.replicas_identical or not self.initial_weights_identical:
            return "different"
        if self.unverifiable:
            return "unverifiable"
        if not self.checks and not self.drift:
            return "unchecked"
        return "equivalent"

    def _summaries(self) -> dict:
        d = self.first_divergence

        def status(check: str, ran: bool) -> str:
            if d is not None and d.check == check:
                return "fail"
            if self.unverifiable and not ran:
                return "unverifiable"
            return "pass" if ran else "off"

        updates = [c.update for c in self.checks if c.update is not None]
        drift = [e for e in self.drift if e.get("noise_ratio") is not None]
        worst_drift = max(drift, key=lambda e: e["noise_ratio"], default=None)
        worst_ratio = max((u.norm_ratio for u in updates), key=lambda r: abs(math.log(r)) if r > 0 and math.isfinite(r)
                          else math.inf, default=None)
        grad_power = _worst([c.min_detectable_rel for c in self.checks])
        update_power = _worst([u.min_detectable_rel for u in updates])
        judged = [p for c in self.checks for p in c.params]
        return {
            "gradient": {"status": status("gradient", bool(self.checks)),
                         "noise_ratio": _worst([c.noise_ratio for c in self.checks]),
                         "max_rel_fro_err": _worst([c.max_rel_fro_err for c in self.checks]),
                         "noise_floor_rel_fro": _worst([c.floor for c in self.checks]),
                         "judged_rel_fro_err": _worst([p.judged_rel_fro_err for p in judged if p.judged]),
                         "dp_floor_rel_fro": _worst([c.judged_floor for c in self.checks]),
                         "min_detectable_rel": _finite(grad_power) if grad_power is not None else None,
                         "coverage": coverage(self.checks[-1].params).to_dict() if self.checks else None},
            "update": {"status": status("update", bool(updates)),
                       "noise_ratio": _worst([u.noise_ratio for u in updates]),
                       "max_rel_fro_err": _worst([u.max_rel_fro_err for u in updates]),
                       "noise_floor_rel_fro": _worst([u.floor for u in updates]),
                       "norm_ratio": worst_ratio,
                       "min_detectable_rel": _finite(update_power) if update_power is not None else None,
                       "coverage": coverage(updates[-1].params).to_dict() if updates else None},
            "trajectory": {"status": status("trajectory", bool(drift)),
                           "noise_ratio": worst_drift["noise_ratio"] if worst_drift else None,
                           "rel_param_distance": worst_drift["rel_param_distance"] if worst_drift else None,
                           "floor_rel_param_distance": worst_drift["floor_rel_param_distance"] if worst_drift else None,
                           "step": worst_drift["step"] if worst_drift else None,
                           "min_detectable_rel": _worst([e["tolerance"] for e in drift])},
        }

    def power(self) -> float | None:
        """The verdict's own min_detectable_rel: the smallest uniform relative change of the gradient and of the update
        that every checked step would flag (the weakest step's, each step's the weaker of its two checks)."""
        per_step = [max(c.min_detectable_rel, c.update.min_detectable_rel if c.update is not None else 0.0)
                    for c in self.checks]
        worst = _worst(per_step)
        return _finite(worst) if worst is not None else None

    def to_dict(self, tolerance_policy: dict) -> dict:
        worst = max(self.checks, key=lambda c: c.noise_ratio, default=None)
        verdict = self.status()
        return {
            "verdict": verdict,
            "unverifiable_reason": "; ".join(self.unverifiable) if verdict == "unverifiable" else None,
            "checks": self._summaries(),
            "checked_steps": [c.step for c in self.checks],
            "max_rel_err": max((c.max_rel_err for c in self.checks), default=None),
            "max_rel_fro_err": max((c.max_rel_fro_err for c in self.checks), default=None),
            "noise_floor_rel_fro": max((c.floor for c in self.checks), default=None),
            "noise_ratio": worst.noise_ratio if worst else None,
            "min_detectable_rel": self.power(),
            "first_divergence": asdict(self.first_divergence) if self.first_divergence else None,
            "replicas_identical": self.replicas_identical,
            "initial_weights_identical": self.initial_weights_identical,
            "stochastic": self.stochastic,
            "parameters": self.parameters,
            "batchnorm": self.batchnorm,
            "buffers": self.buffers,
            "precision": self.precision.to_dict() if self.precision is not None else None,
            "tolerance": {**tolerance_policy, "wire_rounding": self.wire_rounding},
            "drift": self.drift,
            "notes": [n.to_dict() for n in self.notes],
            "per_step": [
                {
                    "step": c.step,
                    "max_rel_err": c.max_rel_err,
                    "max_rel_fro_err": c.max_rel_fro_err,
                    "noise_floor_rel_fro": c.floor,
                    "noise_ratio": c.noise_ratio,
                    "replicas_identical": c.replicas_identical,
                    "grads_identical_across_ranks": c.grads_identical_across_ranks,
                    "min_detectable_rel": _finite(c.min_detectable_rel),
                    "judged_floor_rel_fro": c.judged_floor,
                    **{k: v for k, v in _power(c.params, c.model).items() if k != "min_detectable_rel"},
                    "params": [_param_dict(p) for p in c.params],
                    "update": c.update.to_dict() if c.update is not None else None,
                }
                for c in self.checks
            ],
        }


def tolerance_policy(dtype: str, world_size: int, depth: int, compression: str = "none") -> dict:
    wire = WIRE_DTYPE[compression]
    return {
        **describe_tolerance(dtype),
        "compression": compression,
        "unit_roundoff_wire": UNIT_ROUNDOFF[wire] if wire else UNIT_ROUNDOFF[dtype],
        "factor": TOLERANCE_FACTOR,
        "unit_roundoff": UNIT_ROUNDOFF[dtype],
        "dtype": dtype,
        "world_size": world_size,
        "depth": depth,
    }
