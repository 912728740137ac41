"""The buffers check: the module buffers across ranks, and against what each known semantics predicts.

Owns: the check's place in the list and what it records at every checked step: the buffer entries
(`Verdict.buffers`), the `buffers_per_rank` and `buffers_from_weights` notes, from dpcompare.verify.model_facts.buffer_semantics'
predictions (which own the semantics, the tolerance and the failure). After the gradient check in the list: of two
failed checks at one step, the gradient's is the run's first divergence. Imports no adapter.
"""

from __future__ import annotations

from dpcompare.verify.instruments.run_instruments import Bench
from dpcompare.verify.model_facts.buffer_semantics import BufferCheck
from dpcompare.verify.instruments.check_context import CheckContext, Finding
from dpcompare.verify.instruments.step_evidence import StepEvidence


class Buffers:
    name = "buffers"
    at = "reduced"
    reads_oracle = True
    after_stop = False
    reads_references_after_update = False
    last_to_read_step = False

    @classmethod
    def applies(cls, ctx: CheckContext) -> bool:
        return True

    def __init__(self, ctx: CheckContext, bench: Bench) -> None:
        self.verdict = bench.verdict
        self.buffers = BufferCheck(bench.oracle, ctx.depth, ctx.dtype)

    def judge(self, ctx: CheckContext, step: StepEvidence) -> Finding | None:
        o = step.oracle
        failure = self.buffers.check(step.step, o.state, step.batch, ctx.layout, [i["buffers"] for i in step.ranks],
                                     o.forward_masks)
        self.verdict.buffers = self.buffers.entries()
        if (text := self.buffers.note()) is not None:
            self.verdict.notes = [n for n in self.verdict.notes if n.code != "buffers_per_rank"]
            self.verdict.note("buffers_per_rank", text)
        self.verdict.notes = [n for n in self.verdict.notes if n.code != "buffers_from_weights"]
        if (text := self.buffers.weights_note()) is not None:
            self.verdict.note("buffers_from_weights", text)
        return Finding(failure) if failure is not None else None

    def reused(self) -> dict:
        """What the check took from an earlier step rather than compute again (`Verdict.oracle_reuse`)."""
        shown = self.buffers.unwritten
        return {"buffers": {"unwritten_at": shown[0], "forward_skipped": shown[1:]}} if shown[1:] else {}
