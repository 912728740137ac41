"""Optimizer state comparison: is the state a backend's optimizer holds the one it should hold?

Owns: the comparisons of a backend's optimizer state with the expected one: whether two states step the same way
(_same_state), the parameters whose state differs with a phrase on the first entry that does
(state_difference), the parameters whose step count differs, compared exactly (step_count_mismatch), and the
known way a fresh optimizer comes to have stepped already (FRESH_STEPPED_TRAP). A missing entry and an all-zero
buffer count as the same; integer and bool entries are compared exactly, floating ones to rounding. Imports no
adapter.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from dpcompare.contract.optim_state import OptState, per_element
from dpcompare.verify.judgement.tolerance import CHUNK


def _same_state(a: OptState, b: OptState) -> bool:
    """Two optimizer states that step the same way: equal keys and values, where a missing entry and an
    all-zero buffer count as the same (a zero momentum buffer steps like none). Values agree to 1e-4 of
    their scale, or 4 units of a 16-bit entry's rounding (`agreement`): the expected state is a float64 step from the
    backend's own one, so they differ by rounding; a state that is not the expected one (a step count, a reset buffer) differs by far more."""
    for p in set(a) | set(b):
        ea, eb = a.get(p, {}), b.get(p, {})
        for key in set(ea) | set(eb):
            va, vb = ea.get(key), eb.get(key)
            if va is None or vb is None:
                present = va if vb is None else vb
                if not (per_element(key, present) and not bool(present.any())):
                    return False
                continue
            if torch.is_tensor(va) and torch.is_tensor(vb):
                if _integral(va, vb):
                    if va.shape != vb.shape or not torch.equal(va.to(torch.int64), vb.to(torch.int64)):
                        return False
                    continue
                within = agreement(va, vb)
                va, vb = va.double(), vb.double()
                scale = float(vb.abs().max()) if vb.numel() else 0.0
                if float((va - vb).abs().max() if va.numel() else 0.0) > within * max(scale, 1e-30):
                    return False
            elif va != vb:
                return False
    return True


def agreement(have: torch.Tensor, want: torch.Tensor) -> float:
    """How far two floating state entries may differ, relative to the expected one's largest value: 1e-4, or 4 units
    of the coarser entry's rounding where that is more. An entry held in 16 bits (a --dtype bfloat16 run's AdamW
    moments) is computed in 16-bit arithmetic by the backend and rounded once from float64 by the replay: they differ
    by an ulp or two of each element (bfloat16's unit roundoff is 2^-8), where a wrong state (a reset buffer, another
    beta, a step counted twice) differs by a large part of it."""
    coarse = max(torch.finfo(t.dtype).eps / 2 if t.is_floating_point() else 0.0 for t in (have, want))
    return max(1e-4, 4 * coarse)


def _integral(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Both integer or bool: no rounding excuses a difference."""
    return not (a.is_floating_point() or a.is_complex()) and not (b.is_floating_point() or b.is_complex())


def state_difference(backend: OptState, expected: OptState, names: list[str]) -> tuple[list[str], str] | None:
    """(the parameters, in `names` order, whose optimizer state is not the expected one, and a phrase on the first
    showing the entry that differs and both values), or None. A missing entry and an all-zero buffer count as the
    same (a zero momentum buffer steps like none); tensors agree to 1e-4 of their largest value, or 4 units of a 16-bit
    entry's rounding (`agreement`: the expected state is a float64 replay of the backend's own step, so the two differ
    by rounding alone)."""
    wrong, phrase = [], ""
    for name in names:
        ea, eb = backend.get(name, {}), expected.get(name, {})
        for key in sorted(set(ea) | set(eb)):
            text = _entry_difference(name, key, ea.get(key), eb.get(key))
            if text is not None:
                phrase = phrase or text
                wrong.append(name)
                break
    return (wrong, phrase) if wrong else None


def _entry_difference(name: str, key: str, have: Any, want: Any) -> str | None:
    def zero(v: Any) -> bool:
        return per_element(key, v) and not bool(v.any())

    if have is None or want is None:
        present = have if want is None else want
        if zero(present):
            return None
        size = f"of norm {float(torch.linalg.vector_norm(present.double())):.4g}" if torch.is_tensor(present) else \
            f"= {present}"
        return (f"{name} holds {key} {size} where none was expected" if want is None else
                f"{name} holds no {key} where one {size} was expected")
    if torch.is_tensor(have) and torch.is_tensor(want):
        if have.numel() != want.numel():
            return f"{name}'s {key} has {have.numel()} elements where {want.numel()} were expected"
        if not want.numel():
            return None
        if not _integral(have, want) and _surely_within(have.detach().reshape(-1), want.detach().reshape(-1)):
            return None
        scale, worst, largest = _largest_gap(have.detach().reshape(-1), want.detach().reshape(-1))
        if largest <= (0.0 if _integral(have, want) else agreement(have, want) * max(scale, 1e-30)):
            return None
        a, b = have.double().reshape(-1), want.double().reshape(-1)  # a state that differs: whole, for its phrase
        gap = (a - b).abs()
        where = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), tuple(want.shape))) if want.dim() > 1 \
            else worst
        return (f"{name}'s {key} differs from it: element {where} is {float(a[worst]):.6g} where {float(b[worst]):.6g} "
                f"was expected (the largest difference, {float(gap[worst]) / max(scale, 1e-30):.3g} of the expected "
                f"{key}'s largest value; norms {float(torch.linalg.vector_norm(a)):.6g} and "
                f"{float(torch.linalg.vector_norm(b)):.6g})")
    if float(have) != float(want):
        return f"{name} has {key} {float(have):g} where {float(want):g} was expected"
    return None


SLACK = 4
"""`_surely_within` passes a largest difference grown by SLACK units of its rounding: one would cover it; four leave
room for the float64 comparison's own rounding."""


