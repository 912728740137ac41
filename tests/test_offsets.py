"""The float64 trajectory held between its steps as offsets from the run-precision one (dpcompare.verify.trajectory.trajectory_offsets), and
the probe's float64 copy let go before the checks begin."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from dpcompare.verify.oracle import gradient_oracle as eq
from dpcompare.verify.trajectory import trajectory_offsets as off
from dpcompare.verify.model_facts import model_probe as probe_module
from dpcompare.verify.trajectory.reference_trajectory import Trajectory

CPU = torch.device("cpu")
U32 = 2.0 ** -24


def _pair(n: int = 5000, spread: float = 1e-6) -> tuple[nn.Parameter, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    exact = torch.randn(n, dtype=torch.float64)
    base = (exact * (1 + spread * torch.randn(n, dtype=torch.float64))).float()
    return nn.Parameter(exact.clone()), base, exact


def test_held_values_come_back_within_the_bound_and_the_far_ones_exactly():
    param, base, exact = _pair()
    exact[:7] = torch.tensor([0.0, 1e-300, float("inf"), float("nan"), 1 / 3, -1 / 7, 2.0 ** -1000], dtype=torch.float64)
    base[4], base[5] = 4.0, 3.0  # offsets of about 11 and 22 times the values, not exact in float32
    param.data.copy_(exact)
    held = off.Offsets(U32)
    held.hold([((param, None), base)])
    assert len(held) == 1 and param.numel() == 0, "the float64 values are let go while held"
    assert held.kept >= 6 and held.nbytes < exact.nbytes * 0.6
    read = torch.cat([held.read((param, None), slice(s, s + 1000)) for s in range(0, 5000, 1000)])
    held.restore()
    assert param.shape == exact.shape and len(held) == 0
    for got in (param.detach(), read):
        assert torch.equal(got[:7].isnan(), exact[:7].isnan())
        assert torch.equal(got[:3], exact[:3]) and torch.equal(got[4:7], exact[4:7]), "kept in float64: exact"
        rel = ((got[7:] - exact[7:]).abs() / exact[7:].abs()).max()
        assert 0 < rel <= off.MARGIN * U32, rel


def test_a_tensor_mostly_far_from_its_base_stays_whole():
    param, base, exact = _pair(spread=1e-2)  # a bfloat16-like distance, for a float32 run's bound
    held = off.Offsets(U32)
    held.hold([((param, None), base)])
    assert len(held) == 0 and torch.equal(param.detach(), exact) and held.whole == exact.numel()


def test_a_tensor_left_whole_is_tested_again_after_twice_as_many_holds_each_time():
    """Left whole by the test at holds 1, 3 and 7, and left whole untested at the holds between: its values stay
    its own, exactly. Once it comes near its twin, the next test holds it."""
    param, base, exact = _pair(spread=1e-2)
    held = off.Offsets(U32)
    tested: list[int] = []
    real = held._offset
    held._offset = lambda *args: tested.append(held.holds) or real(*args)
    untested = []
    for _ in range(8):
        held.hold([((param, None), base)])
        assert len(held) == 0 and torch.equal(param.detach(), exact) and held.whole == exact.numel()
        untested.append(held.untested)
    assert tested == [1, 3, 7]
    assert untested == [0, 5000, 0, 5000, 5000, 5000, 0, 5000]
    near = exact.float()
    while held.holds < 14:
        held.hold([((param, None), near)])
        assert len(held) == 0 and held.untested == exact.numel(), "not tested before hold 15"
    held.hold([((param, None), near)])
    assert tested == [1, 3, 7, 15] and len(held) == 1 and held.untested == 0 and held.whole == 0
    held.restore()
    assert ((param.detach() - exact).abs() <= off.MARGIN * U32 * exact.abs()).all()
    held.hold([((param, None), near)])
    assert tested == [1, 3, 7, 15, 16], "a tensor held is tested at every hold"


def test_without_the_check_a_far_base_gives_back_wrong_values():
    """The element-by-element check is what keeps the bound: a base a million away is refused with it (the values
    stay whole, exact) and, with it off, gives values back wrong by far more than the bound."""
    param, _, exact = _pair()
    far = (exact + 1e6).float()
    checked = off.Offsets(U32)
    checked.hold([((param, None), far)])
    assert len(checked) == 0 and torch.equal(param.detach(), exact)
    unchecked = off.Offsets(U32, sparse=1.0)
    unchecked.bound = float("inf")
    unchecked.hold([((param, None), far)])
    unchecked.restore()
    assert ((param.detach() - exact).abs() / exact.abs()).max() > 1e6 * off.MARGIN * U32


def _hard_pairs(base_dtype: torch.dtype, near_t: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Values over float64's range (zeros, subnormals, infinities, NaNs among them), each beside bases at relative
    distances around `near_t` (the cheap test's edge) and far from it, rounded to `base_dtype`."""
    g = torch.Generator().manual_seed(3)
    mags = torch.cat([torch.logspace(-320, 300, 400, dtype=torch.float64),
                      torch.tensor([0.0, float("inf"), float("nan"), 2.0 ** -100, 2.0 ** -101, 2.0 ** -126])])
    values = torch.cat([mags, -mags])
    rel = torch.cat([near_t * (1 + torch.linspace(-1e-3, 1e-3, 21, dtype=torch.float64)),
                     torch.tensor([0.0, 2.0 ** -24, 2.0 ** -12, 0.5, 1.0, 2.0, 1e6], dtype=torch.float64),
                     near_t * torch.rand(12, generator=g, dtype=torch.float64) * 2])
    x = values.repeat_interleave(rel.numel())
    r = rel.repeat(values.numel()) * torch.where(torch.rand(x.numel(), generator=g) < 0.5, -1.0, 1.0).double()
    same = values.to(base_dtype)  # and values equal to their bases (zeros, infinities, subnormals of the base's dtype)
    return torch.cat([x, same.double()]), torch.cat([(x * (1 + r)).to(base_dtype), same])


