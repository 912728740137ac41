"""What the model is, found before it is wrapped, and what the verdict says of the randomness its forward draws.

Owns: the model probe before wrapping (`probe`: one float64 forward/backward of the first global batch, for the
unused, frozen, sparse (a sparse `.grad`: nn.Embedding(sparse=True)) and random parts of the model: which module draws
with which random op, and whether replaying the recorded draws accounts for every random number the forward draws),
and the verdict's account of that randomness before the first step (`judge_randomness`): replayed, or the reason the
run cannot be checked against an oracle.
Everything here runs on generators forked from the run's. Imports no adapter.
"""

from __future__ import annotations

import gc
from typing import Any, Callable

import torch
from torch import nn

from dpcompare.contract import ModelFacts
from dpcompare.contract.sparse import sparse_grads
from dpcompare.verify.model_facts import data_dependence
from dpcompare.verify.randomness import draw_recording as mk
from dpcompare.verify.randomness import random_modules
from dpcompare.verify.oracle.gradient_oracle import verification_copy
from dpcompare.verify.judgement.verdict import Verdict
from dpcompare.contract import batches

STOCHASTIC_REL_DIFF = 2.0**-30
"""Two float64 forwards of the same input that differ by more than this (relative) draw random numbers:
some 10^6 float64 roundings, far below what one changed dropout mask element does (~1e-3)."""


def _flat(output: Any) -> torch.Tensor:
    """A forward's output as one float64 vector (a forward may return a tuple, logits and an auxiliary loss, or a
    structure: transformers' ModelOutput)."""
    return torch.cat([t.detach().double().reshape(-1) for t in batches.leaves(output)])


def probe(template: nn.Module, loss_fn: Callable, batch: Any, device: torch.device) -> ModelFacts:
    """One float64 forward/backward of the first global batch (which parameters get no gradient, which a sparse one,
    as the model built them), its random ops
    recorded at the dispatcher (which module draws with which op), a second forward of the same input (does the
    forward draw random numbers?) and, when it does, whether replaying the recorded draws accounts for all of it
    (which module draws where no replay reaches, and with what); where the forward reads the data into Python
    (data_dependence), the parameters that parts of the batch leave out."""
    # the run's own path (no switch to an alternative with float64 kernels): which parameters a part of the batch uses
    # is the run's question (an eager expert loop skips experts that a grouped matmul computes with no token)
    model = verification_copy(template, device, torch.float64, alternatives=False, sparse=True).train()
    x, y = batches.pair(batch)
    x, y = batches.to(x, device, torch.float64), batches.to(y, device)
    recorder = mk.MaskRecorder(model)
    restore_buffers = random_modules.buffers_restorer(model)
    with random_modules.isolated(device):
        with recorder.recording():
            with data_dependence.watch(model) as reads:
                first = batches.call(model, x)
            # from the buffers the first forward started from: a forward that updates its buffers (spectral_norm's
            # power iteration) draws nothing; only what the forward draws may part the two
            restore_buffers()
            with torch.no_grad():
                second = batches.call(model, x)  # its own draws (only the list of what draws is read from the record)
            # backward inside: a recomputing copy runs its forward again there, on the same attention path
            loss_fn(first, y).backward()
    record = recorder.take()
    diff = float(torch.linalg.vector_norm(_flat(first) - _flat(second)))
    norm = float(torch.linalg.vector_norm(_flat(first)))
    named = list(model.named_parameters())
    drawn = diff > STOCHASTIC_REL_DIFF * max(norm, 1e-300) or bool(record.masks) or bool(record.problems)
    uncaptured = None
    if drawn:
        with random_modules.isolated(device):
            uncaptured = mk.uncaptured(verification_copy(template, device, torch.float64), x)
    unused = tuple(n for n, p in named if p.requires_grad and p.grad is None)
    sparse = sparse_grads(model)  # before left_out_by_parts sets the gradients to None
    left_out = ()
    if reads.first is not None:  # only a forward that reads the data can leave out a part of itself by the data
        with random_modules.isolated(device):
            left_out = tuple(n for n in data_dependence.left_out_by_parts(model, loss_fn, x, y)
                             if n not in unused)
    facts = ModelFacts(
        unused=unused,
        frozen=tuple(n for n, p in named if not p.requires_grad),
        random_modules=tuple(random_modules.drawing_modules(template, [*record.masks, *record.problems])),
        random_ops=tuple(random_modules.draws_described(template, record)),
        stochastic=drawn,
        uncaptured=uncaptured,
        data_reads=reads.first, branches_on_data=reads.branch is not None, left_out_by_parts=left_out,
        sparse_grads=sparse,
    )
    # The copy is in a reference cycle (its recorder's dispatch mode refers back to the recorder): freed only by a
    # collection, which a run that allocates few Python objects may not start before its checks' peak (a float64 copy
    # of the model, 8 B/param, measured held through every checked step of a 22 M Llama-style run).
    del model, recorder, first, second, named
    gc.collect()
    return facts


def judge_randomness(facts: ModelFacts, replay_reason: str | None, verdict: Verdict) -> str | None:
    """The verdict's account of the forward's randomness (`verdict.stochastic`, and the masks_captured note where
    every rank's draws are replayed); returns why the run cannot be checked (None: it can). `replay_reason`: why the
    backend's random numbers are drawn where no recorded draw reaches (`Adapter.rng_replay_reason()`), or None."""
    drawn = ", ".join(facts.random_ops or facts.random_modules) or "an operation in forward"
    verdict.stochastic = {"stochastic": facts.stochastic, "modules": list(facts.random_modules),
                          "draws": list(facts.random_ops), "captured": False, "reason": None,
                          "capture_bytes_per_step": None}
    if not facts.stochastic:
        return None
    blockers = [b for b in (facts.uncaptured, replay_reason) if b]
    if blockers:
        verdict.stochastic["reason"] = "; ".join(blockers)
        return (f"the forward draws random numbers ({drawn}) and {'; '.join(blockers)}: comparing against an oracle "
                "that draws its own would measure randomness, not rounding; rerun with --no-dropout to check the "
                "computation deterministically")
    verdict.stochastic["captured"] = True
    verdict.note("masks_captured", f"the forward draws random numbers ({drawn}): each rank's draws are recorded where "
                                   "they are drawn (its random ops, at the dispatcher) and replayed in the oracle, the "
                                   "floor and the reference trajectory; scaled_dot_product_attention runs on its math "
                                   "path in the checked steps")
    return None
