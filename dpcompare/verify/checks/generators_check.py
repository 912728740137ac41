"""The ranks' generators, where the forward draws random numbers: each rank must draw its own.

Owns: the rng check, at every step of a model whose forward draws random numbers: two ranks whose generators are in
the same state before the forward draw identical dropout masks (every rank seeded alike), which no reduction undoes.
Imports no adapter.
"""

from __future__ import annotations

import math

from dpcompare.verify.instruments.run_instruments import Bench
from dpcompare.verify.instruments.check_context import CheckContext, Finding
from dpcompare.verify.instruments.step_evidence import StepEvidence
from dpcompare.verify.judgement.verdict import Divergence


class Generators:
    name = "rng"
    at = "reduced"
    reads_oracle = False
    after_stop = True  # it reads only what the ranks sent: it runs where nothing else can be checked
    reads_references_after_update = False
    last_to_read_step = False

    @classmethod
    def applies(cls, ctx: CheckContext) -> bool:
        return ctx.facts.stochastic

    def __init__(self, ctx: CheckContext, bench: Bench) -> None:
        pass

    def judge(self, ctx: CheckContext, step: StepEvidence) -> Finding | None:
        seen: dict[str, int] = {}
        for rank, sent in enumerate(step.ranks):
            digest = sent["rng"].digest
            if digest in seen:
                return Finding(Divergence(
                    step.step, "(generator state)", math.nan, 0.0, math.nan,
                    f"ranks {seen[digest]} and {rank} draw identical dropout masks: their generators are in the "
                    f"same state before the forward of step {step.step} (every rank seeded the same); each replica "
                    "needs its own seed for dropout and augmentation, and the same seed only for the weights",
                    check="rng", cause="same_seed"))
            seen[digest] = rank
        return None
