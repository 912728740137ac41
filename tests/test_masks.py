"""Recorded random draws make another copy of the model compute the same random function, and nothing else changes.

Each test runs a small real model in one process: it records the random ops its forward calls at the dispatcher
(dpcompare.verify.randomness.draw_recording.MaskRecorder: bernoulli for dropout, rand, randn, rrelu's noise), replays them in a float64 or
float32 copy (MaskReplayer), assembles a whole batch's draws from its shards' (combine) or asks whether a model draws
where no replay reaches (uncaptured). Every check has a twin that must fail: a run that draws one extra number is seen
to change, a copy without the draws is seen to differ, draws in the wrong order or for the wrong rows give the wrong
output, a draw of another shape or one too many is refused, noise from outside torch is named by its module.
"""

from __future__ import annotations

import contextlib
import copy
import math
import pickle
import threading

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from dpcompare.verify.randomness import random_ops
from dpcompare.verify.oracle.gradient_oracle import Layout
from dpcompare.verify.model_facts.replica_forwards import Forwards
from dpcompare.verify.randomness.draw_recording import MaskMismatch, MaskRecord, MaskRecorder, MaskReplayer, PackedDraw, combine, uncaptured
from dpcompare.verify.judgement.verdict import Verdict

BERNOULLI = "aten.bernoulli_.float"


def _net(p: float = 0.3, inplace: bool = False) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(p), nn.Linear(16, 4), nn.Dropout(p, inplace=inplace))


def _x(*shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm())


def _record(model: nn.Module, *xs: torch.Tensor, seed: int = 5) -> tuple[MaskRecord, list[torch.Tensor]]:
    recorder = MaskRecorder(model)
    torch.manual_seed(seed)
    with recorder.recording():
        outs = [model(x) for x in xs]
    return recorder.take(), outs


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in model.named_parameters()}


def _hooked(model: nn.Module) -> bool:
    return any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def _key(module: str, op: str = BERNOULLI) -> str:
    return random_ops.key_of(module, op)


