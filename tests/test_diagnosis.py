"""The diagnosis names the fault that produced a failed check, and only that fault.

Each test builds, in one process, the gradient (or the parameter update) a known fault produces — from the
float64 per-shard gradients of a small model, or from a real optimizer step taken the faulty way — and
checks that dpcompare.verify.diagnosis.diagnose names that cause and the parameters it affects. Every hypothesis has a
twin that must not fire: a gradient that matches no fault is said to match none.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import dpcompare
from dpcompare.verify.oracle import gradient_oracle as eq
from dpcompare.verify.diagnosis.diagnose import (Diagnosis, GradientEvidence, UpdateEvidence, diagnose_gradient, diagnose_update,
                                        reason_of, state_difference)
from dpcompare.verify.diagnosis.state_comparison import _same_state
from dpcompare.verify.replay.optimizer_replay import reference_step


def _linear() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


def _with_batchnorm() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3))


def _setup(model: nn.Module, world_size: int = 2, loss_fn=None):
    torch.manual_seed(3)
    x = torch.randn(8, 4)
    y = torch.randint(0, 3, (8,))
    oracle = eq.Oracle(model, loss_fn or (lambda out, t: F.cross_entropy(out, t)), "float32", torch.device("cpu"))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    shards = [dpcompare.shard((x, y), r, world_size) for r in range(world_size)]
    digests = [eq.tensor_digest(s[0]) for s in shards]
    return oracle, state, (x, y), shards, digests


def _diagnoses(model: nn.Module, grads_for, *, digests_for=None, has_batchnorm=False, sync_bn=False, per_replica=False,
               grad_accum=1, previous=None, loss_fn=None, tolerance=1e-6, compression="none",
               loss_scale=None, world_size=2) -> list[Diagnosis]:
    """The diagnosis of `grads_for`'s gradient at a check whose failing parameters are found as the verifier finds
    them (distance from the oracle against the parameter's share of the model's gradient)."""
    oracle, state, batch, shards, digests = _setup(model, world_size, loss_fn=loss_fn)
    layout = eq.Layout(world_size, grad_accum)
    oracle_grads = (oracle.oracle_of(state, eq.replica_pieces(batch, layout)) if per_replica
                    else oracle.oracle(state, *batch))
    grads = grads_for(oracle, state, oracle_grads, shards)
    evidence = GradientEvidence(
        step=1, grads=grads, oracle_grads=oracle_grads, tolerance={n: tolerance for n in oracle.names}, oracle=oracle,
        state=state, batch=batch, world_size=world_size, grad_accum=grad_accum,
        shard_digests=digests_for(digests) if digests_for else digests, has_batchnorm=has_batchnorm, sync_bn=sync_bn,
        compression=compression, dtype="float32", layout=layout, per_replica=per_replica,
        previous=previous(oracle, state, shards) if previous else None, loss_scale=loss_scale,
        digests={n: eq.tensor_digest(g) for n, g in grads.items()})
    share = float(torch.linalg.vector_norm(eq.flat(oracle_grads, oracle.names))) / math.sqrt(len(oracle.names))
    failing = [n for n in oracle.names if not eq.rel_fro(grads[n], oracle_grads[n], share) <= tolerance]
    return diagnose_gradient(evidence, failing or oracle.names)


def _diagnose(model: nn.Module, grads_for, **kwargs) -> str:
    return reason_of(_diagnoses(model, grads_for, **kwargs))


def _mean_of_locals(o, s, og, sh):
    local = [o.oracle(s, *shard) for shard in sh]
    return {k: (local[0][k] + local[1][k]) / 2 for k in og}


def _fp16_all_reduce(o, s, og, sh):
    """Each rank's float32 gradient divided by the world size, cast to fp16, summed in fp16 (DDP's fp16 hook)."""
    local = [o.oracle(s, *shard) for shard in sh]
    return {k: ((local[0][k].float() / 2).half().float() + (local[1][k].float() / 2).half().float()).half().double()
            for k in og}


def _global_batch(o, s, og, sh):
    """The gradient of the global batch in one forward (its BatchNorm normalises all the samples together)."""
    return o.oracle(s, torch.cat([sh[0][0], sh[1][0]]), torch.cat([sh[0][1], sh[1][1]]))


# -- gradients ---------------------------------------------------------------------------------------
def test_names_a_sum():
    reason = _diagnose(_linear(), lambda o, s, og, sh: {k: 2 * v for k, v in og.items()})
    assert "2x the oracle" in reason and "summed, not averaged" in reason


def test_names_a_loss_reduced_with_sum():
    """Each rank sums its shard's losses: the mean of the rank sums is 1/N of the global-batch sum."""
    reason = _diagnose(_linear(), lambda o, s, og, sh: {k: v / 2 for k, v in og.items()},
                       loss_fn=lambda out, t: F.cross_entropy(out, t, reduction="sum"))
    assert "1/2 of the oracle" in reason and "reduced with sum" in reason


