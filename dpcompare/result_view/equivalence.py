"""The verdict of a result and its checks: the first divergence, the notes, each check's figures, the tolerance."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from dpcompare.result_view.figures import Field, View, is_number, mapping

# -- the verdict ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Divergence:
    """Where a run first broke tolerance."""

    step: Any
    parameter: str
    reason: str
    check: str = "gradient"
    """The check that broke it (results written before the update and trajectory checks name none: theirs was the
    gradient's)."""
    cause: str | None = None

    @classmethod
    def of(cls, raw: Any) -> Divergence | None:
        if not isinstance(raw, Mapping) or not raw:
            return None
        return cls(raw.get("step"), str(raw.get("parameter")), str(raw.get("reason", "")),
                   str(raw.get("check") or "gradient"), raw.get("cause"))


@dataclass(frozen=True, slots=True)
class Note:
    """A verdict note: readers match the code, people read the text (results written before notes carried a code
    hold a plain string: code None)."""

    code: str | None
    text: str
    concerns: tuple[str, ...] = ()
    """The state components it explains (STATE_COMPONENTS' keys)."""

    @classmethod
    def of(cls, raw: Any) -> Note:
        if not isinstance(raw, Mapping):
            return cls(None, str(raw))
        return cls(raw.get("code"), raw.get("text", ""), tuple(raw.get("concerns") or ()))


@dataclass(frozen=True, slots=True)
class Check(View):
    """One check's summary: its status and worst figures."""

    raw: Mapping[str, Any]
    name: str

    noise_ratio = Field()
    """The worst judged error as a multiple of its floor."""
    norm_ratio = Field()
    """The update's: ||update|| / ||reference update||."""
    min_detectable_rel = Field()
    max_rel_err = Field()
    max_rel_fro_err = Field()
    noise_floor_rel_fro = Field()
    dp_floor_rel_fro = Field()
    floor_rel_fro = Field()
    """The gradient's: the floor its noise ratio is a multiple of, the reduction's allowance included (recorded by
    the verdict, dpcompare.verify.judgement.tolerance)."""
    rel_param_distance = Field()
    clip = Field()

    @property
    def path(self) -> str:
        return f"equivalence.checks.{self.name}"

    @property
    def status(self) -> str | None:
        return self.raw.get("status")

    @property
    def ran(self) -> bool:
        """It ran and was judged (not off, not unverifiable, recorded)."""
        return self.status not in (None, "off", "unverifiable")

    @property
    def clipped_steps(self) -> tuple[int, ...]:
        return tuple(self.raw.get("clipped_steps") or ())

    @property
    def coverage(self) -> Mapping[str, Any]:
        return mapping(self.raw.get("coverage"))


@dataclass(frozen=True, slots=True)
class Tolerance:
    raw: Mapping[str, Any]

    @property
    def factor(self) -> float | None:
        return self.raw.get("factor") if is_number(self.raw.get("factor")) else None

    @property
    def compression(self) -> str:
        return str(self.raw.get("compression", "none"))

    @property
    def wire_measured(self) -> bool:
        """A narrower wire's rounding is measured in the data-parallel floor (else bounded, the tolerance widened)."""
        return self.raw.get("wire_rounding") == "measured"


@dataclass(frozen=True, slots=True)
class Equivalence(View):
    """The verdict and its checks."""

    raw: Mapping[str, Any]
    path = "equivalence"

    noise_ratio = Field()
    max_rel_err = Field()
    max_rel_fro_err = Field()
    noise_floor_rel_fro = Field()
    min_detectable_rel = Field()
    """The verdict's power: the smallest relative change of the gradient or the update every checked step flags."""

    @property
    def verdict(self) -> str | None:
        return self.raw.get("verdict")

    @property
    def unverifiable_reason(self) -> str | None:
        return self.raw.get("unverifiable_reason") or None

    @property
    def first_divergence(self) -> Divergence | None:
        return Divergence.of(self.raw.get("first_divergence"))

    @property
    def replicas_identical(self) -> bool | None:
        return self.raw.get("replicas_identical")

    @property
    def checked_steps(self) -> tuple[int, ...]:
        return tuple(self.raw.get("checked_steps") or ())

    @property
    def checks_recorded(self) -> bool:
        """False in results written before the update and trajectory checks."""
        return isinstance(self.raw.get("checks"), Mapping)

    def check(self, name: str) -> Check:
        """gradient, update, trajectory, grad_norm or a check of one's own ({} where not recorded: status None)."""
        return Check(mapping(mapping(self.raw.get("checks")).get(name)), name)

    @property
    def check_names(self) -> tuple[str, ...]:
        """The checks recorded, in the result's order (a check of one's own's too)."""
        return tuple(mapping(self.raw.get("checks")))

    @property
    def gradient(self) -> Check:
        return self.check("gradient")

    @property
    def update(self) -> Check:
        return self.check("update")

    @property
    def trajectory(self) -> Check:
        return self.check("trajectory")

    @property
    def grad_norm(self) -> Check:
        return self.check("grad_norm")

    @property
    def notes(self) -> tuple[Note, ...]:
        return tuple(Note.of(n) for n in self.raw.get("notes") or ())

    def has_note(self, code: str) -> bool:
        return any(n.code == code for n in self.notes)

    @property
    def tolerance(self) -> Tolerance:
        return Tolerance(mapping(self.raw.get("tolerance")))

    def section(self, name: str) -> Mapping[str, Any]:
        """A recorded section as written ({} when absent): precision, stochastic, batchnorm, split, parameters,
        oracle_coverage, oracle_precision (their keys: the schema)."""
        return mapping(self.raw.get(name))

    @property
    def stochastic(self) -> bool:
        """The forward draws random numbers (False for a result written before this was probed)."""
        return bool(self.section("stochastic").get("stochastic"))

    @property
    def per_replica_forwards(self) -> int | None:
        """The forwards a run computed apart (BatchNorm per replica, a forward that depends on the split), or None."""
        for section in (self.section("batchnorm"), self.section("split")):
            if section.get("semantics") == "per_replica":
                return section.get("forwards")
        return None

    @property
    def buffers(self) -> tuple[Mapping[str, Any], ...]:
        return tuple(b for b in self.raw.get("buffers") or () if isinstance(b, Mapping))

    @property
    def drift(self) -> tuple[Mapping[str, Any], ...]:
        return tuple(d for d in self.raw.get("drift") or () if isinstance(d, Mapping))

    @property
    def per_step(self) -> tuple[Mapping[str, Any], ...]:
        return tuple(s for s in self.raw.get("per_step") or () if isinstance(s, Mapping))
