"""What the checks hold between and within their steps: oracle copies that hold their parameters only while they
compute, the update replayed as it is read (a piece of a parameter at a time where the optimizer steps each element
alone, else a parameter at a time), the expected optimizer state in the dtype the
optimizer keeps, state entries compared a chunk at a time, and freed host memory handed back."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from dpcompare.verify.judgement import held_values
from dpcompare.verify.diagnosis import state_comparison
from dpcompare.verify.judgement import tolerance as tol
from dpcompare.verify.oracle.gradient_oracle import Oracle, global_pieces
from dpcompare.verify.replay.optimizer_replay import held_as, reference_step


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)


def test_a_released_copy_holds_no_parameter_bytes_and_computes_the_same_after_loading():
    model = _model()
    oracle = Oracle(model, nn.CrossEntropyLoss(), "float32", torch.device("cpu"))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    first = oracle.oracle_of(state, global_pieces(_batch()))
    # between computes the float64 and run-precision copies hold no parameter memory
    assert all(p.untyped_storage().nbytes() == 0 for m in (oracle.model64, oracle.model_run) for p in m.parameters())
    again = oracle.oracle_of(state, global_pieces(_batch()))
    assert all(torch.equal(first[n], again[n]) for n in first)
    fresh = Oracle(model, nn.CrossEntropyLoss(), "float32", torch.device("cpu")).oracle_of(state, global_pieces(_batch()))
    assert all(torch.equal(first[n], fresh[n]) for n in first)
    assert oracle.loss_of(state, global_pieces(_batch())) > 0
    assert all(p.untyped_storage().nbytes() == 0 for p in oracle.model64.parameters())


def test_only_a_releasable_copy_is_released_and_its_load_brings_its_values_back():
    model = _model()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    # the negative: a copy nothing would allocate again is refused (loading into freed storage writes past it)
    with pytest.raises(ValueError, match="releasable"):
        held_values.release(model)
    assert all(p.untyped_storage().nbytes() > 0 for p in model.parameters())
    held_values.release(held_values.releasable(model))
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    model.load_state_dict(state)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def _step_inputs():
    g = torch.Generator().manual_seed(2)
    params = {f"p{i}": torch.randn(3 + i, 4, generator=g) for i in range(4)}
    grads = {n: torch.randn(t.shape, generator=g) for n, t in params.items()}
    state = {n: {"exp_avg": torch.randn(t.shape, generator=g) * 0.1, "exp_avg_sq": torch.rand(t.shape, generator=g),
                 "step": torch.tensor(3.0)} for n, t in params.items()}
    return params, grads, state


def _adamw(ps, **kw):
    return torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, **kw)


def test_the_replay_steps_each_parameter_as_it_is_read_in_any_order_and_gives_the_eager_result():
    params, grads, state = _step_inputs()
    names = list(params)
    eager = {}
    for n in names:  # one optimizer over every parameter, stepped at once
        live = nn.Parameter(params[n].double().clone())
        opt = _adamw([live])
        opt.state[live] = {k: v.double().clone() if v.dim() else v.clone() for k, v in state[n].items()}
        live.grad = grads[n].double().clone()
        opt.step()
        eager[n] = (live.detach() - params[n].double(), opt.state[live])
    ref = reference_step(_adamw, params, grads, state, torch.float64, torch.device("cpu"), state_like=state)
    for n in reversed(names):
        assert torch.equal(ref.delta[n], eager[n][0])
        assert torch.equal(ref.delta[n], eager[n][0])  # a second read: the same values
    got = ref.state
    assert list(got) == names
    for n in names:
        assert got[n]["exp_avg"].dtype == torch.float32  # held as the backend holds it
        assert torch.equal(got[n]["exp_avg"], eager[n][1]["exp_avg"].float())
    # the state alone, read first: every parameter stepped for it
    assert set(reference_step(_adamw, params, grads, state, torch.float64, torch.device("cpu")).state) == set(names)


def test_the_expected_state_of_a_fresh_optimizer_is_held_in_the_parameters_dtype():
    params, grads, _ = _step_inputs()
    ref = reference_step(_adamw, params, grads, {}, torch.float64, torch.device("cpu"), state_like={})
    entries = ref.state["p0"]
    assert entries["exp_avg"].dtype == torch.float32 and entries["exp_avg_sq"].dtype == torch.float32
    # where the backend holds an entry, its dtype wins; a scalar step count keeps its own
    have = {"p0": {"exp_avg": torch.zeros(3, 4, dtype=torch.float64)}}
    out = held_as({"p0": {"exp_avg": torch.ones(3, 4, dtype=torch.float64), "step": torch.tensor(1.0)}}, have,
                  torch.float32)
    assert out["p0"]["exp_avg"].dtype == torch.float64 and out["p0"]["step"].dtype == torch.float32
    assert held_as({"p0": {"exp_avg": torch.ones(2, dtype=torch.float64)}}, {}, None)["p0"]["exp_avg"].dtype == \
        torch.float64


@pytest.mark.parametrize("chunk", [3, 7, 1 << 20])
def test_a_state_entry_is_compared_a_chunk_at_a_time_with_the_whole_entrys_verdict(chunk, monkeypatch):
    monkeypatch.setattr(state_comparison, "CHUNK", chunk)
    g = torch.Generator().manual_seed(3)
    want = torch.randn(5, 4, generator=g, dtype=torch.float64)
    have = want.float()
    assert state_comparison.state_difference({"w": {"m": have}}, {"w": {"m": want}}, ["w"]) is None
    wrong = have.clone()
    wrong[3, 2] += 0.01 * float(want.abs().max())
    found = state_comparison.state_difference({"w": {"m": wrong}}, {"w": {"m": want}}, ["w"])
    assert found is not None and found[0] == ["w"] and "element (3, 2)" in found[1]
    nan = have.clone()
    nan[1, 1] = math.nan
    found = state_comparison.state_difference({"w": {"m": nan}}, {"w": {"m": want}}, ["w"])
    assert found is not None and "element (1, 1)" in found[1]


def test_freed_memory_is_handed_back_once_enough_of_it_is_freed(monkeypatch):
    calls = []
    monkeypatch.setattr(held_values, "_TRIM", lambda pad: calls.append(pad))
    monkeypatch.setattr(held_values, "_FREED", [0])
    held_values.give_back_freed(held_values.TRIM_EVERY // 2)
    assert calls == []
    held_values.give_back_freed(held_values.TRIM_EVERY // 2)
    assert calls == [0]
    held_values.give_back_freed()
    assert calls == [0, 0]
    monkeypatch.setattr(held_values, "_TRIM", None)
    held_values.give_back_freed()  # not glibc: nothing to call


def test_the_checks_keep_freed_pages_and_leave_glibcs_defaults_set_back(monkeypatch):
    """Within `pages_kept` every allocation is served from the heap and the heap is not trimmed by itself; a use inside
    another changes nothing; leaving sets glibc's defaults back and trims, also when the checks raised."""
    calls = []
    monkeypatch.setattr(held_values, "_MALLOPT", lambda option, value: calls.append((option, value)))
    monkeypatch.setattr(held_values, "_TRIM", lambda pad: calls.append(("trim", pad)))
    with held_values.pages_kept():
        assert calls == [(held_values._M_MMAP_MAX, 0), (held_values._M_TRIM_THRESHOLD, 1 << 30)]
        with held_values.pages_kept():
            pass
        assert len(calls) == 2
    assert calls[2:] == [*held_values._GLIBC_DEFAULTS.items(), ("trim", 0)]
    calls.clear()
    with pytest.raises(RuntimeError), held_values.pages_kept():
        raise RuntimeError("a check failed")
    assert calls[2:] == [*held_values._GLIBC_DEFAULTS.items(), ("trim", 0)]
    calls.clear()
    monkeypatch.setattr(held_values, "_MALLOPT", None)  # not glibc: nothing is called
    with held_values.pages_kept():
        pass
    assert calls == []


