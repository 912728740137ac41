"""The divided oracle's protocol on two real processes (gloo over a file rendezvous), without a backend:

- a gradient divided over the ranks is the single-process sum of the same forwards to the bit (run dtype, one forward
  per rank), and the float64 one within float64's rounding;
- a rank that cannot compute its share says so, and rank 0 raises it in one exception naming the rank, while neither
  process waits for a share that will not come (both finish, and the next request is served);
- each sum is held by its parameters' owners, each rank its own range only, until rank 0 lets it go; rank 0 reads the
  other ranges from their owners while they serve, and a read after they stopped is refused instead of waiting;
- once a copy's first request showed no gradient completed twice in one backward, each rank sends its gradient to
  the owners a parameter at a time as backward completes it: the same sums to the bit, and a twin whose rank sends
  another gradient is seen in every parameter;
- an optimizer state is held so too (Divider.hold_state), each parameter's entries read back as they were, and so it is
  held a parameter at a time as it is computed (StateHolder: the update check's replay).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dpcompare.verify.memory import divider as divided
from dpcompare.verify.memory import handed_gradients
from dpcompare.verify.ranks.verifier_group import owners
from dpcompare.verify.oracle.gradient_oracle import Layout, accumulate_gradient, replica_pieces, verification_copy
from tests.spawned import spawned

pytestmark = [pytest.mark.multiproc, pytest.mark.slow, pytest.mark.timeout(180)]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(9, 6, generator=g), torch.randint(0, 3, (9,), generator=g)


class _FailOnRank1:
    """A loss that raises on rank 1 (its copy cannot compute its share)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __call__(self, out, y):
        if self.rank == 1:  # rank 2 computes its share as usual
            raise ValueError("planted failure")
        return nn.functional.cross_entropy(out, y)


def _started(rank: int, world: int, init: str, template: nn.Module):
    """The group, the layout, the batch, the loss; on a rank other than 0 its Helper (None on rank 0)."""
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    peers, layout, loss = divided.Peers.make(), Layout(world), nn.functional.cross_entropy
    helper = divided.Helper(peers, template, loss, layout=layout, dtype=torch.float32, device=torch.device("cpu"),
                            recipe=divided.NO_RECIPE) if rank else None
    return peers, layout, _batch(), loss, helper


