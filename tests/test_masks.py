"""Captured dropout masks make another copy of the model compute the same random function, and nothing else changes.

Each test runs a small real model in one process: it records the masks its dropout modules draw
(dpcompare.verify.masks.MaskRecorder), applies them in a float64 or float32 copy (MaskReplayer), assembles a whole
batch's masks from its shards' (combine) or asks whether a model draws outside capturable modules (uncaptured).
Every check has a twin that must fail: a run that draws one extra number is seen to change, a copy without the
masks is seen to differ, a module that draws before its mask is refused, masks in the wrong order or for the wrong
rows give the wrong output.
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

from dpcompare.verify.masks import (CAPTURABLE, MaskMismatch, MaskRecord, MaskRecorder, MaskReplayer, PackedMask,
                                    combine, uncaptured)


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


class _DrawsFirst(nn.Dropout):
    """Draws a number of its own before its mask: the mask regenerated from the state before the call is wrong."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.rand(1)
        return super().forward(x)


class _PlainSubclass(nn.Dropout):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


class _FunctionalDropout(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, 0.3, self.training)


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


class _Transposed(nn.Module):
    """Drops along features-first rows: its mask is not batch-first."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(x.t()).t()


# -- recording -------------------------------------------------------------------------------------
def test_capturable_is_the_dropout_family_with_a_0_1_mask():
    assert nn.Dropout in CAPTURABLE and nn.Dropout2d in CAPTURABLE
    assert not isinstance(nn.AlphaDropout(0.1), CAPTURABLE)  # its dropped value is not 0


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
    assert recorder.modules == ["2", "4"] and sorted(record.masks) == ["2", "4"] and not record.problems
    assert all(len(calls) == 1 for calls in record.masks.values())
    assert not model[2]._forward_hooks and not model[2]._forward_pre_hooks  # hooks only inside the block

    # Twin: a hook that draws one number of its own is seen by the same comparison.
    drawn_y, drawn_state = run(None, extra_draw=True)
    assert not torch.equal(drawn_state, plain_state) and not torch.equal(drawn_y, plain_y)


def test_hooks_are_removed_when_the_forward_fails():
    model = _net()
    recorder = MaskRecorder(model)
    with pytest.raises(RuntimeError, match="shape"):
        with recorder.recording():
            model(_x(8, 5))
    assert not model[2]._forward_hooks and not model[2]._forward_pre_hooks


def test_eval_mode_and_p_zero_record_nothing():
    model = _net()
    model.eval()
    record, _ = _record(model, _x(4, 6))
    assert record.masks == {} and record.problems == {}
    assert MaskRecorder(_net(p=0.0)).modules == []


# -- replay ----------------------------------------------------------------------------------------
def _assert_replayed(model: nn.Module, copy64: nn.Module, x: torch.Tensor, y: torch.Tensor,
                     record: MaskRecord) -> dict[str, torch.Tensor]:
    """The float64 copy under the captured masks computes the recorded forward and its gradients (float32 rounding);
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
def test_captured_masks_make_a_float64_copy_compute_the_same_forward_and_gradients(inplace):
    model, x = _net(inplace=inplace), _x(8, 6)
    copy64 = copy.deepcopy(model).double()
    record, (y,) = _record(model, x)
    grads = _assert_replayed(model, copy64, x, y, record)

    # Twin: without the masks the copy draws its own and computes another function.
    free64 = copy.deepcopy(model).double()
    free64.zero_grad()
    torch.manual_seed(6)
    y_free = free64(x.double())
    (y_free ** 2).sum().backward()
    assert _rel(y, y_free) > 1e-2
    assert max(_rel(grads[n], g.grad) for n, g in free64.named_parameters()) > 1e-2


def test_dropout2d_channel_masks_are_captured():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Dropout2d(0.5), nn.Conv2d(8, 2, 1))
    x = _x(4, 3, 5, 5)
    copy64 = copy.deepcopy(model).double()
    record, (y,) = _record(model, x)
    (mask,) = record.calls()["1"]
    assert mask.shape == (4, 8, 5, 5)
    per_channel = mask.flatten(2)
    assert bool((per_channel.all(-1) | ~per_channel.any(-1)).all())  # each channel kept or dropped whole
    assert 0 < int(per_channel.all(-1).sum()) < 32
    with MaskReplayer(copy64).applying(record.calls()):
        assert _rel(y, copy64(x.double())) < 1e-5

    # Twin: element-wise dropout in the same place draws a mask that varies over the spatial dims.
    model[1] = nn.Dropout(0.5)
    record, _ = _record(model, x)
    per_element = record.calls()["1"][0].flatten(2)
    assert not bool((per_element.all(-1) | ~per_element.any(-1)).all())


