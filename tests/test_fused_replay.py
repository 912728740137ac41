"""The update check's float64 replay steps in torch's fused kernel; its floor, the run-dtype replay, in the loop one
process runs (dpcompare.verify.replay.optimizer_replay.in_one_kernel).

The float64 replay is the reference: the fused kernel computes the same update in float64, within one unit in the
last place of the parameter it reaches (SGD's was the loop's to the bit where this ran), here over the optimizers'
options from a state three steps old. The floor models what a correct single process computes in the run dtype, so it stays the user's loop to the
bit: a twin that steps it in the fused kernel too is caught by that comparison.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from dpcompare.contract.optim_state import per_element, read_state
from dpcompare.verify.judgement.held_values import Compact
from dpcompare.verify.replay import optimizer_replay
from dpcompare.verify.replay.optimizer_replay import in_one_kernel, reference_step

CPU = torch.device("cpu")
N = 20_000
EPS64 = torch.finfo(torch.float64).eps

SGD = [{"lr": 0.05, "momentum": m, "dampening": d, "nesterov": nv, "weight_decay": wd, "maximize": mx}
       for m, d, nv, wd, mx in itertools.product((0.0, 0.9), (0.0, 0.1), (False, True), (0.0, 0.01), (False, True))
       if not (nv and (m == 0 or d != 0))]
ADAM = [(cls, {"lr": 1e-3, "amsgrad": a, "maximize": mx, "weight_decay": wd})
        for cls in (torch.optim.Adam, torch.optim.AdamW)
        for a, mx, wd in itertools.product((False, True), (False, True), (0.0, 0.1))]
EVERY = [(torch.optim.SGD, kw) for kw in SGD] + ADAM


def _factory(cls, kw):
    def make(params, **overrides):
        return cls(params, **{**kw, **overrides})
    return make


def _three_steps_in(make, seed: int):
    """A float32 parameter and its optimizer's state after three steps of `make`'s optimizer, and a fourth gradient."""
    gen = torch.Generator().manual_seed(seed)
    p = nn.Parameter(torch.randn(N, generator=gen))
    opt = make([p])
    for _ in range(3):
        p.grad = torch.randn(N, generator=gen)
        opt.step()
    return {"w": p.detach().clone()}, {"w": torch.randn(N, generator=gen)}, read_state(opt, {"w": p})


def _loop_step(make, before, grads, state, dtype):
    """The user's optimizer (its single-tensor loop) stepping `before` in `dtype`: the value it reaches."""
    p = nn.Parameter(before["w"].to(dtype).clone())
    opt = make([p])
    opt.state[p] = {k: (v.to(dtype).clone() if per_element(k, v) else v.clone()) for k, v in state.get("w", {}).items()}
    p.grad = grads["w"].to(dtype).clone()
    opt.step()
    return p.detach()


