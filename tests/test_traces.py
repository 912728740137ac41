"""--profile: one torch.profiler trace per rank of a few steps after the measured window, the step's phases marked,
readable as Chrome/Perfetto JSON (dpcompare.run.measurement.MeasurementPhase._profile, StepRunner.mark)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

PHASES = ("dpcompare.forward", "dpcompare.backward", "dpcompare.reduce", "dpcompare.optimizer_step")


def _names(trace: str) -> Counter:
    events = json.loads(Path(trace).read_text())["traceEvents"]
    return Counter(e.get("name") for e in events if e.get("ph") == "X")


@pytest.mark.multiproc
def test_each_rank_writes_a_trace_with_the_steps_phases_and_its_collectives(launch):
    finished, result = launch("ddp", 2, "mlp", ["--profile", "--measure-steps", "3", "--steps", "1"], "torchrun")
    assert result is not None, finished.output[-3000:]
    profile = result["metrics"]["profile"]
    assert profile["steps"] == 3 and list(profile["phases"]) == list(PHASES)
    assert [Path(t).name for t in profile["traces"]] == ["rank0.json", "rank1.json"]
    for trace in profile["traces"]:
        names = _names(trace)
        assert all(names[p] == 3 for p in PHASES), {p: names[p] for p in PHASES}  # one of each per traced step
        collectives = [n for n in names if n and ("all_reduce" in n or "allreduce" in n)]
        assert collectives, sorted(n for n in names if n)[:40]
    # the measured window's figures are the profiler's no more than a run without it: the traced steps come after it
    assert result["metrics"]["measured_steps"] == 3


def test_without_profile_no_trace_is_written_and_the_result_says_why(shared_launch):
    finished, result = shared_launch("reference", 1, "mlp", ["--steps", "1", "--measure-steps", "5"], "python")
    assert result is not None, finished.output[-3000:]
    assert result["metrics"]["profile"] is None and "--profile" in result["metrics"]["reasons"]["profile"]