def test_names_a_second_division_when_the_loss_is_a_mean():
    reason = _diagnose(_linear(), lambda o, s, og, sh: {k: v / 2 for k, v in og.items()})
    assert "divided by the world size twice" in reason and "reduced with sum" not in reason


def test_names_a_local_only_gradient():
    reason = _diagnose(_linear(), lambda o, s, og, sh: o.oracle(s, *sh[1]))
    assert "equals rank 1's local gradient" in reason and "not synchronised" in reason


def test_names_the_parameters_left_out_of_the_all_reduce():
    def biases_local(o, s, og, sh):
        local = o.oracle(s, *sh[0])
        return {k: (local[k] if k.endswith("bias") else v) for k, v in og.items()}

    reason = _diagnose(_linear(), biases_local)
    assert reason.startswith("on 0.bias, 2.bias:"), reason
    assert "rank 0's local gradient" in reason and "left out of the all-reduce" in reason
    assert "weight" not in reason.split(":")[0]


def _mean_of_ranks(ranks):
    def grads_for(o, s, og, sh):
        local = [o.oracle(s, *sh[r]) for r in ranks]
        return {k: sum(g[k] for g in local) / len(ranks) for k in og}
    return grads_for


@pytest.mark.parametrize(("ranks", "shown"), [((0, 1), "ranks 0, 1 only (2 of the 4 ranks: one of 2 replica groups)"),
                                              ((0, 2), "ranks 0, 2 only (2 of the 4 ranks: one of 2 replica groups)")],
                         ids=["row", "column"])
def test_names_the_mean_of_one_replica_group(ranks, shown):
    """4 ranks as 2 replica groups of 2 (HSDP) whose groups never all-reduced with each other: rank 0 holds its
    group's mean, whether the group is rank 0's row of the (replicate, shard) mesh or its column."""
    found = _diagnoses(_linear(), _mean_of_ranks(ranks), world_size=4)
    assert [d.cause for d in found] == ["replica_group_only"], reason_of(found)
    assert shown in found[0].reason and "cross-replica all-reduce did not run" in found[0].reason


@pytest.mark.parametrize("ranks", [(0, 3), (0, 1, 2)], ids=["no-group", "three-ranks"])
def test_a_mean_over_ranks_that_form_no_replica_group_is_not_named_one(ranks):
    """Twin: ranks 0 and 3 form neither a row nor a column of a 2x2 mesh, and 3 of 4 ranks no group at all. What is
    named instead is the fit of a factor per rank (the ranks left out weigh about 0)."""
    found = _diagnoses(_linear(), _mean_of_ranks(ranks), world_size=4)
    assert [d.cause for d in found] == ["rank_scale"], reason_of(found)
    assert "replica group" not in found[0].reason


def _digests(grads):
    return {n: eq.tensor_digest(g) for n, g in grads.items()}


def test_names_a_stale_gradient():
    torch.manual_seed(11)
    stale = {n: torch.randn(p.shape, dtype=torch.float64) for n, p in _linear().named_parameters()}
    reason = _diagnose(_linear(), lambda o, s, og, sh: stale, previous=lambda o, s, sh: (0, _digests(stale)))
    assert "step 0's" in reason and "stale" in reason