class _Ops(TorchDispatchMode):
    """The aten ops called under it."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _replayed(make, before, grads, state, dtype):
    """The update `reference_step` replays in `dtype` (as the check reads it, in float64), and the fused kernels it
    called."""
    with _Ops() as ops:
        delta = reference_step(make, Compact(before), Compact(grads), state, dtype, CPU).delta["w"].reshape(-1).clone()
    return delta, {n for n in ops.names if n.startswith("_fused_")}


@pytest.mark.parametrize("cls,kw", EVERY, ids=lambda v: v.__name__ if isinstance(v, type) else
                         ",".join(f"{k}={x}" for k, x in v.items() if k != "lr"))
def test_the_float64_replay_is_the_fused_kernel_within_one_unit_in_the_last_place(cls, kw):
    make = _factory(cls, kw)
    before, grads, state = _three_steps_in(make, seed=len(repr(kw)))
    delta, kernels = _replayed(make, before, grads, state, torch.float64)
    assert kernels == {"_fused_sgd_" if cls is torch.optim.SGD else "_fused_adamw_" if cls is torch.optim.AdamW
                       else "_fused_adam_"}
    start = before["w"].double()
    loop = _loop_step(make, before, grads, state, torch.float64)
    # the value reached within one unit in its last place (and the subtraction's rounding); SGD's was the loop's to
    # the bit on the CPUs this ran on, which the record states, not this test (another vector unit may fuse apart)
    gap = (delta - (loop - start)).abs()
    assert bool((gap <= 2 * EPS64 * torch.maximum(loop.abs(), start.abs())).all())


@pytest.mark.parametrize("cls,kw", [(torch.optim.SGD, SGD[-1]), ADAM[1], ADAM[8]], ids=["sgd", "adam", "adamw"])
def test_the_floor_is_the_user_s_loop_to_the_bit_and_a_fused_floor_is_caught(cls, kw, monkeypatch):
    make = _factory(cls, kw)
    before, grads, state = _three_steps_in(make, seed=7)
    want = _loop_step(make, before, grads, state, torch.float32).double() - before["w"].double()
    delta, kernels = _replayed(make, before, grads, state, torch.float32)
    assert not kernels
    assert torch.equal(delta, want)
    # the twin: the run-dtype replay stepped in the fused kernel too
    real = optimizer_replay.in_one_kernel
    monkeypatch.setattr(optimizer_replay, "in_one_kernel", lambda opt, dtype, device: real(opt, torch.float64, device))
    twin, kernels = _replayed(make, before, grads, state, torch.float32)
    assert kernels
    if cls is not torch.optim.SGD:  # here Adam's and AdamW's fused float32 steps round one element apart from the loop's
        assert not torch.equal(twin, want)


def test_only_a_float64_replay_of_the_three_classes_themselves_goes_to_the_kernel():
    p = [nn.Parameter(torch.zeros(3, dtype=torch.float64))]

    class Mine(torch.optim.AdamW):
        pass

    assert in_one_kernel(torch.optim.AdamW(p), torch.float64, CPU)
    assert not in_one_kernel(torch.optim.AdamW(p), torch.float32, CPU)
    assert not in_one_kernel(Mine(p), torch.float64, CPU)
    assert not in_one_kernel(torch.optim.RMSprop(p), torch.float64, CPU)
    assert not in_one_kernel(torch.optim.SGD(p, lr=0.1, differentiable=True), torch.float64, CPU)
    assert not in_one_kernel(torch.optim.SGD(p, lr=0.1), torch.float64, torch.device("meta"))


class _Kernels(TorchDispatchMode):
    """The fused kernels called under it, with the dtype of the parameters each stepped."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name.startswith("_fused_"):
            self.calls.append((name, args[0][0].dtype))
        return func(*args, **(kwargs or {}))


def _trajectory_run(fused: bool, monkeypatch):
    """Three scheduled AdamW steps of the reference trajectory over a small MLP (its float64 copy in the fused kernel,
    or, `fused` False, the twin whose float64 copy steps in the loop): the kernels called at each step, each step's
    figures, and the float64 copy's parameters after."""
    from torch.nn import functional as F

    from dpcompare.verify.oracle.gradient_oracle import Piece
    from dpcompare.verify.replay.optimizer_rebuild import OptimizerReference
    from dpcompare.verify.trajectory.reference_trajectory import Trajectory

    if not fused:
        monkeypatch.setattr(Trajectory, "_in_one_kernel", lambda self: None)
    torch.manual_seed(1)
    template = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 3))
    factory = OptimizerReference(lambda m: torch.optim.AdamW(m.parameters(), lr=0.05, weight_decay=0.01),
                                 lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5), template)
    t = Trajectory(template, F.cross_entropy, factory, "float32", CPU, depth=2)
    torch.manual_seed(2)
    kernels, figures = [], []
    for step in range(3):
        with _Kernels() as seen:
            t.step([Piece(torch.randn(8, 6), torch.randint(0, 3, (8,)), 1.0)], at=step)
        kernels.append(seen.calls)
        run = {n: p.detach().clone() for n, p in t.model_run.named_parameters()}  # a run that is its own copy
        figures.append(t.judge(step, run, 1))
    with t.whole():
        params = [p.detach().clone() for p in t.model64.parameters()]
    return kernels, figures, params


def test_the_reference_trajectorys_float64_copy_steps_in_the_fused_kernel_scheduled(monkeypatch):
    """At every step, the schedule's too (it sets each group's every entry): the float64 copy's AdamW in the fused
    kernel, the run-precision copy's in the loop. Its values are the loop's within a few units in float64's last
    place, and the figures within 1e-9 of the floor; the twin stepping the float64 copy in the loop calls no kernel."""
    kernels, figures, params = _trajectory_run(True, monkeypatch)
    assert all(calls and {c for c in calls} == {("_fused_adamw_", torch.float64)} for calls in kernels), kernels
    loop_kernels, loop_figures, loop_params = _trajectory_run(False, monkeypatch)
    assert not any(loop_kernels)
    for a, b in zip(params, loop_params):
        assert bool(((a - b).abs() <= 64 * EPS64 * b.abs().clamp_min(1e-3)).all())
    for a, b in zip(figures, loop_figures):
        assert a["ok"] and b["ok"]
        for key in ("rel_param_distance", "floor_rel_param_distance"):
            assert a[key] == pytest.approx(b[key], rel=0, abs=1e-9 * b["floor_rel_param_distance"]), key
