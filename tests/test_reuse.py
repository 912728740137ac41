"""What the checks compute once and take again where a second computation would repeat the first
(`Verdict.oracle_reuse`), and where they must not:

- the reference trajectory's first step takes the oracle's float64 gradient and the run-precision reference's: its
  copies reach, to the bit, what computing their own gradients reaches (momentum SGD, AdamW with clipping), and it
  refuses where the weights, the forwards or the buffers are not the ones those gradients were computed from;
- a regrouped twin of the reference that is its own arithmetic (one rank's forwards in the same order; two ranks'
  forwards, one each, in the other order: one addition, which commutes) is recomputed until it came out bitwise the
  reference, then the reference is taken; a twin that differs (a nondeterministic kernel) is recomputed at every step,
  and one that regroups more than one addition (three ranks, micro-batches) is never taken for the reference;
- the buffer check's float64 forward is not run again where it wrote no buffer and no rank's buffers moved, and is
  run again where a rank's did (so a moved constant buffer is still caught).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from dpcompare.verify.model_facts import buffer_semantics as bf
from dpcompare.verify.oracle import gradient_oracle as eq
from dpcompare.verify.judgement.held_values import Compact
from dpcompare.verify.instruments.run_reference import RunReference
from dpcompare.verify.model_facts.batch_split import SplitCheck
from dpcompare.verify.trajectory.reference_trajectory import Trajectory

CPU = torch.device("cpu")


class _Scaled(nn.Module):
    """A model with a constant buffer (as rotary frequencies are): its forward reads it and never writes it."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(5, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 3))
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x * self.scale)


def _model(batchnorm: bool = False) -> nn.Module:
    torch.manual_seed(0)
    if batchnorm:
        return nn.Sequential(nn.Linear(5, 12), nn.BatchNorm1d(12), nn.Tanh(), nn.Linear(12, 3))
    return _Scaled()


def _pieces(step: int) -> list[eq.Piece]:
    g = torch.Generator().manual_seed(step)
    return eq.global_pieces((torch.randn(8, 5, generator=g), torch.randint(0, 3, (8,), generator=g)))


def _optimizer(name: str):
    if name == "sgd":
        return lambda params, **_: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)
    return lambda params, **_: torch.optim.AdamW(params, lr=0.01, weight_decay=0.01)


def _setup(name: str, clip: float | None = None, batchnorm: bool = False):
    template, loss = _model(batchnorm), F.cross_entropy
    oracle = eq.Oracle(template, loss, "float32", CPU)
    make = lambda: Trajectory(template, loss, _optimizer(name), "float32", CPU, depth=3, clip=clip)  # noqa: E731
    return template, oracle, make


def _take(trajectory: Trajectory, oracle: eq.Oracle, state: dict, pieces: list[eq.Piece]) -> bool:
    return trajectory.take(pieces, oracle.oracle_of(state, pieces), oracle.floor_of(state, pieces),
                           (oracle.model64, oracle.model_run), private=False)


@pytest.mark.parametrize("name,clip", [("sgd", None), ("adamw", 0.05)])
def test_the_trajectorys_first_step_from_the_oracles_gradients_is_its_own_to_the_bit(name, clip):
    template, oracle, make = _setup(name, clip)
    taken, computed = make(), make()
    state = {k: v.clone() for k, v in template.state_dict().items()}
    assert _take(taken, oracle, state, _pieces(0))
    computed.step(_pieces(0))
    for step in (1, 2):  # and the steps after it, each computing its own
        for t in (taken, computed):
            t.step(_pieces(step))
    with taken.whole(), computed.whole():
        for a, b in ((taken.model64, computed.model64), (taken.model_run, computed.model_run)):
            for (n, p), q in zip(a.named_parameters(), b.parameters()):
                assert p.numel() and torch.equal(p, q), n
    params = {n: p.detach().float() for n, p in computed.model_run.named_parameters()}
    assert taken.judge(2, params, 1) == computed.judge(2, params, 1)


def test_the_trajectory_refuses_gradients_of_other_weights_forwards_or_buffers():
    template, oracle, make = _setup("sgd")
    state = {k: v.clone() for k, v in template.state_dict().items()}
    moved = {k: (v + 1e-6 if k == "net.0.weight" else v) for k, v in state.items()}
    assert not _take(make(), oracle, moved, _pieces(0)), "the oracle's weights are not the trajectory's"
    trajectory = make()
    with trajectory.whole():
        before = [p.detach().clone() for p in trajectory.model64.parameters()]
    assert not trajectory.take(_pieces(1), oracle.oracle_of(state, _pieces(0)), oracle.floor_of(state, _pieces(0)),
                               (oracle.model64, oracle.model_run), private=False), "other forwards"
    plain = {n: t for n, t in oracle.oracle_of(state, _pieces(0)).items()}  # no record of what computed them
    assert not trajectory.take(_pieces(0), plain, oracle.floor_of(state, _pieces(0)),
                               (oracle.model64, oracle.model_run), private=False)
    with trajectory.whole():
        assert all(torch.equal(p, q) for p, q in zip(trajectory.model64.parameters(), before)), "refused: none stepped"
        assert all(p.grad is None for p in trajectory.model64.parameters())
    template, oracle, make = _setup("sgd", batchnorm=True)  # the forward writes its running statistics
    state = {k: v.clone() for k, v in template.state_dict().items()}
    assert not _take(make(), oracle, state, _pieces(0))