class _DrawsFirst(nn.Dropout):
    """Draws a number of its own before its mask."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + 0.1 * torch.rand(1)


class _Attention(nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, dropout=dropout, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(x, x, x)[0])


class _Noisy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + 0.1 * torch.randn(x.shape[0], 4)


class _NumpyAttention(nn.Module):
    """Attention whose probabilities are perturbed by NumPy's generator before its output projection: the projection
    is the first module to see a difference, the attention the one that draws."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(8, 24), nn.Linear(8, 8)
        self.rng = np.random.default_rng(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        probs = torch.softmax(q @ k.transpose(1, 2), dim=-1)
        probs = probs * torch.from_numpy(self.rng.random(probs.shape) < 0.9).to(probs.dtype)
        return self.out(probs @ v)


class _Transposed(nn.Module):
    """Drops along features-first rows: its mask is not batch-first."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(x.t()).t()


# -- which calls draw ----------------------------------------------------------------------------------------------
def test_the_dispatchers_random_ops_are_classified_by_what_replays_them():
    aten = torch.ops.aten
    assert random_ops.rule_of(aten.bernoulli_.float).kind == "values" and random_ops.rule_of(aten.bernoulli_.float).mask
    assert random_ops.rule_of(aten.rand.default).kind == "values" and not random_ops.rule_of(aten.rand.default).mask
    assert random_ops.rule_of(aten.native_dropout.default).kind == "dropout"
    assert random_ops.rule_of(aten.rrelu_with_noise.default).kind == "rrelu"
    flash = random_ops.rule_of(aten._scaled_dot_product_efficient_attention.default)
    assert flash.kind == "kernel"
    q = torch.zeros(1, 1, 2, 4)
    assert flash.draws((q, q, q, None, True), {"dropout_p": 0.1})
    assert not flash.draws((q, q, q, None, True), {"dropout_p": 0.0})  # no dropout: deterministic
    cudnn_rnn = random_ops.rule_of(aten._cudnn_rnn.default)
    assert cudnn_rnn.kind == "kernel"
    # Twin: deterministic ops have no rule, and a dropout kernel in eval mode draws nothing.
    assert random_ops.rule_of(aten.mul.Tensor) is None and random_ops.rule_of(aten.add.Tensor) is None
    assert not random_ops.rule_of(aten.native_dropout.default).draws((q, 0.1, False), {})


# -- recording -------------------------------------------------------------------------------------
def test_recording_changes_nothing_the_run_computes_or_draws():
    model, x = _net(), _x(8, 6)

    def draw(module, args, output) -> None:
        torch.rand(1)

    def run(recorder: MaskRecorder | None, extra_draw: bool = False):
        torch.manual_seed(5)
        handle = model[2].register_forward_hook(draw) if extra_draw else None
        with recorder.recording() if recorder else contextlib.nullcontext():
            y = model(x)
        if handle:
            handle.remove()
        return y, torch.get_rng_state()

    plain_y, plain_state = run(None)
    recorder = MaskRecorder(model)
    y, state = run(recorder)
    assert torch.equal(y, plain_y) and torch.equal(state, plain_state)
    record = recorder.take()
    assert sorted(record.masks) == [_key("2"), _key("4")] and not record.problems
    assert all(len(calls) == 1 for calls in record.masks.values())
    assert not _hooked(model) and not _get_current_dispatch_mode_stack()  # hooks and mode only inside the block

    # Twin: a hook that draws one number of its own is seen by the same comparison.
    drawn_y, drawn_state = run(None, extra_draw=True)
    assert not torch.equal(drawn_state, plain_state) and not torch.equal(drawn_y, plain_y)


def test_hooks_and_mode_are_removed_when_the_forward_fails():
    model = _net()
    recorder = MaskRecorder(model)
    with pytest.raises(RuntimeError, match="shape"):
        with recorder.recording():
            model(_x(8, 5))
    assert not _hooked(model) and not _get_current_dispatch_mode_stack()


def test_eval_mode_p_zero_and_draws_outside_the_model_record_nothing():
    model = _net()
    model.eval()
    record, _ = _record(model, _x(4, 6))
    assert record.masks == {} and record.problems == {}
    record, _ = _record(_net(p=0.0), _x(4, 6))
    assert record.masks == {}
    recorder = MaskRecorder(_net())
    with recorder.recording():
        torch.rand(3)  # the loss's or the backend's own draw: not the model's forward
    assert recorder.take().masks == {}


# -- replay ----------------------------------------------------------------------------------------
def _assert_replayed(model: nn.Module, copy64: nn.Module, x: torch.Tensor, y: torch.Tensor,
                     record: MaskRecord) -> dict[str, torch.Tensor]:
    """The float64 copy under the recorded draws computes the recorded forward and its gradients (float32 rounding);
    returns the recorded model's gradients."""
    (y ** 2).sum().backward()
    with MaskReplayer(copy64).applying(record.calls()):
        y64 = copy64(x.double())
        (y64 ** 2).sum().backward()
    assert _rel(y, y64) < 1e-5
    grads, grads64 = _grads(model), _grads(copy64)
    assert all(_rel(grads[n], grads64[n]) < 1e-5 for n in grads), {n: _rel(grads[n], grads64[n]) for n in grads}
    return grads


@pytest.mark.parametrize("inplace", [False, True])
def test_recorded_masks_make_a_float64_copy_compute_the_same_forward_and_gradients(inplace):
    model, x = _net(inplace=inplace), _x(8, 6)
    copy64 = copy.deepcopy(model).double()
    record, (y,) = _record(model, x)
    grads = _assert_replayed(model, copy64, x, y, record)

    # Twin: without the draws the copy draws its own and computes another function.
    free64 = copy.deepcopy(model).double()
    free64.zero_grad()
    torch.manual_seed(6)
    y_free = free64(x.double())
    (y_free ** 2).sum().backward()
    assert _rel(y, y_free) > 1e-2
    assert max(_rel(grads[n], g.grad) for n, g in free64.named_parameters()) > 1e-2


@pytest.mark.parametrize("make", [
    lambda: nn.Sequential(nn.Linear(6, 8), nn.AlphaDropout(0.3), nn.Linear(8, 4)),
    lambda: nn.Sequential(nn.Linear(6, 8), nn.RReLU(), nn.Linear(8, 4)),
    lambda: nn.Sequential(nn.Linear(6, 16), nn.ReLU(), _DrawsFirst(0.3), nn.Linear(16, 4)),
    lambda: _Noisy(),
], ids=["alpha-dropout", "rrelu", "draws-before-its-mask", "randn-in-forward"])
def test_every_random_op_of_the_forward_replays(make):
    torch.manual_seed(0)
    model, x = make(), _x(8, 6)
    copy64 = copy.deepcopy(model).double()
    record, (y,) = _record(model, x)
    assert record.masks and not record.problems
    _assert_replayed(model, copy64, x, y, record)

    # Twin: the draws of another seed give another output.
    other, _ = _record(model, x, seed=6)
    with MaskReplayer(copy64).applying(other.calls()):
        assert _rel(y, copy64(x.double())) > 1e-3


def test_dropout2d_draws_one_number_per_channel_and_replays():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Dropout2d(0.5), nn.Conv2d(8, 2, 1))
    x = _x(4, 3, 5, 5)
    copy64 = copy.deepcopy(model).double()
    record, (y,) = _record(model, x)
    (mask,) = record.calls()[_key("1")]
    assert mask.shape == (4, 8, 1, 1) and mask.dtype == torch.bool and 0 < int(mask.sum()) < 32
    with MaskReplayer(copy64).applying(record.calls()):
        assert _rel(y, copy64(x.double())) < 1e-5

    # Twin: element-wise dropout in the same place draws a mask of the input's shape.
    model[1] = nn.Dropout(0.5)
    record, _ = _record(model, x)
    assert record.calls()[_key("1")][0].shape == (4, 8, 5, 5)