def _surely_within(have: torch.Tensor, want: torch.Tensor) -> bool:
    """Whether two floating entries (flat) agree as `_entry_difference` asks, told in their own dtypes, without a
    float64 copy: max |want| is exact in any dtype, and the largest difference computed in the two's common dtype
    (of unit roundoff u) is within u of itself, relatively, where it is finite. True only where that largest
    difference, grown by 4u, is within the agreement: then the float64 comparison (`_largest_gap`) passes too. False:
    not known here (a difference near the limit, one not finite, an entry on another device's), and that comparison
    decides. Two reads of `want` and one of `have` a chunk at a time, where the float64 one makes about a dozen."""
    if have.device != want.device:
        return False
    common = torch.promote_types(have.dtype, want.dtype)
    if not common.is_floating_point:
        return False
    u = torch.finfo(common).eps / 2
    scale = largest = 0.0
    for i in range(0, want.numel(), CHUNK):
        b = want[i:i + CHUNK]
        gap = _largest_magnitude(torch.sub(have[i:i + CHUNK], b))
        if not math.isfinite(gap):  # a NaN or an infinity in either: the float64 comparison says which
            return False
        scale = max(scale, _largest_magnitude(b))
        largest = max(largest, gap)
    return largest * (1 + SLACK * u) <= agreement(have, want) * max(scale, 1e-30)


def _largest_magnitude(t: torch.Tensor) -> float:
    """max |t|, exactly (NaN where `t` holds one), in one read: from aminmax, which is vectorised on the CPU where the
    infinity norm is not (about 15 times slower there on a chunk of float32)."""
    low, high = torch.aminmax(t)
    low, high = float(low), float(high)
    return math.nan if math.isnan(low) or math.isnan(high) else max(-low, high)


def _largest_gap(have: torch.Tensor, want: torch.Tensor) -> tuple[float, int, float]:
    """(max |want|, the index of the largest |have - want|, that difference), in float64 a chunk at a time (no whole
    float64 copy of a state entry), where `want` is (the model's device: the replay's)."""
    scale, worst, largest = 0.0, 0, -1.0
    for i in range(0, want.numel(), CHUNK):
        # a copy: a float64 entry on want's device (a --dtype float64 run's state) comes back from .to() as itself, and the gap is
        # taken in place below: the backend's state the update check replays from would be left |have - want|
        a = have[i:i + CHUNK].to(device=want.device, dtype=torch.float64, copy=True)
        b = want[i:i + CHUNK].to(dtype=torch.float64)
        scale = max(scale, float(b.abs().max()))
        gap = a.sub_(b).abs_()
        at = int(gap.argmax())
        if float(gap[at]) > largest or math.isnan(float(gap[at])):
            worst, largest = i + at, float(gap[at])
            if math.isnan(largest):
                return scale, worst, math.inf
    return scale, worst, largest


FRESH_STEPPED_TRAP = (" — at step 0 this is a fresh optimizer that already ran step() on zero gradients: Horovod's "
                      "broadcast_optimizer_state does that (horovod/horovod#3743; broadcast after the first step, or "
                      "not at all), and so do DeepSpeed's fp16/bf16 optimizer wrappers when they are built "
                      "(initialize_optimizer_states: with Adam the first real step then runs at step count 2)")


def step_count_mismatch(backend: OptState, expected: OptState, names: list[str]) -> tuple[list[str], str] | None:
    """(the parameters, in `names` order, whose optimizer step count (Adam's `step`, a whole number: no rounding
    excuses it) is not the expected one, and a phrase on the first), or None. A missing count is 0 (a fresh
    optimizer's)."""
    wrong = []
    phrase = ""
    for name in names:
        have = float(backend.get(name, {}).get("step", 0))
        want = float(expected.get(name, {}).get("step", 0))
        if have != want:
            phrase = phrase or f"{name} has optimizer step count {have:g} where {want:g} was expected"
            wrong.append(name)
    return (wrong, phrase) if wrong else None
