"""Update hypotheses: the known faults of an optimizer update, and the update each would have produced.

Owns: _UpdateHypotheses, whose methods are the hypotheses for a failed update check, in the order they are tried
(non-finite values, a skipped step, a parameter group stepped with another group's hyper-parameters, the schedule
at another step, the learning rate scaled by the world size, a double step, the optimizer state, a zero gradient where
none belongs, weight decay, clipping by the global norm or part by part, a scaled step size, a shard never applied). Each replays the reference step with its fault (UpdateEvidence.step_with) and
claims the failing parameters whose update that candidate explains (dpcompare.verify.diagnosis.explanation). Imports no
adapter.
"""

from __future__ import annotations

import math

import torch

from dpcompare.verify.replay.clipping_rule import clip_coefficient
from dpcompare.verify.oracle.gradient_oracle import Grads, flat, rel_fro
from dpcompare.verify.diagnosis.failure_evidence import UpdateEvidence
from dpcompare.verify.diagnosis.explanation import SCALE_AGREEMENT, Diagnosis, _common_scale, _Hypothesis, _matching, _share
from dpcompare.verify.replay.optimizer_rebuild import ScheduledStep
from dpcompare.verify.diagnosis.state_comparison import FRESH_STEPPED_TRAP, _same_state
from dpcompare.verify.replay.optimizer_replay import state_summary


