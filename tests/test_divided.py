"""The oracle's arithmetic divided over the ranks (dpcompare.verify.memory.divider): every rank runs its own forwards of the
float64 oracle, the run-precision references and the reference trajectory, and rank 0 adds the ranks' gradients in a
fixed order.

- What the backend is judged against does not move: with one forward per rank, the run-precision reference and its
  regrouped floor are rank 0's old sequential sums to the bit, so every judged figure is the same as `--oracle-ranks
  rank0`'s (the single-process oracle), and the float64 oracle's figures agree to float64's rounding; so do the
  update check's, replayed by each range's owner (a parameter cut between two ranges replayed on its pieces).
- Faults confined to the parameters of rank 1's range (the range the ranks' judging is divided by) are caught, with
  their cause: in the gradient (Rank1RangeGradientDDP), in the update (Rank1RangeDoubleStepDDP), and at a step no
  other check sees, by the reference trajectory whose range rank 1 holds (Rank1RangeUncheckedDoubleStepDDP).
- The ranges themselves (dpcompare.verify.ranks.range_plan) are tests/test_plan.py's.
"""

from __future__ import annotations

import math

import pytest

from test_negative import different, update_failed

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

STEPS = ["--steps", "3", "--optimizer", "adamw"]
MLP_RANK1 = ["2.weight", "2.bias", "4.weight", "4.bias"]
"""Rank 1's range of the mlp at two ranks (6922 elements: 0.weight and 0.bias are 2112 of them, 2.weight 4096, cut
after its first 1349 for the checks' ranges and held whole by rank 1 in the trajectory's)."""


@pytest.mark.slow  # breadth: the default tier keeps this capability's other test
def test_a_gradient_fault_in_rank_1s_range_alone_is_caught_on_divided_arithmetic(launch):
    proc, result = launch("tests.faulty_adapters:Rank1RangeGradientDDP", 2, "mlp", STEPS)
    d = different(proc, result)
    assert d["step"] == 0 and d["parameter"] in MLP_RANK1, d
    assert d["parameters"] == MLP_RANK1, d
    assert "1.05x the oracle" in d["reason"], d["reason"]
    assert result["equivalence"]["oracle_division"]["ranks"] == 2, result["equivalence"]["oracle_division"]
    assert result["equivalence"]["oracle_division"]["divided"] > 0


@pytest.mark.slow  # breadth: the default tier keeps this capability's other test
def test_a_change_in_rank_1s_range_at_an_unchecked_step_is_caught_by_the_trajectory_rank_1_holds(launch):
    """The reference trajectory is held and judged in ranges: rank 1 holds and judges the parameters its range holds,
    and a change there at a step no other check sees (--check-every 2: step 1) is found from its figures."""
    proc, result = launch("tests.faulty_adapters:Rank1RangeUncheckedDoubleStepDDP", 2, "mlp",
                          [*STEPS, "--check-every", "2"])
    d = different(proc, result, "trajectory")
    assert (d["step"], d["cause"]) == (1, "trajectory") and d["parameter"] in MLP_RANK1, d
    assert result["equivalence"]["checks"]["gradient"]["status"] == "pass", result["equivalence"]["checks"]


@pytest.mark.slow
def test_an_update_fault_in_rank_1s_range_alone_is_caught(launch):
    proc, result = launch("tests.faulty_adapters:Rank1RangeDoubleStepDDP", 2, "mlp", STEPS)
    d = update_failed(proc, result)
    assert (d["step"], d["cause"], d["parameters"]) == (0, "double_step", MLP_RANK1), d


@pytest.mark.slow
def test_divided_arithmetic_judges_as_the_single_process_oracle(launch):
    """The same run with --oracle-ranks all and rank0: every judged figure equal, the float64 oracle's within its
    rounding (the ranks' float64 shards added, where one forward of the global batch ran before), the update check's
    every flag equal and its figures within the replay's rounding (`_same_figures`)."""
    runs = {}
    for where in ("all", "rank0"):
        proc, result = launch("ddp", 2, "mlp", [*STEPS, "--oracle-ranks", where])
        assert proc.returncode == 0 and result["equivalence"]["verdict"] == "equivalent", proc.output[-3000:]
        runs[where] = result["equivalence"]
    assert runs["all"]["oracle_division"]["ranks"] == 2 and runs["rank0"]["oracle_division"] is None
    # every checked step's update replayed and reduced by each range's owner (dpcompare.verify.replay.replay_ranges)
    assert runs["all"]["oracle_division"]["updates"] == len(runs["all"]["per_step"]) > 0
    for a, b in zip(runs["all"]["per_step"], runs["rank0"]["per_step"]):
        for pa, pb in zip(a["params"], b["params"]):
            for key in ("judged_rel_fro_err", "judged_floor_rel_fro", "noise_ratio", "tolerance_rel_fro"):
                assert pa[key] == pb[key], (a["step"], pa["parameter"], key, pa[key], pb[key])
            assert math.isclose(pa["rel_fro_err"], pb["rel_fro_err"], rel_tol=1e-6), (pa, pb)
        _same_figures(a["update"], b["update"], [a["step"], "update"])


