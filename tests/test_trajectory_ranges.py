"""The reference trajectory held in ranges over the ranks (dpcompare.verify.trajectory.trajectory_ranges) on three real processes (gloo over a
file rendezvous), without a backend:

- the trajectory starts from rank 0's initial weights whatever each rank built, and each range is judged against
  rank 0's parameters after the step, never the rank's own;
- each rank's range of the run-precision copy after three steps is, to the bit, what one process holding the whole
  trajectory reaches on the same forwards (one per rank), with momentum SGD and with AdamW, and under DeepSpeed's
  engine recipe at a loss scale (slow tier), a parameter cut over two ranks included (each holder's piece of it); with
  clipping by the global norm within a few units of float32's rounding (a cut parameter's norm is the norm of its
  pieces' norms, which rounds apart from one norm of the whole). The float64 copy's within 1e-9 of its largest value:
  between steps it is held as offsets within 2^-32 of each element (dpcompare.verify.trajectory.trajectory_offsets), and whether a tensor is
  held so is decided tensor by tensor, so a holder's piece may be held where one process keeps the whole in float64.
  Rank 0's drift entries are the single process's, figure for figure (a cut parameter's from its pieces' squares);
- between steps a rank holds the storage of the trainable parameters it holds whole, and of its pieces of the others;
- a rank that cannot compute its share says so: rank 0 raises it naming the rank, no rank steps (its copies bitwise
  as they were), and the next step is served; judged again, the step reads the same figure within the offsets' bound
  (a step is judged on its float64 copy before that copy is held as offsets).
"""

from __future__ import annotations

import copy
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from dpcompare.verify.memory import divider as divided
from dpcompare.verify.oracle.gradient_oracle import Layout, replica_pieces
from dpcompare.verify.judgement.precision_recipe import Recipe
from dpcompare.verify.trajectory.reference_trajectory import Trajectory

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(180)]

WORLD = 3
STEPS = 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def _batch(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(9, 6, generator=g), torch.randint(0, 3, (9,), generator=g)


def _factory(optimizer: str):
    if optimizer == "sgd":
        return lambda params, **_: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)
    return lambda params, **_: torch.optim.AdamW(params, lr=0.01, weight_decay=0.01)


class _FailOnRank1:
    def __call__(self, out, y):
        raise ValueError("planted failure")


def _distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference of `a` from `b`, relative to `b`'s largest element (0: bitwise the same)."""
    if torch.equal(a, b):
        return 0.0
    return float((a - b).detach().abs().max() / b.detach().abs().max())


