"""Diagnosis: why a check failed, found by testing what each known fault would have produced.

Owns: diagnose_gradient and diagnose_update, which try the hypotheses for a failed gradient check
(dpcompare.verify.diagnosis.gradient_hypotheses, with the wire's in dpcompare.verify.diagnosis.wire_hypotheses) and for a failed
update check (dpcompare.verify.diagnosis.update_hypotheses) in a fixed order, on what rank 0 knows at the check
(dpcompare.verify.diagnosis.failure_evidence). Each hypothesis builds the gradient (or update) its fault would give and claims a
failing parameter only when that candidate really explains the error: it matches the backend's value within the
parameter's tolerance and removes at least 3/4 of its distance from the reference. When one hypothesis explains
every failing parameter, it alone is named (the first in order); otherwise each hypothesis in turn claims what it
explains, and the rest is said to match none of the known patterns, listing the relations tested, rather than given
to a cause that does not fit (dpcompare.verify.diagnosis.explanation). The reason names the cause, the parameters it explains
when that is not all of them, and the fix. The verifier also reads here the comparisons of a backend's optimizer
state with the expected one (dpcompare.verify.diagnosis.state_comparison). Imports no adapter.
"""

from __future__ import annotations

from dpcompare.verify.diagnosis.failure_evidence import GradientEvidence, UpdateEvidence
from dpcompare.verify.diagnosis.explanation import Diagnosis, _explain, reason_of
from dpcompare.verify.diagnosis.gradient_hypotheses import _GradientHypotheses
from dpcompare.verify.diagnosis.state_comparison import FRESH_STEPPED_TRAP, state_difference, step_count_mismatch
from dpcompare.verify.diagnosis.update_hypotheses import _UpdateHypotheses

__all__ = ["FRESH_STEPPED_TRAP", "Diagnosis", "GradientEvidence", "UpdateEvidence", "diagnose_gradient",
           "diagnose_update", "reason_of", "state_difference", "step_count_mismatch"]


def diagnose_gradient(ev: GradientEvidence, failing: list[str]) -> list[Diagnosis]:
    """Name the one known fault whose gradient explains every failing parameter, else the faults that each
    explain some of them and what matches none."""
    h = _GradientHypotheses(ev)
    return _explain(failing, h.ordered(), h.names, h.none_reason())


def diagnose_update(ev: UpdateEvidence, failing: list[str]) -> list[Diagnosis]:
    """Name the one known fault whose update explains every failing parameter, else the faults that each
    explain some of them and what matches none."""
    h = _UpdateHypotheses(ev)
    return _explain(failing, h.ordered(), h.names, h.NONE)