CUT = {"2.weight"}
"""The mlp's parameter cut over the two ranks' ranges (after its first 1349 elements)."""


def _same_figures(divided, single, where: list) -> None:
    """The owners' update figures against one process's: every flag, count and name equal; each float within 1e-8
    relative. A parameter cut between two ranges is replayed and its sums added on its pieces: measured, its figures
    (and through its sums the model's) came within 5e-13 of one process's over 4 steps of AdamW and of SGD, where a
    figure is a distance about 1e-7 of the update. Its largest relative error takes each piece's own max |o| as its
    scale (dpcompare.verify.ranks.range_cuts): never below one process's."""
    if isinstance(single, dict):
        assert divided.keys() == single.keys(), where
        for key in single:
            if key == "max_rel_err" and single.get("parameter") in CUT:
                assert single[key] <= divided[key] < math.inf, (*where, single["parameter"], key)
            else:
                _same_figures(divided[key], single[key], [*where, key])
    elif isinstance(single, list):
        assert len(divided) == len(single), where
        for x, y in zip(divided, single):
            _same_figures(x, y, [*where, y["parameter"]] if isinstance(y, dict) and "parameter" in y else where)
    elif isinstance(single, float) and not isinstance(divided, bool):
        assert math.isclose(divided, single, rel_tol=1e-8), (*where, divided, single)
    else:
        assert divided == single, (*where, divided, single)


@pytest.mark.slow
def test_at_three_ranks_the_first_split_is_measured_on_two_ranks_forwards(launch):
    """The first checked step's split at three ranks: ranks 0 and 1's forwards joined against their shards (16 of the
    24 samples on rank 0, where the global batch's forward was 24), found global; the later steps' joined pairs in
    turn from ranks 0 and 1 again."""
    proc, result = launch("ddp", 3, "mlp", ["--steps", "4", "--measure-steps", "0", "--optimizer", "adamw"])
    assert proc.returncode == 0 and result["equivalence"]["verdict"] == "equivalent", proc.output[-3000:]
    split = result["equivalence"]["split"]
    assert (split["semantics"], split["step"], split["ranks"]) == ("global", 0, [0, 1]), split
    assert split["distance_rel_fro"] < 1e-14 and split["rounding_rel_fro"] is None, split
    joined = result["equivalence"]["oracle_division"]["joined"]
    assert [j["ranks"] for j in joined] == [[0, 1], [1, 2], [0, 2]] and {j["samples"] for j in joined} == {16}, joined


@pytest.mark.slow
@pytest.mark.parametrize("model, ranks, step", [("split_later_mlp", 2, 3), ("split_later_in_tensors_mlp", 2, 3),
                                                ("split_later_in_tensors_mlp", 3, 1)])
def test_a_split_that_parts_from_the_global_batch_later_is_still_found(launch, model, ranks, step):
    """The ranks' shards stand for the global batch from the second step only while they compute its loss: a model
    whose samples interact through the batch's mean magnitude agrees at first and parts later, in Python (the probe
    sees the branch: the global batch's own forward stays) or in tensors alone (a joined forward's loss shows it: the
    global batch's at two ranks; at three, ranks 0 and 1's forwards joined, 16 of the 24 samples)."""
    proc, result = launch("ddp", ranks, f"tests.semantics_workloads:{model}", ["--steps", "4", "--measure-steps", "0"])
    assert proc.returncode == 0 and result["equivalence"]["verdict"] == "equivalent", proc.output[-3000:]
    split = result["equivalence"]["split"]
    assert (split["semantics"], split["step"]) == ("per_replica", step), split
    if model.endswith("in_tensors_mlp"):
        joined = result["equivalence"]["oracle_division"]["joined"]
        assert joined[-1] == {"ranks": [0, 1], "samples": 48 // ranks}, joined
