"""The forwards the oracle runs for a checked step, with the random numbers the ranks drew.

Owns: which forwards stand for a step's gradient: the global batch in one forward, or each replica's own forwards as
the backend split them (`Layout`), where BatchNorm without --sync-bn normalises each replica's samples alone, where
the forward depends on how the batch is split (dpcompare.verify.model_facts.batch_split finds it) or where the numbers the ranks drew
apply rank by rank (unless the loss is not a mean: then the global batch, the draws joined); the ranks' recorded draws
(dpcompare.verify.randomness.draw_recording) split forward by forward, unpacked once per step: the gradient check, the buffers and the
trajectory of a step share them (recorded draws that do not fit the forwards raise MaskMismatch); and the
per_replica_batchnorm note, how far the per-replica
gradient the run is judged against is from the single-process global-batch gradient. Imports no adapter.
"""
from __future__ import annotations

import torch

from dpcompare.contract import batches
from dpcompare.verify.randomness import draw_recording as mk
from dpcompare.verify.oracle.gradient_oracle import Grads, Layout, Masks, Oracle, Piece, global_pieces, replica_pieces
from dpcompare.verify.model_facts.split_causes import SPLIT_AGREEMENT, without_statistic
from dpcompare.verify.judgement.tolerance import UNIT_ROUNDOFF, rel_fro_of
from dpcompare.verify.judgement.verdict import Verdict


