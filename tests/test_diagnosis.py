"""The diagnosis names the fault that produced a failed check, and only that fault.

Each test builds, in one process, the gradient (or the parameter update) a known fault produces — from the
float64 per-shard gradients of a small model, or from a real optimizer step taken the faulty way — and
checks that dpcompare.verify.diagnosis names that cause and the parameters it affects. Every hypothesis has a
twin that must not fire: a gradient that matches no fault is said to match none.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from dpcompare.verify import equivalence as eq
from dpcompare.run import workloads
from dpcompare.verify.diagnosis import (GradientEvidence, UpdateEvidence, _same_state, diagnose_gradient, diagnose_update,
                                 reason_of)
from dpcompare.verify.update_check import reference_step


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
    shards = [workloads.shard((x, y), r, world_size) for r in range(world_size)]
    digests = [eq.tensor_digest(s[0]) for s in shards]
    return oracle, state, (x, y), shards, digests


def _diagnose(model: nn.Module, grads_for, *, digests_for=None, has_batchnorm=False, sync_bn=False, grad_accum=1,
              previous=None, loss_fn=None, tolerance=1e-6) -> str:
    oracle, state, batch, shards, digests = _setup(model, loss_fn=loss_fn)
    oracle_grads = oracle.oracle(state, *batch)
    grads = grads_for(oracle, state, oracle_grads, shards)
    evidence = GradientEvidence(
        step=1, grads=grads, oracle_grads=oracle_grads, tolerance={n: tolerance for n in oracle.names}, oracle=oracle,
        state=state, batch=batch, world_size=2, grad_accum=grad_accum,
        shard_digests=digests_for(digests) if digests_for else digests, has_batchnorm=has_batchnorm, sync_bn=sync_bn,
        compression="none", dtype="float32", previous=previous(oracle, state, shards) if previous else None)
    failing = [n for n in oracle.names if eq.rel_fro(grads[n], oracle_grads[n]) > tolerance]
    return reason_of(diagnose_gradient(evidence, failing or oracle.names))


def _mean_of_locals(o, s, og, sh):
    local = [o.oracle(s, *shard) for shard in sh]
    return {k: (local[0][k] + local[1][k]) / 2 for k in og}


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


def test_names_a_stale_gradient():
    torch.manual_seed(11)
    stale = {n: torch.randn(p.shape, dtype=torch.float64) for n, p in _linear().named_parameters()}
    reason = _diagnose(_linear(), lambda o, s, og, sh: stale, previous=lambda o, s, sh: (0, stale))
    assert "step 0's" in reason and "stale" in reason


def test_names_an_undeclared_fp16_wire():
    def fp16_all_reduce(o, s, og, sh):
        local = [o.oracle(s, *shard) for shard in sh]
        return {k: ((local[0][k].float() / 2).half().float() + (local[1][k].float() / 2).half().float()).half().double()
                for k in og}

    reason = _diagnose(_linear(), fp16_all_reduce)
    assert "float16 on the wire" in reason and "--compression fp16" in reason


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


def test_names_per_rank_batchnorm():
    reason = _diagnose(_with_batchnorm(), _mean_of_locals, has_batchnorm=True)
    assert "BatchNorm" in reason and "--sync-bn" in reason


def test_does_not_blame_batchnorm_when_it_was_synchronised_or_absent():
    for kwargs in ({"has_batchnorm": True, "sync_bn": True}, {"has_batchnorm": False}):
        reason = _diagnose(_with_batchnorm(), _mean_of_locals, **kwargs)
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
    reason = _diagnose(_linear(), lambda o, s, og, sh: {k: v * math.inf for k, v in og.items()})
    assert "inf or NaN" in reason


def test_admits_an_unknown_fault():
    noise = torch.Generator().manual_seed(9)
    reason = _diagnose(_linear(), lambda o, s, og, sh: {k: v + 0.3 * torch.randn(v.shape, generator=noise, dtype=v.dtype)
                                                        for k, v in og.items()})
    assert "matches none of the known fault patterns" in reason


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
