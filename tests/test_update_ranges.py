"""The update check divided over the ranks (dpcompare.verify.replay.replay_ranges) on three real processes (gloo over a file
rendezvous), without a backend:

- each owner's figures of its range are the single-process comparison's to the bit (AdamW with weight decay, from a
  state one step old; and under --clip-grad-norm, whose coefficient is the norm of every range's norms), a parameter
  cut over two ranks within float64's rounding of its pieces' sums (its maximum error exactly), and the state the step
  leaves, held by the owners, reads back as the single-process replay's (a cut parameter's put together, to the bit);
- an update wrong in rank 1's range alone (the step taken twice there) is found there, by the owner that judges it;
- a rank that cannot replay its range is named by rank 0 in one exception, and the ranks serve the next request.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dpcompare.contract.optim_state import read_state
from dpcompare.verify.memory import divider
from dpcompare.verify.ranks import verifier_group
from dpcompare.verify.replay import replay_ranges
from dpcompare.verify.oracle.gradient_oracle import Layout, verification_copy
from dpcompare.verify.judgement.held_values import Compact, Difference
from dpcompare.verify.judgement.tolerance import UNIT_ROUNDOFF, judge_figures, range_figures
from dpcompare.verify.ranks.range_plan import of_model
from dpcompare.verify.replay.optimizer_replay import reference_step
from tests.spawned import spawned

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(180)]
CPU = torch.device("cpu")
U = UNIT_ROUNDOFF["float32"]


def _factory(params, **overrides):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, **overrides)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def _backend(template: nn.Module, double_in: set[str]):
    """A backend's step: AdamW stepped once (its state one step old), then a second step with a gradient; `double_in`:
    the parameters whose second step is taken twice. Returns (params before, gradient, state before, values after)."""
    model = verification_copy(template, CPU, torch.float32)
    opt = _factory(model.parameters())
    g = torch.Generator().manual_seed(2)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()
    grads = {n: torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = read_state(opt, model)
    for n, p in model.named_parameters():
        p.grad = grads[n].clone()
    opt.step()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in double_in:
                p.add_(p - before[n])
    return before, grads, state, {n: p.detach().clone() for n, p in model.named_parameters()}


def _alone(before, grads, state, after, names, clip):
    """The single-process comparison's figures and the state its float64 replay leaves."""
    params = Compact(before)
    ref = reference_step(_factory, params, Compact(grads), state, torch.float64, CPU, clip=clip, state_like=state)
    floor = reference_step(_factory, params, Compact(grads), state, torch.float32, CPU, clip=clip, keep_state=False)
    figures = range_figures("sums", (Difference(after, params), ref.delta, ref.delta, floor.delta, floor.delta), names,
                            U)
    return figures, ref.state


def _same(figures: dict, alone: dict, plan) -> bool:
    """The divided figures are the single-process ones: to the bit where one rank holds the parameter; where it is cut,
    its pieces' squared norms added within float64's rounding, its largest error the same, its largest relative error
    no smaller (each piece's scale is its own max |o|: never above the whole's)."""
    if figures.keys() != alone.keys():
        return False
    for n, (sums, numel) in figures.items():
        whole, count = alone[n]
        if not plan.is_cut(n):
            if (sums, numel) != (whole, count):
                return False
            continue
        close = all(math.isclose(getattr(sums, f), getattr(whole, f), rel_tol=1e-12, abs_tol=1e-300)
                    for f in ("o2", "a2", "go2", "ga2", "fo2", "oa2", "g2"))
        if not (close and numel == count and sums.max_abs == whole.max_abs and sums.finite == whole.finite
                and sums.max_rel >= whole.max_rel):
            return False
    return True


def _worker(rank: int, world: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    peers = verifier_group.Peers.make()
    template = _model()
    batch = (torch.zeros(3, 6), torch.zeros(3, dtype=torch.long))
    if rank:
        helper = divider.Helper(peers, template, nn.functional.cross_entropy, layout=Layout(world), dtype=torch.float32,
                                device=CPU, recipe=divider.NO_RECIPE, factory=_factory)
        for _ in range(3):  # the same step: unclipped, clipped, one wrong in rank 1's range
            helper.serve(batch, lambda: None)
        if rank == 1:
            helper.factory = None  # cannot replay its range
        helper.serve(batch, lambda: None)
        helper.factory = _factory
        helper.serve(batch, lambda: None)  # served again afterwards
        dist.destroy_process_group()
        return
    oracle_divider = divider.Divider(peers, Layout(world))
    oracle_divider.own(verification_copy(template, CPU, torch.float64))
    names = [n for n, _ in template.named_parameters()]
    plan = oracle_divider.owner
    assert plan == of_model(template, world)  # the test below knows it from the planner alone
    results: dict = {}

    def judged(double_in: set[str], clip: float | None):
        before, grads, state, after = _backend(template, double_in)
        oracle_divider.open()
        try:
            held, held_state = oracle_divider.hold(grads), oracle_divider.hold_state(state, names)
            figures, left = replay_ranges.divided(oracle_divider, _factory, CPU, names, Compact(before), after, held,
                                                  held_state, torch.float32, U, clip, None)
            left = {n: {k: v.clone() if torch.is_tensor(v) else v for k, v in left[n].items()} for n in names}
        finally:
            oracle_divider.done()
        return figures, left, _alone(before, grads, state, after, names, clip)

    for clip, key in ((None, "plain"), (0.5, "clipped")):
        figures, left, (alone, alone_state) = judged(set(), clip)
        results[key] = _same(figures, alone, plan)
        results[key + "_state"] = all(torch.equal(left[n][k], v) if torch.is_tensor(v) else left[n][k] == v
                                      for n in names for k, v in alone_state[n].items())
    wrong = plan.names(1)
    figures, _, (alone, _) = judged(set(wrong), None)
    params, _ = judge_figures(figures, names, dtype="float32", world_size=1, depth=3)
    results["wrong"] = (sorted(wrong), sorted(p.parameter for p in params if not p.ok), _same(figures, alone, plan))
    try:
        judged(set(), None)
        results["failure"] = None
    except RuntimeError as exc:
        results["failure"] = str(exc)
    figures, _, (alone, _) = judged(set(), None)
    results["again"] = _same(figures, alone, plan)
    torch.save(results, out)
    dist.destroy_process_group()


def test_each_owner_judges_its_range_of_the_update_as_one_process_would():
    results, _ = spawned(_worker, 3)
    plan = of_model(_model(), 3)
    assert all(plan.names(r) for r in range(3)), plan  # every rank judges a range
    assert any(plan.is_cut(n) for n in plan.sizes), plan  # and a parameter cut over two of them is judged whole
    assert results["plain"] and results["clipped"], "each range's figures are one process's, to the bit"
    assert results["plain_state"] and results["clipped_state"], "the state left reads back as one process's"
    wrong, failing, same = results["wrong"]
    assert wrong and failing == wrong and same, results["wrong"]  # found in rank 1's range, and only there
    assert results["failure"] is not None and "rank 1" in results["failure"], results["failure"]
    assert results["again"]
