"""Explanation: when a candidate explains a failing parameter, and how the hypotheses' claims become diagnoses.

Owns: the Diagnosis record (a cause, its reason, the parameters it explains); the test a hypothesis' candidate
(gradient or update) must pass to claim a failing parameter: within the parameter's tolerance of the backend's
value and at most EXPLAINED_SHARE of that value's distance from the reference; the fit of one scale factor that
several parameters share (SCALE_AGREEMENT); and _explain, which tries the hypotheses in their fixed order: when one
explains every failing parameter it alone is named (the first in order), otherwise each in turn claims what it
explains and the rest is said to match none. Each reason names the parameters it is about unless it is the only
one and covers all of them. Imports no adapter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from dpcompare.verify.oracle.gradient_oracle import Grads, flat, rel_fro


@dataclass(slots=True)
class Diagnosis:
    cause: str
    """A short code: summed, averaged_twice, loss_sum, loss_scale_not_undone, loss_scale_undone_twice, scaled,
    unsynchronised, replica_group_only, stale, swapped, zeroed_partition, unapplied_shard, wire_dtype, wire_underflow, wire_overflow, batchnorm, duplicated_data,
    wrong_shards, non_finite, skipped_step, lr_scaled, double_step, optimizer_state, unused_zero_grad, weight_decay,
    clipped, not_clipped, clipped_in_parts, recompute_redrew_masks, unknown."""
    reason: str
    parameters: list[str] = field(default_factory=list)


EXPLAINED_SHARE = 0.25
"""A candidate explains a parameter only when its distance to the backend's value is at most this share of
the reference's: it accounts for at least 3/4 of the error, not merely for something within tolerance."""

SCALE_AGREEMENT = 1e-3
"""A scale factor explains a set of parameters only when each one's own fitted scale agrees with it to this
relative precision: a scale that fits the sum of several unrelated parameters is no cause."""


def _share(reference: Grads, names: list[str]) -> float:
    return float(torch.linalg.vector_norm(flat(reference, names))) / math.sqrt(max(len(names), 1))


def _matching(values: Grads, candidate: Grads, reference: Grads, names: list[str], tol: dict[str, float],
              share: float) -> list[str]:
    """The parameters whose value the candidate explains: within tolerance of it, and at most EXPLAINED_SHARE of
    the value's distance from the reference (a small value is within tolerance of many wrong candidates)."""
    out = []
    for n in names:
        if not bool(torch.isfinite(candidate[n]).all()):
            continue
        residual = rel_fro(values[n], candidate[n], share)
        if residual <= tol[n] and residual <= EXPLAINED_SHARE * rel_fro(values[n], reference[n], share):
            out.append(n)
    return out


def _scale_fit(values: Grads, reference: Grads, names: list[str]) -> float:
    v, r = flat(values, names), flat(reference, names)
    denom = float(r @ r)
    return float(v @ r) / denom if denom > 0 else math.nan


def _common_scale(values: Grads, reference: Grads, names: list[str],
                  preferred: tuple[float, ...] = ()) -> tuple[float, list[str]]:
    """The scale c with values ~ c * reference that the most parameters share, refitted on them, and those
    parameters: each one's own least-squares scale agrees with c to SCALE_AGREEMENT. Tried: the fit over all
    of `names`, the `preferred` values, and every parameter's own scale (the first with the most agreeing wins)."""
    own: dict[str, float] = {}
    for p in names:
        v, r = values[p].reshape(-1), reference[p].reshape(-1)
        rr = float(r @ r)
        if rr > 0 and bool(torch.isfinite(v).all()):
            own[p] = float(v @ r) / rr

    def agreeing(c: float) -> list[str]:
        return [p for p, cp in own.items() if abs(cp - c) <= SCALE_AGREEMENT * abs(c)]

    if not own:
        return math.nan, []
    tried = [c for c in (_scale_fit(values, reference, list(own)), *preferred, *own.values()) if math.isfinite(c) and c]
    if not tried:
        return 0.0, list(own)
    group = agreeing(max(tried, key=lambda c: len(agreeing(c))))
    if not group:
        return math.nan, []
    c = _scale_fit(values, reference, group)
    return c, [p for p in group if abs(own[p] - c) <= SCALE_AGREEMENT * abs(c)]


def _which(params: list[str], all_names: list[str]) -> str:
    if set(params) >= set(all_names):
        return "every checked parameter"
    shown = ", ".join(params[:6]) + (f" and {len(params) - 6} more" if len(params) > 6 else "")
    return shown


_Hypothesis = Callable[[list[str]], list[Diagnosis]]
"""Takes the failing parameters not yet explained; returns the diagnoses its fault explains."""


def _explain(failing: list[str], hypotheses: list[_Hypothesis], all_names: list[str],
             none_reason: str) -> list[Diagnosis]:
    """One cause where one explains every failing parameter (the first in order): a fault that changes the
    whole gradient leaves a few parameters that other candidates fit by chance, and naming those would name
    faults that did not happen. Otherwise each hypothesis in order claims what it explains of the rest, and
    what none explains is said to match none."""
    if not failing:
        return []
    tried: dict[int, list[Diagnosis]] = {}
    for i, hypothesis in enumerate(hypotheses):
        tried[i] = hypothesis(list(failing))
        for d in tried[i]:
            if set(d.parameters) >= set(failing):
                d.parameters = list(failing)
                return _prefixed([d], all_names)
    remaining = list(failing)
    found: list[Diagnosis] = []
    for i, hypothesis in enumerate(hypotheses):
        if not remaining:
            break
        for d in tried[i] if remaining == failing else hypothesis(remaining):
            d.parameters = [n for n in remaining if n in d.parameters]
            if d.parameters:
                found.append(d)
                remaining = [n for n in remaining if n not in d.parameters]
    if remaining:
        found.append(Diagnosis("unknown", none_reason, remaining))
    return _prefixed(found, all_names)


def _prefixed(found: list[Diagnosis], all_names: list[str]) -> list[Diagnosis]:
    """Each reason says which parameters it is about, unless it is the only one and covers all of them."""
    for d in found:
        if len(found) > 1 or not set(d.parameters) >= set(all_names):
            d.reason = f"on {_which(d.parameters, all_names)}: {d.reason}"
    return found


def reason_of(found: list[Diagnosis]) -> str:
    return "; ".join(d.reason for d in found)
