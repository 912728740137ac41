"""The trajectory check: after every step, the run's parameters against a float64 single process trained beside it.

Owns: the check's place in the list and what it does at every step: the reference trajectory's step
(dpcompare.verify.trajectory.reference_trajectory trains the float64 and run-dtype copies; skipped where the loss scaler skipped: a checked
step as the recipe's overflow predicts, an unchecked one as the backend took it), the drift entry judged against the
run-dtype copy's, the non-float parameters compared bitwise, and the parameters the oracle coverage leaves out
followed at the run's values. Imports no adapter.
"""

from __future__ import annotations

from dpcompare.contract import batches
from dpcompare.contract.amp import ScalerState
from dpcompare.verify.randomness import draw_recording as mk
from dpcompare.verify.instruments.run_instruments import Bench
from dpcompare.verify.instruments.check_context import CheckContext, Finding
from dpcompare.verify.instruments.step_evidence import StepEvidence
from dpcompare.verify.judgement.verdict import Divergence, Verdict, worst


class Trajectory:
    name = "trajectory"
    at = "updated"
    reads_oracle = False  # every step
    after_stop = False
    reads_references_after_update = False
    last_to_read_step = False

    @classmethod
    def applies(cls, ctx: CheckContext) -> bool:
        return True

    @classmethod
    def summary(cls, verdict: Verdict, policy: dict) -> dict:
        """The check's entry in the verdict's `checks`: its worst judged step's drift (`Verdict.drift`)."""
        drift = [e for e in verdict.drift if e.get("noise_ratio") is not None]
        most = max(drift, key=lambda e: e["noise_ratio"], default=None)
        return {"status": verdict.check_status(cls.name, bool(drift)),
                "noise_ratio": most["noise_ratio"] if most else None,
                "rel_param_distance": most["rel_param_distance"] if most else None,
                "floor_rel_param_distance": most["floor_rel_param_distance"] if most else None,
                "step": most["step"] if most else None,
                "min_detectable_rel": worst([e["tolerance"] for e in drift])}

    def __init__(self, ctx: CheckContext, bench: Bench) -> None:
        self.bench, self.verdict, self.trajectory = bench, bench.verdict, bench.trajectory
        self.taken: list[int] = []
        """The steps whose gradients the trajectory took from the oracle's and the reference's (`ahead`)."""
        self.run_taken: list[int] = []
        """The steps whose run-precision copy took its gradient from the run-precision reference (`ahead`): its
        weights were the run's, bitwise."""

    def ahead(self, ctx: CheckContext, step: StepEvidence, private: bool) -> None:
        """At a checked step's reduce, once the checks that read the oracle have: where this step's gradients of the
        reference trajectory are the ones the oracle and the run-precision reference just computed (the same forwards
        at the same weights: a fresh run's first step, dpcompare.verify.trajectory.reference_trajectory.Trajectory.take), its copies step
        from them now instead of computing them again after the update. `private`: the oracle's gradients are read
        after this."""
        o = step.oracle
        if o is None or o.overflow or self.bench.backend.scaler_state() is not None:
            return
        try:
            pieces = self._pieces(step)
        except mk.MaskMismatch:
            return  # the step computes its own, and says why
        oracle = self.bench.oracle
        if self.trajectory.take(pieces, o.oracle, o.floor, (oracle.model64, oracle.model_run), private):
            self.taken.append(step.step)
        elif self.trajectory.take_run(pieces, o.floor, oracle.model_run):
            self.run_taken.append(step.step)

    def reused(self) -> dict:
        """What the check took from the oracle rather than compute again, and how its float64 copy was held between
        steps (`Verdict.oracle_reuse`)."""
        out = {"gradients_from_oracle": list(self.taken)} if self.taken else {}
        if self.run_taken:
            out["run_gradients_from_reference"] = list(self.run_taken)
        held = self.trajectory.offsets
        if held.elements:
            out["held_as_offsets"] = {"elements": held.elements, "kept_float64": held.kept, "whole": held.whole,
                                      "whole_untested": held.untested, "bound": held.bound}
        return {"trajectory": out} if out else {}

    def _pieces(self, step: StepEvidence) -> list:
        pieces = self.bench.forwards.pieces(step.batch, step.records)
        masks = (self.bench.forwards.masks(batches.rows(step.batch[0]), step.records) if step.records is not None
                 else None)
        return self.bench.shared(pieces, step.batch, masks)

    def judge(self, ctx: CheckContext, step: StepEvidence) -> Finding | None:
        after = self.bench.backend.scaler_state()
        if after is not None:
            self.verdict.precision.skipped_total = after.skipped_steps
        if step.step not in self.taken:
            try:
                self.trajectory.step(self._pieces(step), self._loss_scale(step), skip=self._skipped(step, after),
                                     at=step.step)
            except mk.MaskMismatch as exc:
                return self.bench.mask_failure(step.step, exc)
        entry = self.trajectory.judge(step.step, dict(step.masters), ctx.world_size)
        self.trajectory.follow(step.masters, ctx.unchecked)
        self.verdict.drift.append(entry)
        if (carried := self.trajectory.carried_divergence(step.step, step.masters)) is not None:
            return Finding(carried)
        if entry["ok"] is False:
            return Finding(Divergence(
                step.step, entry["worst_parameter"], entry["rel_param_distance"], entry["tolerance"],
                entry["noise_ratio"],
                f"the parameters after step {step.step} are {entry['rel_param_distance']:.2e} from the float64 "
                f"reference trajectory, {entry['noise_ratio']:.3g}x the drift of a {ctx.dtype} single process "
                f"({entry['floor_rel_param_distance']:.2e}): the weights changed in a way the checked gradients and "
                "updates do not account for (an unchecked step, see --check-every, or a change between steps)",
                check="trajectory", cause="trajectory"))
        return None

    @staticmethod
    def _loss_scale(step: StepEvidence) -> float:
        """The scale this step's backward used, read before the step (the scaler may have changed it since)."""
        return step.scaler_before.scale if step.scaler_before is not None else 1.0

    def _skipped(self, step: StepEvidence, after: ScalerState | None) -> bool:
        """Whether the reference skips this step: a checked step where the recipe overflows (the backend is judged on
        it), an unchecked step as the backend took it."""
        steps = self.verdict.precision.steps
        if steps and steps[-1].step == step.step:
            return steps[-1].predicted_overflow
        before = step.scaler_before
        return before is not None and after is not None and after.skipped_steps > before.skipped_steps
