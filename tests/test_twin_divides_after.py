"""Where the division by the world size is done (dpcompare.verify.instruments.run_reference): the run-precision reference multiplies
each rank's loss by its share 1/N in the graph; a backend that averages (DDP, Horovod's Average, DeepSpeed) takes the
loss's gradient unscaled and divides the reduced sum afterwards. With N a power of two the two are the same bits; at
three ranks they round 1/N differently, and BatchNorm's backward over a rank's few samples (its input's gradient is
what is left of the output's less its projections) carries that rounding well above the unit roundoff. The floor's
regrouped twin then divides after, so the floor holds both legitimate places of the division: the arithmetic of a
real three-rank DDP reduction (each rank's unscaled gradient divided by 3, summed) is within the twin's distance,
and far outside the distance of a twin that only reverses the order (the floor before, which made a BatchNorm model
at three ranks falsely `different`). End to end: tests/test_hf_families.py (a ResNet at three ranks, and a fault that
is still caught there).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from dpcompare.verify.oracle import gradient_oracle as eq
from dpcompare.verify.judgement import precision_recipe
from dpcompare.verify.instruments.run_reference import RunReference
from dpcompare.verify.model_facts.batch_split import SplitCheck
from dpcompare.verify.judgement.tolerance import rel_fro_of

CPU = torch.device("cpu")


def _block(inp: int, out: int) -> list[nn.Module]:
    return [nn.Conv2d(inp, out, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(out), nn.ReLU()]


def _setup(ranks: int, per_rank: int = 8) -> tuple[eq.Oracle, dict, list[eq.Piece]]:
    torch.manual_seed(0)
    model = nn.Sequential(*_block(3, 8), *_block(8, 16), *_block(16, 16), *_block(16, 32), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(32, 5))
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(ranks * per_rank, 3, 8, 8, generator=g), torch.randint(0, 5, (ranks * per_rank,), generator=g))
    oracle = eq.Oracle(model, F.cross_entropy, "float32", CPU)
    return oracle, {k: v.clone() for k, v in model.state_dict().items()}, eq.replica_pieces(batch, eq.Layout(ranks))


def _reference(oracle, ranks: int) -> RunReference:
    layout, verdict = eq.Layout(ranks), eq.Verdict()
    split = SplitCheck(oracle, type("F", (), {"layout": layout})(), depth=3, applies=False, verdict=verdict)
    return RunReference(oracle, layout, dtype="float32", world_size=ranks, wire="none", has_batchnorm=True,
                        sync_bn=False, verdict=verdict, split=split)


def _averaged_as_ddp(oracle: eq.Oracle, state: dict, pieces: list[eq.Piece]) -> dict[str, torch.Tensor]:
    """What DDP's reduction computes: each rank's gradient of its unscaled local loss, divided by the world size in
    float32 (its bucket's division before the all-reduce), summed in the ranks' order."""
    model = eq.verification_copy(oracle.template, CPU, torch.float32)
    model.load_state_dict(state)
    model.train()
    total: dict[str, torch.Tensor] = {}
    for piece in pieces:
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(piece.x), piece.y).backward()
        for n, p in model.named_parameters():
            share = p.grad / len(pieces)
            total[n] = share if n not in total else total[n] + share
    return {n: t.double() for n, t in total.items()}


def test_at_three_ranks_the_twin_divides_after_and_its_floor_holds_ddps_arithmetic():
    oracle, state, pieces = _setup(3)
    reference = _reference(oracle, 3)
    floor, spread, wire = reference.measure(state, None, pieces, None, 1.0, step=0)
    assert wire is None
    names = oracle.names
    twin = rel_fro_of(spread, floor, names)
    reversed_only = rel_fro_of(oracle.floor_of(state, list(reversed(pieces))), floor, names)
    ddp = rel_fro_of(_averaged_as_ddp(oracle, state, pieces), floor, names)
    # the premise: DDP's arithmetic is farther from the reference than the order alone moves it (measured 6x)
    assert ddp > 3 * reversed_only, (ddp, reversed_only)
    # the twin that divides after stands where DDP does (measured 1.0x)
    assert ddp < 2 * twin and twin < 2 * ddp, (ddp, twin)
    # parameter by parameter too: the first convolution's, whose gradient crosses every BatchNorm
    first = names[0]
    assert rel_fro_of(_averaged_as_ddp(oracle, state, pieces), floor, [first]) < 2 * rel_fro_of(spread, floor, [first])
    assert [n.code for n in reference.verdict.notes] == ["divided_after"]
    assert "1/3" in reference.verdict.notes[0].text
    reference.measure(state, None, pieces, None, 1.0, step=1)
    assert len(reference.verdict.notes) == 1, "said once"
    assert not reference.recomputed, "not the reference's own arithmetic: never taken for it"


@pytest.mark.parametrize("ranks", [2, 4])
def test_with_a_power_of_two_the_twin_only_reverses_the_order(ranks):
    oracle, state, pieces = _setup(ranks, per_rank=4)
    reference = _reference(oracle, ranks)
    floor, spread, _ = reference.measure(state, None, pieces, None, 1.0, step=0)
    assert not reference.verdict.notes
    # 1/N in the graph or after: the same bits, so DDP's arithmetic is within the order's own distance
    reversed_twin = oracle.floor_of(state, list(reversed(pieces)))
    assert all(torch.equal(spread[n], reversed_twin[n]) for n in oracle.names)
    ddp = _averaged_as_ddp(oracle, state, pieces)
    assert rel_fro_of(ddp, floor, oracle.names) <= 2 * max(rel_fro_of(spread, floor, oracle.names), 1e-7)


def test_the_twin_keeps_the_run_s_loss_scale_where_the_shares_differ_or_a_recipe_divides_after_already():
    oracle, _, pieces = _setup(3, per_rank=2)
    reference = _reference(oracle, 3)
    assert reference._twin_scale(pieces, 1.0) == pytest.approx(3.0)
    assert reference._twin_scale(pieces, 1024.0) == 1024.0  # a scaled loss: a recipe's, which divides after
    uneven = [eq.Piece(p.x, p.y, w, rank=p.rank) for p, w in zip(pieces, (0.5, 0.25, 0.25))]
    assert reference._twin_scale(uneven, 1.0) == 1.0
    autocast = precision_recipe.Recipe("autocast", "bf16")
    bf16 = _reference(eq.Oracle(oracle.template, F.cross_entropy, "float32", CPU, autocast), 3)
    assert bf16._twin_scale(pieces, 1.0) == 1.0
    assert [n.code for n in reference.verdict.notes] == ["divided_after"] and not bf16.verdict.notes