def _run_state(trajectory: Trajectory) -> dict:
    """The state the run holds where it trains as the trajectory's run-precision copy does (one process)."""
    return {k: v.detach().clone() for k, v in trajectory.model_run.state_dict().items()}


@pytest.mark.parametrize("name,clip", [("sgd", None), ("adamw", 0.05)])
def test_the_run_precision_copy_from_the_references_gradient_is_its_own_to_the_bit(name, clip):
    """At every step after the first: where the run's weights are the run-precision copy's, bitwise, the copy takes
    the reference's gradient and reaches what computing its own reaches, the float64 copy computing its own."""
    template, oracle, make = _setup(name, clip)
    taken, computed = make(), make()
    for step in range(4):
        state = _run_state(taken)
        pieces = _pieces(step)
        assert taken.take_run(pieces, oracle.floor_of(state, pieces), oracle.model_run), step
        taken.step(pieces)
        computed.step(pieces)
    with taken.whole(), computed.whole():
        for a, b in ((taken.model64, computed.model64), (taken.model_run, computed.model_run)):
            for (n, p), q in zip(a.named_parameters(), b.parameters()):
                assert p.numel() and torch.equal(p, q), n
    params = {n: p.detach().float() for n, p in computed.model_run.named_parameters()}
    assert taken.judge(3, params, 1) == computed.judge(3, params, 1)


def test_the_run_precision_copy_refuses_a_gradient_of_other_weights_forwards_or_buffers():
    template, oracle, make = _setup("sgd")
    trajectory = make()
    state = _run_state(trajectory)
    moved = {k: (v + 1e-6 if k == "net.0.weight" else v) for k, v in state.items()}
    assert not trajectory.take_run(_pieces(0), oracle.floor_of(moved, _pieces(0)), oracle.model_run), "other weights"
    assert not trajectory.take_run(_pieces(1), oracle.floor_of(state, _pieces(0)), oracle.model_run), "other forwards"
    plain = dict(oracle.floor_of(state, _pieces(0)).items())  # no record of what computed it
    assert not trajectory.take_run(_pieces(0), plain, oracle.model_run)
    assert not trajectory.take_run(_pieces(0), oracle.oracle_of(state, _pieces(0)), oracle.model_run), "float64's"
    # taken for one step's forwards, then stepped on another's: the copy computes its own
    assert trajectory.take_run(_pieces(0), oracle.floor_of(state, _pieces(0)), oracle.model_run)
    own = make()
    trajectory.step(_pieces(1))
    own.step(_pieces(1))
    assert all(torch.equal(p, q) for p, q in zip(trajectory.model_run.parameters(), own.model_run.parameters()))
    template, oracle, make = _setup("sgd", batchnorm=True)  # the forward writes its running statistics
    trajectory = make()
    state = _run_state(trajectory)
    assert not trajectory.take_run(_pieces(0), oracle.floor_of(state, _pieces(0)), oracle.model_run)


def test_a_gradient_taken_but_not_the_copys_own_would_be_seen(monkeypatch):
    """The premise's twin: a copy handed a gradient of other forwards (the check of the forwards disabled) steps
    elsewhere than computing its own, so the comparison above can fail."""
    template, oracle, make = _setup("sgd")
    taken, computed = make(), make()
    state = _run_state(taken)
    assert taken.take_run(_pieces(0), oracle.floor_of(state, _pieces(5)), oracle.model_run) is False  # source differs
    monkeypatch.setattr("dpcompare.verify.trajectory.reference_trajectory.computed_by", lambda g, slot, p: True)
    assert taken.take_run(_pieces(0), oracle.floor_of(state, _pieces(5)), oracle.model_run)
    taken.step(_pieces(0))
    computed.step(_pieces(0))
    assert not all(torch.equal(p, q) for p, q in zip(taken.model_run.parameters(), computed.model_run.parameters()))


class _Reference:
    """The oracle as RunReference uses it: each floor_of is one run-precision gradient; `jitter` makes every second
    computation differ in its last bit (a nondeterministic kernel)."""

    names = ["w"]

    def __init__(self, jitter: bool) -> None:
        self.jitter, self.calls = jitter, 0

    def floor_of(self, state, pieces, loss_scale=1.0, compiled=False):
        self.calls += 1
        w = torch.ones(4)
        if self.jitter and self.calls % 2 == 0:
            w = torch.nextafter(w, torch.full_like(w, 2.0))
        return Compact({"w": w})


def _reference(jitter: bool) -> tuple[RunReference, _Reference]:
    fake = _Reference(jitter)
    layout = eq.Layout(1)
    verdict = eq.Verdict()
    split = SplitCheck(fake, type("F", (), {"layout": layout})(), depth=3, applies=False, verdict=verdict)
    return RunReference(fake, layout, dtype="float32", world_size=1, wire="none", has_batchnorm=False,
                        sync_bn=False, verdict=verdict, split=split), fake


