"""A divided gradient sent to its owners as backward completes it, never whole on a rank.

Owns: `hand_off` (a rank's share of a divided gradient, dpcompare.verify.memory.divider's, each trainable parameter's
gradient settled with its owners, dpcompare.verify.ranks.verifier_group.settle, as the rank's last forward's backward
completes it, and let go then). Imports no adapter.

Every rank settles the parameters in one order, the copy's trainable parameters last to first (the order backward
completes them in a model that runs its modules in the order it names them): a parameter is settled once it and every
one before it in that order are complete, so a rank that completes them in another order holds those that wait, and
one that computes nothing (no forward of its own in the request, or one that failed) settles each in turn with what it
has. Each settlement pairs the same sends and receives on every rank as `to_owners` does, so the sums at the owners
are `to_owners`'s to the bit: the ranks' gradients added in the request's order in the copy's dtype.

A parameter whose gradient is completed twice in one backward (a reentrant recomputation that uses it inside and
outside the recomputed part) would be sent before its second part: the rank says so (`twice`), and rank 0 computes the
request again, and every later one of that copy, with each gradient whole before it is sent.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from dpcompare.verify.oracle.gradient_oracle import Piece, accumulate_piece
from dpcompare.verify.judgement.precision_recipe import NONE as NO_RECIPE
from dpcompare.verify.randomness.draw_recording import MaskReplayer
from dpcompare.verify.randomness.random_modules import each_rank_from_start
from dpcompare.verify.ranks.range_plan import Plan
from dpcompare.verify.ranks.verifier_group import Peers, settle

__all__ = ["hand_off"]


def hand_off(peers: Peers, owner: Plan, model: nn.Module, loss_fn: Callable, pieces: list[Piece],
             device: torch.device, replayer: MaskReplayer | None, order: list[int],
             out: dict[str, torch.Tensor]) -> tuple[frozenset[str], float, list[str]]:
    """This rank's `pieces` (none: a rank that only receives) accumulated as accumulate_raw does without a recipe, each
    trainable parameter settled with its owners as the last piece's backward completes it (see the module docstring):
    this rank's pieces of the sums land in `out`, the raw sums (1 / ranks x loss scale = 1). Returns the names whose
    gradient stayed None on this rank, the pieces' losses weighted as their gradients, and the names completed twice
    in one backward (the request's result is then wrong, and rank 0 says so). Every rank calls it at once with the same
    `owner` and `order`; whatever happens on this rank (a forward that fails), it settles every parameter before it
    returns or raises, so no other rank waits on it."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    sequence = [n for n, _ in reversed(named)]
    params, name_of = dict(named), {id(p): n for n, p in named}
    sends = peers.rank in order
    at, last = [0], [False]
    ready: set[str] = set()
    completed: set[str] = set()
    twice: list[str] = []

    def advance(everything: bool = False) -> None:
        while at[0] < len(sequence) and (everything or sequence[at[0]] in ready):
            n = sequence[at[0]]
            p = params[n]
            given = (p.grad if p.grad is not None else torch.zeros_like(p)) if sends else None
            p.grad = None
            settle(peers, owner, n, p, given, order, out)
            at[0] += 1

    def completes(p: torch.Tensor) -> None:
        n = name_of.get(id(p))
        if n is None:
            return
        completed.add(n)
        if not last[0]:
            return
        if n in ready:
            twice.append(n)
            return
        ready.add(n)
        advance()

    model.train()
    model.zero_grad(set_to_none=True)
    handles = [p.register_post_accumulate_grad_hook(completes) for _, p in named]
    loss = 0.0
    try:
        for i, piece in enumerate(each_rank_from_start(model, pieces)):
            last[0] = i == len(pieces) - 1
            loss += piece.weight * accumulate_piece(model, loss_fn, piece, device, replayer, NO_RECIPE, piece.weight)
    finally:
        for h in handles:
            h.remove()
        advance(everything=True)
    return frozenset(n for n, _ in named if n not in completed), loss, twice