@pytest.mark.parametrize("u, base_dtype", [(U32, torch.float32), (2.0 ** -8, torch.bfloat16),
                                           (2.0 ** -11, torch.float16), (2.0 ** -53, torch.float32)],
                         ids=["float32", "bfloat16", "float16", "float64-run"])
@pytest.mark.parametrize("chunk", [16, 1 << 16])
def test_the_cheap_test_keeps_exactly_the_elements_the_exact_test_keeps(u, base_dtype, chunk, monkeypatch):
    """Holding passes most chunks without giving their elements back (`_near`: every offset small against its
    value) and tests the others exactly; the elements it keeps in float64 are exactly those the exact test keeps,
    over float64's whole range and at the cheap test's edge, for each run dtype's bound. In chunks of 16 many pass
    by the cheap test alone."""
    monkeypatch.setattr(off, "CHUNK", chunk)
    bound = off.MARGIN * u
    near = off._near(bound)
    x, base = _hard_pairs(base_dtype, 1 / near.inverse if near is not None else 2.0 ** -30)
    held = off.Offsets(u, sparse=1.0)._offset((nn.Parameter(x.clone()), None), x.clone(), base)
    exact = torch.nonzero(~off._comes_back(x, base, torch.sub(x, base).float(), bound)).view(-1)
    assert held is not None and torch.equal(held.index, exact), (held.index.numel(), exact.numel())
    assert exact.numel() > 100, "the pairs reach both sides of the bound"