def _worker(rank: int, world: int, init: str, out: str) -> None:
    template = _model()
    peers, layout, batch, loss, helper = _started(rank, world, init, template)
    pieces = replica_pieces(batch, layout)
    if rank:
        helper.serve(batch, lambda: None)  # the two good requests
        helper.loss_fn = _FailOnRank1(rank)  # rank 1 fails, rank 2 does not
        helper.serve(batch, lambda: None)  # the failing one
        helper.loss_fn = loss
        helper.serve(batch, lambda: None)  # served again afterwards
        held = {k: sorted(g) for k, g in helper._held.items()}  # what this rank still holds: its range of one sum
        helper.serve(batch, lambda: None)  # rank 0 lets that sum go
        after = len(helper._held)
        helper.serve(batch, lambda: None)  # rank 0 holds an optimizer state in ranges, and reads it
        state_held = {k: sorted(g) for k, g in helper._held.items()}
        helper.serve(batch, lambda: None)  # rank 0 lets it go
        state_after = len(helper._held)
        helper.serve(batch, lambda: None)  # rank 0 holds a state a parameter at a time as it is computed, and reads it
        streamed = sorted({n for g in helper._held.values() for n in g})
        streamed_holds = sum(1 for g in helper._held.values() if len(g))
        helper.serve(batch, lambda: None)  # rank 0 lets it go
        saved = {"held": held, "after": after, "state_held": state_held, "state_after": state_after,
                 "streamed": streamed, "streamed_holds": streamed_holds, "streamed_after": len(helper._held)}
        if rank == 2:  # a twin that hands rank 2's gradient off twice over: the owners' sums change
            real = handed_gradients.settle
            handed_gradients.settle = lambda peers, owner, n, p, given, *a: real(
                peers, owner, n, p, None if given is None else given * 2, *a)
        helper.serve(batch, lambda: None)
        torch.save(saved, f"{out}.{rank}")
        dist.destroy_process_group()
        return
    divider = divided.Divider(peers, layout)
    divider.open()
    state = template.state_dict()
    results = {}
    kept = {}
    for dtype, slot in ((torch.float32, "run"), (torch.float64, "64")):
        model = verification_copy(template, torch.device("cpu"), dtype)
        alone, _ = accumulate_gradient(model, loss, pieces, torch.device("cpu"))
        shared, _ = divider.gradient(slot, model, None, state, pieces, loss, torch.device("cpu"))
        results[slot] = max(float((alone[n] - shared[n]).abs().max()) for n in alone)
        # the copy's second request: each rank's gradient sent to its owners as its backward completes it
        handed, _ = divider.gradient(slot, model, None, state, pieces, loss, torch.device("cpu"))
        kept[slot] = {n: shared[n].clone() for n in alone}
        results[f"{slot}-handed"] = all(torch.equal(shared[n], handed[n]) for n in alone)
        del handed
    results["handed"] = divider.handed
    del shared
    divider.done()
    divider.open()
    model = verification_copy(template, torch.device("cpu"), torch.float32)
    try:
        divider.gradient("run", model, None, state, pieces, loss, torch.device("cpu"))
        results["failure"] = None
    except RuntimeError as exc:
        results["failure"] = str(exc)
    divider.done()
    divider.open()
    again, _ = divider.gradient("run", model, None, state, pieces, loss, torch.device("cpu"))
    results["again"] = float(sum(t.abs().sum() for t in again.values()))
    divider.done()
    try:  # the other ranks no longer serve: reading their ranges would wait forever, so it is refused
        again["2.weight"]
        results["outside"] = None
    except RuntimeError as exc:
        results["outside"] = str(exc)
    del again
    divider.open()
    divider.done()
    # An optimizer state as read (AdamW's, after a step): held in ranges by the owners, each parameter's entries read
    # back from its owner as they were, its step count (and an entry not of its shape) kept here; what the entries
    # are, without sending them.
    model = verification_copy(template, torch.device("cpu"), torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    read = {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in model.named_parameters()}
    read["0.weight"]["factored"] = torch.randn(2)  # an entry of another shape than its parameter's: kept on rank 0
    divider.open()
    held = divider.hold_state(read, [n for n, _ in model.named_parameters()])
    results["state_back"] = all(torch.equal(held[n][k], v) for n in read for k, v in read[n].items())
    like = held.like()
    results["state_like"] = all(like[n][k].device.type == ("cpu" if k == "factored" else "meta") and
                                like[n][k].dtype == v.dtype and
                                like[n][k].shape == v.shape for n in read for k, v in read[n].items() if v.dim())
    divider.done()
    del held
    divider.open()
    divider.done()
    # The same state held as it is computed, a parameter at a time (the update check's replay: StateHolder), each
    # parameter's entries sent to its owner once complete: read back as they were, as hold_state's.
    divider.open()
    holder = divider.state_holder([n for n, _ in model.named_parameters()])
    holder.flush_bytes = 1  # each parameter's sent as it is added (a model's worth waits at most FLUSH_BYTES)
    for n, entries in read.items():
        holder.add(n, entries)
    streamed = holder.result()
    del holder
    results["streamed_back"] = all(torch.equal(streamed[n][k], v) for n in read for k, v in read[n].items())
    results["streamed_like"] = all(streamed.like()[n][k].shape == v.shape for n in read for k, v in read[n].items())
    divider.done()
    del streamed
    divider.open()
    divider.done()
    divider.open()
    model = verification_copy(template, torch.device("cpu"), torch.float32)
    twin, _ = divider.gradient("run", model, None, state, pieces, loss, torch.device("cpu"))
    results["twin-differs"] = sorted(n for n in kept["run"] if not torch.equal(kept["run"][n], twin[n]))
    del twin
    divider.done()
    torch.save(results, out)
    dist.destroy_process_group()


def test_a_divided_gradient_is_the_single_process_sum_and_a_failing_rank_is_named():
    # three ranks: with two, a + b and b + a are the same number whatever the order; with three they are not
    results, helpers = spawned(_worker, 3, helpers=(1, 2))
    assert results["run"] == 0.0, "the run-dtype sum of one forward per rank is rank 0's own sum, to the bit"
    assert results["64"] < 1e-15
    # sent to their owners a parameter at a time as backward completes them: the same sums, to the bit
    assert results["run-handed"] and results["64-handed"] and results["handed"] >= 2
    # and a twin whose rank 2 sends twice its gradient is seen in every parameter's sum
    assert results["twin-differs"] == sorted(n for n, _ in _model().named_parameters())
    assert results["failure"] is not None and "rank 1" in results["failure"] and "planted failure" in results["failure"]
    assert results["again"] > 0.0  # the ranks served the next request after the failure
    assert results["outside"] is not None and "outside a point of the step" in results["outside"]
    for rank in (1, 2):  # each rank held its own range of the last sum only, until rank 0 let it go
        helper = helpers[rank]
        mine = sorted(owners(_model(), 3).names(rank))
        assert mine and helper["held"] and all(names == mine for names in helper["held"].values()), (rank, helper)
        assert helper["after"] == 0
        # the optimizer state's two moments, each its own range only, until rank 0 let the state go
        assert len(helper["state_held"]) == 2 and all(names == mine for names in helper["state_held"].values())
        assert helper["state_after"] == 0
    assert results["state_back"] and results["state_like"]
    for rank in (1, 2):  # held a parameter at a time: each rank its own parameters' entries only, until let go
        helper, mine = helpers[rank], sorted(owners(_model(), 3).names(rank))
        assert helper["streamed"] == mine and helper["streamed_holds"] == 2 * len(mine), (rank, helper)
        assert helper["streamed_after"] == 0
    assert results["streamed_back"] and results["streamed_like"]


class _SharedInAndOut(nn.Module):
    """A weight used inside a block recomputed reentrantly in backward and outside it: its gradient is completed twice
    in one backward (once by the recomputed block's own backward, once by the rest)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(6, 6)
        self.shared = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(self.shared(t)), self.inp(x), use_reentrant=True)
        return self.head(self.shared(h))


def _twice_worker(rank: int, world: int, init: str, out: str) -> None:
    template = _SharedInAndOut()
    peers, layout, batch, loss, helper = _started(rank, world, init, template)
    if rank:
        helper.serve(batch, lambda: None)
        dist.destroy_process_group()
        return
    divider = divided.Divider(peers, layout)
    divider.open()
    pieces = replica_pieces(batch, layout)
    model = verification_copy(template, torch.device("cpu"), torch.float32)
    divider._hands["run"] = False  # computed whole before it is sent: what the handed request must come to
    whole, _ = divider.gradient("run", model, None, template.state_dict(), pieces, loss, torch.device("cpu"))
    whole = {n: whole[n].clone() for n in whole}
    divider._hands.clear()
    results = {}
    for k in range(2):
        shared, _ = divider.gradient("run", model, None, template.state_dict(), pieces, loss, torch.device("cpu"))
        results[k] = all(torch.equal(whole[n], shared[n]) for n in whole)
        del shared
    results["handed"], results["hands"] = divider.handed, dict(divider._hands)
    divider.done()
    torch.save(results, out)
    dist.destroy_process_group()


def test_a_gradient_completed_twice_in_one_backward_is_computed_whole_before_it_is_sent():
    """The first request hands off, finds the shared weight completed twice on every rank, and is computed again with
    each gradient whole before it is sent, as every later one: the sums of a request computed so, to the bit, each
    time. (Not the single-process sum to the bit: one process adds each forward's two parts in turn, the ranks add
    their own two first.)"""
    results, _ = spawned(_twice_worker, 2)
    assert results[0] and results[1]
    assert results["handed"] == 0 and results["hands"] == {"run": False}