def _worker(rank: int, world: int, init: str, out: str, optimizer: str, clip: float | None, recipe: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    peers = divided.Peers.make()
    layout, template, loss, cpu = Layout(world), _model(), nn.functional.cross_entropy, torch.device("cpu")
    ranks0 = copy.deepcopy(template)  # rank 0's initial weights
    with torch.no_grad():  # every other rank built other weights: the trajectory starts from rank 0's
        for p in template.parameters():
            p.add_(0.01 * rank)
    kwargs = dict(depth=3, clip=clip, recipe=Recipe(recipe, "fp16") if recipe != "none" else Recipe())
    scale = 1024.0 if recipe != "none" else 1.0  # the loss scale the recipe's copy multiplies its loss by
    shared = Trajectory(template, loss, _factory(optimizer), "float32", cpu, peers=peers, **kwargs)
    alone = Trajectory(ranks0, loss, _factory(optimizer), "float32", cpu, **kwargs)
    # the run's parameters after each step, as rank 0 read them (any values near the trajectory's); another rank's
    # differ, and are not what the trajectory is judged against (the replicas' check holds them to rank 0's)
    masters = {n: p.detach() + 1e-3 * (1 + rank) * torch.ones_like(p) for n, p in ranks0.named_parameters()}
    helper = divider = None
    if rank:
        helper = divided.Helper(peers, template, loss, layout=layout, dtype=torch.float32, device=cpu,
                                recipe=divided.NO_RECIPE, trajectory=shared)
    else:
        divider = divided.Divider(peers, layout)
    report: dict = {"entries": [], "alone": []}
    for step in range(STEPS):
        batch = _batch(step)
        alone.step(replica_pieces(batch, layout), scale)
        if rank:
            helper.serve(batch, lambda: None)
        else:
            shared.step(replica_pieces(batch, layout), scale)
            report["entries"].append(shared.judge(step, masters, world))
            report["alone"].append(alone.judge(step, masters, world))
            divider.done()
    plan = shared.ranges.plan
    with shared.whole(), alone.whole():
        report["same"] = {}
        for slot in ("model64", "model_run"):
            theirs, pieces = dict(getattr(alone, slot).named_parameters()), shared.pieces[id(getattr(shared, slot))]
            for n, p in getattr(shared, slot).named_parameters():
                mine = p if shared.ranges.mine(n) else pieces.get(n)
                if mine is not None:
                    report["same"][f"{slot}/{n}"] = _distance(mine, plan.take(n, rank, theirs[n]))
        report["held"] = {n: p.untyped_storage().nbytes() > 0 for n, p in shared.model64.named_parameters()}
        report["whole"] = {n: shared.ranges.mine(n) for n, _ in shared.model64.named_parameters()}
        report["mine"] = {n: plan.holds(n, rank) for n, _ in shared.model64.named_parameters()}
        report["cut"] = [n for n in plan.sizes if plan.is_cut(n)]
        report["pieces"] = sorted(shared.pieces[id(shared.model64)])
        before = {n: (p if shared.ranges.mine(n) else shared.pieces[id(shared.model64)][n]).detach().clone()
                  for n, p in shared.model64.named_parameters() if plan.holds(n, rank)}
    # a step whose share fails on rank 1: named by rank 0, stepped by none, and the ranks stay in step after it
    batch = _batch(STEPS)
    if rank:
        if rank == 1:
            shared.loss_fn = _FailOnRank1()
        helper.serve(batch, lambda: None)
        shared.loss_fn = loss
        helper.serve(batch, lambda: None)
    else:
        try:
            shared.step(replica_pieces(batch, layout))
            report["failure"] = None
        except RuntimeError as exc:
            report["failure"] = str(exc)
        divider.done()
        report["after_failure"] = shared.judge(STEPS, masters, world)
        divider.done()
    with shared.whole():
        now = {**dict(shared.model64.named_parameters()), **shared.pieces[id(shared.model64)]}
        report["unstepped"] = all(torch.equal(now[n], before[n]) for n in before)
    torch.save(report, f"{out}.{rank}")
    dist.destroy_process_group()


@pytest.mark.parametrize(("optimizer", "clip", "recipe"), [
    pytest.param("sgd", None, "none", marks=pytest.mark.slow),
    pytest.param("adamw", 0.05, "none", marks=pytest.mark.slow),
    # fp16 weights from fp32 masters at a loss scale: the recipe's rank count and scale, its overflow test over ranges
    pytest.param("adamw", None, "engine", marks=pytest.mark.slow)])
def test_a_trajectory_in_ranges_steps_and_judges_as_one_process(optimizer, clip, recipe):
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "report")
        mp.spawn(_worker, args=(WORLD, f"file://{os.path.join(tmp, 'rendezvous')}", out, optimizer, clip, recipe),
                 nprocs=WORLD, join=True)
        reports = [torch.load(f"{out}.{r}") for r in range(WORLD)]
    trainable = sorted(reports[0]["mine"])
    assert reports[0]["cut"], "the model's parameters are cut over the three ranks"
    for r, report in enumerate(reports):
        assert report["same"], r
        run = {k: d for k, d in report["same"].items() if k.startswith("model_run/")}
        if clip is None:  # to the bit, a cut parameter's pieces included
            assert all(d == 0.0 for d in run.values()), (r, run)
        else:  # the coefficient from a cut parameter's pieces' norms rounds apart from one process's
            assert all(d <= 8 * torch.finfo(torch.float32).eps for d in run.values()), (r, run)
        assert all(d <= 1e-9 for k, d in report["same"].items() if k.startswith("model64/")), (r, report["same"])
        # between steps: the storage of the parameters it holds whole, and its pieces of the cut ones, only
        assert report["held"] == report["whole"], (r, report["held"], report["whole"])
        assert report["pieces"] == sorted(n for n in report["cut"] if report["mine"][n]), r
        assert report["unstepped"], r
    held = sorted(n for r in reports for n, m in r["mine"].items() if m)
    assert sorted(set(held)) == trainable  # every parameter held, a cut one by each of its holders
    assert all(any(r["mine"].values()) for r in reports)  # each rank owns a range
    rank0 = reports[0]
    for mine, alone in zip(rank0["entries"], rank0["alone"]):  # a cut parameter's figures from its pieces' squares
        assert mine["worst_parameter"] == alone["worst_parameter"] and mine["ok"] == alone["ok"], (mine, alone)
        for key in ("rel_param_distance", "floor_rel_param_distance", "noise_ratio", "tolerance"):
            assert mine[key] == pytest.approx(alone[key], rel=1e-9 if clip is None else 1e-5), (key, mine, alone)
    assert rank0["failure"] is not None and "rank 1" in rank0["failure"] and "planted failure" in rank0["failure"]
    # none stepped: the same figure, within the offsets' bound (the step was judged on its float64 copy before it was
    # held; this judge reads the values given back from their offsets); `unstepped` above is the bitwise check
    assert rank0["after_failure"]["rel_param_distance"] == pytest.approx(rank0["entries"][-1]["rel_param_distance"],
                                                                          rel=1e-9)
