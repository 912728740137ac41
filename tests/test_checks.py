"""The verifier's checks as a list with one interface (dpcompare.verify.checks.CHECKS), judged with a frozen context.

Checked against: the `Check` protocol (every entry declares its name, its point of the step, whether it reads the
oracle's step and whether it runs after a stop, and judges through `judge(ctx, step)`), the result schema (every name a
failure can carry is the schema's `check` enum, declared once in `CheckName`), and a real run: a check added to the list
is built with the run's context and handed every step at its point, with the oracle's side of each checked step, and
what it finds is the verdict's. Negative: a planted check that fails at step 1 makes a correct reference run `different`,
naming it; the context cannot be changed once built. Each test runs in this process (the reference backend, one rank).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import os
import re
from pathlib import Path
from typing import get_args

import pytest

from conftest import REPO_ROOT, without_launcher_vars
from dpcompare import cli
from dpcompare.verify import checks
from dpcompare.verify.checks import CHECKS, GradNorm
from dpcompare.verify.instruments.check_context import CheckContext, CheckSettings, Finding, Point
from dpcompare.verify.judgement.verdict import CheckName, Divergence

SCHEMA = REPO_ROOT / "dpcompare" / "schema" / "result.schema.json"


def test_every_check_follows_the_one_interface() -> None:
    assert len({c.__name__ for c in CHECKS}) == len(CHECKS) > 0
    for check in CHECKS:
        assert check.at in get_args(Point), check
        assert isinstance(check.reads_oracle, bool) and isinstance(check.after_stop, bool), check
        assert isinstance(check.name, str) and inspect.getmodule(check).__doc__.count("Owns:") == 1, check
        assert list(inspect.signature(check.judge).parameters) == ["self", "ctx", "step"], check
        assert list(inspect.signature(check).parameters) == ["ctx", "bench"], check
        assert isinstance(check.applies(_context()), bool), check
    # the reduce's checks come before the optimizer step's: the list's order is the order a step runs them in
    points = [c.at for c in CHECKS]
    assert points == sorted(points, key=["reduced", "updated"].index)


def test_a_failure_names_a_check_the_result_schema_declares() -> None:
    divergence = json.loads(SCHEMA.read_text())["properties"]["equivalence"]["properties"]["first_divergence"]
    (declared,) = [d for d in divergence["oneOf"] if d.get("type") == "object"]
    known, own = declared["properties"]["check"]["anyOf"]
    assert known["enum"] == list(get_args(CheckName))
    assert own["type"] == "string" and re.fullmatch(own["pattern"], "bounded_gradient")  # a check of one's own
    # every check of the list is a failure's name, but the power check, which only makes a weak verdict unverifiable
    assert {c.name for c in CHECKS} - set(get_args(CheckName)) == {"power"}


def test_the_context_is_frozen_and_the_grad_norm_check_needs_clipping() -> None:
    ctx = _context()
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.world_size = 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.settings.dtype = "float64"
    assert not GradNorm.applies(ctx)
    assert GradNorm.applies(dataclasses.replace(ctx, settings=CheckSettings(dtype="float32", clip_grad_norm=1.0)))
    assert ctx.u == 2.0**-24 and ctx.floor_min == ctx.depth * ctx.u and ctx.u_wire == ctx.u


def _context() -> CheckContext:
    return CheckContext(settings=CheckSettings(dtype="float32"), world_size=2, depth=3, names=("w",),
                        all_names=("w",), factory=lambda params, **kw: None)


class _Planted:
    """Sees every step at both points; fails the run at step 1, after the optimizer step."""

    name = "gradient"
    at = "updated"
    reads_oracle = False
    after_stop = False
    seen: list[tuple[int, str, bool, bool]] = []
    contexts: list[CheckContext] = []

    @classmethod
    def applies(cls, ctx: CheckContext) -> bool:
        return True

    def __init__(self, ctx, bench) -> None:
        type(self).contexts.append(ctx)

    def judge(self, ctx, step) -> Finding | None:
        type(self).seen.append((step.step, step.at, step.checked, step.oracle is not None))
        if step.step == 1:
            return Finding(Divergence(1, "(planted)", math.nan, 0.0, math.nan, "a planted check", check="gradient",
                                      cause="planted"))
        return None


class _PlantedAtReduce(_Planted):
    at = "reduced"
    reads_oracle = True
    seen: list[tuple[int, str, bool, bool]] = []
    contexts: list[CheckContext] = []

    def judge(self, ctx, step) -> Finding | None:
        type(self).seen.append((step.step, step.at, step.checked, step.oracle is not None))
        return None


def test_a_check_added_to_the_list_runs_at_its_point_and_its_failure_is_the_verdicts(tmp_path: Path,
                                                                                     monkeypatch) -> None:
    monkeypatch.setattr(checks, "CHECKS", [*CHECKS, _PlantedAtReduce, _Planted])  # the list the verifier reads
    for planted in (_Planted, _PlantedAtReduce):
        monkeypatch.setattr(planted, "seen", [])
        monkeypatch.setattr(planted, "contexts", [])
    saved = dict(os.environ)  # restored whole: a backend may set RANK, MASTER_PORT, ... for its world of one
    os.environ.clear()
    os.environ.update(without_launcher_vars(saved))
    try:
        status = cli.main(["--backend", "reference", "--model", "mlp", "--steps", "3", "--check-every", "2",
                           "--measure-steps", "0", "--out", str(tmp_path)])
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert status == 0
    result = json.loads(next(tmp_path.glob("*.json")).read_text())
    e = result["equivalence"]
    assert e["verdict"] == "different" and e["first_divergence"]["cause"] == "planted", e["first_divergence"]
    assert e["first_divergence"]["step"] == 1
    # every step at its point, the oracle's side only where the step was checked (--check-every 2: steps 0 and 2)
    assert _Planted.seen == [(0, "updated", True, True), (1, "updated", False, False), (2, "updated", True, True)]
    assert _PlantedAtReduce.seen == [(0, "reduced", True, True), (2, "reduced", True, True)]
    (ctx,) = _Planted.contexts
    assert ctx.world_size == result["world_size"] and ctx.settings.dtype == result["config"]["dtype"]
    assert ctx.names and ctx.names == tuple(p["parameter"] for p in e["per_step"][0]["params"])
