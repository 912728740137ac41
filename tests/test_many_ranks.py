"""Eight ranks and beyond under torchrun, with the oracle divided over the ranks (the default, `--oracle-ranks all`):
every run is `equivalent`, every check passes, and the checks' ranges (dpcompare.verify.ranks.range_plan) give every rank an even
share of the trainable elements, cutting inside a parameter where the ranks' shares cross it.

The built-in mlp has 6 parameter tensors: cut by whole parameter, from 6 ranks some rank held nothing and built an
optimizer over an empty list, and every torch.distributed run died. Here each rank holds at most ceil(T/N) of the T
elements, and no rank is left empty where the model has more elements than ranks.

Tiers: the default tier runs the README's headline launch as written (`torchrun --nproc_per_node=8 -m dpcompare
--backend ddp`, the mlp, its defaults). The slow tier runs ddp, fsdp and DeepSpeed ZeRO-0 and ZeRO-3 at 8 ranks on
mlp-wide and ddp, fsdp and ZeRO-3 on gpt-tiny (both cut inside parameters), and the two sharding backends (fsdp,
ZeRO-3) at 16 on the mlp. The deep tier adds the 8-rank mlp of every backend (the headline's model, which mlp-wide cuts
the same way), ZeRO-0 on gpt-tiny at 8 (its reduce is DDP's), ddp and ZeRO-0 at 16 on the mlp, and the 16-rank mlp-wide
and gpt-tiny (each 1-2 minutes of 16 gloo ranks on two cores): CI keeps within its hour.
"""

from __future__ import annotations

import pytest

from test_equivalence_matrix import assert_equivalent

pytestmark = [pytest.mark.multiproc]

BACKENDS = {"ddp": [], "fsdp": [], "zero0": ["--opt", "zero_stage=0"], "zero3": ["--opt", "zero_stage=3"]}
"""The backend of each cell and what selects its variant."""


def _assert_even_ranges(result: dict, world_size: int) -> None:
    division = result["equivalence"]["oracle_division"]
    assert division is not None and division["ranks"] == world_size, division
    assert division["divided"] > 0 and division["updates"] == len(result["equivalence"]["per_step"]), division
    # each rank's gradient sent to its owners as its backward completed it (memory.handed_gradients)
    assert division["handed"] == division["divided"], division
    for copy in ("checks", "trajectory"):
        ranges = division["ranges"][copy]
        assert ranges["empty_ranks"] == 0, (copy, ranges)
        assert ranges["most"] <= ranges["even_share"] == -(-ranges["elements"] // world_size), (copy, ranges)
    assert not any(n["code"] == "ranges_uneven" for n in result["equivalence"]["notes"])


@pytest.mark.timeout(300)
def test_the_headline_launch_at_eight_ranks_is_equivalent_with_the_oracle_divided(launch):
    """`torchrun --nproc_per_node=8 -m dpcompare --backend ddp`, as written: the mlp (6 tensors, 6922 elements) cut
    into 8 shares of at most 866 elements, two of its weights held in pieces."""
    proc, result = launch("ddp", 8, "mlp", [], "torchrun")
    assert_equivalent(proc, result, backend="ddp", world_size=8, model="mlp", launcher="torchrun", steps=4)
    _assert_even_ranges(result, 8)
    assert result["equivalence"]["oracle_division"]["ranges"]["checks"]["cut"] == ["0.weight", "2.weight"]


def _cells():
    for world_size in (8, 16):
        for model in ("mlp", "mlp-wide", "gpt-tiny"):
            for variant in BACKENDS:
                # the breadth tier: FSDP at eight ranks on mlp-wide (the default tier runs ddp's eight-rank headline;
                # the rest, 16 ranks included, is the deep tier)
                slow = world_size == 8 and model == "mlp-wide" and variant == "fsdp"
                marks = [pytest.mark.slow] if slow else [pytest.mark.deep]
                yield pytest.param(variant, world_size, model, marks=marks, id=f"{variant}-ws{world_size}-{model}")


@pytest.mark.timeout(540)
@pytest.mark.parametrize(("variant", "world_size", "model"), list(_cells()))
def test_every_sharded_backend_is_equivalent_at_eight_and_sixteen_ranks(launch, variant, world_size, model):
    """The defaults a user runs (4 checked steps, momentum SGD; AdamW on gpt-tiny, a transformer), the costs not
    measured (--measure-steps 0: this checks the verdict, and 16 ranks share two cores here)."""
    backend = "deepspeed" if variant.startswith("zero") else variant
    optimizer = ["--optimizer", "adamw"] if model == "gpt-tiny" else []
    proc, result = launch(backend, world_size, model, [*BACKENDS[variant], *optimizer, "--measure-steps", "0"],
                          "torchrun", timeout_s=500)
    assert_equivalent(proc, result, backend=backend, world_size=world_size, model=model, launcher="torchrun", steps=4)
    _assert_even_ranges(result, world_size)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_model_with_fewer_elements_than_ranks_leaves_ranks_empty_and_says_so(launch):
    """A 4-element linear regression at 8 ranks: 4 ranks hold one element each, 4 hold none and still take part in
    every collective; the run is `equivalent`, and its note says the shares could not be even, and why."""
    proc, result = launch("ddp", 8, "tests.robust_models:four_elements", [], "torchrun")
    assert_equivalent(proc, result, backend="ddp", world_size=8, model="four-elements", launcher="torchrun", steps=4)
    ranges = result["equivalence"]["oracle_division"]["ranges"]["checks"]
    assert (ranges["elements"], ranges["most"], ranges["empty_ranks"]) == (4, 1, 4), ranges
    notes = [n["text"] for n in result["equivalence"]["notes"] if n["code"] == "ranges_uneven"]
    assert len(notes) == 1 and "4 rank(s) holding none" in notes[0], result["equivalence"]["notes"]
