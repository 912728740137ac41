"""The power each checked step must have for the verdict to say `equivalent`.

Owns: after the update check of a step, whether its gradient and update checks would catch a REQUIRED_POWER change of
their quantity (dpcompare.verify.judgement.tolerance's `min_detectable_rel`); where not, the part that cannot be checked, naming
the weak check, its floor, where that comes from and the remedy (said once; the checks go on). Imports no adapter.
"""

from __future__ import annotations

from dpcompare.verify.instruments.run_instruments import Bench
from dpcompare.verify.instruments.check_context import CheckContext, Finding
from dpcompare.verify.instruments.step_evidence import StepEvidence
from dpcompare.verify.judgement.tolerance import REQUIRED_POWER


class Power:
    name = "power"  # it fails nothing: a weak step makes the verdict unverifiable
    at = "updated"
    reads_oracle = True
    after_stop = False
    reads_references_after_update = False
    last_to_read_step = False

    @classmethod
    def applies(cls, ctx: CheckContext) -> bool:
        return True

    def __init__(self, ctx: CheckContext, bench: Bench) -> None:
        self.verdict = bench.verdict

    def judge(self, ctx: CheckContext, step: StepEvidence) -> Finding | None:
        checks = self.verdict.checks
        if not checks or checks[-1].step != step.step or checks[-1].update is None:
            return None  # no update was judged at this step (its loss scale overflowed)
        check = checks[-1]
        grad, update = check.min_detectable_rel, check.update.min_detectable_rel
        if max(grad, update) <= REQUIRED_POWER or any("cannot catch" in u for u in self.verdict.unverifiable):
            return None
        causes = []
        if grad > REQUIRED_POWER:
            worst = max((p for p in check.params), key=lambda p: p.judged_floor_rel_fro)
            causes.append(f"the gradient check detects only a {grad:.3g} change: at {ctx.floor_name} the reference "
                          f"regrouped differs from itself by {check.judged_floor:.3g} ({worst.parameter}){self._tf32()}"
                          "; a larger per-rank batch (BatchNorm over few samples amplifies rounding), float32 without "
                          "--amp, or --dtype float64 gives the check power")
        if update > REQUIRED_POWER:
            causes.append(f"the update check detects only a {update:.3g} change: the update is below what "
                          f"{ctx.dtype} storage of the weights resolves (its floor {check.update.floor:.3g}); a "
                          "larger --lr or --dtype float64 gives it power")
        return Finding(unverifiable=f"at step {step.step} the checks cannot catch a {REQUIRED_POWER:.0%} change of the "
                                    f"gradient or the update: {'; '.join(causes)}")

    def _tf32(self) -> str:
        tf32 = self.verdict.precision.tf32 if self.verdict.precision is not None else None
        if tf32 and (tf32.get("checked_matmul_allow_tf32") or tf32.get("checked_cudnn_allow_tf32")):
            return " (TF32 convolutions and matmuls: float32 inputs rounded to 10 mantissa bits)"
        return ""