def test_a_gradient_one_rounding_away_from_the_last_steps_is_not_called_stale():
    """The stale gradient is the previous step's to the bit (its digest is what is held over the step): one element
    moved by one unit in its last place is another gradient."""
    torch.manual_seed(11)
    stale = {n: torch.randn(p.shape, dtype=torch.float64) for n, p in _linear().named_parameters()}
    moved = {n: g.clone() for n, g in stale.items()}
    for g in moved.values():
        g.view(-1)[0] = torch.nextafter(g.view(-1)[0], torch.tensor(math.inf, dtype=g.dtype))
    found = _diagnoses(_linear(), lambda o, s, og, sh: moved, previous=lambda o, s, sh: (0, _digests(stale)))
    assert "stale" not in [d.cause for d in found], reason_of(found)


def test_names_an_undeclared_fp16_wire():
    """Values in fp16's range, rounded to its precision: the rounding is named, not the range."""
    found = _diagnoses(_linear(), _fp16_all_reduce)
    assert [d.cause for d in found] == ["wire_dtype"], reason_of(found)
    assert "float16 on the wire" in found[0].reason and "--compression fp16" in found[0].reason


def _fp16_hook_at(ranks: int, before: bool):
    """Each rank's float32 gradient cast to fp16 and divided there by the world size, summed in fp16 (DDP's own
    fp16_compress_hook), or summed in fp16 and the sum divided there (Horovod's Compression.fp16 averaging)."""
    def reduce(o, s, og, sh):
        local = [o.oracle(s, *shard).values() for shard in sh]
        out = {}
        for k, *grads in zip(og, *local):
            acc = None
            for g in grads:
                term = g.float().half() / ranks if before else g.float().half()
                acc = term if acc is None else (acc.float() + term.float()).half()
            out[k] = (acc if before else acc / ranks).double()
        return out
    return reduce


@pytest.mark.parametrize("before", [True, False], ids=["ddp-hook", "summed-first"])
def test_names_an_undeclared_fp16_wire_at_three_ranks_where_the_division_is_done_on_the_wire(before):
    """By 3, dividing in fp16 and dividing in float32 round differently: the simulation divides where the hook does."""
    found = _diagnoses(_linear(), _fp16_hook_at(3, before), world_size=3)
    assert [d.cause for d in found] == ["wire_dtype"], reason_of(found)


def _fp16_ring_at_three_ranks(o, s, og, sh):
    """DDP's fp16 hook over a ring: each third of a gradient summed starting from another rank (a chunk per rank, as
    a ring's reduce-scatter adds them), so the fp16 sum's order changes along the gradient."""
    local = [o.oracle(s, *shard) for shard in sh]
    out = {}
    for k in og:
        terms = [l[k].float().half().reshape(-1) / 3 for l in local]
        flat = torch.empty_like(terms[0])
        for chunk, part in enumerate(torch.arange(flat.numel()).chunk(3)):
            order = [(chunk + j) % 3 for j in range(3)]
            acc = terms[order[0]][part]
            for r in order[1:]:
                acc = (acc.float() + terms[r][part].float()).half()
            flat[part] = acc
        out[k] = flat.reshape(og[k].shape).double()
    return out


def test_names_an_undeclared_fp16_wire_summed_round_a_ring_at_three_ranks():
    """Three fp16 terms added in another order round as much as the wire itself: each element is taken in the order
    nearest it."""
    found = _diagnoses(_linear(), _fp16_ring_at_three_ranks, world_size=3)
    assert [d.cause for d in found] == ["wire_dtype"], reason_of(found)


def test_wire_dtype_is_not_blamed_for_noise_of_that_size_at_three_ranks():
    """Twin: the orders' nearest element does not make noise of the wire's size into the wire."""
    noise = torch.Generator().manual_seed(5)
    reason = _diagnose(_linear(), lambda o, s, og, sh: {
        k: v * (1 + 4e-4 * torch.randn(v.shape, generator=noise, dtype=v.dtype)) for k, v in og.items()},
        world_size=3)
    assert "matches none of the known fault patterns" in reason, reason


def test_wire_dtype_is_not_blamed_for_noise_of_that_size():
    """Twin: an error as large as fp16 rounding that an fp16 all-reduce does not reproduce."""
    noise = torch.Generator().manual_seed(5)
    reason = _diagnose(_linear(), lambda o, s, og, sh: {
        k: v * (1 + 4e-4 * torch.randn(v.shape, generator=noise, dtype=v.dtype)) for k, v in og.items()})
    assert "matches none of the known fault patterns" in reason, reason