class _UpdateHypotheses:
    """The known faults of an optimizer update, in the order they are tried. Each method takes the failing
    parameters not yet explained and returns the diagnoses whose candidate update matches the backend's."""

    NONE = ("the update matches none of the known patterns (a group's hyper-parameters, the schedule's step, learning "
            "rate x N, a double step, optimizer state, weight decay, clipping by the global norm or by parts' norms, a "
            "scaled step size, a part never applied)")

    def __init__(self, ev: UpdateEvidence) -> None:
        self.ev = ev
        self.names, self.d, self.ref = ev.names, ev.delta, ev.reference
        self.share = _share(self.ref, self.names)
        self.n = ev.world_size
        self.backend_lr = sorted({float(h["lr"]) for h in ev.backend_hparams if "lr" in h})
        self.lr_said = (f"the backend's optimizer runs at lr {', '.join(f'{v:g}' for v in self.backend_lr)}, --lr is "
                        f"{ev.lr:g}" if self.backend_lr and self.backend_lr != [ev.lr] else f"--lr is {ev.lr:g}")

    def ordered(self) -> list[_Hypothesis]:
        return [self.non_finite, self.skipped, self.group_hparams, self.schedule, self.lr_scaled, self.double_step,
                self.state, self.unused_zero_grad, self.weight_decay, self.clipped, self.clipped_in_parts, self.scale,
                self.unapplied]

    def determined(self, names: list[str]) -> bool:
        """Whether a mechanism fitted to the updates of `names` (a weight decay, a clipping coefficient) says anything
        of them: they hold two elements or more. One coefficient fits any one value (a 0-dim parameter alone, CLIP's
        logit_scale: any wrong update of it is some weight decay), so there a fit names no cause. The step-size ratio
        (`scale`) is still said: of one element it is what the update measured, not a fitted mechanism."""
        return sum(self.ref[p].numel() for p in names) > 1

    def match(self, candidate: Grads, remaining: list[str]) -> list[str]:
        return _matching(self.d, candidate, self.ref, remaining, self.ev.tolerance, self.share)

    def non_finite(self, remaining: list[str]) -> list[Diagnosis]:
        bad = [p for p in remaining if not bool(torch.isfinite(self.d[p]).all())]
        return [Diagnosis("non_finite", "the backend's update holds inf or NaN where the reference's is finite", bad)]

    def unapplied(self, remaining: list[str]) -> list[Diagnosis]:
        """A block of a parameter that did not move where the reference's does, the rest right: one rank's shard of
        a sharded parameter kept (or rolled back to) its old values after the step."""
        out = []
        for p in remaining:
            held = (self.d[p] == 0) & (self.ref[p] != 0)
            if not bool(held.any()):
                continue
            candidate = {p: torch.where(held, torch.zeros_like(self.ref[p]), self.ref[p])}
            if not _matching(self.d, candidate, self.ref, [p], self.ev.tolerance, self.share):
                continue
            rows = held.reshape(held.shape[0], -1).any(dim=1).nonzero().reshape(-1) if held.dim() else held.reshape(1)
            where = (f"rows {int(rows[0])}-{int(rows[-1])} of {held.shape[0]}" if held.dim() and rows.numel()
                     else f"{int(held.sum())} element(s)")
            share = held.shape[0] and rows.numel() / held.shape[0] if held.dim() else 1.0
            out.append(Diagnosis("unapplied_shard",
                                 f"{where} of {p} did not move where the reference update moves them ({share:.0%} of its "
                                 "rows), and the rest of the update is right: one rank's shard of the parameter kept or "
                                 f"got back its old values after the step (with {self.n} rank(s) a dim-0 shard is about "
                                 f"1/{self.n} of the rows): the sharded step or the all-gather after it lost that part",
                                 [p]))
        return out

    def skipped(self, remaining: list[str]) -> list[Diagnosis]:
        """The loss scaler skipped a step whose gradient is finite (it found inf/NaN where there was none)."""
        if not self.ev.skipped:
            return []
        still = [p for p in remaining if not bool(self.d[p].any())]
        return [Diagnosis("skipped_step", f"the backend's loss scaler skipped step {self.ev.step} (the weights did not "
                          "move and it counted a skip) although the reduced gradient passed the check and is finite: "
                          "it tests for overflow on something other than the unscaled reduced gradient (a rank's "
                          "gradient before the reduce, a stale flag), so it skips where the other backends step",
                          still)]

    def group_hparams(self, remaining: list[str]) -> list[Diagnosis]:
        """A parameter group stepped with another group's value of a hyper-parameter (its weight decay on the group
        that has none, the first group's learning rate on one of its own): the backend lost the groups' own values.
        Tried where the run's optimizer has groups (dpcompare.verify.replay.optimizer_rebuild), one differing value at a time."""
        view = self.ev.factory
        if not isinstance(view, ScheduledStep) or len(view.reference.groups) < 2:
            return []
        out, left = [], list(remaining)
        for gid, members in enumerate(view.reference.groups):
            mine = [p for p in left if p in set(members)]
            own = view.hparams(gid)
            for other in (o for o in range(len(view.reference.groups)) if o != gid and mine):
                theirs = view.hparams(other)
                for key in [k for k in own if k in theirs and k != "initial_lr" and repr(own[k]) != repr(theirs[k])]:
                    matched = self.match(self.ev.step_with(factory=view.changed(gid, **{key: theirs[key]})), mine)
                    if matched:
                        out.append(Diagnosis("group_hparams", f"parameter group {gid} took a step with group "
                                             f"{other}'s {key} ({_text(theirs[key])}) where their own group's is "
                                             f"{_text(own[key])} at step {view.step}: the backend lost the parameter "
                                             "groups' own hyper-parameters; build its optimizer over the groups as "
                                             "given", matched))
                        mine = [p for p in mine if p not in matched]
                        left = [p for p in left if p not in matched]
        return out

    def schedule(self, remaining: list[str]) -> list[Diagnosis]:
        """The learning-rate schedule at another step than the run's: a scheduler stepped twice per step, once too
        often, never, or one step behind (dpcompare.verify.replay.optimizer_rebuild: the reference's schedule at each step)."""
        view = self.ev.factory
        if not isinstance(view, ScheduledStep) or not view.reference.scheduled:
            return []
        k = view.step
        groups = range(len(view.reference.groups))
        for s in sorted({s for s in (0, k - 1, k + 1, 2 * k, 2 * k + 1, 3 * k) if s >= 0 and s != k}):
            other = view.at(s)
            if all(repr(other.hparams(g)) == repr(view.hparams(g)) for g in groups):
                continue  # the schedule's values there are this step's: that step would explain nothing
            matched = self.match(self.ev.step_with(factory=other), remaining)
            if matched:
                ways = [w for cond, w in ((s == 2 * k, "stepped twice per optimizer step"),
                                          (s == 3 * k, "stepped three times per optimizer step"),
                                          (s == k + 1, "stepped once more than the optimizer (once before the first "
                                                       "step too)"), (s == 0, "never stepped"),
                                          (s == k - 1, "one step behind (a step it left out)")) if cond]
                lr = lambda h: _text(h.get("lr"))  # noqa: E731
                return [Diagnosis("schedule", f"the update took the schedule's learning rate of step {s} (lr "
                                  f"{lr(other.hparams(0))}, group 0) where step {k} runs at {lr(view.hparams(0))}: the "
                                  f"backend's scheduler has taken {s} step(s) before step {k}, where {k} are due (it is "
                                  f"{' or '.join(ways) or 'out of step with the optimizer'}); step it once after "
                                  "every optimizer step", matched)]
        return []

    def lr_scaled(self, remaining: list[str]) -> list[Diagnosis]:
        ev, n, backend_lr = self.ev, self.n, self.backend_lr
        if n < 2 or (backend_lr and all(math.isclose(v, ev.lr) for v in backend_lr)):
            return []  # the backend's optimizer runs at the run's learning rate: not this
        unsure = ("" if backend_lr else "; the backend's learning rate could not be read, and a double step of Adam "
                  "from a fresh state gives the same update")
        return [Diagnosis("lr_scaled", f"the update is {n}x the reference: the learning rate is scaled by the world size "
                          f"(the linear-scaling rule applied in this backend only; {self.lr_said}); apply it in every "
                          f"backend or in none{unsure}", self.match(ev.step_with(lr=ev.lr * n), remaining))]

    def double_step(self, remaining: list[str]) -> list[Diagnosis]:
        ratio = _norm_ratio(self.d, self.ref, remaining)
        return [Diagnosis("double_step", f"the optimizer step was applied twice (||update|| / ||reference|| = {ratio:.2f}): "
                          "step() runs twice per training step (in the wrapper and in the loop); call it once",
                          self.match(self.ev.step_with(times=2), remaining))]

    def state(self, remaining: list[str]) -> list[Diagnosis]:
        ev = self.ev
        if ev.backend_state is None or _same_state(ev.backend_state, ev.expected_state):
            return []
        trap = FRESH_STEPPED_TRAP if ev.step == 0 else ""
        return [Diagnosis("optimizer_state", f"the optimizer state before step {ev.step} is not {ev.expected_from}: it "
                          f"holds {state_summary(ev.backend_state)} where {state_summary(ev.expected_state)} was "
                          f"expected, and the update taken from the backend's own state matches{trap}",
                          self.match(ev.step_with(state=ev.backend_state), remaining))]

    def unused_zero_grad(self, remaining: list[str]) -> list[Diagnosis]:
        ev = self.ev
        none = [p for p in remaining if ev.grads.get(p) is None]
        if not none:
            return []
        zeros = dict(ev.grads, **{p: torch.zeros_like(ev.params[p]) for p in none})
        return [Diagnosis("unused_zero_grad", "these parameters take no part in the loss; the backend gave them a zero "
                          "gradient instead of None, so its optimizer steps them (weight decay, momentum) where a single "
                          "process leaves them alone", self.match(ev.step_with(grads=zeros), none))]

    def weight_decay(self, remaining: list[str]) -> list[Diagnosis]:
        ev, d, ref = self.ev, self.d, self.ref
        out = []
        if ev.weight_decay > 0:
            out.append(Diagnosis("weight_decay", f"weight decay was not applied (--weight-decay is {ev.weight_decay:g})",
                                 self.match(ev.step_with(weight_decay=0.0), remaining)))
        if not self.determined(remaining):
            return out
        theta = flat(ev.params, remaining)
        resid = flat(d, remaining) - flat(ref, remaining)
        denom = float(theta @ theta)
        c = -float(resid @ theta) / denom if denom > 0 else 0.0
        if c != 0.0 and math.isfinite(c):
            candidate = {p: ref[p] - c * ev.params[p] for p in remaining}
            word = "applied where the run configures" if c > 0 else "missing where the run configures"
            out.append(Diagnosis("weight_decay", f"weight decay differs: the parameters {'shrink' if c > 0 else 'grow'} by "
                                 f"an extra {abs(c):.3g} of themselves per step (lr x wd = {abs(c):.3g}, wd = "
                                 f"{abs(c) / ev.lr:.3g} {word} --weight-decay {ev.weight_decay:g})",
                                 self.match(candidate, remaining)))
        return out

    def clipped(self, remaining: list[str]) -> list[Diagnosis]:
        """The gradient clipped by one factor, where the run clips none or by another: a backend clipping of its own
        (DeepSpeed's default), one clipping at another norm, or one that ignores --clip-grad-norm."""
        ev, d = self.ev, self.d
        usable = {p: g for p, g in ev.grads.items() if g is not None}
        if not usable:
            return []
        total = float(torch.linalg.vector_norm(flat(usable, list(usable))))

        def scaled(s: float) -> Grads:
            return ev.step_with(grads={p: (None if g is None else s * g) for p, g in ev.grads.items()}, clip=None)

        def loss(s: float) -> float:
            return rel_fro(flat(d, remaining), flat(scaled(s), remaining))

        if ev.clip is not None and total > ev.clip:
            unclipped = self.match(ev.step_with(clip=None), remaining)
            if unclipped:
                return [Diagnosis("not_clipped", f"the gradient was not clipped: --clip-grad-norm {ev.clip:g} caps its "
                                  f"total norm {total:.4g} (x{clip_coefficient(total, ev.clip):.4g}), and the update is "
                                  "the unclipped gradient's: the backend ignored the clipping", unclipped)]
        if not self.determined(remaining):
            return []
        # Fit on a log scale: the match needs the scale to a relative precision near the tolerance.
        from scipy.optimize import minimize_scalar  # scipy takes seconds to import: only where it is used

        fit = minimize_scalar(lambda t: loss(10.0**t), bounds=(-9.0, 0.0), method="bounded",
                              options={"xatol": 1e-10, "maxiter": 200})
        s = float(10.0**fit.x)
        if s > 1 - 1e-4:
            return []
        fix = ("set the same clipping in every backend or none (DeepSpeed clips at 1.0 by default since 0.19.3: "
               "gradient_clipping)" if ev.clip is None else
               f"--clip-grad-norm {ev.clip:g} caps it at {min(total, ev.clip):.4g}: the backend clips at another norm")
        return [Diagnosis("clipped", f"the gradient was clipped before the step (scaled by {s:.3g}: total norm "
                          f"{total:.3g} capped at {s * total:.3g}); {fix}", self.match(scaled(s), remaining))]

    def clipped_in_parts(self, remaining: list[str]) -> list[Diagnosis]:
        """The gradient clipped part by part, each part (a ZeRO partition, an FSDP shard, a parameter group) by its own
        norm: each parameter's gradient scaled by its part's factor. Fitted per parameter where the update is affine
        in the gradient (SGD, with or without momentum); Adam's is not, and is left to the other hypotheses."""
        ev = self.ev
        if "betas" in ev.factory([torch.nn.Parameter(torch.zeros(1))]).defaults:
            return []  # Adam-like: the update is not affine in the gradient
        usable = [p for p in remaining if ev.grads.get(p) is not None and bool(ev.grads[p].any())]
        if len(usable) < 2:
            return []
        zero = ev.step_with(grads={p: (None if g is None else torch.zeros_like(g)) for p, g in ev.grads.items()},
                            clip=None)
        full = ev.step_with(clip=None)
        factors = {}
        for p in usable:
            b = (full[p] - zero[p]).reshape(-1)
            bb = float(b @ b)
            if bb > 0:
                factors[p] = float((self.d[p] - zero[p]).reshape(-1) @ b) / bb
        clipped = {p: f for p, f in factors.items() if 0 < f < 1 - 1e-4}
        groups: list[list[str]] = []
        for p in [n for n in self.names if n in clipped]:  # parts are runs of parameters in parameter order
            if groups and abs(clipped[groups[-1][0]] - clipped[p]) <= SCALE_AGREEMENT * clipped[p]:
                groups[-1].append(p)
            else:
                groups.append([p])
        if len(groups) < 2:
            return []  # one factor for every parameter: clipping by the global norm, which `clipped` names
        scaled = {p: (None if g is None else clipped.get(p, 1.0) * g) for p, g in ev.grads.items()}
        explained = self.match(ev.step_with(grads=scaled, clip=None), remaining)
        if not explained:
            return []
        parts = []
        for group in groups:
            norm = float(torch.linalg.vector_norm(flat({p: ev.grads[p] for p in group}, group)))
            f = clipped[group[0]]
            parts.append(f"{group[0]}{'..' + group[-1] if len(group) > 1 else ''} x{f:.3g} (norm {norm:.3g} capped "
                         f"at {f * norm:.3g})")
        return [Diagnosis("clipped_in_parts", f"the gradient was clipped part by part, each part by its own norm: "
                          f"{'; '.join(parts)}; clipping must use the global norm over every part (under ZeRO and "
                          "FSDP each rank holds a partition: the norm is an all-reduce of the partitions' squared "
                          "norms)", explained)]

    def scale(self, remaining: list[str]) -> list[Diagnosis]:
        c, agreeing = _common_scale(self.d, self.ref, remaining)
        if not math.isfinite(c) or c == 0.0 or abs(c - 1.0) < 1e-3:
            return []
        return [Diagnosis("scaled", f"the update is {c:.4g}x the reference: the step size differs ({self.lr_said})",
                          self.match({p: c * self.ref[p] for p in agreeing}, agreeing))]


def _text(v) -> str:
    if torch.is_tensor(v) and v.numel() == 1:
        v = float(v)
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _norm_ratio(a: Grads, b: Grads, names: list[str]) -> float:
    nb = float(torch.linalg.vector_norm(flat(b, names)))
    return float(torch.linalg.vector_norm(flat(a, names))) / nb if nb > 0 else math.inf
