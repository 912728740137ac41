"""The update check's divisor power replays a multiplied gradient a piece at a time: the same figures, no parameter made
whole in float64.

`dpcompare.verify.replay.divisor_power` replays the first checked step with the reduced gradient k times the one
checked (k in SCALES, powers of two). The replay takes k as it steps each piece (`reference_step(..., multiple=k)`),
where the gradient used to be handed over multiplied, a float64 copy of each parameter's gradient made whole; and a
norm of an update (`norm_of` on a `Difference`) is read a chunk at a time, where it used to step the parameter whole.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dpcompare.verify.judgement.held_values import Compact
from dpcompare.verify.judgement.tolerance import CHUNK, norm_of
from dpcompare.verify.replay import divisor_power as dp
from dpcompare.verify.replay.optimizer_replay import reference_step

CPU = torch.device("cpu")
SIZES = {"embed": (3 * CHUNK + 1001,), "head": (700, 5), "bias": (7,)}
"""One parameter of several chunks (as an embedding), two of one."""
OPTIMIZERS = {
    "sgd": lambda params, **kw: torch.optim.SGD(params, **{"lr": 0.05, "momentum": 0.9, **kw}),
    "adamw": lambda params, **kw: torch.optim.AdamW(params, **{"lr": 1e-3, "weight_decay": 0.01, **kw}),
}


def _inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    params = {n: torch.randn(s, generator=gen) for n, s in SIZES.items()}
    grads = {n: torch.randn(s, generator=gen) * 1e-3 for n, s in SIZES.items()}
    return Compact(params), Compact(grads)


class _Multiplied(dict):
    """The gradients multiplied whole in float64, as the check handed them to the replay before."""

    def __init__(self, grads: Compact, k: float) -> None:
        super().__init__({n: grads.held(n).double() * k for n in grads})


def _replayed(make, params, grads, dtype, k, clip, *, whole: bool):
    result = reference_step(make, params, _Multiplied(grads, k) if whole else grads, {}, dtype, CPU, clip=clip,
                            keep_state=False, multiple=1.0 if whole else k)
    return {n: result.delta[n].clone() for n in SIZES}


@pytest.mark.parametrize("opt,clip", list(itertools.product(OPTIMIZERS, (None, 1e-4))))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_a_multiple_taken_piece_by_piece_is_the_multiplied_gradients_replay_to_the_bit(opt, clip, dtype):
    params, grads = _inputs()
    for k in (1.0, *dp.SCALES):
        pieces = _replayed(OPTIMIZERS[opt], params, grads, dtype, k, clip, whole=False)
        whole = _replayed(OPTIMIZERS[opt], params, grads, dtype, k, clip, whole=True)
        for n in SIZES:
            assert torch.equal(pieces[n], whole[n]), (opt, clip, dtype, k, n)
    # the multiple is taken: a replay that drops it is not the multiplied one
    dropped = _replayed(OPTIMIZERS[opt], params, grads, dtype, 1.0, clip, whole=False)
    times_two = _replayed(OPTIMIZERS[opt], params, grads, dtype, 2.0, clip, whole=True)
    if clip is None:
        assert not torch.equal(dropped["embed"], times_two["embed"])


def test_a_multiple_that_is_no_power_of_two_is_refused():
    params, grads = _inputs()
    with pytest.raises(ValueError, match="power of two"):
        reference_step(OPTIMIZERS["sgd"], params, grads, {}, torch.float64, CPU, multiple=3.0)


def test_the_norm_of_an_update_read_in_chunks_is_the_whole_ones_within_rounding():
    params, grads = _inputs(1)
    delta = reference_step(OPTIMIZERS["sgd"], params, grads, {}, torch.float64, CPU, keep_state=False).delta
    whole = {n: float(torch.linalg.vector_norm(delta[n])) for n in SIZES}  # __getitem__: the parameter made whole
    chunked = {n: norm_of(delta, [n]) for n in SIZES}
    assert chunked["head"] == whole["head"] and chunked["bias"] == whole["bias"]  # one chunk: to the bit
    assert chunked["embed"] == pytest.approx(whole["embed"], rel=1e-14)


class _Whole(TorchDispatchMode):
    """Every float64 tensor made under it with more elements than a comparison's chunk (a view moves nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (list, tuple)) else (out,):
            if (torch.is_tensor(t) and t.dtype == torch.float64 and t.numel() > CHUNK
                    and t.untyped_storage().nbytes() >= t.numel() * 8 and not func._schema.name.startswith(
                        ("aten::view", "aten::_unsafe_view", "aten::reshape", "aten::as_strided", "aten::slice",
                         "aten::detach", "aten::alias", "aten::_reshape_alias"))):
                self.made.append((func._schema.name, t.numel()))
        return out


def _power(opt: str, grads_for):
    """divisor_power as the update check measures it at a fresh state's first step: `grads_for(k)` the gradients
    replayed k times larger and the multiple the replay takes."""
    params, grads = _inputs(2)

    def replay(k, dtype=torch.float64):
        given, multiple = grads_for(grads, k)
        return reference_step(OPTIMIZERS[opt], params, given, {}, dtype, CPU, keep_state=False,
                              multiple=multiple).delta
    with _Whole() as seen:
        power = dp.divisor_power(replay, replay(1), replay(1, torch.float32), list(SIZES), dtype="float32", depth=2)
    return power, seen.made


@pytest.mark.parametrize("opt", OPTIMIZERS)
def test_the_divisor_power_makes_no_parameter_whole_in_float64_and_its_twin_does(opt):
    power, made = _power(opt, lambda grads, k: (grads, k))
    assert made == [], made
    twin, twin_made = _power(opt, lambda grads, k: (grads if k == 1 else _Multiplied(grads, k), 1.0))
    assert twin_made, "the twin that multiplies each gradient whole is seen making float64 copies of it"
    assert any(n == SIZES["embed"][0] for _, n in twin_made)
    # the same power either way: SGD's update follows the gradient's scale (none), AdamW's hides it
    assert (power is None) == (twin is None) == (opt == "sgd")
    if power is not None:
        assert (power.change, power.tolerance, power.detected) == (twin.change, twin.tolerance, twin.detected)
        assert math.isfinite(power.change) and power.tolerance > 0
