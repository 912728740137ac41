"""The range planner (dpcompare.verify.ranks.range_plan) as a pure function, at every world size from 1 to 1024, on real models'
shapes: a Llama-3-8B-sized config built on the meta device, the built-in models, and transformers families.

- Every element of every trainable parameter is held by exactly one rank; a rank holds at most one piece of a
  parameter; no rank holds more than an even share (ceil(T/N)), so the checks' state a rank holds falls as 1/N;
  ranks left with nothing are allowed (more ranks than elements).
- An embedding or head larger than 1/N of the model is cut across its holders, never held by one.
- A parameter the optimizer steps whole is never cut, and the plan says what that costs (a rank over its share by at
  most that parameter).
- `problems` finds each planted fault: an element held twice, an element held by no rank, a rank over its share, a
  piece outside the world, a parameter that may not be cut and was.
- The pieces put back together (`take` then `join`) are the value, to the bit.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpcompare.run.registry import MODELS, load
from dpcompare.verify.ranks.range_plan import Piece, Plan, of_model, plan, problems

WORLD_SIZES = list(range(1, 1025))


def bytes_per_param(p: Plan, rank: int, per_element: float) -> float:
    """What `rank` holds at `per_element` bytes an element, per parameter of the whole model."""
    return per_element * p.elements(rank) / sum(p.sizes.values())


def _sizes(model: nn.Module) -> list[tuple[str, int]]:
    return [(n, p.numel()) for n, p in model.named_parameters() if p.requires_grad]


@pytest.fixture(scope="module")
def llama_8b() -> list[tuple[str, int]]:
    """Llama-3-8B's shapes (4096 wide, 32 layers, 14336 in the MLP, 8 KV heads, a 128256-token vocabulary), built on
    the meta device: no memory is allocated."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                      tie_word_embeddings=False)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    sizes = _sizes(model)
    assert 7.9e9 < sum(n for _, n in sizes) < 8.1e9, sum(n for _, n in sizes)
    return sizes


def _builtin(name: str) -> list[tuple[str, int]]:
    return _sizes(load(name, MODELS, "model")(0).model)


def _family(name: str) -> list[tuple[str, int]]:
    transformers = pytest.importorskip("transformers")
    from tests.hf_families import family_config

    config = family_config(name)
    with torch.device("meta"):
        model = getattr(transformers, config.architectures[0])(config)
    return _sizes(model)


def _holds_everything_once(p: Plan, sizes: list[tuple[str, int]]) -> None:
    """The invariants, read from the pieces directly (not through `problems`, which the twins below test)."""
    assert list(p.sizes) == [n for n, _ in sizes]
    counts = [0] * p.world_size
    for name, n in sizes:
        pieces = p.holders(name)
        assert [q.start for q in pieces] == [0] + [q.stop for q in pieces[:-1]], (name, pieces)  # no gap, no overlap
        assert pieces[-1].stop == n, (name, pieces)
        assert len({q.rank for q in pieces}) == len(pieces), (name, pieces)  # one piece a rank
        assert [q.rank for q in pieces] == sorted(q.rank for q in pieces)
        for q in pieces:
            counts[q.rank] += q.numel
    share = -(-sum(n for _, n in sizes) // p.world_size)
    assert max(counts) <= share, (p.world_size, max(counts), share)
    assert sum(counts) == sum(n for _, n in sizes)


@pytest.mark.parametrize("source, name", [*(("builtin", m) for m in ("mlp", "mlp-wide", "cnn", "lm", "gpt-tiny",
                                                                     "resnet18")),
                                          *(("transformers", f) for f in ("llama", "mixtral", "bert", "vit", "resnet"))])
def test_every_element_of_a_real_model_is_held_once_at_every_world_size(source, name):
    """The built-in models and transformers families (their tiny configs' shapes, on the meta device)."""
    sizes = _builtin(name) if source == "builtin" else _family(name)
    for world in WORLD_SIZES:
        p = plan(sizes, world)
        _holds_everything_once(p, sizes)
        assert problems(p) == [], (world, problems(p))


def test_a_llama_3_8b_sized_model_is_cut_evenly_up_to_1024_ranks(llama_8b):
    total = sum(n for _, n in llama_8b)
    embed = dict(llama_8b)["model.embed_tokens.weight"]
    for world in WORLD_SIZES:
        p = plan(llama_8b, world)
        _holds_everything_once(p, llama_8b)
        assert problems(p) == []
        # the checks' state a rank holds: within 64/N B/param at 64 B an element held, to the element
        assert max(bytes_per_param(p, r, 64) for r in range(world)) <= 64 / world + 64 / total, world
        if embed > total / world:  # an embedding above a share is cut across its holders
            assert len(p.holders("model.embed_tokens.weight")) >= embed * world // total, world
    assert len(plan(llama_8b, 1024).holders("lm_head.weight")) >= 16


def test_more_ranks_than_elements_leaves_ranks_holding_nothing():
    p = plan([("scale", 1), ("bias", 3)], 8)  # a 0-dim logit scale and a small bias
    _holds_everything_once(p, [("scale", 1), ("bias", 3)])
    assert problems(p) == []
    assert sorted(r for r in range(8) if p.elements(r)) == [1, 3, 5, 7]
    assert p.names(0) == [] and "4 rank(s) holding none" in p.describe()


def test_a_parameter_stepped_whole_is_never_cut_and_its_cost_is_bounded():
    sizes = [("embed", 10_000), ("w", 500), ("head", 10_000)]
    for world in (2, 3, 7, 64):
        p = plan(sizes, world, whole=["embed"])
        assert not p.is_cut("embed") and p.is_cut("head") == (world > 2), (world, p.holders("head"))
        assert problems(p, whole=["embed"]) == [], (world, problems(p, whole=["embed"]))
        assert max(p.elements(r) for r in range(world)) <= p.share() + 10_000
    every = [n for n, _ in sizes]
    assert all(not plan(sizes, 64, whole=every).is_cut(n) for n in every)


def test_pieces_put_back_together_are_the_value_to_the_bit():
    sizes = [("a", 12), ("b", 35), ("c", 6)]
    values = {"a": torch.randn(3, 4), "b": torch.randn(5, 7), "c": torch.randn(6)}
    for world in (1, 2, 5, 53, 100):
        p = plan(sizes, world)
        for name, value in values.items():
            parts = [p.take(name, q.rank, value) for q in p.holders(name)]
            assert [tuple(t.shape) for t in parts] == [p.shape(name, q.rank, value.shape) for q in p.holders(name)]
            assert torch.equal(p.join(name, parts, value.shape), value), (world, name)


def test_of_model_reads_only_shapes_on_the_meta_device():
    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(50_000, 64), nn.Linear(64, 64))
    p = of_model(model, 16)
    assert p.is_cut("0.weight") and len(p.holders("0.weight")) >= 15