def test_micro_batches_replay_in_call_order():
    model, x1, x2 = _net(), _x(4, 6, seed=1), _x(4, 6, seed=2)
    copy64 = copy.deepcopy(model).double()
    record, (y1, y2) = _record(model, x1, x2)
    calls = record.calls()
    assert {n: len(c) for n, c in calls.items()} == {"2": 2, "4": 2}
    assert not torch.equal(calls["2"][0], calls["2"][1])

    replayer = MaskReplayer(copy64)
    with replayer.applying(calls):
        assert _rel(y1, copy64(x1.double())) < 1e-5
        assert _rel(y2, copy64(x2.double())) < 1e-5
        with pytest.raises(MaskMismatch, match="called 3 times") as third:
            copy64(x1.double())
    assert third.value.module == "2"

    # Twin: the masks in the other order give other outputs.
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
    assert not copy64[2]._forward_hooks and not copy64[2]._forward_pre_hooks


def test_nothing_is_hooked_without_masks():
    model = _net()
    for masks in (None, {}):
        torch.manual_seed(5)
        with MaskReplayer(model).applying(masks):
            assert not model[2]._forward_hooks
            y = model(_x(4, 6))
        torch.manual_seed(5)
        assert torch.equal(y, model(_x(4, 6)))


def test_a_module_that_draws_before_its_mask_is_refused():
    model = _net()
    model[2] = _DrawsFirst(0.3)
    record, _ = _record(model, _x(8, 6))
    assert list(record.problems) == ["2"] and "does not match" in record.problems["2"]
    assert "2" not in record.masks and "4" in record.masks  # the plain dropout beside it is still captured
    copy64 = copy.deepcopy(model).double()
    with pytest.raises(MaskMismatch, match="no mask was captured") as missing:
        with MaskReplayer(copy64).applying(record.calls()):
            copy64(_x(8, 6).double())
    assert missing.value.module == "2"

    # Twin: a subclass that only calls nn.Dropout's forward is captured.
    model[2] = _PlainSubclass(0.3)
    record, _ = _record(model, _x(8, 6))
    assert record.problems == {} and sorted(record.masks) == ["2", "4"]


def test_a_mask_of_another_shape_is_refused():
    model = _net()
    record, _ = _record(model, _x(4, 6))
    copy64 = copy.deepcopy(model).double()
    replayer = MaskReplayer(copy64)
    with pytest.raises(MaskMismatch, match=r"shape \(4, 16\), input has shape \(3, 16\)") as wrong:
        with replayer.applying(record.calls()):
            copy64(_x(3, 6).double())
    assert wrong.value.module == "2"
    with pytest.raises(MaskMismatch, match="no capturable module") as unknown:
        with replayer.applying({"0": record.calls()["2"]}):
            pass
    assert unknown.value.module == "0"

    # Twin: the shape it was recorded with is accepted.
    with replayer.applying(record.calls()):
        copy64(_x(4, 6).double())


def test_hooks_fire_in_a_data_parallel_replica_on_its_own_thread():
    """nn.DataParallel's replicate() shallow-copies each module's __dict__: the replica shares the hooks dict."""
    model = _net()
    recorder = MaskRecorder(model)
    replica = model[2]._replicate_for_data_parallel()
    h = torch.relu(model[0](_x(4, 6)))
    with recorder.recording():
        thread = threading.Thread(target=replica, args=(h,))
        thread.start()
        thread.join()
    record = recorder.take()
    assert [m.replica for m in record.masks["2"]] == [0] and record.problems == {}


# -- combine ---------------------------------------------------------------------------------------
def test_masks_of_strided_shards_assemble_into_the_whole_batch():
    model, x = _net(), _x(6, 6)
    index = [torch.arange(r, 6, 2) for r in range(2)]
    pieces, outs = [], []
    for r in range(2):
        record, (y,) = _record(model, x[index[r]], seed=10 + r)
        pieces.append(record.calls())
        outs.append(y)
    whole = combine(pieces, index, 6)
    for name in ("2", "4"):
        assert len(whole[name]) == 1
        for r in range(2):
            assert torch.equal(whole[name][0][index[r]], pieces[r][name][0])
    expected = torch.empty(6, 4)
    for r in range(2):
        expected[index[r]] = outs[r].detach()
    copy64 = copy.deepcopy(model).double()
    with MaskReplayer(copy64).applying(whole):
        assert _rel(copy64(x.double()), expected) < 1e-5

    # Twin: the same pieces read as contiguous halves put the masks on the wrong rows.
    halves = combine(pieces, [torch.arange(0, 3), torch.arange(3, 6)], 6)
    with MaskReplayer(copy64).applying(halves):
        assert _rel(copy64(x.double()), expected) > 1e-2
    with pytest.raises(ValueError, match="exactly once"):
        combine(pieces, [torch.arange(0, 3), torch.arange(0, 3)], 6)


