"""The per-step check records and the verdict they add up to.

Owns: what one checked step recorded (`StepCheck`: the gradient per parameter and as one vector, and its
`UpdateCheck`), the first failed check (`Divergence`), the `Verdict` that collects them with the notes, the
unverifiable parts and the reports of the other checks (buffers, randomness, precision, trajectory), its status
(`equivalent`, `different`, `unverifiable`, `unchecked`), its power, and its JSON form with the tolerance policy it
was judged under. Judges nothing itself: the checks that fill it are dpcompare.verify.checks'. Imports no adapter.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Literal

from dpcompare.contract import Note
from dpcompare.verify.judgement.precision_recipe import PrecisionReport
from dpcompare.verify.judgement.tolerance import (TOLERANCE_FACTOR, UNIT_ROUNDOFF, WIRE_DTYPE, ParamError, allowed_floor,
                                        coverage, min_detectable)
from dpcompare.verify.judgement.tolerance import describe as describe_tolerance

CheckName = Literal["initial", "gradient", "grad_norm", "update", "trajectory", "replicas", "rng", "buffers", "loss_scale",
                    "checkpoint"]


@dataclass(slots=True)
class Divergence:
    step: int
    parameter: str
    rel_fro_err: float
    tolerance_rel_fro: float
    noise_ratio: float
    reason: str
    check: CheckName = "gradient"
    """Which check broke: initial weights, gradient, the total norm clipped by (grad_norm), update, trajectory,
    replicas, the ranks' generators, the module buffers, or the loss scaler (a step skipped, or stepped, against the
    recipe's overflow)."""
    cause: str = "unknown"
    """The diagnosis' code (dpcompare.verify.diagnosis.diagnose.Diagnosis.cause)."""
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
class GradNormCheck:
    """One checked step's grad_norm check (--clip-grad-norm): the total norm the backend clipped by against the float64
    oracle's global norm (judged by dpcompare.verify.checks.grad_norm_check)."""

    step: int
    clip: float
    """--clip-grad-norm."""
    reported: float | None
    """The total norm before clipping as the backend reported it (None: it reported none)."""
    oracle: float
    """The float64 oracle's global norm of the step's gradient: the unclipped norm."""
    clipped: bool
    """The clip took effect: the unclipped norm is above `clip`."""
    coefficient: float
    """What the reference step multiplies the gradient by: min(1, clip / (oracle + 1e-6))."""
    rel_err: float
    """|reported - oracle| / oracle (NaN: nothing reported)."""
    floor: float
    """The effective floor of the tolerance (dpcompare.verify.checks.grad_norm_check)."""
    tolerance: float
    noise_ratio: float
    """rel_err over the floor with the reduction's and the norm's allowances (it passes at or below the factor)."""
    ok: bool

    def to_dict(self) -> dict:
        return {k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in asdict(self).items()}


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
    grad_norm: GradNormCheck | None = None
    """Under --clip-grad-norm: the total norm the backend clipped by, against the oracle's."""

    @property
    def max_rel_err(self) -> float:
        """The largest defined one (NaN: none is: every reference is zero, `max_rel_err_reason`)."""
        return _defined_max([p.max_rel_err for p in self.params])

    @property
    def max_rel_err_reason(self) -> str | None:
        if not math.isnan(self.max_rel_err):
            return None
        return next((p.max_rel_err_reason for p in self.params if p.max_rel_err_reason), "no parameter was compared")

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


def _defined_max(values: list[float]) -> float:
    """The largest of `values` that is not NaN (an undefined figure, whose reason is recorded beside it)."""
    return max((v for v in values if not math.isnan(v)), default=math.nan)


def _worst(values: list[float]) -> float | None:
    return max(values) if values else None