def test_names_duplicated_shards():
    reason = _diagnose(_linear(), lambda o, s, og, sh: o.oracle(s, *sh[0]), digests_for=lambda d: [d[0], d[0]])
    assert "ranks 0 and 1 read the same shard" in reason


def test_names_shards_from_another_data_stream():
    reason = _diagnose(_linear(), lambda o, s, og, sh: og, digests_for=lambda d: [d[0], "0123456789abcdef"])
    assert "not the shards of the global batch" in reason


def test_names_per_rank_batchnorm_though_sync_bn_was_given():
    """--sync-bn asked for global-batch statistics; each rank normalised its own shard."""
    found = _diagnoses(_with_batchnorm(), _mean_of_locals, has_batchnorm=True, sync_bn=True)
    assert [d.cause for d in found] == ["batchnorm"]
    assert "each rank's shard" in found[0].reason and "though --sync-bn was given" in found[0].reason


def test_names_a_backend_that_synchronises_batchnorm_on_its_own():
    """Without --sync-bn the oracle normalises each replica's shard; the backend normalised the global batch."""
    found = _diagnoses(_with_batchnorm(), _global_batch, has_batchnorm=True, per_replica=True)
    assert [d.cause for d in found] == ["batchnorm"]
    assert "synchronises BatchNorm statistics on its own" in found[0].reason


def test_does_not_blame_batchnorm_when_absent():
    """Twin: the same gradients, from a model the run does not know to have BatchNorm."""
    for grads_for, kwargs in ((_mean_of_locals, {"sync_bn": True}), (_global_batch, {"per_replica": True})):
        reason = _diagnose(_with_batchnorm(), grads_for, has_batchnorm=False, **kwargs)
        assert "matches none of the known fault patterns" in reason, kwargs


def test_names_batchnorm_over_micro_batches():
    """--grad-accum 2 with synchronised BatchNorm: statistics over each micro-batch across the ranks."""
    def per_micro_batch(o, s, og, sh):
        chunks = [tuple(t.chunk(2) for t in shard) for shard in sh]
        groups = [(torch.cat([c[0][j] for c in chunks]), torch.cat([c[1][j] for c in chunks])) for j in range(2)]
        grads = [o.oracle(s, *g) for g in groups]
        return {k: (grads[0][k] + grads[1][k]) / 2 for k in og}

    reason = _diagnose(_with_batchnorm(), per_micro_batch, has_batchnorm=True, sync_bn=True, grad_accum=2)
    assert "each micro-batch" in reason and "--grad-accum 2" in reason and "across ranks" in reason


def test_names_a_non_finite_gradient():
    """Also the twin of the wire's overflow: infs that no all-reduce on a narrow wire produces."""
    found = _diagnoses(_linear(), lambda o, s, og, sh: {k: v * math.inf for k, v in og.items()})
    assert [d.cause for d in found] == ["non_finite"] and "inf or NaN" in found[0].reason


def test_admits_an_unknown_fault():
    noise = torch.Generator().manual_seed(9)
    reason = _diagnose(_linear(), lambda o, s, og, sh: {k: v + 0.3 * torch.randn(v.shape, generator=noise, dtype=v.dtype)
                                                        for k, v in og.items()})
    assert "matches none of the known fault patterns" in reason


def test_names_gradients_that_underflow_on_a_declared_fp16_wire():
    """Gradients ~1e-20 (a loss scaled by 1e-20) all flush to zero on the fp16 wire: not a scale factor of 0."""
    found = _diagnoses(_linear(), _fp16_all_reduce, loss_fn=lambda out, t: 1e-20 * F.cross_entropy(out, t),
                       compression="fp16", tolerance=1e-2)
    assert [d.cause for d in found] == ["wire_underflow"], reason_of(found)
    reason = found[0].reason
    assert "underflow to zero on the fp16 wire" in reason and "smallest subnormal is 6.0e-08" in reason
    assert 1e-23 < float(reason.split("gradients of size ~")[1].split(" ")[0]) < 1e-19 and "loss scaling" in reason
    assert "scale factor" not in reason


