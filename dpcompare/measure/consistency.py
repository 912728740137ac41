"""Whether a result's cost figures hold together, judged from its recorded metrics alone (so results written by
older versions are judged too): exposed communication against the backend's total (a contradiction, or the
ablation's noise), the ablation's difference beyond the total (interference: computation slowed by the collectives
beside it), and compute plus exposed communication against the measured step. Each judgement is None when the
figures agree, else the sentence that says why they do not; compare and report print it beside the figure. The
figures are read through the result's reader (dpcompare.result_view.Metrics; a dict of metrics is read through it).
Imports no adapter and no torch."""

from __future__ import annotations

from typing import Any, Mapping

from dpcompare.result_view import Metrics


def _view(metrics: Metrics | Mapping[str, Any]) -> Metrics:
    return metrics if isinstance(metrics, Metrics) else Metrics(metrics)

CONTRADICTION_SLACK = 0.10
"""Exposed communication may exceed the total by this fraction (two methods, each with its own noise)."""


def exposed_flag(metrics: Metrics | Mapping[str, Any]) -> tuple[str, str] | None:
    """("!", why) when exposed communication contradicts the total, ("~", why) when it is above the total only
    within its 95 % interval, None otherwise. Exposed (the synced minus the unsynced step) is part of the total
    (the backend's own counter), so it cannot be larger; it contradicts the total only when its whole interval
    lies above it (a result without an interval is judged on its figure alone). Then the collectives slowed the
    computation around them (cores, memory bandwidth or a PCIe link shared with compute), and the ablation
    booked that slowdown as communication: read exposed as an upper bound, and the total as what the
    collectives themselves took. Results measured with the interleaved ablation bound exposed by the total
    (exposed_split) and put that slowdown in comm_interference_ms (interference_flag): this judges older results."""
    m = _view(metrics)
    exposed, total = m.comm_exposed_ms.value, m.comm_total_ms.value
    if exposed is None or total is None or total <= 0:
        return None
    bound = total * (1.0 + CONTRADICTION_SLACK)
    if exposed <= bound:
        return None
    interval = m.comm_exposed_ci_ms.value
    if isinstance(interval, list) and len(interval) == 2 and interval[0] <= bound:
        pairs = m.ablation_pairs.value
        return "~", (f"exposed communication {exposed:.2f} ms is above total {total:.2f} ms, but its 95 % interval "
                     f"({interval[0]:.2f}-{interval[1]:.2f} ms{f' over {pairs} ablation pairs' if pairs else ''}) "
                     f"reaches the total: the ablation's noise, not a contradiction; more --measure-steps "
                     f"(or --ablation-steps) narrow it")
    within = f" (95 % interval {interval[0]:.2f}-{interval[1]:.2f} ms)" if isinstance(interval, list) else ""
    return "!", (f"exposed communication {exposed:.2f} ms{within} > total {total:.2f} ms: the collectives slowed "
                 f"the computation around them and the synced-minus-unsynced ablation counted that as "
                 f"communication; exposed is an upper bound here")


def interference_flag(metrics: Metrics | Mapping[str, Any]) -> str | None:
    """Why the ablation's difference exceeded the total by more than CONTRADICTION_SLACK, or None: the part beyond
    the total (comm_interference_ms) is the computation slowed by the collectives beside it, shown apart from
    exposed communication, which it is not."""
    m = _view(metrics)
    extra, total, raw = m.comm_interference_ms.value, m.comm_total_ms.value, m.comm_ablation_ms.value
    if extra is None or total is None or raw is None or total <= 0:
        return None
    if extra <= total * CONTRADICTION_SLACK:
        return None
    return (f"the synced step took {raw:.2f} ms longer than the unsynced one, {extra:.2f} ms beyond the total "
            f"communication {total:.2f} ms: the collectives slowed the computation beside them (cores, memory "
            f"bandwidth, a shared link); exposed is bounded by the total and this interference is not counted in it")


def breakdown_flag(metrics: Metrics | Mapping[str, Any]) -> str | None:
    """Why compute and exposed communication do not fit in the measured step, or None. The step is the p50 of the
    measured window; compute and exposed come from the ablation's pairs, whose synced arm (compute + exposed) is
    the measured step up to its reduce, so it is at most the step. More than CONTRADICTION_SLACK beyond it (results
    of the older ablation, run after the measured window), the machine ran slower during the ablation than during
    the measured steps (another tenant on a shared machine, a slow spell): the breakdown does not add up and is
    not printed as if it did."""
    m = _view(metrics)
    step, compute, exposed = m.step_ms_p50.value, m.compute_ms_p50.value, m.comm_exposed_ms.value
    if step is None or compute is None or exposed is None or step <= 0:
        return None
    parts = compute + max(exposed, 0.0)
    if parts <= step * (1.0 + CONTRADICTION_SLACK):
        return None
    if m.comm_ablation_ms.value is not None:  # the interleaved ablation: one machine
        return (f"compute {compute:.2f} ms + exposed {max(exposed, 0.0):.2f} ms = {parts:.2f} ms is "
                f"{parts / step - 1:.0%} more than the measured step p50 {step:.2f} ms, though the synced arm is part "
                f"of every measured step: the median of the unsynced arm and the median of the pairs' differences "
                f"do not add up to the synced arm's median when the steps are this noisy, so compute and exposed "
                f"compare with each other, not with the step, and the rest of the step is not known; more "
                f"--measure-steps, or a quieter machine, narrow it")
    return (f"compute {compute:.2f} ms + exposed {max(exposed, 0.0):.2f} ms = {parts:.2f} ms is {parts / step - 1:.0%} "
            f"more than the measured step p50 {step:.2f} ms: the ablation's pairs ran slower than the measured steps "
            f"(the machine's load changed between the two windows), so compute and exposed compare with each other, "
            f"not with the step, and the rest of the step is not known; rerun when the machine is quieter")


def contradiction(metrics: Metrics | Mapping[str, Any]) -> str | None:
    """Why exposed communication contradicts the total (see exposed_flag), or None."""
    flag = exposed_flag(metrics)
    return flag[1] if flag and flag[0] == "!" else None


def within_noise(metrics: Metrics | Mapping[str, Any]) -> str | None:
    """Why exposed communication above the total is the ablation's noise (see exposed_flag), or None."""
    flag = exposed_flag(metrics)
    return flag[1] if flag and flag[0] == "~" else None
