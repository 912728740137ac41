"""The global batch's gradient, computed by rank 0 alone, is held in ranges by the parameters' owners (three real
processes, gloo over a file rendezvous, no backend).

Where the ranks share the checks, a forward of the global batch (the first checked step's oracle and its
run-precision reference, and wherever the split is measured) is one forward that rank 0 computes alone. Its gradient
used to be held whole on rank 0 (8 bytes a parameter in float64, whatever the world size). While the helpers serve,
each parameter's sum now goes to its owners as rank 0's backward completes it (`Divider.holds`, `Request.alone`):
- the same sums, to the bit, as rank 0's own computation of them, in float64 and in the run dtype;
- rank 0 keeps its own range only, and each helper its own, until rank 0 lets the sum go;
- outside a point of the step (the helpers not serving) rank 0 computes it whole, as before, and no rank waits.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dpcompare.verify.memory import divider as divided
from dpcompare.verify.oracle.gradient_oracle import (Layout, Oracle, accumulate_gradient, global_pieces,
                                                    verification_copy)
from dpcompare.verify.ranks.verifier_group import Remote, owners
from tests.spawned import spawned
from tests.test_divided_protocol import _batch, _model  # the divided protocol's model and batch

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(180)]
CPU = torch.device("cpu")


def _worker(rank: int, world: int, init: str, out: str) -> None:
    template, batch, loss = _model(), _batch(), nn.functional.cross_entropy
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    peers, layout = divided.Peers.make(), Layout(world)
    if rank:
        helper = divided.Helper(peers, template, loss, layout=layout, dtype=torch.float32, device=CPU,
                                recipe=divided.NO_RECIPE)
        helper.serve(batch, lambda: None)  # the three sums rank 0 computes alone
        held = {k: sorted(g) for k, g in helper._held.items()}
        helper.serve(batch, lambda: None)  # rank 0 lets them go
        torch.save({"held": held, "after": len(helper._held)}, f"{out}.{rank}")
        dist.destroy_process_group()
        return
    divider = divided.Divider(peers, layout)
    pieces = global_pieces(batch)
    state = template.state_dict()
    results: dict = {"holds_outside": divider.holds(pieces)}  # not serving: computed whole here, as before
    divider.open()
    results["holds_serving"] = divider.holds(pieces)
    kept = []  # held until the helpers have said what they hold
    for dtype, slot in ((torch.float32, "run"), (torch.float64, "64")):
        model = verification_copy(template, CPU, dtype)
        whole, _ = accumulate_gradient(model, loss, pieces, CPU)
        shared, none = divider.gradient(slot, model, None, state, pieces, loss, CPU)
        results[f"{slot}-remote"] = isinstance(shared, Remote)
        results[f"{slot}-own"] = sorted(shared.own)  # what rank 0 holds of it
        results[f"{slot}-same"] = all(torch.equal(whole[n], shared[n]) for n in whole)
        results[f"{slot}-none"] = sorted(none)
        kept.append(shared)
        del shared
    results["alone"], results["divided"] = divider.alone, divider.requests
    # through the oracle, as the checks ask for it; and a twin that holds only divided sums (the code before): rank 0
    # then holds the global batch's gradient whole
    oracle = Oracle(template, loss, "float32", CPU)
    oracle.divider = divider
    through = oracle.oracle_of(state, pieces)
    results["oracle-own"] = sorted(through.own) if isinstance(through, Remote) else None
    kept.append(through)
    divider.holds = divider.divides
    twin = oracle.oracle_of(state, pieces)
    results["twin-own"] = sorted(twin.own) if isinstance(twin, Remote) else sorted(twin)
    del twin, through
    divider.done()
    del kept  # let go: the owners let their ranges go with the next request
    divider.open()
    divider.done()
    torch.save(results, out)
    dist.destroy_process_group()


def test_the_global_batch_computed_by_rank_0_alone_is_held_by_its_owners_and_the_same_sums():
    results, helpers = spawned(_worker, 3, helpers=(1, 2))
    assert not results["holds_outside"] and results["holds_serving"]
    plan = owners(_model(), 3)
    for slot in ("run", "64"):
        assert results[f"{slot}-remote"], "a sum held in ranges, not a whole gradient on rank 0"
        assert results[f"{slot}-own"] == sorted(plan.names(0)), "rank 0 keeps its own range only"
        assert results[f"{slot}-same"], "the same sums to the bit as rank 0's own computation"
        assert results[f"{slot}-none"] == []
    assert results["alone"] == 2 and results["divided"] == 0
    assert results["oracle-own"] == sorted(plan.names(0))
    assert results["twin-own"] == sorted(n for n, _ in _model().named_parameters()), "the twin holds it whole"
    for rank in (1, 2):
        mine = sorted(plan.names(rank))
        assert mine and len(helpers[rank]["held"]) == 3
        assert all(names == mine for names in helpers[rank]["held"].values()), helpers[rank]
        assert helpers[rank]["after"] == 0  # let go once rank 0 let them go