# -- the planted twins: each fault `problems` exists to find ------------------------------------------------------------
SIZES = {"a": 10, "b": 6}


def _twin(pieces: dict[str, list[tuple[int, int, int]]], world: int = 2) -> Plan:
    return Plan(world, dict(SIZES), {n: tuple(Piece(n, r, a, b) for r, a, b in ps) for n, ps in pieces.items()})


def test_the_twins_are_told_apart_from_the_good_plan():
    good = plan(list(SIZES.items()), 2)
    assert problems(good) == []
    assert problems(_twin({"a": [(0, 0, 8)], "b": [(1, 0, 6)]}))  # the check can fail on a plan this close to good


def test_an_element_held_twice_is_found():
    found = problems(_twin({"a": [(0, 0, 8), (1, 6, 10)], "b": [(1, 0, 6)]}))
    assert any("[6, 8) held twice" in f for f in found), found


def test_an_element_held_by_no_rank_is_found():
    found = problems(_twin({"a": [(0, 0, 4), (1, 5, 10)], "b": [(1, 0, 6)]}))
    assert any("a: elements [4, 5) held by no rank" in f for f in found), found
    found = problems(_twin({"a": [(0, 0, 10)], "b": [(1, 0, 5)]}))
    assert any("b: elements [5, 6) held by no rank" in f for f in found), found
    found = problems(_twin({"a": [(0, 0, 10)]}))
    assert any("b: held by no rank" in f for f in found), found


def test_an_unbalanced_share_is_found():
    found = problems(_twin({"a": [(0, 0, 10)], "b": [(0, 0, 6)]}))  # rank 0 holds all 16: its share is 8
    assert any("rank 0 holds 16 elements, more than its share 8" in f for f in found), found
    # the same plan is allowed where the parameters may not be cut: then a rank may exceed by the largest of them
    assert not any("share" in f for f in problems(_twin({"a": [(0, 0, 10)], "b": [(1, 0, 6)]}), whole=["a", "b"]))


def test_a_piece_outside_the_world_two_pieces_on_a_rank_and_a_forbidden_cut_are_found():
    assert any("outside the 2 ranks" in f for f in problems(_twin({"a": [(0, 0, 5), (2, 5, 10)], "b": [(1, 0, 6)]})))
    assert any("a rank holds two pieces" in f
               for f in problems(_twin({"a": [(0, 0, 5), (0, 5, 10)], "b": [(1, 0, 6)]})))
    assert any("cut, though it may not be" in f
               for f in problems(_twin({"a": [(0, 0, 5), (1, 5, 10)], "b": [(1, 0, 6)]}), whole=["a"]))