def test_one_ranks_regrouped_twin_is_taken_from_the_reference_once_it_came_out_identical():
    reference, fake = _reference(jitter=False)
    for step in range(4):
        floor, spread, _ = reference.measure({}, None, _pieces(0), None, 1.0, step)
    assert reference.recomputed == {"recomputed": [0], "identical": True, "reused": [1, 2, 3]}
    assert fake.calls == 2 + 3 and spread is floor


def _ranks_pieces(ranks: int, micro: int = 1) -> list[eq.Piece]:
    g = torch.Generator().manual_seed(7)
    batch = (torch.randn(8 * ranks * micro, 5, generator=g), torch.randint(0, 3, (8 * ranks * micro,), generator=g))
    return eq.replica_pieces(batch, eq.Layout(ranks, grad_accum=micro))


def test_two_ranks_twin_in_the_other_order_is_the_same_sum_to_the_bit_and_is_taken_once_identical():
    pieces = _ranks_pieces(2)
    assert eq.same_sum(list(reversed(pieces)), pieces)
    # the premise, on a real copy: the two ranks' gradients added in the other order are the same bits
    _, oracle, _ = _setup("sgd")
    state = {k: v.clone() for k, v in oracle.template.state_dict().items()}
    a, b = oracle.floor_of(state, pieces), oracle.floor_of(state, list(reversed(pieces)))
    assert all(torch.equal(a.held(n), b.held(n)) for n in oracle.names)
    fake = _Reference(jitter=False)
    layout = eq.Layout(2)
    split = SplitCheck(fake, type("F", (), {"layout": layout})(), depth=3, applies=False, verdict=eq.Verdict())
    reference = RunReference(fake, layout, dtype="float32", world_size=2, wire="none", has_batchnorm=False,
                             sync_bn=False, verdict=eq.Verdict(), split=split)
    for step in range(3):
        floor, spread, _ = reference.measure({}, None, pieces, None, 1.0, step)
    assert reference.recomputed == {"recomputed": [0], "identical": True, "reused": [1, 2]} and spread is floor


@pytest.mark.parametrize("ranks,micro", [(3, 1), (2, 2), (1, 2)])
def test_a_twin_that_regroups_more_than_one_addition_is_not_the_same_sum(ranks, micro):
    pieces = _ranks_pieces(ranks, micro)
    assert not eq.same_sum(list(reversed(pieces)), pieces)
    # three ranks' gradients added in the other order: another rounding, which the floor is there to measure
    if ranks == 3:
        _, oracle, _ = _setup("sgd")
        state = {k: v.clone() for k, v in oracle.template.state_dict().items()}
        a, b = oracle.floor_of(state, pieces), oracle.floor_of(state, list(reversed(pieces)))
        assert not all(torch.equal(a.held(n), b.held(n)) for n in oracle.names)


def test_a_twin_that_differs_from_the_reference_is_recomputed_at_every_step():
    reference, fake = _reference(jitter=True)
    for step in range(3):
        floor, spread, _ = reference.measure({}, None, _pieces(0), None, 1.0, step)
        assert not torch.equal(floor.held("w"), spread.held("w"))
    assert reference.recomputed == {"recomputed": [0, 1, 2], "identical": False, "reused": []}
    assert fake.calls == 6


def _buffer_step(check: bf.BufferCheck, model: nn.Module, step: int, moved: bool = False):
    start = bf.snapshot(model)
    after = {k: v + 0.5 for k, v in start.items()} if moved else dict(start)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    return check.check(step, state, (_pieces(step)[0].x, _pieces(step)[0].y), eq.Layout(1),
                       [{"before": start, "after": after}], None)


def test_the_buffer_forward_is_not_run_again_where_it_wrote_none_and_no_buffer_moved(monkeypatch):
    model = _model()
    check = bf.BufferCheck(eq.Oracle(model, F.cross_entropy, "float32", CPU), 3, "float32")
    runs = []
    real = check._f64
    monkeypatch.setattr(check, "_f64", lambda *a, **k: runs.append(1) or real(*a, **k))
    for step in range(3):
        assert _buffer_step(check, model, step) is None
    assert check.unwritten == [0, 1, 2] and len(runs) == 1


def test_a_constant_buffer_a_rank_moved_after_the_forward_was_skipped_is_still_caught():
    model = _model()
    check = bf.BufferCheck(eq.Oracle(model, F.cross_entropy, "float32", CPU), 3, "float32")
    assert _buffer_step(check, model, 0) is None and check.unwritten == [0]
    failure = _buffer_step(check, model, 1, moved=True)
    assert failure is not None and failure.check == "buffers" and failure.parameter == "scale", failure
    assert check.unwritten == [0]


def test_a_model_whose_forward_writes_buffers_runs_the_forward_at_every_step():
    model = copy.deepcopy(_model(batchnorm=True))
    check = bf.BufferCheck(eq.Oracle(model, F.cross_entropy, "float32", CPU), 3, "float32")
    _buffer_step(check, model, 0)  # its buffers did not move: the forward that writes them says it
    assert check.unwritten == []