class Forwards:
    """The forwards of the steps of a run split as `layout` says, of a model with BatchNorm modules `batchnorms`;
    `per_replica`: BatchNorm without --sync-bn, the oracle runs each replica's forwards, as the backend does;
    `stochastic`: the forward draws random numbers. `dtype` and `depth`: the run's, for the note's floor."""

    def __init__(self, layout: Layout, oracle: Oracle, *, batchnorms: list[str], per_replica: bool, stochastic: bool,
                 dtype: str, depth: int, verdict: Verdict) -> None:
        self.layout, self.oracle, self.batchnorms, self.per_replica = layout, oracle, batchnorms, per_replica
        self.has_batchnorm = bool(batchnorms)
        self.stochastic, self.dtype, self.depth, self.verdict = stochastic, dtype, depth, verdict
        self.joined = False
        """The loss is not a mean over its samples (dpcompare.verify.model_facts.batch_split): the oracle runs the global batch in one
        forward, the ranks' masks joined, even where it would otherwise run the ranks' forwards for their masks."""
        self._unpacked: tuple[list[mk.MaskRecord], list[Masks]] | None = None
        """The last step's records and their unpacked masks."""

    def pieces(self, batch, records: list[mk.MaskRecord] | None) -> list[Piece]:
        """The forwards the oracle runs for this step (see the module docstring); raises MaskMismatch when the
        captured masks do not fit them."""
        n = batches.rows(batch[0])
        masks = self.masks(n, records) if records is not None else None
        if self.per_replica or (masks is not None and not self.has_batchnorm and not self.joined):
            return replica_pieces(batch, self.layout, masks)
        return self.whole(batch, masks)

    def whole(self, batch, masks: list[Masks] | None) -> list[Piece]:
        """The global batch in one forward, the ranks' masks (`masks`, each forward's) joined; raises MaskMismatch
        where they cannot be (not batch-first)."""
        if masks is None:
            return global_pieces(batch)
        n = batches.rows(batch[0])
        return global_pieces(batch, mk.combine(masks, [p[3] for p in self.layout.positions(n)], n))

    def join(self, batch, masks: list[Masks] | None, ranks: list[int]) -> list[Piece]:
        """The forwards of `ranks` joined into one forward of their samples (in the global batch's order), the masks
        each drew joined as `whole` joins them, weighted by their share of the global batch: the global batch itself
        where `ranks` are all of them. Raises MaskMismatch where the draws cannot be joined (not batch-first)."""
        if len(ranks) == self.layout.world_size:
            return self.whole(batch, masks)
        n = batches.rows(batch[0])
        chosen = [(i, p[3]) for i, p in enumerate(self.layout.positions(n)) if p[0] in ranks]
        idx = torch.sort(torch.cat([samples for _, samples in chosen])).values
        joined = None if masks is None else mk.combine(
            [masks[i] for i, _ in chosen], [torch.searchsorted(idx, samples) for _, samples in chosen], len(idx))
        return [Piece(batches.take(batch[0], idx), batches.take(batch[1], idx), self.layout.share_of(batch[1], idx),
                      joined)]

    def masks(self, batch_size: int, records: list[mk.MaskRecord]) -> list[Masks]:
        """Each forward's masks, in the order of `layout.positions`: a rank's masks split by micro-batch. Unpacked
        once per step: the gradient check, the buffers and the trajectory of a step share them."""
        cached = self._unpacked
        if cached is not None and len(cached[0]) == len(records) and all(a is b for a, b in zip(cached[0], records)):
            return cached[1]
        out = self._split_masks(batch_size, records)
        self._unpacked = (list(records), out)
        return out

    def _split_masks(self, batch_size: int, records: list[mk.MaskRecord]) -> list[Masks]:
        return split_masks(self.layout, batch_size, records)

    def note_per_replica(self, step: int, state: dict, batch, oracle: Grads, floor: Grads,
                         pieces: list[Piece]) -> None:
        """The distance between the per-replica gradient the run is judged against and the single-process
        global-batch gradient, measured once (the first checked step), in floors of the gradient check."""
        if not (self.per_replica and self.has_batchnorm) or self.verdict.batchnorm is not None:
            return  # per replica for another reason than BatchNorm: dpcompare.verify.model_facts.batch_split's note
        n = batches.rows(batch[0])
        whole, none = None, self.oracle.none
        try:
            masks = (mk.combine([p.masks or {} for p in pieces], [p[3] for p in self.layout.positions(n)], n)
                     if self.stochastic else None)
            whole = self.oracle.oracle_of(state, global_pieces(batch, masks))
        except mk.MaskMismatch:
            pass  # masks that are not batch-first cannot be joined: the distance stays unmeasured, and says so
        self.oracle.none = none  # the judged oracle's
        names = self.oracle.names
        floor_rel = max(rel_fro_of(floor, oracle, names), self.depth * UNIT_ROUNDOFF[self.dtype])
        distance = rel_fro_of(whole, oracle, names) if whole is not None else None
        ws, k, r = self.layout.world_size, self.layout.grad_accum, self.layout.replicas
        forwards = ws * k * r
        local = n // forwards
        shown = ", ".join(self.batchnorms[:4]) + (f" and {len(self.batchnorms) - 4} more" if len(self.batchnorms) > 4 else "")
        split = " x ".join([f"{ws} rank(s)"] + ([f"{k} micro-batches"] if k > 1 else []) +
                           ([f"{r} device replicas"] if r > 1 else []))
        measured = (f"at step {step} that gradient is {distance:.3g} (relative) from the single-process global-batch "
                    f"gradient, {distance / floor_rel:.3g}x the {self.dtype} noise floor" if distance is not None else
                    "its distance from the global-batch gradient was not measured (the captured masks are not batch-first)")
        # the cause tested, not assumed: BatchNorm on its running statistics makes the split the global batch
        tested = (without_statistic(self.oracle, state, replica_pieces(batch, self.layout), batch, SPLIT_AGREEMENT)
                  if distance is not None and not self.stochastic else None)
        if tested is not None:
            measured += (f"; with BatchNorm on its running statistics the split is {tested['distance_rel_fro']:.3g} "
                         f"from the global batch ({'the' if tested['holds'] else 'not the only'} cause)")
        self.verdict.batchnorm = {"semantics": "per_replica", "modules": list(self.batchnorms), "local_batch": local,
                                  "forwards": forwards, "step": step, "distance_rel_fro": distance,
                                  "floors": distance / floor_rel if distance is not None else None,
                                  "cause": {"name": "statistic" if tested and tested["holds"] else None,
                                            "evidence": {"statistic": tested}} if tested is not None else None}
        self.verdict.note("per_replica_batchnorm",
                          f"BatchNorm without --sync-bn ({len(self.batchnorms)} module(s): {shown}): each of the {split} "
                          f"normalises its own {local} samples, so the run computes the mean of those forwards' losses, "
                          f"and the oracle computes exactly that; {measured}; --sync-bn makes it one computation")


def split_masks(layout: Layout, batch_size: int, records: list[mk.MaskRecord]) -> list[Masks]:
    """Each forward's masks, in the order of `layout.positions`, from every rank's record (raises MaskMismatch where
    they fit no forwards)."""
    for record in records:
        for name, why in record.problems.items():
            raise mk.MaskMismatch(name, why)
    k = layout.grad_accum
    for rank, record in enumerate(records):
        if record.forwards > k:
            raise mk.MaskMismatch("", f"rank {rank} ran the model's forward {record.forwards} times in a step of "
                                      f"{k} micro-batch(es): its draws fit no forwards the oracle runs")
    # Each forward of a rank's step is one of its micro-batches (on each replica): its draws are that forward's.
    return [records[rank].calls(replica if layout.replicas > 1 else None, forward=micro)
            for rank, micro, replica, _ in layout.positions(batch_size)]