def _sgd(ps, **kw):
    return torch.optim.SGD(ps, lr=1e-2, momentum=0.9, weight_decay=0.01, nesterov=True, **kw)


class _NormedSGD(torch.optim.SGD):
    """A step that is not element by element: each update is scaled by its parameter's norm."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"] / (1.0 + float(p.norm())))


@pytest.mark.parametrize("factory", [_adamw, _sgd], ids=["adamw", "sgd"])
@pytest.mark.parametrize("chunk", [5, 1 << 20])
def test_compare_steps_an_elementwise_replay_a_piece_at_a_time_with_the_whole_replays_figures(factory, chunk,
                                                                                             monkeypatch):
    """The update check reads the replay in pieces (a piece of a parameter stepped in buffers reused from piece to
    piece, never a whole-parameter copy): its figures and the state it leaves are those of the replay stepped a
    whole parameter at a time, bitwise."""
    params, grads, state = _step_inputs()
    if factory is _sgd:
        state = {n: {"momentum_buffer": e["exp_avg"]} for n, e in state.items()}
    monkeypatch.setattr(tol, "CHUNK", chunk)
    names = list(params)
    backend = {n: t + 0.01 for n, t in params.items()}

    def figures(read_whole: bool):
        ref = reference_step(factory, params, grads, state, torch.float64, torch.device("cpu"), state_like=state)
        floor = reference_step(factory, params, grads, state, torch.float32, torch.device("cpu"), keep_state=False)
        stepped = []
        original = type(ref._replay).reached

        def counted(self, n):
            stepped.append(n)
            return original(self, n)

        monkeypatch.setattr(type(ref._replay), "reached", counted)
        if read_whole:  # the whole-parameter path: the values read before compare reads them
            for n in names:
                ref.delta[n], floor.delta[n]
            stepped.clear()
            monkeypatch.setattr(type(ref._replay), "piece", lambda self, n, part: original(self, n).reshape(-1)[part])
        got = tol.compare(held_values.Difference(backend, params), ref.delta, floor.delta, dtype="float32", world_size=1,
                          depth=2, names=names)
        after = ref.state
        monkeypatch.undo()
        monkeypatch.setattr(tol, "CHUNK", chunk)
        return got, after, stepped

    (pieces, model), after, stepped = figures(read_whole=False)
    ref = reference_step(factory, params, grads, state, torch.float64, torch.device("cpu"), state_like=state)
    tol.compare(held_values.Difference(backend, params), ref.delta, ref.delta, dtype="float32", world_size=1, depth=2,
                names=names)
    buffers = ref._replay._buffers  # one per role, never one per piece size (every parameter's tail kept)
    assert set(buffers) == {"param", "grad", *(k for k, v in next(iter(state.values())).items() if v.dim() > 0)}
    assert max(b.numel() for b in buffers.values()) <= min(chunk, max(t.numel() for t in params.values()))
    (whole, whole_model), whole_after, _ = figures(read_whole=True)
    assert stepped == []  # no parameter was stepped whole
    assert pieces == whole and model == whole_model
    for n in names:
        assert after[n].keys() == whole_after[n].keys()
        for k, v in after[n].items():
            assert v.dtype == whole_after[n][k].dtype and torch.equal(v, whole_after[n][k])


def test_a_replay_that_is_not_elementwise_is_stepped_whole_once_per_parameter(monkeypatch):
    """The negative: an optimizer whose step reads its whole parameter (here a norm) is never stepped in pieces,
    which would scale each piece by its own norm: compare steps each parameter once, whole."""
    params, grads, _ = _step_inputs()
    monkeypatch.setattr(tol, "CHUNK", 5)
    factory = lambda ps, **kw: _NormedSGD(ps, lr=0.5, **kw)  # noqa: E731
    ref = reference_step(factory, params, grads, {}, torch.float64, torch.device("cpu"))
    floor = reference_step(factory, params, grads, {}, torch.float32, torch.device("cpu"), keep_state=False)
    stepped = []
    original = type(ref._replay).reached

    def counted(self, n):
        if self._last is None or self._last[0] != n:
            stepped.append(n)
        return original(self, n)

    monkeypatch.setattr(type(ref._replay), "reached", counted)
    tol.compare(floor.delta, ref.delta, floor.delta, dtype="float32", world_size=1, depth=2, names=list(params))
    assert sorted(stepped) == sorted(list(params) * 2)  # each parameter once in each replay
    for n in params:  # the whole parameter's norm scales its update
        want = -0.5 * grads[n].double() / (1.0 + float(params[n].double().norm()))
        assert torch.allclose(ref.delta[n], want, rtol=1e-12, atol=0)


@pytest.mark.slow  # breadth: the default tier keeps this capability's other test
@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_a_state_lost_between_steps_is_named_at_the_step_it_starts(launch):
    """The state a step starts from is compared at its reduce (the expected one let go there): a state the backend
    lost after step 0 is still the update check's finding at step 1, with its cause."""
    proc, result = launch("tests.faulty_adapters:StateLostDDP", 2, "mlp", ["--steps", "3"])
    assert proc.returncode == 0, proc.output[-4000:]
    e = result["equivalence"]
    d = e["first_divergence"]
    assert e["verdict"] == "different" and e["checks"]["gradient"]["status"] == "pass", e["checks"]
    assert (d["step"], d["check"], d["cause"]) == (1, "update", "optimizer_state"), d
    assert "the state step 0 left" in d["reason"] and "momentum_buffer" in d["reason"], d["reason"]


