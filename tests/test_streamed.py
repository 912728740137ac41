"""A float64 gradient compared as backward produces it (dpcompare.verify.memory.streamed_distance): the distance is the one the whole
gradient gives, to the bit, while no two parameters' gradients are ever held at once; where a parameter's gradient
is completed twice in one backward (a reentrant recomputation), the gradient is computed whole instead."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from dpcompare.run import workloads
from dpcompare.verify.oracle import gradient_oracle as eq
from dpcompare.verify.judgement.held_values import Compact
from dpcompare.verify.memory.streamed_distance import accumulate_streamed, distance_of
from dpcompare.verify.judgement.tolerance import rel_fro_of


class Tied(nn.Module):
    """An embedding whose weight is the head's too (summed by autograd before it is completed), and a parameter the
    loss never reaches (its gradient stays None)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.mid = nn.Linear(6, 6)
        self.unused = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return F.linear(torch.tanh(self.mid(self.embed(x))).mean(1), self.embed.weight)


class Recomputed(nn.Module):
    """Blocks recomputed in backward: non-reentrant (each gradient completed once), or reentrant with the first
    block's weight used outside the recomputed part too (completed twice in one backward)."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.inp = nn.Linear(5, 5)
        self.blocks = nn.ModuleList(nn.Linear(5, 5) for _ in range(3))
        self.head = nn.Linear(5, 2)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = checkpoint(lambda t, b=block: torch.tanh(b(t)), x, use_reentrant=self.reentrant)
        if self.reentrant:
            x = x + F.linear(x, self.blocks[0].weight)
        return self.head(x)


def _case(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn, pieces_of) -> tuple:
    torch.manual_seed(3)
    oracle = eq.Oracle(model, loss_fn, "float32", torch.device("cpu"))
    state = model.state_dict()
    pieces = pieces_of((x, y))
    whole = oracle.oracle_of(state, pieces)
    # a gradient to compare with: the float64 one, moved in every parameter by a different amount
    against = Compact({n: whole[n] * (1 + 1e-3 * (i + 1)) + 1e-4 for i, n in enumerate(oracle.names)}, copy=False)
    return oracle, state, pieces, whole, against


def _cases():
    mlp = workloads.mlp(1234)
    x, y = mlp.make_batch(0, 12)
    yield "mlp", (mlp.model, x, y, mlp.loss_fn, eq.global_pieces)
    yield "mlp, two ranks' pieces", (mlp.model, x, y, mlp.loss_fn, lambda b: eq.replica_pieces(b, eq.Layout(2), None))
    torch.manual_seed(0)
    tokens = torch.randint(0, 11, (8, 4))
    yield "tied and unused", (Tied(), tokens, torch.randint(0, 11, (8,)), F.cross_entropy, eq.global_pieces)
    torch.manual_seed(0)
    yield "non-reentrant recomputation", (Recomputed(False), torch.randn(8, 5), torch.randint(0, 2, (8,)),
                                          F.cross_entropy, eq.global_pieces)


CASES = dict(_cases())


@pytest.mark.parametrize("name", list(CASES))
def test_the_distance_is_the_whole_gradients_to_the_bit_and_one_gradient_is_held_at_a_time(name):
    oracle, state, pieces, whole, against = _case(*CASES[name])
    expected = rel_fro_of(against, whole, oracle.names)
    none = oracle.none
    params = dict(oracle.model64.named_parameters())
    held_beside: list[str] = []
    handed: list[str] = []
    model = oracle.model64
    model.load_state_dict(state)

    def sink(n, g):
        handed.append(n)
        held_beside.extend(m for m, p in params.items() if p.grad is not None and m != n)
        assert torch.equal(g, whole[n])  # each gradient as the whole computation reads it

    left_none = accumulate_streamed(model, oracle.loss_fn, pieces, oracle.device, sink, oracle.replay64)
    assert left_none == none and sorted(handed) == sorted(set(oracle.names) - none)
    if len(pieces) == 1:  # while one is handed on, no other parameter's gradient is held
        assert held_beside == []
    else:  # the earlier pieces' sum is held as autograd accumulates it; only the last piece's backward hands on
        assert held_beside
    assert all(p.grad is None for p in params.values())
    got = distance_of(oracle, state, pieces, against)
    assert got == expected and got > 1e-4, (got, expected)  # 0 would hide a comparison that never ran
    assert oracle.none == none


def test_a_gradient_completed_twice_in_one_backward_is_computed_whole():
    torch.manual_seed(0)
    oracle, state, pieces, whole, against = _case(Recomputed(True), torch.randn(8, 5), torch.randint(0, 2, (8,)),
                                                  F.cross_entropy, eq.global_pieces)
    oracle.model64.load_state_dict(state)
    handed = []
    assert accumulate_streamed(oracle.model64, oracle.loss_fn, pieces, oracle.device,
                               lambda n, g: handed.append(n), oracle.replay64) is None
    assert "blocks.0.weight" in handed  # handed once before its second completion: partial, so not used
    assert distance_of(oracle, state, pieces, against) == rel_fro_of(against, whole, oracle.names)


def test_a_difference_in_one_parameter_moves_the_distance():
    oracle, state, pieces, whole, _ = _case(*CASES["mlp"])
    same = Compact({n: whole[n].clone() for n in oracle.names}, copy=False)
    assert distance_of(oracle, state, pieces, same) == 0.0
    name = oracle.names[-1]
    moved = Compact({n: whole[n] * (1.01 if n == name else 1.0) for n in oracle.names}, copy=False)
    got = distance_of(oracle, state, pieces, moved)
    assert got == rel_fro_of(moved, whole, oracle.names) and got > 0.0


class EarlierPieceOnly(nn.Module):
    """A parameter only the first piece's forward reaches (`b`): its gradient is whole before the last backward."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 2), nn.Linear(3, 2)

    def forward(self, x):
        return self.b(x) if x[0, 0] > 0 else self.a(x)


def test_a_gradient_only_an_earlier_piece_gave_is_handed_on_as_computed():
    torch.manual_seed(0)
    model = EarlierPieceOnly().double()
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.randint(0, 2, (4,))
    x[:2, 0], x[2:, 0] = 1.0, -1.0
    pieces = [eq.Piece(x[:2], y[:2], 0.5, None, 0, 0), eq.Piece(x[2:], y[2:], 0.5, None, 1, 1)]
    got: dict[str, torch.Tensor] = {}
    none = accumulate_streamed(model, F.cross_entropy, pieces, torch.device("cpu"), got.__setitem__)
    raw, raw_none, _, _ = eq.accumulate_raw(model, F.cross_entropy, pieces, torch.device("cpu"))
    assert none == raw_none == frozenset() and sorted(got) == ["a.bias", "a.weight", "b.bias", "b.weight"]
    assert all(torch.equal(got[n], raw[n]) for n in got) and got["b.weight"].abs().sum() > 0