def test_does_not_call_a_scaled_gradient_an_underflow():
    """Twin: a gradient halved under a declared fp16 wire, with gradients of normal size or tiny ones, is a
    second division, not an underflow: the fp16 all-reduce does not reproduce it."""
    for scale in (1.0, 1e-20):
        found = _diagnoses(_linear(), lambda o, s, og, sh: {k: v / 2 for k, v in og.items()}, compression="fp16",
                           tolerance=1e-2, loss_fn=lambda out, t: scale * F.cross_entropy(out, t))
        assert [d.cause for d in found] == ["averaged_twice"], (scale, reason_of(found))


def test_names_gradients_that_overflow_on_a_declared_fp16_wire():
    """Gradients ~1e5 pass 65504 on the fp16 wire and become inf: the wire's overflow, not only a non-finite value."""
    found = _diagnoses(_linear(), _fp16_all_reduce, loss_fn=lambda out, t: 1e6 * F.cross_entropy(out, t),
                       compression="fp16", tolerance=1e-2)
    assert [d.cause for d in found] == ["wire_overflow"], reason_of(found)
    assert "exceed fp16's largest value 65504 on the wire and become inf" in found[0].reason


def _square() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3))


def test_names_two_gradients_that_were_swapped():
    def exchanged(o, s, og, sh):
        return dict(og, **{"0.weight": og["2.weight"], "2.weight": og["0.weight"]})

    found = _diagnoses(_square(), exchanged)
    assert [d.cause for d in found] == ["swapped"] and found[0].parameters == ["0.weight", "2.weight"]
    assert "the gradients of 0.weight and 2.weight (same shape (4, 4)) were exchanged" in found[0].reason


def test_does_not_call_a_copied_gradient_a_swap():
    """Twin: one parameter holds the other's gradient, the other its own (or something else): no exchange."""
    noise = torch.Generator().manual_seed(6)
    for other in ("own", "noisy"):
        def copied(o, s, og, sh):
            second = og["2.weight"] + (0.5 * torch.randn(4, 4, generator=noise, dtype=torch.float64) if other == "noisy"
                                       else 0)
            return dict(og, **{"0.weight": og["2.weight"], "2.weight": second})

        found = _diagnoses(_square(), copied)
        assert "swapped" not in [d.cause for d in found] and found[-1].cause == "unknown", reason_of(found)


class _Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


