"""The verifier's instruments for one run, built once from its context and shared by its checks.

Owns: `Bench`: the float64 oracle and the run-precision copies (dpcompare.verify.oracle.gradient_oracle), the forwards they run
(dpcompare.verify.model_facts.replica_forwards, dpcompare.verify.model_facts.batch_split), the run-precision reference (dpcompare.verify.instruments.run_reference),
the reference trajectory trained beside the run (dpcompare.verify.trajectory.reference_trajectory), the backend as the checks read it
(its loss scaler, its optimizer's hyper-parameters), and the `Verdict` every check records into; the state a step's
forward ran from, rebuilt from what the ranks read. Imports no adapter: the backend is read through the contract.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch import nn

from dpcompare.contract import batches
from dpcompare.contract import Adapter, Wrapped
from dpcompare.verify.oracle import gradient_oracle as eq
from dpcompare.verify.randomness import draw_recording as mk
from dpcompare.verify.instruments.check_context import CheckContext, Finding
from dpcompare.verify.memory.divider import Divider
from dpcompare.verify.oracle.gradient_oracle import Piece
from dpcompare.verify.judgement.held_values import Compact
from dpcompare.verify.model_facts.replica_forwards import Forwards
from dpcompare.verify.instruments.run_reference import RunReference
from dpcompare.verify.model_facts.batch_split import SplitCheck
from dpcompare.verify.model_facts.split_causes import in_proportion
from dpcompare.verify.trajectory.reference_trajectory import Trajectory


def _own_count_apart(pieces: list[Piece], layout: eq.Layout) -> bool:
    """Whether the loss over items is normalised by each forward's own count (not --loss-normalisation global) and
    `pieces` hold their items out of proportion to their samples: their weights (shares of the samples) are then not
    their shares of the items, and the split parts from the joined forward by the normalisation. Measured on the
    pair, it would only be measured again on the global batch."""
    if layout.items is None or layout.global_count:
        return False
    return not in_proportion(pieces, [layout.items(p.y) for p in pieces])


class Bench:
    """Rank 0's copies of the model and what computes with them, for the run `ctx` describes."""

    def __init__(self, ctx: CheckContext, *, template: nn.Module, loss_fn: Callable, wrapped: Wrapped,
                 backend: Adapter, divider: Divider | None = None) -> None:
        settings = ctx.settings
        self.backend, self.module = backend, wrapped.module
        self.oracle = eq.Oracle(template, loss_fn, settings.dtype, ctx.device, ctx.recipe)
        self.trajectory = Trajectory(template, loss_fn, ctx.factory, settings.dtype, ctx.device, ctx.depth, ctx.u_wire,
                                     ctx.recipe, prestep=ctx.prestep is not None, clip=settings.clip_grad_norm,
                                     peers=divider.peers if divider is not None else None)
        self.verdict = eq.Verdict(notes=list(wrapped.notes))
        # BatchNorm without --sync-bn: the oracle runs each replica's forwards, as the backend does (as it does where
        # the forward depends on the split, which dpcompare.verify.model_facts.batch_split finds at the first checked step).
        per_replica = ctx.has_batchnorm and not settings.sync_bn and ctx.layout.splits_the_batch
        self.forwards = Forwards(ctx.layout, self.oracle, batchnorms=list(ctx.batchnorms), per_replica=per_replica,
                                 stochastic=ctx.facts.stochastic, dtype=settings.dtype, depth=ctx.depth,
                                 verdict=self.verdict)
        self.split = SplitCheck(self.oracle, self.forwards, depth=ctx.depth, verdict=self.verdict,
                                applies=ctx.layout.splits_the_batch and not ctx.has_batchnorm)
        self.reference = RunReference(self.oracle, ctx.layout, dtype=settings.dtype, world_size=ctx.world_size,
                                      wire=ctx.wire, wired=ctx.wired, has_batchnorm=ctx.has_batchnorm, sync_bn=settings.sync_bn,
                                      verdict=self.verdict, split=self.split, compiled=settings.compile)
        self.divider = divider
        """Where the ranks share the forwards (dpcompare.verify.memory.divider): the oracle's and the references' copies ask
        every rank for its own forwards; the trajectory's copies are held in ranges over the ranks
        (dpcompare.verify.trajectory.trajectory_ranges)."""
        self.oracle.divider = divider
        if divider is not None:
            divider.own(self.oracle.model64, ctx.factory)
        self.layout = ctx.layout
        self.joined: list[dict] = []
        """The forwards `joined_pair` joined, step by step: the ranks, and the samples of the joined forward."""
        self.reads_data = ctx.facts.branches_on_data
        """The probe saw the model's own code branch on the data: the oracle keeps the global batch's own forward."""
        self.optimizer = backend.optimizer_view()[0]

        """The torch optimizer behind the backend's: its hyper-parameters (its state comes with each step's Reads)."""
        named = {id(p): n for n, p in reversed(list(template.named_parameters()))}
        self.state_keys = {k: named[id(t)] for k, t in template.state_dict(keep_vars=True).items() if id(t) in named}
        """State-dict key -> the parameter it holds, by name: a tied weight (an LM head sharing the embedding) has
        several keys and one name."""

    def run_state(self, masters: dict[str, torch.Tensor], before: dict, held: Compact | None = None) -> dict:
        """The state the step's forward ran from: the parameters the optimizer holds (`masters`: fp32 master values
        where the backend keeps them apart; snapshotted here, or the snapshot `held` already took) and the module
        buffers as they were before the forward (`before`)."""
        state = {}
        for key, value in self.module.state_dict().items():
            name = self.state_keys.get(key)  # a tied weight is in the state dict under each of its names
            if name is None or name not in masters:
                state[key] = value.detach().clone()
            elif held is not None and name in held:
                state[key] = held.held(name)
            else:
                state[key] = masters[name].detach().clone()
        # The forward ran from the buffers before it (it has updated them since): the oracle starts there too.
        state.update({k: v for k, v in before.items() if k in state})
        return state

    def shared(self, pieces: list[Piece], batch, forward_masks: list[eq.Masks] | None) -> list[Piece]:
        """The forwards to compute `pieces`' gradient by where the ranks share them: the ranks' own forwards in place
        of one forward of the global batch, where that was measured to be the same function (the split's float64
        gradient is the global batch's: dpcompare.verify.model_facts.batch_split) and nothing couples the ranks' samples; else
        `pieces`. Not where the model's own code branches on the data (the probe's `branches_on_data`): a branch on
        the local batch can agree with the global batch's at the first step and not later, which only the global
        batch's own forward shows (dpcompare.verify.model_facts.batch_split reconsiders it at every checked step). Where the shards do
        stand for it, the step's oracle holds their losses against the global batch's own (dpcompare.verify.
        step_evidence): a split that parts later through tensor ops alone shows there."""
        f = self.split.finding
        if (self.divider is None or len(pieces) != 1 or pieces[0].position is not None or not self.split.applies
                or self.forwards.joined or f is None or f.semantics != "global" or self.reads_data):
            return pieces
        return eq.replica_pieces(batch, self.layout, forward_masks)

    def split_on_a_pair(self, step: int, state: dict, batch, forward_masks: list[eq.Masks] | None,
                        pieces: list[Piece]) -> list[Piece] | None:
        """At the first checked step, where two ranks or more share the oracle's forwards and `pieces` is the global
        batch the split is still to be measured against: the split measured on ranks 0 and 1's forwards joined
        against their shards instead (dpcompare.verify.model_facts.batch_split's `measure_pair`, each weighted as a share of the two
        ranks' samples). The ranks' shards, which then stand for the global batch at this step as at the later ones
        (`shared`), where it found them `global`; None where it does not apply or found anything else (the global
        batch measures it). Rank 0 computes two ranks' samples in one forward where the global batch's would be N
        ranks'; at two ranks the pair is the global batch, and what this saves is memory: the joined forward's
        gradient is compared as its backward completes it, where the global batch's measurement holds it whole on
        rank 0 (8 B/param)."""
        check = self.split
        if (self.divider is None or self.layout.world_size < 2 or check.finding is not None or check.unmeasured
                or not check.applies or self.forwards.joined or self.reads_data or len(pieces) != 1
                or pieces[0].position is not None):
            return None
        pair = [0, 1]
        try:
            joined = self.forwards.join(batch, forward_masks, pair)
        except mk.MaskMismatch:
            return None  # draws that cannot be joined: the global batch's measurement says so
        joined = [dataclasses.replace(joined[0], weight=1.0)]
        shards = eq.replica_pieces(batch, self.layout, forward_masks, ranks=pair)
        if _own_count_apart(shards, self.layout):
            return None  # normalised by each rank's own count of its items: the global batch measures by how much
        if not check.measure_pair(step, state, joined, shards, pair):
            return None
        return eq.replica_pieces(batch, self.layout, forward_masks)

    def joined_pair(self, batch, forward_masks: list[eq.Masks] | None) -> tuple[list[Piece], float]:
        """Where the shards stand for the global batch (`shared`): two ranks' forwards joined into one forward, the
        next pair in turn (ranks r and r + 1), and those forwards' float64 losses in the step's oracle (weighted as
        their gradients, dpcompare.verify.memory.divider's `last_losses`; a rank with no forwards adds none): what the step's
        oracle holds the shards to. It costs two ranks' samples at any world size, where the global batch's own forward
        costs N (with two ranks it is the global batch). Samples that interact through the batch part the joined
        forward from its pieces as they part the global batch from the shards; the first checked step measured the
        split on the global batch itself."""
        ranks = self.layout.world_size
        first = len(self.joined) % ranks
        pair = sorted({first, (first + 1) % ranks})
        pieces = self.forwards.join(batch, forward_masks, pair)
        self.joined.append({"ranks": pair, "samples": int(batches.rows(pieces[0].x))})
        return pieces, sum(self.divider.last_losses.get(r, 0.0) for r in pair)

    def mask_failure(self, step: int, exc: mk.MaskMismatch) -> Finding:
        """The draws of `step` cannot be replayed: nothing random can be checked from here on."""
        self.verdict.stochastic["captured"] = False
        self.verdict.stochastic["reason"] = f"{exc.module}: {exc}"
        return Finding(unverifiable=f"the random numbers drawn in {exc.module or 'the model itself'} could not be "
                                    f"replayed at step {step} ({exc.reason}): the oracle would measure randomness, not "
                                    "rounding; rerun with --no-dropout", stop=True)
