"""The gradient check: the reduced gradient against the float64 oracle of the global-batch loss.

Owns: at every checked step whose loss scale did not overflow, the backend's reduced gradient judged per parameter
and as one vector against the run-precision reference the oracle step computed (dpcompare.verify.instruments.step_evidence), in
multiples of the floor of what data parallelism changes (dpcompare.verify.judgement.tolerance); the ranks' reduced gradients
against each other (by digest); how the backend left the gradients of parameters that take no part in the loss; and
the diagnosis of a failed gradient (dpcompare.verify.diagnosis.diagnose). Imports no adapter.
"""

from __future__ import annotations

from dpcompare.verify.oracle import gradient_oracle as eq
from dpcompare.verify.instruments.run_instruments import Bench
from dpcompare.verify.instruments.check_context import CheckContext, Finding
from dpcompare.verify.instruments.step_evidence import StepEvidence
from dpcompare.verify.diagnosis.diagnose import GradientEvidence, diagnose_gradient, reason_of
from dpcompare.verify.judgement.tolerance import ParamError, allowed_floor, classic_tolerance, coverage, rel_fro_of
from dpcompare.verify.judgement.verdict import Verdict, finite, worst


class Gradient:
    name = "gradient"
    at = "reduced"
    reads_oracle = True
    after_stop = False
    reads_references_after_update = False
    last_to_read_step = False

    @classmethod
    def applies(cls, ctx: CheckContext) -> bool:
        return True

    @classmethod
    def summary(cls, verdict: Verdict, policy: dict) -> dict:
        """The check's entry in the verdict's `checks`: the worst of its checked steps, and the floor its noise ratio
        is a multiple of (recorded: readers never recompute it). Each step's own is the step's record itself."""
        checks = verdict.checks
        power = worst([c.min_detectable_rel for c in checks])
        entry = {"status": verdict.check_status(cls.name, bool(checks)),
                 "noise_ratio": worst([c.noise_ratio for c in checks]),
                 "max_rel_fro_err": worst([c.max_rel_fro_err for c in checks]),
                 "noise_floor_rel_fro": worst([c.floor for c in checks]),
                 "judged_rel_fro_err": worst([p.judged_rel_fro_err for c in checks for p in c.params if p.judged]),
                 "dp_floor_rel_fro": worst([c.judged_floor for c in checks]),
                 "min_detectable_rel": finite(power) if power is not None else None,
                 "coverage": coverage(checks[-1].params).to_dict() if checks else None}
        if entry["dp_floor_rel_fro"] is None or not policy:  # no floor measured, or no policy to scale it by
            entry["floor_rel_fro"] = None
            return entry
        u_sum = policy["unit_roundoff"] if verdict.wire_rounding == "measured" else policy["unit_roundoff_wire"]
        entry["floor_rel_fro"] = allowed_floor(
            entry["dp_floor_rel_fro"], depth=policy["depth"], unit_roundoff=policy["unit_roundoff"],
            world_size=policy["world_size"], u_sum=u_sum)
        return entry

    def __init__(self, ctx: CheckContext, bench: Bench) -> None:
        self.bench, self.verdict = bench, bench.verdict
        self.previous: tuple[int, dict[str, str]] | None = None
        """The last compared step's reduced gradient, a digest per parameter, for a diagnosis that looks back (a stale
        gradient is that step's to the bit): not the gradient itself, 4 bytes a parameter held from step to step."""

    def judge(self, ctx: CheckContext, step: StepEvidence) -> Finding | None:
        o, names = step.oracle, list(ctx.names)
        if o.overflow:
            return None  # the loss scaler's to handle (the loss_scale check)
        params, model = eq.compare(o.grads, o.oracle, o.floor, dtype=ctx.dtype, world_size=ctx.world_size,
                                   depth=ctx.depth, u_sum=ctx.u_wire if o.wire is None else None, names=names,
                                   spread=o.spread)
        digests = eq.first_mismatch([i["grads"] for i in step.ranks], list(ctx.all_names))
        self.verdict.checks.append(eq.StepCheck(step.step, params, True, digests is None, model=model))
        self._record_unused(ctx, step.ranks)
        finding = None
        failing = [p for p in params if not p.ok]
        if not model.ok and not failing:  # spread thin over the parameters: all of them are the evidence
            failing = sorted(params, key=lambda p: -p.judged_rel_fro_err / max(p.tolerance_rel_fro, 1e-300))
        apart = self._ranks_apart(ctx, step.ranks)
        if not failing and apart:  # rank 0's gradient is right, another rank's is not: the same evidence
            failing = [p for p in params if p.parameter in apart]
        now = self._digests(ctx, step)
        if failing and self.verdict.first_divergence is None:
            finding = Finding(self._diagnosed(ctx, step, params, failing, apart, now))
        self.previous = (step.step, now)
        return finding

    @staticmethod
    def _digests(ctx: CheckContext, step: StepEvidence) -> dict[str, str]:
        """Rank 0's reduced gradient, a digest per parameter: the one every rank sends where there are several (the
        replicas' comparison), else taken here."""
        names = list(ctx.all_names)
        mine = step.ranks[0]["grads"] if len(step.ranks) > 1 else eq.grad_digests(step.reads.grads, names)
        return dict(zip(names, mine))

    def _diagnosed(self, ctx: CheckContext, step: StepEvidence, params: list[ParamError], failing: list[ParamError],
                   apart: list[str], digests: dict[str, str]) -> eq.Divergence:
        """The failed check's divergence, with the cause the diagnosis finds."""
        o, names, settings = step.oracle, list(ctx.names), ctx.settings
        model_floor = rel_fro_of(o.floor, o.oracle, names)
        scaled = o.scaler is not None
        evidence = GradientEvidence(
            step=step.step, grads=o.grads, oracle_grads=o.floor, tolerance=classic_tolerance(
                params, model_floor, ctx.depth, ctx.dtype, ctx.world_size, ctx.u_wire),
            oracle=self.bench.oracle, state=o.state, batch=step.batch, world_size=ctx.world_size,
            grad_accum=settings.grad_accum, shard_digests=[i["shard"] for i in step.ranks],
            has_batchnorm=ctx.has_batchnorm, sync_bn=settings.sync_bn, compression=ctx.wire,
            dtype=ctx.dtype, layout=ctx.layout, per_replica=self.bench.forwards.per_replica, masks=o.forward_masks,
            previous=self.previous, digests=digests, loss_scale=o.loss_scale if scaled else None,
            judged_tolerance={p.parameter: p.tolerance_rel_fro for p in params},
            missing=frozenset(n for n in names if step.reads.grads.get(n) is None and n not in o.none),
            rank_norms=[i.get("grad_norms") or {} for i in step.ranks] if apart else None,
            redrawn={name: f"rank {rank}: {how}" for rank, r in reversed(list(enumerate(step.records or [])))
                     for name, how in r.redrawn.items()})
        found = diagnose_gradient(evidence, [p.parameter for p in failing])
        first = next((p for p in failing if not p.ok), failing[0])
        return eq.Divergence(step.step, first.parameter, first.judged_rel_fro_err, first.tolerance_rel_fro,
                             first.noise_ratio, reason_of(found), check="gradient", cause=found[0].cause,
                             parameters=[p.parameter for p in failing])

    @staticmethod
    def _ranks_apart(ctx: CheckContext, ranks: list[dict]) -> list[str]:
        """The parameters whose reduced gradient differs between ranks (by digest): every backend hands every rank the
        same reduced gradient."""
        per_rank = [i["grads"] for i in ranks]
        return [n for k, n in enumerate(ctx.all_names) if n in ctx.names
                and any(d[k] != per_rank[0][k] for d in per_rank[1:])]

    def _record_unused(self, ctx: CheckContext, ranks: list[dict]) -> None:
        forms = self.verdict.parameters["unused_grad"]
        for name in ctx.facts.unused:
            seen = {i["unused"].get(name, "none") for i in ranks}
            forms[name] = seen.pop() if len(seen) == 1 else "mixed"