def test_zeros_beside_zeros_are_held_and_an_infinity_beside_itself_is_kept():
    """A moment whose gradient's element is zero is zero in both copies: held, none kept. An infinity equal to its
    base has a NaN offset: kept in float64, exactly."""
    zeros = torch.zeros(3000, dtype=torch.float64)
    held = off.Offsets(U32)._offset((nn.Parameter(zeros.clone()), None), zeros.clone(), zeros.float())
    assert held is not None and held.index.numel() == 0
    x = zeros.clone()
    x[7] = float("inf")
    held = off.Offsets(U32)._offset((nn.Parameter(x.clone()), None), x.clone(), x.float())
    assert held is not None and held.index.tolist() == [7] and held.values.tolist() == [float("inf")]


def test_a_cheap_test_looser_than_its_proof_keeps_too_few(monkeypatch):
    """The comparison above fails where the cheap test passes chunks whose elements the exact one keeps: its T 2^12
    times too large for a float32 run's bound, on offsets of about 2^-4 of their values (which come back about 2^-28
    off, where 2^-32 is allowed)."""
    bound = off.MARGIN * U32
    loose = off._near(bound)
    monkeypatch.setattr(off, "_near", lambda b: off._Near(inverse=loose.inverse / 2 ** 12, tiny=loose.tiny))
    g = torch.Generator().manual_seed(5)
    x = torch.randn(5000, generator=g, dtype=torch.float64)
    base = (x * (1 + 2.0 ** -4 * (1 + torch.rand(5000, generator=g, dtype=torch.float64)))).float()
    held = off.Offsets(U32, sparse=1.0)._offset((nn.Parameter(x.clone()), None), x.clone(), base)
    exact = torch.nonzero(~off._comes_back(x, base, torch.sub(x, base).float(), bound)).view(-1)
    assert exact.numel() > 4000 and held.index.numel() < exact.numel()


def test_a_base_that_moved_while_held_is_refused():
    param, base, _ = _pair()
    held = off.Offsets(U32)
    held.hold([((param, None), base)])
    base.add_(1.0)
    with pytest.raises(RuntimeError, match="base changed"):
        held.restore()


def _trajectory(hold: bool) -> Trajectory:
    torch.manual_seed(1)
    template = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
    t = Trajectory(template, F.cross_entropy, lambda params, **_: torch.optim.AdamW(params, lr=0.05), "float32", CPU,
                   depth=3)
    if not hold:
        t.offsets.hold = lambda entries: None
    return t


def test_the_held_trajectory_judges_as_the_whole_one():
    """AdamW, four steps: each step's figures as a trajectory that holds nothing gives them, to 1e-6 of the floor (a
    held value's error is 2^-24 of its offset, itself about the floor), and its optimizer state held and given back."""
    held, whole = _trajectory(True), _trajectory(False)
    torch.manual_seed(2)
    batches = [[eq.Piece(torch.randn(8, 6), torch.randint(0, 3, (8,)), 1.0)] for _ in range(4)]
    run = {n: p.detach().float().clone() for n, p in whole.model_run.named_parameters()}
    for step, pieces in enumerate(batches):
        for t in (held, whole):
            t.step(pieces)
        assert len(held.offsets) == 0, "whole until the step is judged"
        a, b = held.judge(step, run, 1), whole.judge(step, run, 1)
        assert len(held.offsets) > 0 and held.offsets.elements > 0, "held once judged"
        assert a["floor_rel_param_distance"] > 0
        for key in ("rel_param_distance", "floor_rel_param_distance"):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-6 * b["floor_rel_param_distance"]), key
    states = [held.opt64.state[p] for p in held.model64.parameters()]
    with held.whole():
        assert all(s["exp_avg"].dtype == torch.float64 and s["exp_avg"].numel() for s in states)
        for (n, p), q in zip(held.model64.named_parameters(), whole.model64.parameters()):
            assert p.numel() and ((p - q).abs() <= 8 * off.MARGIN * U32 * q.abs()).all(), n


