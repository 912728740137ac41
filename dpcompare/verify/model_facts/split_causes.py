"""Why the ranks' split of a batch computes another gradient than the global batch: each cause tested, none assumed.

Owns: `find_cause`, run on rank 0 in float64 where dpcompare.verify.model_facts.batch_split finds that the split moves the gradient.
Each test changes one thing and measures again, and a cause is named only where its test holds:

  normalisation  the loss is a mean over items (tokens not ignored) and each forward divided by its own count: the
                 split weighted by each forward's share of the step's items (what --loss-normalisation global
                 computes) is the global batch's gradient;
  statistic      a statistic of each forward's own samples (BatchNorm's batch statistics, an MoE router's
                 load-balancing loss): with it taken out (BatchNorm on its running statistics, the loss without the
                 term the workload names `per_forward_term`) the split is the global batch's gradient;
  samples_interact  the model computes each sample's output alone (the ranks' outputs are the global forward's rows),
                 so the loss couples the samples (in-batch negatives of a contrastive loss);
  control_flow   a sample's output depends on the batch it is in, but not on the other samples' values (in batches
                 of its size with half its samples replaced by others, scaled up and down, the kept ones do not move):
                 a branch on the local batch's size; or they move with no gradient through the others' inputs (a
                 branch on the content in tensor ops: capacity routing, a top-k); or the model's own code reads a
                 tensor's value into Python (a branch on the content, where it read);
  model_interaction  the kept samples' outputs move with the others' values, and their gradient reaches the others'
                 inputs: the model mixes samples (attention or pooling across the batch).
Where no test holds, the cause is None and the note says so. Every figure is kept (`Cause.evidence`). Imports no
adapter.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import Any, Callable, Iterator

import torch
from torch import nn

from dpcompare.contract import batches
from dpcompare.contract.normalisation import LossError, labels
from dpcompare.verify.model_facts import data_dependence
from dpcompare.verify.oracle.model_dtypes import as_input
from dpcompare.verify.oracle.gradient_oracle import Grads, Layout, Oracle, Piece, replica_pieces
from dpcompare.verify.judgement.tolerance import rel_fro_of

SPLIT_AGREEMENT = 1e-9
"""The least agreement asked of the split and the global batch in float64: a mean over independent samples computed
in float64 throughout puts them about 1e-15 apart."""
PER_FORWARD_TERM = "per_forward_term"
"""A loss function's attribute: the same loss without its terms computed from each forward's own statistics (an MoE
router's load-balancing loss: dpcompare.run.hf_tasks.with_router_aux)."""


@dataclass(slots=True)
class Cause:
    name: str | None
    """normalisation, statistic, samples_interact, control_flow, model_interaction, or None (no test held)."""
    evidence: dict[str, Any] = field(default_factory=dict)
    """Each test run, its figures and whether it held."""

    def to_dict(self) -> dict:
        return {"name": self.name, "evidence": self.evidence}


def find_cause(oracle: Oracle, layout: Layout, state: dict, batch, whole: Grads, agreement: float,
               masks: list | None) -> Cause:
    """The first cause whose test holds (see the module docstring), against the global batch's float64 gradient
    `whole` at the run's `state`, within `agreement` (the split finding's)."""
    evidence: dict[str, Any] = {}
    names = oracle.names
    split = replica_pieces(batch, layout, masks)
    counted = counts_of(oracle, layout, state, split)
    samples = sum(batches.rows(p.x) for p in split)
    if counted is not None and all(c * samples == sum(counted[0]) * batches.rows(p.x)
                                   for p, c in zip(split, counted[0])):
        # every forward holds the step's items in proportion to its samples: its own count divides as the step's
        evidence["normalisation"] = {"items_per_forward": counted[0], "counted": counted[1], "holds": False,
                                     "tested": False, "why": "every forward's share of the items is its share of the samples"}
        counted = None
    if counted is not None:
        counts, how = counted
        total = sum(counts)
        by_items = [dataclasses.replace(p, weight=c / total) for p, c in zip(split, counts) if c > 0]
        reweighted = oracle.oracle_of(state, by_items)
        distance = rel_fro_of(reweighted, whole, names)
        del reweighted
        evidence["normalisation"] = {
            "items_per_rank": [sum(c for p, c in zip(split, counts) if p.rank == r) for r in range(layout.world_size)],
            "items_per_forward": counts, "counted": how, "reweighted_distance_rel_fro": distance,
            "holds": distance <= agreement}
        if distance <= agreement:
            return Cause("normalisation", evidence)
        split = by_items  # the normalisation taken out of every test that follows: a cause beside it shows alone
    statistic = without_statistic(oracle, state, split, batch, agreement)
    if statistic is not None:
        evidence["statistic"] = statistic
        if statistic["holds"]:
            return Cause("statistic", evidence)
    if masks:
        evidence["samples"] = {"tested": False, "why": "the forwards draw random numbers: a forward run again here "
                                                       "would draw others"}
        return Cause(None, evidence)
    samples = _samples(oracle, layout, state, batch, agreement)
    evidence["samples"] = samples
    return Cause(samples.pop("cause", None), evidence)


REPLACEMENTS = (1.0, 2.0, 0.5)
"""The batches of a forward's size that test what moves the samples it keeps: half its samples kept, the rest others of
the batch, their inputs (where floating) scaled by each factor."""
VISIBLE_IGNORE_INDEX = -100
"""A target value that says the loss leaves the position out, where the workload names no ignore index: the default
ignore_index of F.cross_entropy and transformers' losses."""


def counts_of(oracle: Oracle, layout: Layout, state: dict, split: list[Piece]) -> tuple[list[int], str] | None:
    """Each forward's items and how they were counted: by the workload's count of its targets; as the loss returns
    them (`(sum, count)`, counted by a float64 forward of each); or, where the workload says neither, by the targets
    VISIBLE_IGNORE_INDEX marks (a plain mean over the other positions, as F.cross_entropy computes, recognised: the
    test then says whether that is the loss's normalisation). None: a loss over samples."""
    if layout.items is not None:
        return [layout.items(p.y) for p in split], "the workload's count of its targets"
    loss = oracle.loss_fn
    if getattr(loss, "returns_count", False):
        model = oracle.model64
        model.load_state_dict(state)
        with torch.no_grad():
            counts = [loss.sum_and_count(batches.call(model, as_input(p.x, model, oracle.device)),
                                         batches.to(p.y, oracle.device))[1]
                      for p in split]
        model.load_state_dict(state)
        return [int(c) for c in counts], "as the loss returns them (sum, count)"
    ys = [_labels(p.y) for p in split]
    if all(y is not None and not y.is_floating_point() for y in ys) and any(
            bool((y == VISIBLE_IGNORE_INDEX).any()) for y in ys):
        return ([int((y != VISIBLE_IGNORE_INDEX).sum()) for y in ys],
                f"the targets not {VISIBLE_IGNORE_INDEX} (the workload names no ignore_index; its targets hold "
                f"{VISIBLE_IGNORE_INDEX}, F.cross_entropy's default)")
    return None


def in_proportion(pieces: list[Piece], counts: list[int]) -> bool:
    """Whether each forward's items (`counts`, as `counts_of` gives them) are its share of the samples: then each
    forward's own count normalises its loss as the step's count would."""
    samples = sum(batches.rows(p.x) for p in pieces)
    return all(c * samples == sum(counts) * batches.rows(p.x) for p, c in zip(pieces, counts))


@contextlib.contextmanager
def _statistics_out(model: nn.Module) -> Iterator[list[str]]:
    """`model`'s BatchNorm layers on their running statistics (eval mode) while inside; yields their names."""
    layers = [(n, m) for n, m in model.named_modules()
              if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
    for _, m in layers:
        m.eval()
    try:
        yield [n for n, _ in layers]
    finally:
        for _, m in layers:
            m.train()


def without_statistic(oracle: Oracle, state: dict, split: list[Piece], batch, agreement: float) -> dict | None:
    """The split against the global batch with the per-forward statistics taken out; None where the model has none.
    BatchNorm's own note (dpcompare.verify.model_facts.replica_forwards) holds it as its cause's test."""
    loss = getattr(oracle.loss_fn, "loss_fn", oracle.loss_fn)
    term_free = getattr(loss, PER_FORWARD_TERM, None)
    model = oracle.model64
    has_bn = any(isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats for m in model.modules())
    if term_free is None and not has_bn:
        return None
    loss_fn = term_free if term_free is not None else oracle.loss_fn
    with _statistics_out(model) as layers:
        distance = _local_distance(oracle, state, split, batch, loss_fn)
    what = ([f"BatchNorm on its running statistics ({len(layers)} layers)"] if layers else []) + (
        ["the loss without its per-forward term (the routers' load-balancing loss)"] if term_free is not None else [])
    return {"taken_out": "; ".join(what), "distance_rel_fro": distance, "holds": distance <= agreement}


def _local_distance(oracle: Oracle, state: dict, split: list[Piece], batch, loss_fn: Callable) -> float:
    """The split's float64 gradient from the global batch's, both computed here on rank 0's float64 copy with
    `loss_fn` (the copy as it is set: its modules' modes kept)."""
    model = oracle.model64
    model.load_state_dict(state)
    names = oracle.names

    def gradient(pieces: list[Piece]) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        for p in pieces:
            out = loss_fn(batches.call(model, as_input(p.x, model, oracle.device)), batches.to(p.y, oracle.device))
            (p.weight * (out[0] / out[1] if isinstance(out, tuple) else out)).backward()
        got = dict(model.named_parameters())
        return {n: (got[n].grad.detach().clone() if got[n].grad is not None else torch.zeros_like(got[n]))
                for n in names}

    training = [m for m in model.modules() if m.training]
    try:
        split_grad = gradient(split)
        whole_grad = gradient([Piece(batch[0], batch[1], 1.0)])
    finally:
        model.zero_grad(set_to_none=True)
        for m in training:
            m.train()
        model.load_state_dict(state)
    return rel_fro_of(split_grad, whole_grad, names)


def _labels(y: Any) -> torch.Tensor | None:
    try:
        return labels(y)
    except LossError:
        return None


def _first_tensor(out: Any) -> torch.Tensor | None:
    """A forward's output with one row a sample: the output, its logits (transformers' ModelOutput), or its first
    tensor of more than 0 dimensions (a tuple's logits before an auxiliary loss)."""
    if torch.is_tensor(out):
        return out
    logits = out.get("logits") if isinstance(out, Mapping) else getattr(out, "logits", None)
    if torch.is_tensor(logits):
        return logits
    return next((t for t in batches.leaves(out) if t.dim() > 0), None)


def _scaled_after(x: Any, half: int, scale: float) -> Any:
    """A copy of `x` whose floating tensors' samples from `half` on are multiplied by `scale`."""
    dim = batches.current().sample_dim

    def one(t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point() or t.dim() == 0:
            return t
        t = t.clone()
        t.narrow(dim, half, t.shape[dim] - half).mul_(scale)
        return t

    return batches.apply(one, x)


def _samples(oracle: Oracle, layout: Layout, state: dict, batch, agreement: float) -> dict[str, Any]:
    """Rank 0's first forward against the same samples' rows of the global batch's forward; where they differ, the
    forward again with the other samples replaced by others of the batch (the same count)."""
    model = oracle.model64
    model.load_state_dict(state)
    x, y = batch
    n = batches.rows(x)
    idx = layout.positions(n)[0][3]
    if len(idx) < 2 or len(idx) == n:
        return {"tested": False, "why": "a forward of fewer than two samples, or of the whole batch"}
    with torch.no_grad(), data_dependence.watch(model) as reads:
        own = _first_tensor(batches.call(model, as_input(batches.take(x, idx), model, oracle.device)))
    with torch.no_grad():
        full = _first_tensor(batches.call(model, as_input(x, model, oracle.device)))
    model.load_state_dict(state)  # a forward in training mode moves buffers
    if own is None or full is None or own.shape[:1] != idx.shape or full.shape[0] != n:
        return {"tested": False, "why": "the model's output is not a tensor with one row a sample"}
    rows = _rel(own, full[idx.to(full.device)])
    out: dict[str, Any] = {"tested": True, "rows_distance_rel": rows, "own_read": reads.own_read}
    if rows <= agreement:
        out["cause"] = "samples_interact"
        return out
    outside = torch.tensor([i for i in range(n) if i not in set(idx.tolist())])
    half = len(idx) // 2
    if len(outside) < len(idx) - half:
        out["cause"] = "control_flow" if reads.own_read else None
        return out
    # the forward again, half its samples kept and the rest replaced by others of the batch (the same count), a few
    # times: the kept samples' outputs move with the others' values (the model mixes samples, or branches on their
    # content), or with none of them (a branch on the batch's size)
    g = torch.Generator().manual_seed(0)
    moved, swapped = 0.0, idx
    for scale in REPLACEMENTS:
        swapped = torch.cat([idx[:half], outside[torch.randperm(len(outside), generator=g)[: len(idx) - half]]])
        # the others' values scaled too: larger or smaller than the kept samples'
        inputs = _scaled_after(batches.take(x, swapped), half, scale)
        with torch.no_grad():
            again = _first_tensor(batches.call(model, as_input(inputs, model, oracle.device)))
        model.load_state_dict(state)
        moved = max(moved, _rel(again[:half], own[:half]))
    out.update(kept_rows_moved_rel=moved, replacements=len(REPLACEMENTS))
    if reads.own_read:
        out.update(cause="control_flow", branch="content")  # the model's own read of a value is a branch on it
    elif moved <= agreement:
        out.update(cause="control_flow", branch="size")
    elif any(t.is_floating_point() for t in batches.leaves(x)):
        # moved by the others' values: through a differentiable path (mixing), or only through which branch they
        # chose (capacity routing made of tensor ops: its mask carries no gradient)
        out["cross_sample_gradient_rel"] = cross = _cross_gradient(model, batches.take(x, swapped), half,
                                                                   oracle.device)
        model.load_state_dict(state)
        out.update(cause="model_interaction") if cross > agreement else out.update(cause="control_flow",
                                                                                    branch="content")
    else:
        out["cause"] = "model_interaction"
    return out


def _cross_gradient(model: nn.Module, x: Any, kept: int, device: torch.device) -> float:
    """The gradient of the first `kept` samples' outputs with respect to the other samples' floating inputs, relative
    to their gradient with respect to their own."""
    dim = batches.current().sample_dim
    inputs = batches.apply(lambda t: t.detach().requires_grad_(True) if t.is_floating_point() else t,
                           as_input(x, model, device))
    leaves = [t for t in batches.leaves(inputs) if t.requires_grad]
    first = _first_tensor(batches.call(model, inputs)).narrow(dim, 0, kept)
    grads = torch.autograd.grad(first.sum(), leaves, allow_unused=True)
    model.zero_grad(set_to_none=True)
    grads = [g for g in grads if g is not None]
    norm = lambda parts: float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p) for p in parts]))) \
        if parts else 0.0  # noqa: E731
    own = norm([g.narrow(dim, 0, kept) for g in grads])
    return norm([g.narrow(dim, kept, g.shape[dim] - kept) for g in grads]) / max(own, 1e-300)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    scale = max(float(torch.linalg.vector_norm(b)), 1e-300)
    return float(torch.linalg.vector_norm(a - b)) / scale
