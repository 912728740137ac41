"""A float64 gradient compared as backward produces it, never held whole.

Owns: `accumulate_streamed` (the oracle's sum over its pieces, each trainable parameter's gradient handed on as the
last piece's backward completes it, through a post-accumulate-grad hook, and let go then) and `distance_of` (the
relative Frobenius distance of a gradient held elsewhere, in ranges by their owners for one, from the float64
gradient over some pieces, reduced parameter by parameter in the parameters' order: the figure
dpcompare.verify.judgement.tolerance.rel_fro_of gives from the gradient held whole, to the bit). Rank 0 then holds one
parameter's float64 gradient at a time, not the model's (8 bytes a parameter).

A parameter whose gradient is completed twice in one backward (a reentrant recomputation that uses it inside and
outside the recomputed part) cannot be handed on once: the gradient is then computed whole, as before. Autograd
completes a leaf's gradient once per backward otherwise, shared weights included (their uses are summed first).
Imports no adapter.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn

from dpcompare.verify.oracle.gradient_oracle import Grads, Oracle, Piece, accumulate_piece, loaded
from dpcompare.verify.judgement.held_values import Compact, release
from dpcompare.verify.randomness.draw_recording import MaskReplayer
from dpcompare.verify.judgement.precision_recipe import NONE as NO_RECIPE
from dpcompare.verify.judgement.tolerance import range_figures, rel_fro_of, rel_ratio


def accumulate_streamed(model: nn.Module, loss_fn: Callable, pieces: list[Piece], device: torch.device,
                        sink: Callable[[str, torch.Tensor], None],
                        replayer: MaskReplayer | None = None) -> frozenset[str] | None:
    """dpcompare.verify.oracle.gradient_oracle.accumulate_gradient's sum (no recipe, no loss scale), each trainable parameter's
    handed to `sink` (its name, the gradient read as accumulate_gradient's are) as the last piece's backward completes
    it, and let go then: with one piece (a joined forward's), the whole gradient is never held; the earlier pieces'
    sum, where there are more, is held as autograd accumulates it. Returns the names whose gradient stayed None (never
    handed); None where a parameter's gradient was completed twice in one backward: what was handed is then partial."""
    model.train()
    model.zero_grad(set_to_none=True)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    handed: set[str] = set()
    twice: list[str] = []

    def hand(name: str, p: torch.Tensor) -> None:
        if name in handed:
            twice.append(name)
            return
        handed.add(name)
        sink(name, Compact({name: p.grad}, copy=False)[name])
        p.grad = None

    for piece in pieces[:-1]:
        accumulate_piece(model, loss_fn, piece, device, replayer, NO_RECIPE, piece.weight)
    hooks = [p.register_post_accumulate_grad_hook(lambda p, n=n: hand(n, p)) for n, p in named]
    try:
        accumulate_piece(model, loss_fn, pieces[-1], device, replayer, NO_RECIPE, pieces[-1].weight)
    finally:
        for h in hooks:
            h.remove()
    if twice:
        model.zero_grad(set_to_none=True)
        return None
    for n, p in named:  # a gradient the earlier pieces alone gave
        if n not in handed and p.grad is not None:
            hand(n, p)
    return frozenset(n for n, _ in named if n not in handed)


def distance_of(oracle: Oracle, state: dict, pieces: list[Piece], against: Grads) -> float:
    """rel_fro_of(`against`, `oracle`'s float64 gradient over `pieces` at `state`), each parameter's gradient compared
    as backward completes it (accumulate_streamed). Computed whole where a parameter's is completed twice in one
    backward. The oracle's `none` is left as it was."""
    figures: dict[str, tuple[float, float]] = {}

    def sink(name: str, g: torch.Tensor) -> None:
        figures[name] = range_figures("fro", ({name: against[name]}, {name: g}), [name])[name]

    try:
        with loaded(oracle.model64, state):
            none = accumulate_streamed(oracle.model64, oracle.loss_fn, pieces, oracle.device, sink, oracle.replay64)
    finally:
        oracle.model64.zero_grad(set_to_none=True)
        release(oracle.model64)
    if none is None:
        kept = oracle.none
        distance = rel_fro_of(against, oracle.oracle_of(state, pieces), oracle.names)
        oracle.none = kept
        return distance
    for n in none:  # read as accumulate_gradient reads a gradient autograd left None: zeros
        sink(n, torch.zeros(against[n].shape, dtype=torch.float64))
    return rel_ratio(math.sqrt(sum(figures[n][0] ** 2 for n in oracle.names)),
                     math.sqrt(sum(figures[n][1] ** 2 for n in oracle.names)))