def test_combine_refuses_masks_that_are_not_batch_first_or_unevenly_called():
    model, x = _Transposed(), _x(6, 6)
    index = [torch.arange(r, 6, 2) for r in range(2)]
    pieces = [_record(model, x[index[r]], seed=r)[0].calls() for r in range(2)]
    assert pieces[0]["drop"][0].shape == (6, 3)
    with pytest.raises(MaskMismatch, match="not batch-first") as wrong:
        combine(pieces, index, 6)
    assert wrong.value.module == "drop"

    net = _net()
    uneven = [_record(net, x[index[0]])[0].calls(), _record(net, x[index[1]], x[index[1]])[0].calls()]
    with pytest.raises(MaskMismatch, match=r"called \[1, 2\] times") as counts:
        combine(uneven, index, 6)
    assert counts.value.module == "2"


# -- uncaptured ------------------------------------------------------------------------------------
def test_uncaptured_passes_models_whose_randomness_is_all_captured():
    torch.manual_seed(0)
    with_bn = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 4))
    no_randomness = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))
    for model in (_net(), _net(inplace=True), with_bn, no_randomness):
        assert uncaptured(model, _x(8, 6)) is None
    assert uncaptured(_Attention(dropout=0.0), _x(2, 5, 8)) is None


@pytest.mark.parametrize(("model", "shape", "expected"), [
    (lambda: nn.Sequential(nn.Linear(6, 8), _FunctionalDropout(), nn.Linear(8, 4)), (8, 6), "1 (_FunctionalDropout)"),
    (lambda: nn.Sequential(nn.Linear(6, 8), nn.AlphaDropout(0.3), nn.Linear(8, 4)), (8, 6), "1 (AlphaDropout)"),
    (lambda: _Attention(dropout=0.1), (2, 5, 8), "attn (MultiheadAttention)"),
    (lambda: _Noisy(), (8, 6), "the model's own forward (_Noisy)"),
    (lambda: nn.Sequential(nn.Linear(6, 16), nn.ReLU(), _DrawsFirst(0.3)), (8, 6), "2 (_DrawsFirst)"),
])
def test_uncaptured_names_the_module_that_draws(model, shape, expected):
    torch.manual_seed(0)
    model = model()
    model.eval()
    state = torch.get_rng_state()
    assert uncaptured(model, _x(*shape)) == expected
    assert not model.training and not any(m.training for m in model.modules())  # its training flags as found
    assert torch.equal(torch.get_rng_state(), state)  # the caller's generator untouched


def test_uncaptured_keeps_mixed_training_flags():
    model = _net()
    model[2].eval()
    uncaptured(model, _x(8, 6))
    assert model.training and not model[2].training and model[4].training


# -- transit ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(3, 5, 7), (1,), (13,), (2, 0, 3), (4, 8)])
def test_packed_masks_round_trip_at_one_bit_per_element(shape):
    mask = torch.rand(shape, generator=torch.Generator().manual_seed(3)) < 0.5
    packed = PackedMask.of(mask, replica=1)
    assert packed.bits.dtype == np.uint8 and packed.bits.nbytes == math.ceil(mask.numel() / 8)
    assert torch.equal(packed.unpack(), mask) and packed.unpack().device.type == "cpu"
    # Twin: the padding bits of the last byte are not read back as elements; a flipped element bit is.
    if mask.numel() % 8:
        padded = PackedMask(packed.shape, 1, packed.bits.copy())
        padded.bits[-1] |= (1 << (8 - mask.numel() % 8)) - 1
        assert torch.equal(padded.unpack(), mask)
    if mask.numel():
        flipped = PackedMask(packed.shape, 1, packed.bits.copy())
        flipped.bits[0] ^= 0x80
        assert not torch.equal(flipped.unpack(), mask)


def test_mask_records_are_picklable_and_small():
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
    record = MaskRecord({"d": [PackedMask.of(one, 0), PackedMask.of(two, 1)]}, {})
    assert [m.tolist() for m in record.calls()["d"]] == [one.tolist(), two.tolist()]
    assert [m.tolist() for m in record.calls(replica=1)["d"]] == [two.tolist()]
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
    assert record.problems == {} and all(m.replica == x.device.index for m in record.masks["2"])
    _assert_replayed(model, copy64, x, y, record)

    torch.manual_seed(6)
    assert _rel(y, copy.deepcopy(model).double()(x.double())) > 1e-2  # twin: the copy's own draw differs
