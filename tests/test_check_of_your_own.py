"""A check of one's own is one class and one list entry (docs/extending.md#a-check-of-your-own).

The check below lives in this module, not in dpcompare: added to dpcompare.verify.checks.CHECKS, a real run (in this
process, through dpcompare.cli.main) runs it at every checked step, its entry stands in the verdict's `checks` after
dpcompare's own and beside each checked step's gradient, the result validates against the published schema, and the
run's line says it in its own words. Made to fail, the run is `different` with it named as the first divergence's
check. Nothing in dpcompare names it.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import ClassVar

import pytest
import torch

from conftest import validate_result
from dpcompare.verify import checks
from dpcompare.verify.checks import CHECKS
from dpcompare.verify.instruments.check_context import CheckContext, Finding
from dpcompare.verify.instruments.run_instruments import Bench
from dpcompare.verify.instruments.step_evidence import StepEvidence
from dpcompare.verify.judgement.verdict import Divergence, StepCheck, Verdict
from tests.test_failures import in_process  # noqa: F401 - the fixture

EXTENDING = Path(__file__).resolve().parents[1] / "docs" / "extending.md"
MODEL = "tests.zerodim_models:clip_towers"
QUICK = ["--steps", "3", "--measure-steps", "0"]


class BoundedGradient:
    """Every element of the reduced gradient is finite, and within `bound` in magnitude (inf: finite is all it asks),
    at every checked step."""

    name = "bounded_gradient"
    at = "reduced"  # after the reduce, before the optimizer step
    reads_oracle = False  # it reads only the backend's reads (StepEvidence.reads): no oracle needed
    after_stop = False
    bound: ClassVar[float] = math.inf

    @classmethod
    def applies(cls, ctx: CheckContext) -> bool:
        return True

    def __init__(self, ctx: CheckContext, bench: Bench) -> None:
        self.verdict = bench.verdict
        self.verdict.records[self.name] = {"steps": [], "max_abs": None}

    def judge(self, ctx: CheckContext, step: StepEvidence) -> Finding | None:
        if step.reads is None:  # an unchecked step: nothing was read
            return None
        largest = {n: float(g.abs().max()) if g.numel() else 0.0
                   for n, g in step.reads.grads.items() if g is not None and g.is_floating_point()}
        worst = max(largest, key=lambda n: largest[n] if math.isfinite(largest[n]) else math.inf)
        mine = self.verdict.records[self.name]
        mine["steps"].append(step.step)
        mine["max_abs"] = max(largest[worst], mine["max_abs"] or 0.0)
        if self.verdict.checks and self.verdict.checks[-1].step == step.step:  # the gradient check's record of it
            self.verdict.checks[-1].records[self.name] = {"max_abs": largest[worst], "parameter": worst}
        if math.isfinite(largest[worst]) and largest[worst] <= self.bound:
            return None
        return Finding(Divergence(
            step.step, worst, largest[worst], self.bound, largest[worst] / self.bound,
            f"the reduced gradient of {worst} holds an element of magnitude {largest[worst]:.3g}, above the bound "
            f"{self.bound:.3g}", check=self.name, cause="unbounded_gradient", parameters=[worst]))

    @classmethod
    def summary(cls, verdict: Verdict, policy: dict) -> dict:
        mine = verdict.records.get(cls.name, {"steps": [], "max_abs": None})
        return {"status": verdict.check_status(cls.name, bool(mine["steps"])), "steps": mine["steps"],
                "max_abs": mine["max_abs"]}

    @staticmethod
    def step_record(check: StepCheck) -> dict | None:
        return check.records.get(BoundedGradient.name)

    @staticmethod
    def words(entry) -> str:
        return f"bounded_gradient: largest element {entry.raw['max_abs']:.3g} at {len(entry.raw['steps'])} step(s)"


@pytest.fixture
def added():
    """BoundedGradient in the list, as a user adds a check (`CHECKS.append`), and out of it afterwards."""
    CHECKS.append(BoundedGradient)
    try:
        yield
    finally:
        CHECKS.remove(BoundedGradient)


def _run(in_process) -> tuple[dict, str]:
    status, out, err, files = in_process("dp", MODEL, QUICK)
    assert status == 0 and len(files) == 1, (out + err)[-3000:]
    payload = json.loads(files[0].read_text())
    validate_result(payload)
    return payload["equivalence"], out


def test_a_check_of_ones_own_runs_and_is_recorded(in_process, added):
    assert checks.CHECKS[-1] is BoundedGradient
    e, out = _run(in_process)
    assert e["verdict"] == "equivalent", e["first_divergence"] or e["unverifiable_reason"]
    # its entry, after dpcompare's own (whose order is unchanged)
    assert list(e["checks"]) == ["gradient", "update", "grad_norm", "trajectory", "bounded_gradient"], e["checks"]
    mine = e["checks"]["bounded_gradient"]
    assert mine["status"] == "pass" and mine["steps"] == e["checked_steps"] and 0 < mine["max_abs"] < math.inf, mine
    # beside each checked step's gradient, after the update's and the grad_norm's
    for step in e["per_step"]:
        assert list(step)[-3:] == ["update", "grad_norm", "bounded_gradient"], list(step)
        assert step["bounded_gradient"]["max_abs"] <= mine["max_abs"], step["bounded_gradient"]
    # its own words in the run's line
    assert f"bounded_gradient: largest element {mine['max_abs']:.3g} at {len(mine['steps'])} step(s)" in out, out
    # a verdict no verifier built records it too (the list the checks hand over), off
    assert Verdict().to_dict({})["checks"]["bounded_gradient"] == {"status": "off", "steps": [], "max_abs": None}


def test_a_check_of_ones_own_that_fails_is_the_first_divergence(in_process, added, monkeypatch):
    monkeypatch.setattr(BoundedGradient, "bound", 1e-12)  # every gradient breaks it
    e, _ = _run(in_process)
    assert e["verdict"] == "different", e
    d = e["first_divergence"]
    assert (d["check"], d["step"], d["cause"]) == ("bounded_gradient", 0, "unbounded_gradient"), d
    assert "above the bound 1e-12" in d["reason"], d
    assert e["checks"]["bounded_gradient"]["status"] == "fail", e["checks"]
    assert e["checks"]["gradient"]["status"] == "pass", e["checks"]  # only the failed check is blamed


def test_out_of_the_list_it_is_not_run_nor_recorded(in_process):
    assert BoundedGradient not in CHECKS
    e, _ = _run(in_process)
    assert list(e["checks"]) == ["gradient", "update", "grad_norm", "trajectory"], e["checks"]
    assert all("bounded_gradient" not in step for step in e["per_step"])


def test_the_check_is_the_docs_example():
    """docs/extending.md#a-check-of-your-own shows this module's check, verbatim."""
    section = EXTENDING.read_text().split("\n## A check of your own\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    (example,) = [b for b in blocks if "class BoundedGradient" in b]
    assert example in Path(__file__).read_text(), "docs/extending.md's check and this module's differ"