def test_the_probes_float64_copy_is_let_go_before_the_checks(monkeypatch):
    """The probe's copy sits in a reference cycle: without the collection the probe runs, it outlives the probe."""
    made: list[weakref.ref] = []
    real = probe_module.verification_copy

    def copy(*args, **kwargs):
        model = real(*args, **kwargs)
        made.append(weakref.ref(model))
        return model

    monkeypatch.setattr(probe_module, "verification_copy", copy)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.0), nn.Linear(8, 2))
    batch = (torch.randn(4, 4), torch.randint(0, 2, (4,)))
    gc.disable()
    try:
        probe_module.probe(model, F.cross_entropy, batch, CPU)
        assert made and all(r() is None for r in made)
        monkeypatch.setattr(probe_module.gc, "collect", lambda: 0)
        made.clear()
        probe_module.probe(model, F.cross_entropy, batch, CPU)
        assert any(r() is not None for r in made), "the copy is freed without a collection: no cycle to break"
    finally:
        gc.enable()


class _NormScaledSGD(torch.optim.SGD):
    """Couples the parameters: every step is scaled by the global gradient norm of those stepped together."""

    @torch.no_grad()
    def step(self, closure=None):
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        for g in grads:
            g.div_(norm)
        return super().step(closure)


def _stepped(make, parts: bool, part: int = 40, steps: int = 3) -> list[torch.Tensor]:
    torch.manual_seed(3)
    params = [nn.Parameter(torch.randn(n, dtype=torch.float64)) for n in (30, 7, 50, 12)]
    optimizer = make(params)
    for step in range(steps):
        for p in params:
            p.grad = torch.randn_like(p) * (step + 1)
        if parts:
            off.step_in_parts(optimizer, params, off.Offsets(U32), part=part)
        else:
            optimizer.step()
        assert all(p.grad is None for p in params) if parts and type(optimizer) in off.ELEMENTWISE else True
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
    lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.01),
    lambda ps: torch.optim.Adam(ps, lr=0.01, amsgrad=True),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01, fused=True),
    lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.01, fused=True)],
    ids=["sgd", "adamw", "adam-amsgrad", "sgd-fused", "adamw-fused"])
def test_stepping_a_part_at_a_time_is_one_step_to_the_bit(make):
    whole, parts = _stepped(make, False), _stepped(make, True)
    assert all(torch.equal(a, b) for a, b in zip(whole, parts))


def test_an_optimizer_that_couples_the_parameters_steps_once():
    """Not one of ELEMENTWISE (a subclass too): stepped whole, the one step's values. Stepped a part at a time (taken
    for elementwise), its values differ: the list is what keeps the parts exact."""
    make = lambda ps: _NormScaledSGD(ps, lr=0.1)  # noqa: E731
    assert all(torch.equal(a, b) for a, b in zip(_stepped(make, False), _stepped(make, True)))
    real = off.ELEMENTWISE
    try:
        off.ELEMENTWISE = (*real, _NormScaledSGD)
        parts = _stepped(make, True)
    finally:
        off.ELEMENTWISE = real
    assert not all(torch.equal(a, b) for a, b in zip(_stepped(make, False), parts))


def test_the_held_trajectory_stepped_in_parts_judges_as_the_whole_one(monkeypatch):
    monkeypatch.setattr(off, "PART", 64)
    monkeypatch.setattr(off.step_in_parts, "__defaults__", (64,))
    test_the_held_trajectory_judges_as_the_whole_one()


def test_a_slot_no_longer_held_is_let_go():
    """An optimizer's load replaces its state dicts: a state dict left whole is followed until a hold no longer names
    it, then let go with the tensors it holds."""
    param, base, exact = _pair(spread=1e-2)
    state = {"exp_avg": exact.clone()}
    held = off.Offsets(U32)
    held.hold([((state, "exp_avg"), base)])
    assert held.whole == exact.numel() and len(held._left) == 1
    fresh = {"exp_avg": exact.clone()}
    held.hold([((fresh, "exp_avg"), base)])
    assert [v[0] for v in held._left.values()] == [fresh], "the replaced state dict is no longer kept"
