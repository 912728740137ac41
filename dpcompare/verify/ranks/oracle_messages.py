"""The divided oracle's messages (dpcompare.verify.memory.divider): what rank 0 asks every rank (`Request`), what a rank
answers before its tensors (`Status`), and the state rank 0 sends with a request, loaded by each rank as it arrives
(`send_state`, `receive_into`). Imports no adapter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from dpcompare.verify.ranks.verifier_group import Peers

SLOTS = ("64", "run")
"""The copies a request names: the float64 one, and the one in the run's precision (its recipe's weights)."""


@dataclass(frozen=True, slots=True)
class Request:
    """One share every rank computes: `slot`'s copy, at `state` (its keys, shapes and dtypes; the tensors follow the
    request, a broadcast each), over the forwards at `positions` with `weights`, in that order."""

    slot: str | None
    """None: nothing more this time (the point of the step is over)."""
    state: list[tuple[str, tuple[int, ...], torch.dtype]] | None = None
    positions: tuple[int, ...] = ()
    weights: tuple[float, ...] = ()
    recipe: bool = False
    loss_scale: float = 1.0
    ranks: int = 1
    key: int = 0
    """The gradient's number: its owners hold their ranges under it until rank 0 lets it go (`drop`)."""
    name: str | None = None
    """slot "fetch": the parameter of gradient `key` its owner sends rank 0."""
    reduce: tuple | None = None
    """slot "reduce": (the sums' numbers, None for rank 0's own values sent with it; the parameters; the unit
    roundoff; the dtypes of the values sent, by parameter) for Divider.per_parameter, its reduction in `name`."""
    drop: tuple[int, ...] = ()
    """The gradients rank 0 let go since its last request: their owners let their ranges go."""
    hand: bool = False
    """Each parameter's gradient sent to its owners as backward completes it (dpcompare.verify.memory.handed_gradients),
    not once every forward is done."""
    alone: bool = False
    """Rank 0 computes every forward (the global batch in one forward: no rank's of the layout) and the others none:
    they only take their ranges of the sums, so that rank 0 does not hold the gradient whole."""


@dataclass(slots=True)
class Status:
    """What a rank answers a request with before its tensors: whether it computed a share, and what it left None."""

    computed: bool
    none: frozenset[str] = frozenset()
    loss: float = 0.0
    """Its forwards' losses, weighted as their gradients are."""
    error: str | None = None
    mismatch: tuple[str, str] | None = None
    """A MaskMismatch on that rank: (module, reason)."""
    twice: bool = False
    """Its error: a gradient completed twice in one backward after it was sent (rank 0 computes the request again,
    each gradient whole before it is sent)."""


def send_state(peers: Peers, state: dict[str, torch.Tensor]) -> None:
    """Rank 0: `state`'s tensors broadcast to every rank, in its order (`receive_into` takes them)."""
    for t in state.values():
        dist.broadcast(t.detach().to("cpu").contiguous(), src=0, group=peers.group)


def receive_into(peers: Peers, meta: list[tuple[str, tuple[int, ...], torch.dtype]], model: nn.Module,
                 into: dict[str, torch.Tensor] | None = None) -> list[str]:
    """The state rank 0 sends (`send_state`), loaded into `model` a tensor at a time as it arrives (load_state_dict,
    its modules' own loading included), so it is never held whole beside the copy it loads; `into`, where given,
    receives the tensors as they were sent instead (a copy whose parameters are made from them as they are used:
    dpcompare.verify.oracle.weights_on_use). Every tensor is received whatever happens; returns the keys `model` has no
    entry for (none loaded), for its share's status."""
    keys = model.state_dict().keys()
    missing = []
    for key, shape, dtype in meta:
        t = torch.empty(shape, dtype=dtype)
        dist.broadcast(t, src=0, group=peers.group)
        if key not in keys:
            missing.append(key)
        elif into is not None:
            into[key] = t
        else:
            model.load_state_dict({key: t}, strict=False)
    return missing