def _float64_verdict(have: torch.Tensor, want: torch.Tensor) -> bool:
    scale, _, largest = state_comparison._largest_gap(have.reshape(-1), want.reshape(-1))
    return largest <= state_comparison.agreement(have, want) * max(scale, 1e-30)


def _near_limit_cases():
    """State entries beside their expected values: apart by rounding, by a hair either side of the agreement, by far,
    and with a NaN or an infinity, over the dtypes a backend and a replay hold them in."""
    g = torch.Generator().manual_seed(11)
    pairs = [(torch.float32, torch.float32), (torch.float32, torch.float64), (torch.bfloat16, torch.float32),
             (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32), (torch.float64, torch.float64)]
    for have_dtype, want_dtype in pairs:
        for spread in (1e-7, 1e-5, 1.0, 1e2):
            want = (torch.randn(3000, generator=g, dtype=torch.float64) * spread).to(want_dtype)
            limit = state_comparison.agreement(torch.empty(0, dtype=have_dtype), want) * float(want.abs().max())
            for rel in (0.0, 1e-3, 0.999, 1 - 1e-6, 1.0, 1 + 1e-6, 1.01, 3.0):
                have = want.double().clone()
                have[17] += rel * limit
                have[2000:2100] += torch.rand(100, generator=g, dtype=torch.float64) * 0.5 * limit
                yield have.to(have_dtype), want
            for bad in (math.nan, math.inf):
                have = want.to(have_dtype).clone()
                have[5] = bad
                yield have, want


def test_an_entry_within_rounding_is_passed_in_its_own_dtype_exactly_where_float64_passes_it():
    """`_surely_within` passes only entries the float64 comparison passes, and passes most of those it passes; a twin
    that grows the largest difference by less than its rounding (a slack of minus 2^20 units) passes an entry the
    float64 comparison refuses."""
    cases = list(_near_limit_cases())
    passed = [state_comparison._surely_within(h, w) for h, w in cases]
    exact = [_float64_verdict(h, w) for h, w in cases]
    assert all(e for p, e in zip(passed, exact) if p)
    assert sum(passed) >= 0.8 * sum(exact) and sum(exact) < len(cases)
    assert all((state_comparison.state_difference({"w": {"m": h}}, {"w": {"m": w}}, ["w"]) is None) == e
               for (h, w), e in zip(cases, exact))


def test_a_slack_below_the_rounding_passes_what_float64_refuses(monkeypatch):
    monkeypatch.setattr(state_comparison, "SLACK", -2.0 ** 20)
    cases = list(_near_limit_cases())
    assert any(state_comparison._surely_within(h, w) and not _float64_verdict(h, w) for h, w in cases)