class _TinyResNet(nn.Module):
    def __init__(self, c: int = 4, blocks: int = 3) -> None:
        super().__init__()
        self.stem, self.bn = nn.Conv2d(1, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.blocks = nn.Sequential(*[_Block(c) for _ in range(blocks)])
        self.fc = nn.Linear(c, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.view(x.shape[0], 1, 2, 2)
        return self.fc(self.blocks(F.relu(self.bn(self.stem(x)))).mean((2, 3)))


def _tiny_resnet() -> nn.Module:
    torch.manual_seed(0)
    return _TinyResNet()


@pytest.mark.parametrize("fault", ["per_rank_batchnorm", "summed"])
def test_one_cause_for_a_fault_of_every_parameter(fault):
    """One fault that changes every parameter's gradient is named alone. With a loose tolerance, as a deep
    ResNet's many small gradients give, a greedy first match also gave some parameters to a scale factor fitted
    on the rest and to one rank's local gradient, by chance."""
    faults = {"per_rank_batchnorm": ("batchnorm", _mean_of_locals),
              "summed": ("summed", lambda o, s, og, sh: {k: 2 * v for k, v in og.items()})}
    cause, grads_for = faults[fault]
    found = _diagnoses(_tiny_resnet(), grads_for, has_batchnorm=True, sync_bn=True, tolerance=0.1)
    assert [d.cause for d in found] == [cause], reason_of(found)


def test_noise_on_top_of_a_partial_cause_is_unknown_not_a_second_cause():
    """Biases left out of the all-reduce, and the weights perturbed by noise no fault explains: the biases are
    named, the weights match none."""
    noise = torch.Generator().manual_seed(9)

    def biases_local_weights_noisy(o, s, og, sh):
        local = o.oracle(s, *sh[0])
        return {k: (local[k] if k.endswith("bias") else v + 0.3 * torch.randn(v.shape, generator=noise, dtype=v.dtype))
                for k, v in og.items()}

    found = _diagnoses(_linear(), biases_local_weights_noisy)
    assert [d.cause for d in found] == ["unsynchronised", "unknown"], reason_of(found)
    assert found[0].parameters == ["0.bias", "2.bias"] and found[1].parameters == ["0.weight", "2.weight"]


def test_names_a_scale_shared_by_some_parameters_among_unrelated_errors():
    """The weights summed, the biases far off in no known way: the scale is the one the weights share (a fit over
    all failing parameters is pulled off 2 by the biases), and the biases match none."""
    noise = torch.Generator().manual_seed(1)

    def weights_summed(o, s, og, sh):
        return {k: (2 * v if k.endswith("weight") else v + 3 * v.norm() * torch.randn(v.shape, generator=noise,
                                                                                     dtype=v.dtype))
                for k, v in og.items()}

    found = _diagnoses(_linear(), weights_summed)
    assert [(d.cause, d.parameters) for d in found] == [("summed", ["0.weight", "2.weight"]),
                                                        ("unknown", ["0.bias", "2.bias"])], reason_of(found)


def test_noise_on_a_few_parameters_leaves_them_unknown():
    """Per-rank BatchNorm everywhere, two parameters also perturbed: BatchNorm on the rest, the two match none.
    With the loose tolerance a greedy first match gave two of the rest to a fitted scale and to rank 0's local
    gradient (the shape of a real ResNet-50 diagnosis: one right cause and two made-up ones)."""
    noise = torch.Generator().manual_seed(4)

    def per_rank_some_noisy(o, s, og, sh):
        g = _mean_of_locals(o, s, og, sh)
        return {k: (v + 0.3 * v.norm() * torch.randn(v.shape, generator=noise, dtype=v.dtype)
                    if k in ("blocks.0.conv1.weight", "blocks.2.bn2.weight") else v) for k, v in g.items()}

    found = _diagnoses(_tiny_resnet(), per_rank_some_noisy, has_batchnorm=True, sync_bn=True, tolerance=0.1)
    assert [d.cause for d in found] == ["batchnorm", "unknown"], reason_of(found)
    assert found[1].parameters == ["blocks.0.conv1.weight", "blocks.2.bn2.weight"]


def _clipped_locals(max_norm: float):
    def fault(o, s, og, sh):
        local = [o.oracle(s, *shard) for shard in sh]
        norms = [float(torch.linalg.vector_norm(eq.flat(g, list(og)))) for g in local]
        factors = [min(1.0, max_norm / n) for n in norms]
        return {k: (factors[0] * local[0][k] + factors[1] * local[1][k]) / 2 for k in og}
    return fault


def test_names_each_rank_clipping_its_local_gradient():
    found = _diagnoses(_linear(), _clipped_locals(1e-3))
    assert [d.cause for d in found] == ["local_clip"], reason_of(found)
    assert "clipped its own local gradient to norm 0.001 before the all-reduce" in found[0].reason


def test_names_a_factor_that_differs_between_ranks():
    def rank_scale(o, s, og, sh):
        local = [o.oracle(s, *shard) for shard in sh]
        return {k: (local[0][k] + 0.5 * local[1][k]) / 2 for k in og}

    found = _diagnoses(_linear(), rank_scale)
    assert [d.cause for d in found] == ["rank_scale"], reason_of(found)
    assert "rank 0 x1 " in found[0].reason and "rank 1 x0.5 " in found[0].reason


def test_a_per_rank_factor_is_not_claimed_for_noise():
    """Twin: the right mean plus noise has no per-rank factor that explains it."""
    def noisy(o, s, og, sh):
        torch.manual_seed(5)
        return {k: v + 1e-3 * float(torch.linalg.vector_norm(v)) * torch.randn_like(v) for k, v in og.items()}

    found = _diagnoses(_linear(), noisy)
    assert all(d.cause not in ("local_clip", "rank_scale") for d in found), reason_of(found)


def test_a_state_that_is_not_what_the_last_step_left_shows_the_entry_and_both_values():
    expected = {"w": {"momentum_buffer": torch.tensor([[1.0, 2.0], [3.0, 4.0]])}, "b": {"momentum_buffer": torch.ones(2)}}
    stale = {"w": {"momentum_buffer": torch.tensor([[1.0, 2.0], [3.0, 0.5]])}, "b": {"momentum_buffer": torch.ones(2)}}
    wrong, text = state_difference(stale, expected, ["b", "w"])
    assert wrong == ["w"]
    assert "w's momentum_buffer differs from it: element (1, 1) is 0.5 where 4 was expected" in text, text
    # Twins: rounding is no difference; a zero buffer steps like none; a missing one that is not zero is named.
    rounded = {"w": {"momentum_buffer": expected["w"]["momentum_buffer"] * (1 + 1e-7)}, "b": expected["b"]}
    assert state_difference(rounded, expected, ["b", "w"]) is None
    assert state_difference({"w": {"momentum_buffer": torch.zeros(2, 2)}}, {}, ["w"]) is None
    wrong, text = state_difference({}, expected, ["w"])
    assert wrong == ["w"] and "holds no momentum_buffer where one of norm 5.477 was expected" in text


# -- updates -----------------------------------------------------------------------------------------
def _factory(optimizer: str, lr: float = 0.05, weight_decay: float = 0.0):
    def make(params, **o):
        kw = {"lr": lr, "weight_decay": weight_decay, **o}
        if optimizer == "sgd":
            return torch.optim.SGD(params, momentum=0.9, **kw)
        return torch.optim.AdamW(params, **kw)
    return make


def _update_case(optimizer: str, faulty, *, weight_decay: float = 0.0, none: tuple[str, ...] = (), backend_lr=None):
    """A reference update from a fresh state, and the update `faulty(step)` produces, on a small model."""
    model = _linear()
    torch.manual_seed(4)
    params = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    grads = {n: (None if n in none else torch.randn(p.shape, dtype=torch.float64)) for n, p in params.items()}
    factory = _factory(optimizer, weight_decay=weight_decay)
    ref = reference_step(factory, params, grads, {}, torch.float64, torch.device("cpu")).delta
    delta, backend_state = faulty(factory, params, grads)
    names = list(params)
    evidence = UpdateEvidence(step=0, names=names, delta=delta, reference=ref, tolerance={n: 1e-8 for n in names},
                              params=params, grads=grads, expected_state={}, backend_state=backend_state,
                              factory=factory, device=torch.device("cpu"), world_size=2, lr=0.05,
                              weight_decay=weight_decay, backend_hparams=[{"lr": backend_lr}] if backend_lr else [])
    failing = [n for n in names if eq.rel_fro(delta[n], ref[n]) > 1e-8]
    return reason_of(diagnose_update(evidence, failing)), failing


def _step(factory, params, grads, state=None, times=1, **o):
    return reference_step(factory, params, grads, state or {}, torch.float64, torch.device("cpu"), times=times, **o)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_names_a_learning_rate_scaled_by_the_world_size(optimizer):
    reason, _ = _update_case(optimizer, lambda f, p, g: (_step(f, p, g, lr=0.1).delta, {}), backend_lr=0.1)
    assert "2x the reference" in reason and "scaled by the world size" in reason
    assert "runs at lr 0.1, --lr is 0.05" in reason


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_names_a_double_step(optimizer):
    """With the backend's learning rate read as the run's: for Adam from a fresh state a double step and a
    doubled learning rate give the same update, and the learning rate tells them apart."""
    reason, _ = _update_case(optimizer, lambda f, p, g: (_step(f, p, g, times=2).delta, {}), backend_lr=0.05)
    assert "applied twice" in reason and "scaled by the world size" not in reason


def test_a_doubled_update_of_unknown_learning_rate_says_both_causes():
    reason, _ = _update_case("adamw", lambda f, p, g: (_step(f, p, g, times=2).delta, {}))
    assert "scaled by the world size" in reason and "double step" in reason


def test_names_an_optimizer_state_that_is_not_fresh():
    """Horovod's broadcast_optimizer_state on a fresh AdamW: one step on zero gradients (step count 1)."""
    def trap(f, p, g):
        zeros = {n: torch.zeros_like(t) for n, t in p.items()}
        state = _step(f, p, zeros).state
        return _step(f, p, g, state).delta, state

    reason, _ = _update_case("adamw", trap)
    assert "not a fresh optimizer's" in reason and "step count 1" in reason and "horovod/horovod#3743" in reason


def test_a_zero_momentum_buffer_counts_as_a_fresh_state():
    """Twin: the same trap with SGD momentum leaves a zero buffer, which steps exactly like no buffer."""
    model = _linear()
    params = {n: p.detach().double() for n, p in model.named_parameters()}
    state = _step(_factory("sgd"), params, {n: torch.zeros_like(t) for n, t in params.items()}).state
    assert _same_state(state, {})
    assert not _same_state(_step(_factory("adamw"), params, {n: torch.zeros_like(t) for n, t in params.items()}).state, {})


def test_names_clipping():
    def clipped(f, p, g):
        total = torch.linalg.vector_norm(torch.cat([t.reshape(-1) for t in g.values()]))
        return _step(f, p, {n: t * (0.3 / total) for n, t in g.items()}).delta, {}

    reason, _ = _update_case("sgd", clipped)
    assert "clipped" in reason and "capped at 0.3" in reason


def test_names_weight_decay_that_was_not_applied():
    reason, _ = _update_case("sgd", lambda f, p, g: (_step(f, p, g, weight_decay=0.0).delta, {}), weight_decay=0.1)
    assert "weight decay was not applied" in reason


def test_names_weight_decay_the_run_does_not_configure():
    reason, _ = _update_case("adamw", lambda f, p, g: (_step(f, p, g, weight_decay=0.2).delta, {}))
    assert "weight decay differs" in reason and "wd = 0.2" in reason


def test_names_unused_parameters_given_a_zero_gradient():
    def zero_filled(f, p, g):
        return _step(f, p, {n: (torch.zeros_like(p[n]) if t is None else t) for n, t in g.items()}).delta, {}

    reason, failing = _update_case("adamw", zero_filled, weight_decay=0.1, none=("2.weight", "2.bias"))
    assert failing == ["2.weight", "2.bias"]
    assert "zero gradient instead of None" in reason


def test_admits_an_unknown_update_fault():
    noise = torch.Generator().manual_seed(2)
    reason, _ = _update_case("sgd", lambda f, p, g: ({n: t + 0.01 * torch.randn(t.shape, generator=noise, dtype=t.dtype)
                                                      for n, t in _step(f, p, g).delta.items()}, {}))
    assert "matches none of the known patterns" in reason


def test_names_clipping_part_by_part():
    """ZeRO-2 clipping each partition by its own norm: the first layer's gradient and the rest scaled apart."""
    def by_parts(f, p, g):
        names = list(g)
        parts = [names[:2], names[2:]]
        scaled = {}
        for part in parts:
            norm = float(torch.linalg.vector_norm(eq.flat(g, part)))
            for n in part:
                scaled[n] = g[n] * min(1.0, 1e-2 / norm)
        return _step(f, p, scaled).delta, {}

    reason, failing = _update_case("sgd", by_parts)
    assert "clipped part by part" in reason and "0.weight..0.bias" in reason and "2.weight..2.bias" in reason, reason
    assert "capped at 0.01" in reason, reason


def test_clipping_by_the_global_norm_is_not_called_clipping_by_parts():
    def global_clip(f, p, g):
        norm = float(torch.linalg.vector_norm(eq.flat(g, list(g))))
        return _step(f, p, {n: v * 1e-2 / norm for n, v in g.items()}).delta, {}

    reason, _ = _update_case("sgd", global_clip)
    assert "clipped before the step" in reason and "part by part" not in reason, reason


def test_names_no_gradient_at_all():
    oracle, state, batch, shards, digests = _setup(_linear())
    grads = {n: torch.zeros_like(v) for n, v in oracle.oracle(state, *batch).items()}
    found = _diagnoses(_linear(), lambda o, s, og, sh: grads)
    assert [d.cause for d in found] == ["no_gradient"], reason_of(found)
    assert "zero everywhere" in found[0].reason and "partition" not in found[0].reason
