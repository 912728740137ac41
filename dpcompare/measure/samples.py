"""What rank 0 turns into a run's metrics, and what it writes them into.

Owns: `RankSample` (what one rank measured, gathered to rank 0), `Metrics` (the figures in the order they are
written, a missing one with its reason) and `paired_steps` (the ablation pairs every rank measured). Each concern's
figures are written by its own module of dpcompare.measure (dpcompare.measure.run_metrics says which, in order).
Imports nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class RankSample:
    """What one rank measured, gathered to rank 0."""

    step_ms: list[float]
    synced_ms: list[float]
    unsynced_ms: list[float]
    memory: dict[str, float | None]
    memory_reason: str | None
    comm: dict[str, Any] | None
    """Native counter over the measured window: {'total_ms', 'overlap_ms', 'steps', 'method'} or {'reason'}."""
    model_state: dict[str, Any] | None = None
    """This rank's model-state census in MiB (dpcompare.measure.memory.census_mib), or None when none was taken."""
    collectives: dict[str, Any] | None = None
    """This rank's Python collectives by kind (dpcompare.measure.collectives.CollectiveRecorder.record), or None."""


@dataclass(slots=True)
class Metrics:
    values: dict[str, Any] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)

    def set(self, name: str, value: Any, reason: str | None = None) -> None:
        self.values[name] = value
        if value is None:
            self.reasons[name] = reason or "not measured"

    def to_dict(self) -> dict[str, Any]:
        return {**self.values, "reasons": self.reasons}


def paired_steps(samples: list[RankSample]) -> int:
    """How many ablation pairs (a synced step and its unsynced twin) every rank measured."""
    return min(min(len(s.synced_ms), len(s.unsynced_ms)) for s in samples)