def test_micro_batches_replay_in_call_order():
    model, x1, x2 = _net(), _x(4, 6, seed=1), _x(4, 6, seed=2)
    copy64 = copy.deepcopy(model).double()
    record, (y1, y2) = _record(model, x1, x2)
    calls = record.calls()
    assert {n: len(c) for n, c in calls.items()} == {_key("2"): 2, _key("4"): 2}
    assert not torch.equal(calls[_key("2")][0], calls[_key("2")][1])

    replayer = MaskReplayer(copy64)
    with replayer.applying(calls):
        assert _rel(y1, copy64(x1.double())) < 1e-5
        assert _rel(y2, copy64(x2.double())) < 1e-5
        with pytest.raises(MaskMismatch, match="3 times") as third:
            copy64(x1.double())
    assert third.value.module == "2"

    # Twin: the draws in the other order give other outputs.
    with replayer.applying({n: c[::-1] for n, c in calls.items()}):
        assert _rel(y1, copy64(x1.double())) > 1e-2
        copy64(x2.double())

    with pytest.raises(MaskMismatch, match="not used") as left:
        with replayer.applying(calls):
            copy64(x1.double())
    assert left.value.module == "2"
    with pytest.raises(ValueError, match="in flight"):  # an error inside is not hidden by the leftover check
        with replayer.applying(calls):
            raise ValueError("in flight")
    assert not _hooked(copy64) and not _get_current_dispatch_mode_stack()


def test_nothing_is_hooked_without_draws():
    model = _net()
    torch.manual_seed(5)
    with MaskReplayer(model).applying(None):
        assert not _hooked(model)
        y = model(_x(4, 6))
    torch.manual_seed(5)
    assert torch.equal(y, model(_x(4, 6)))
    # Twin: an empty record says the run drew nothing, so a copy that draws is refused.
    with pytest.raises(MaskMismatch, match="recorded no draw") as drew:
        with MaskReplayer(model).applying({}):
            model(_x(4, 6))
    assert drew.value.module == "2"


def test_a_draw_of_another_shape_is_refused():
    model = _net()
    record, _ = _record(model, _x(4, 6))
    copy64 = copy.deepcopy(model).double()
    replayer = MaskReplayer(copy64)
    with pytest.raises(MaskMismatch, match=r"shape \(4, 16\), this call's \(3, 16\)") as wrong:
        with replayer.applying(record.calls()):
            copy64(_x(3, 6).double())
    assert wrong.value.module == "2"
    with pytest.raises(MaskMismatch, match="no module of this name") as unknown:
        with replayer.applying({_key("9"): record.calls()[_key("2")]}):
            pass
    assert unknown.value.module == "9"

    # Twin: the shape it was recorded with is accepted.
    with replayer.applying(record.calls()):
        copy64(_x(4, 6).double())


