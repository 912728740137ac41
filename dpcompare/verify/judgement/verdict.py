"""The per-step check records and the verdict they add up to.

Owns: what one checked step recorded (`StepCheck`: the gradient per parameter and as one vector, and its
`UpdateCheck`), the first failed check (`Divergence`), the `Verdict` that collects them with the notes, the
unverifiable parts and the reports of the other checks (buffers, randomness, precision, trajectory), its status
(`equivalent`, `different`, `unverifiable`, `unchecked`), its power, and its JSON form with the tolerance policy it
was judged under. Judges nothing itself: the checks that fill it are dpcompare.verify.checks', and each check's entry
in the JSON (`checks`, and beside each step's gradient) is the check's own (`summary`, `step_record`): the verdict is
handed the list (`Verdict.recorded`, `hand_over`) and assembles them in its order, importing no check. Imports no
adapter.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Sequence

from dpcompare.contract import Note
from dpcompare.verify.judgement.precision_recipe import PrecisionReport
from dpcompare.verify.judgement.tolerance import (TOLERANCE_FACTOR, UNIT_ROUNDOFF, WIRE_DTYPE, ParamError, coverage,
                                        min_detectable)
from dpcompare.verify.judgement.tolerance import describe as describe_tolerance

CheckName = Literal["initial", "gradient", "grad_norm", "update", "trajectory", "replicas", "rng", "buffers", "loss_scale",
                    "checkpoint"]
"""The checks of dpcompare itself; a check of one's own (dpcompare.verify.checks.CHECKS) names its failures by its own
`name`."""


@dataclass(slots=True)
class Divergence:
    step: int
    parameter: str
    rel_fro_err: float
    tolerance_rel_fro: float
    noise_ratio: float
    reason: str
    check: CheckName | str = "gradient"
    """Which check broke: initial weights, gradient, the total norm clipped by (grad_norm), update, trajectory,
    replicas, the ranks' generators, the module buffers, or the loss scaler (a step skipped, or stepped, against the
    recipe's overflow); or a check of one's own, by its name."""
    cause: str = "unknown"
    """The diagnosis' code (dpcompare.verify.diagnosis.diagnose.Diagnosis.cause)."""
    parameters: list[str] = field(default_factory=list)
    """Every parameter that broke tolerance at that step and check."""


def _power(params: list[ParamError], model: ParamError | None) -> dict:
    cov = coverage(params)
    return {"min_detectable_rel": finite(min_detectable(params, model)), "coverage": cov.to_dict(),
            "model": _param_dict(model) if model is not None else None}


def finite(x: float) -> float | None:
    """`x`, or None where it is not finite (recorded as null)."""
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
    records: dict[str, Any] = field(default_factory=dict)
    """What a check of one's own recorded at this step, by its name (its `step_record` reads it for the JSON)."""

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


def worst(values: list[float]) -> float | None:
    """The largest of `values` (None: there are none)."""
    return max(values) if values else None


_HANDED: list[Sequence[type]] = [()]
"""The list of checks dpcompare.verify.checks handed over when imported (`hand_over`)."""


def hand_over(checks: Sequence[type]) -> None:
    """What dpcompare.verify.checks calls when imported, with its list (CHECKS, the object itself: a check added to it
    later is seen): the checks a verdict handed none records (`Verdict.recorded` None). The verdict is judged below
    the checks and imports none of them."""
    _HANDED[0] = checks


def record_order(checks: Sequence[type]) -> list[type]:
    """`checks` in the order their entries stand in the JSON: the list's, but that a check whose `recorded_after` names
    another check stands right after that one's (the grad_norm check after the update's, where results have always
    held it)."""
    ordered = [c for c in checks if getattr(c, "recorded_after", None) is None]
    for c in checks:
        if (after := getattr(c, "recorded_after", None)) is not None:
            names = [o.name for o in ordered]
            ordered.insert(names.index(after) + 1 if after in names else len(ordered), c)
    return ordered


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
    records: dict[str, Any] = field(default_factory=dict)
    """What a check of one's own keeps for its entry in `checks`, by its name (its `summary` reads it)."""
    recorded: Sequence[type] | None = None
    """The checks whose entries the JSON holds, in their list's order (`record_order`): each one's `summary` in
    `checks`, its `step_record` beside each step's gradient (both optional, class methods: a check that did not run
    this time still has its entry, `off`). Set by the verifier to the list it ran (dpcompare.verify.checks.CHECKS);
    None: the list handed over (`hand_over`)."""

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

    def check_status(self, check: str, ran: bool) -> str:
        """A check's status in `checks`: fail where it broke first (the first divergence's check), unverifiable where
        it did not run in an unverifiable run, else pass, or off where it did not run."""
        d = self.first_divergence
        if d is not None and d.check == check:
            return "fail"
        if self.unverifiable and not ran:
            return "unverifiable"
        return "pass" if ran else "off"

    def recorders(self) -> list[type]:
        """The checks whose entries the JSON holds, in their order (`recorded`)."""
        return record_order(self.recorded if self.recorded is not None else _HANDED[0])

    def power(self) -> float | None:
        """The verdict's own min_detectable_rel: the smallest uniform relative change of the gradient and of the update
        that every checked step would flag (the weakest step's, each step's the weaker of its two checks)."""
        per_step = [max(c.min_detectable_rel, c.update.min_detectable_rel if c.update is not None else 0.0)
                    for c in self.checks]
        weakest = worst(per_step)
        return finite(weakest) if weakest is not None else None

    def to_dict(self, tolerance_policy: dict) -> dict:
        noisiest = max(self.checks, key=lambda c: c.noise_ratio, default=None)
        verdict = self.status()
        recorders = self.recorders()
        summaries = [c for c in recorders if hasattr(c, "summary")]
        steps = [c for c in recorders if hasattr(c, "step_record")]
        return {
            "verdict": verdict,
            "unverifiable_reason": "; ".join(self.unverifiable) if verdict == "unverifiable" else None,
            "checks": {c.name: c.summary(self, tolerance_policy) for c in summaries},
            "checked_steps": [c.step for c in self.checks],
            "max_rel_err": _defined_max([c.max_rel_err for c in self.checks]) if self.checks else None,
            "max_rel_err_reason": (next((c.max_rel_err_reason for c in self.checks if c.max_rel_err_reason), None)
                                   if self.checks and math.isnan(_defined_max([c.max_rel_err for c in self.checks]))
                                   else None),
            "max_rel_fro_err": max((c.max_rel_fro_err for c in self.checks), default=None),
            "noise_floor_rel_fro": max((c.floor for c in self.checks), default=None),
            "noise_ratio": noisiest.noise_ratio if noisiest else None,
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
                    "min_detectable_rel": finite(c.min_detectable_rel),
                    "judged_floor_rel_fro": c.judged_floor,
                    **{k: v for k, v in _power(c.params, c.model).items() if k != "min_detectable_rel"},
                    "params": [_param_dict(p) for p in c.params],
                    **{r.name: r.step_record(c) for r in steps},
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