@dataclass(slots=True)
class Verdict:
    checks: list[StepCheck] = field(default_factory=list)
    first_divergence: Divergence | None = None
    replicas_identical: bool = True
    initial_weights_identical: bool = True
    drift: list[dict] = field(default_factory=list)
    """The trajectory, judged: one entry per step (see dpcompare.verify.trajectory.reference_trajectory)."""
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
    split: dict | None = None
    """Whether the ranks' split of the batch computes the global batch's gradient, as measured in float64
    (dpcompare.verify.model_facts.batch_split: global, loss_not_mean or per_replica, the distance, the rounding it was allowed; None:
    the batch was not split, or something else decided the forwards)."""
    buffers: list[dict] = field(default_factory=list)
    """Every module buffer after the checked steps: do the ranks agree, and which semantics it follows
    (dpcompare.verify.model_facts.buffer_semantics)."""
    precision: "PrecisionReport | None" = None
    """The mixed-precision recipe that ran and what its loss scaler did at every checked step (None: not recorded)."""
    oracle_coverage: dict | None = None
    """The oracle coverage: the parameters the oracle checked (--check-coverage, dpcompare.verify.memory.oracle_coverage);
    None: every one."""
    oracle_precision: dict | None = None
    """Where the float64 copies left float64 or the model's own path (dpcompare.verify.oracle.float64_paths); None: nowhere."""
    oracle_division: dict | None = None
    """How the ranks shared the oracle's forwards (dpcompare.verify.memory.divider): `ranks`, and `divided`, the gradients
    computed so (the oracle's, the references', the trajectory's); None: one process computed every forward."""
    oracle_reuse: dict | None = None
    """What the checks computed once and took again where a second computation would repeat the first
    (`regrouped_floor`: a regrouped twin of the reference that is its own arithmetic, at one rank or two ranks' forwards
    one each, recomputed until bitwise identical; `trajectory`:
    the steps whose reference-trajectory gradients were the oracle's and the reference's; `buffers`: the steps whose
    float64 buffer forward was not run again); None: nothing."""
    checkpoint: dict | None = None
    """--save-checkpoint / --load-checkpoint: what was saved (`saved`: directory, format, the next step) and what was
    loaded, judged against what the saving run held (`loaded`: dpcompare.verify.starting_state.loaded_state); None: neither."""
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
        norms = [c.grad_norm for c in self.checks if c.grad_norm is not None]
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
            "grad_norm": {"status": "fail" if any(g.reported is not None and not g.ok for g in norms) else
                          status("grad_norm", any(g.reported is not None for g in norms)),
                          "noise_ratio": _worst([g.noise_ratio for g in norms if math.isfinite(g.noise_ratio)]),
                          "max_rel_err": _worst([g.rel_err for g in norms if math.isfinite(g.rel_err)]),
                          "min_detectable_rel": _worst([g.tolerance for g in norms]),
                          "clip": norms[0].clip if norms else None,
                          "clipped_steps": [g.step for g in norms if g.clipped]},
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

    def _recorded_floor(self, checks: dict, policy: dict) -> dict:
        """The gradient check's floor as its noise ratio divides by it (recorded: readers never recompute it)."""
        gradient = checks["gradient"]
        if gradient["dp_floor_rel_fro"] is None or not policy:  # no floor measured, or no policy to scale it by
            gradient["floor_rel_fro"] = None
            return checks
        u_sum = policy["unit_roundoff"] if self.wire_rounding == "measured" else policy["unit_roundoff_wire"]
        gradient["floor_rel_fro"] = allowed_floor(
            gradient["dp_floor_rel_fro"], depth=policy["depth"], unit_roundoff=policy["unit_roundoff"],
            world_size=policy["world_size"], u_sum=u_sum)
        return checks

    def to_dict(self, tolerance_policy: dict) -> dict:
        worst = max(self.checks, key=lambda c: c.noise_ratio, default=None)
        verdict = self.status()
        return {
            "verdict": verdict,
            "unverifiable_reason": "; ".join(self.unverifiable) if verdict == "unverifiable" else None,
            "checks": self._recorded_floor(self._summaries(), tolerance_policy),
            "checked_steps": [c.step for c in self.checks],
            "max_rel_err": _defined_max([c.max_rel_err for c in self.checks]) if self.checks else None,
            "max_rel_err_reason": (next((c.max_rel_err_reason for c in self.checks if c.max_rel_err_reason), None)
                                   if self.checks and math.isnan(_defined_max([c.max_rel_err for c in self.checks]))
                                   else None),
            "max_rel_fro_err": max((c.max_rel_fro_err for c in self.checks), default=None),
            "noise_floor_rel_fro": max((c.floor for c in self.checks), default=None),
            "noise_ratio": worst.noise_ratio if worst else None,
            "min_detectable_rel": self.power(),
            "first_divergence": asdict(self.first_divergence) if self.first_divergence else None,
            "replicas_identical": self.replicas_identical,
            "initial_weights_identical": self.initial_weights_identical,
            "stochastic": self.stochastic,
            "parameters": self.parameters,
            "oracle_coverage": self.oracle_coverage,
            "oracle_precision": self.oracle_precision,
            "oracle_division": self.oracle_division,
            "oracle_reuse": self.oracle_reuse,
            "checkpoint": self.checkpoint,
            "batchnorm": self.batchnorm,
            "split": self.split,
            "buffers": self.buffers,
            "precision": self.precision.to_dict() if self.precision is not None else None,
            "tolerance": {**tolerance_policy, "wire_rounding": self.wire_rounding},
            "drift": self.drift,
            "notes": [n.to_dict() for n in self.notes],
            "per_step": [
                {
                    "step": c.step,
                    "max_rel_err": c.max_rel_err,
                    "max_rel_err_reason": c.max_rel_err_reason,
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
                    "grad_norm": c.grad_norm.to_dict() if c.grad_norm is not None else None,
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