def test_a_data_parallel_replica_on_its_own_thread_is_recorded():
    """nn.DataParallel's replicate() shallow-copies each module's __dict__: the replica shares the hooks dict, and its
    thread enters the recording's dispatch mode at its first hooked call."""
    model = _net()
    recorder = MaskRecorder(model)
    replica = model[2]._replicate_for_data_parallel()
    h = torch.relu(model[0](_x(4, 6)))
    with recorder.recording():
        thread = threading.Thread(target=replica, args=(h,))
        thread.start()
        thread.join()
    record = recorder.take()
    assert [m.replica for m in record.masks[_key("2")]] == [0] and record.problems == {}
    # Twin: a thread outside the model's modules records nothing.
    with recorder.recording():
        thread = threading.Thread(target=lambda: F.dropout(h, 0.5))
        thread.start()
        thread.join()
    assert recorder.take().masks == {}


class _LayerDrop(nn.Module):
    """Skips its dropout when a number it draws falls below 0.5 (as LayerDrop skips layers): how many numbers a forward
    draws depends on what it drew."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.drop, self.b = nn.Linear(6, 6), nn.Dropout(0.3), nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(self.drop(h) if float(torch.rand([])) >= 0.5 else h)


def test_each_micro_batch_takes_its_own_forwards_draws_however_many_it_made():
    torch.manual_seed(0)
    model, x = _LayerDrop(), _x(8, 6)
    seed = next(s for s in range(100) if [len(c) for c in _record(model, x[:4], x[4:], seed=s)[0].masks.values()]
                == [2, 1])
    record, (y1, y2) = _record(model, x[:4], x[4:], seed=seed)
    assert record.forwards == 2
    forwards = Forwards(Layout(1, grad_accum=2), None, batchnorms=[], per_replica=False, stochastic=True,
                        dtype="float32", depth=2, verdict=Verdict())
    split = forwards.masks(8, [record])
    assert [{k: len(c) for k, c in f.items()} for f in split] in ([{_key("", "aten.rand.default"): 1},
                                                                   {_key("", "aten.rand.default"): 1,
                                                                    _key("drop"): 1}],
                                                                  [{_key("", "aten.rand.default"): 1, _key("drop"): 1},
                                                                   {_key("", "aten.rand.default"): 1}])
    copy64 = copy.deepcopy(model).double()
    for xs, y, drawn in ((x[:4], y1, split[0]), (x[4:], y2, split[1])):
        with MaskReplayer(copy64).applying(drawn):
            assert _rel(y, copy64(xs.double())) < 1e-5
    # Twin: a rank that ran its forward three times in a step of two micro-batches is refused.
    three, _ = _record(model, x[:4], x[4:], x[:4], seed=seed)
    with pytest.raises(MaskMismatch, match="forward 3 times in a step of 2"):
        forwards.masks(8, [three])


# -- combine ---------------------------------------------------------------------------------------
def test_draws_of_strided_shards_assemble_into_the_whole_batch():
    model, x = _net(), _x(6, 6)
    index = [torch.arange(r, 6, 2) for r in range(2)]
    pieces, outs = [], []
    for r in range(2):
        record, (y,) = _record(model, x[index[r]], seed=10 + r)
        pieces.append(record.calls())
        outs.append(y)
    whole = combine(pieces, index, 6)
    for key in (_key("2"), _key("4")):
        assert len(whole[key]) == 1
        for r in range(2):
            assert torch.equal(whole[key][0][index[r]], pieces[r][key][0])
    expected = torch.empty(6, 4)
    for r in range(2):
        expected[index[r]] = outs[r].detach()
    copy64 = copy.deepcopy(model).double()
    with MaskReplayer(copy64).applying(whole):
        assert _rel(copy64(x.double()), expected) < 1e-5

    # Twin: the same pieces read as contiguous halves put the draws on the wrong rows.
    halves = combine(pieces, [torch.arange(0, 3), torch.arange(3, 6)], 6)
    with MaskReplayer(copy64).applying(halves):
        assert _rel(copy64(x.double()), expected) > 1e-2
    with pytest.raises(ValueError, match="exactly once"):
        combine(pieces, [torch.arange(0, 3), torch.arange(0, 3)], 6)


def test_combine_refuses_draws_that_are_not_batch_first_or_unevenly_called():
    model, x = _Transposed(), _x(6, 6)
    index = [torch.arange(r, 6, 2) for r in range(2)]
    pieces = [_record(model, x[index[r]], seed=r)[0].calls() for r in range(2)]
    assert pieces[0][_key("drop")][0].shape == (6, 3)
    with pytest.raises(MaskMismatch, match="not batch-first") as wrong:
        combine(pieces, index, 6)
    assert wrong.value.module == "drop"

    net = _net()
    uneven = [_record(net, x[index[0]])[0].calls(), _record(net, x[index[1]], x[index[1]])[0].calls()]
    with pytest.raises(MaskMismatch, match=r"called \[1, 2\] times") as counts:
        combine(uneven, index, 6)
    assert counts.value.module == "2"


# -- uncaptured ------------------------------------------------------------------------------------
def test_uncaptured_passes_models_whose_randomness_is_all_replayed():
    torch.manual_seed(0)
    with_bn = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 4))
    no_randomness = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))
    functional = nn.Sequential(nn.Linear(6, 8), nn.AlphaDropout(0.3), nn.RReLU(), _DrawsFirst(0.2))
    for model in (_net(), _net(inplace=True), with_bn, no_randomness, functional, _Noisy()):
        assert uncaptured(model, _x(8, 6)) is None
    for dropout in (0.0, 0.1):  # nn.MultiheadAttention drops its attention weights with F.dropout
        assert uncaptured(_Attention(dropout=dropout), _x(2, 5, 8)) is None


@pytest.mark.parametrize(("model", "shape", "expected"), [
    (lambda: nn.Sequential(nn.Linear(8, 8), _NumpyAttention(), nn.Linear(8, 3)), (2, 5, 8), "1 (_NumpyAttention) draws"),
    (lambda: nn.Sequential(_NumpyAttention()), (2, 5, 8), "0 (_NumpyAttention) draws"),
])
def test_uncaptured_names_the_module_that_draws_not_the_first_to_see_it(model, shape, expected):
    torch.manual_seed(0)
    model = model()
    model.eval()
    state = torch.get_rng_state()
    found = uncaptured(model, _x(*shape))
    assert found.startswith(expected) and "outside torch's random operations" in found, found
    assert "out" not in found.split(" draws")[0]  # not its output projection, the first module whose output differs
    assert not model.training and not any(m.training for m in model.modules())  # its training flags as found
    assert torch.equal(torch.get_rng_state(), state)  # the caller's generator untouched


def test_a_fused_kernel_that_draws_is_named_with_its_op():
    """CUDA's memory-efficient attention draws its dropout inside the kernel: run here on meta tensors, which go
    through the dispatcher the same way."""

    class FusedAttention(nn.Module):
        def forward(self, q: torch.Tensor) -> torch.Tensor:
            out = torch.ops.aten._scaled_dot_product_efficient_attention(q, q, q, None, True, dropout_p=0.1)
            return out[0]

    model = nn.Sequential(FusedAttention())
    recorder = MaskRecorder(model)
    with recorder.recording():
        model(torch.empty(2, 2, 4, 8, device="meta"))
    record = recorder.take()
    assert list(record.problems) == ["0"]
    assert "aten._scaled_dot_product_efficient_attention.default with dropout 0.1" in record.problems["0"]
    assert "inside the kernel" in record.problems["0"]
    with pytest.raises(MaskMismatch, match="inside the kernel") as refused:
        with MaskReplayer(model).applying({}):
            model(torch.empty(2, 2, 4, 8, device="meta"))
    assert refused.value.module == "0"
    # Twin: the same kernel without dropout draws nothing.
    model[0].forward = lambda q: torch.ops.aten._scaled_dot_product_efficient_attention(q, q, q, None, True)[0]
    with recorder.recording():
        model(torch.empty(2, 2, 4, 8, device="meta"))
    assert not recorder.take().problems


def test_uncaptured_keeps_mixed_training_flags():
    model = _net()
    model[2].eval()
    uncaptured(model, _x(8, 6))
    assert model.training and not model[2].training and model[4].training


# -- transit ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(3, 5, 7), (1,), (13,), (2, 0, 3), (4, 8)])
def test_masks_round_trip_at_one_bit_per_element(shape):
    mask = torch.rand(shape, generator=torch.Generator().manual_seed(3)) < 0.5
    packed = PackedDraw.of(mask.float(), replica=1, mask=True)
    assert packed.bits.dtype == np.uint8 and packed.nbytes == math.ceil(mask.numel() / 8)
    assert torch.equal(packed.unpack(), mask) and packed.unpack().device.type == "cpu"
    # Twin: the padding bits of the last byte are not read back as elements; a flipped element bit is.
    if mask.numel() % 8:
        padded = PackedDraw(packed.shape, 1, packed.bits.copy())
        padded.bits[-1] |= (1 << (8 - mask.numel() % 8)) - 1
        assert torch.equal(padded.unpack(), mask)
    if mask.numel():
        flipped = PackedDraw(packed.shape, 1, packed.bits.copy())
        flipped.bits[0] ^= 0x80
        assert not torch.equal(flipped.unpack(), mask) and not flipped.same(packed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int64])
def test_other_draws_travel_as_they_are(dtype):
    values = (torch.rand(3, 5, generator=torch.Generator().manual_seed(4)) * 100).to(dtype)
    packed = PackedDraw.of(values)
    assert packed.bits is None and packed.nbytes == values.numel() * values.element_size()
    assert packed.unpack().dtype == dtype and torch.equal(packed.unpack(), values)
    changed = values.clone()
    changed[0, 0] += 1
    assert not PackedDraw.of(changed).same(packed) and PackedDraw.of(values.clone()).same(packed)


def test_records_are_picklable_and_small():
    model, x = _net(), _x(7, 6)
    record, _ = _record(model, x, x)
    again = pickle.loads(pickle.dumps(record))
    calls, calls_again = record.calls(), again.calls()
    assert calls.keys() == calls_again.keys()
    assert all(torch.equal(a, b) for n in calls for a, b in zip(calls[n], calls_again[n]))
    numel = sum(m.numel() for c in calls.values() for m in c)
    assert numel / 8 <= record.nbytes < numel / 8 + 4
    error = pickle.loads(pickle.dumps(MaskMismatch("blocks.0", "why")))
    assert error.module == "blocks.0" and error.reason == "why"


def test_calls_selects_a_replica():
    one, two = torch.tensor([True, False]), torch.tensor([False, True])
    record = MaskRecord({"d|op": [PackedDraw.of(one, 0, mask=True), PackedDraw.of(two, 1, mask=True)]}, {})
    assert [m.tolist() for m in record.calls()["d|op"]] == [one.tolist(), two.tolist()]
    assert [m.tolist() for m in record.calls(replica=1)["d|op"]] == [two.tolist()]
    assert record.calls(replica=2) == {}


# -- CUDA ------------------------------------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: masks drawn by the CUDA generator")
def test_masks_drawn_on_cuda_make_a_float64_copy_compute_the_same_forward_and_gradients():
    device = torch.device("cuda")
    model, x = _net().to(device), _x(64, 6).to(device)
    copy64 = copy.deepcopy(model).double()

    torch.manual_seed(5)
    plain = model(x)
    plain_state = torch.cuda.get_rng_state(device)
    record, (y,) = _record(model, x)
    assert torch.equal(y, plain) and torch.equal(torch.cuda.get_rng_state(device), plain_state)
    assert record.problems == {} and list(record.masks) == [_key("2", "aten.native_dropout.default"),
                                                             _key("4", "aten.native_dropout.default")]
    assert all(m.replica == x.device.index for m in record.masks[_key("2", "aten.native_dropout.default")])
    _assert_replayed(model, copy64, x, y, record)

    torch.manual_seed(6)
    assert _rel(y, copy.deepcopy(model).double()(x.double())) > 1e-2  # twin: the copy's own draw differs
