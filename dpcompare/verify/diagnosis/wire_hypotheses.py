"""Wire hypotheses: a reduced gradient that carries the marks of an all-reduce in a narrower dtype.

Owns: the simulation of an all-reduce of the ranks' float32 gradients on an fp16 or bf16 wire (divided by the
world size before the sum or after it, in float32 or in the wire's dtype, each partial sum rounded to the wire:
`WAYS`; from three ranks in each order a ring may add them in), and the two diagnoses it supports:
gradients that leave the wire's range (flushed to zero, or turned into inf) and the wire's rounding on a backend
that declared no compression. The hypotheses of dpcompare.verify.diagnosis.gradient_hypotheses call them with the ranks'
local gradients and their mean. Imports no adapter.
"""

from __future__ import annotations

import math

import torch

from dpcompare.verify.oracle.gradient_oracle import TOLERANCE_FACTOR, UNIT_ROUNDOFF, WIRE_DTYPE, Grads, rel_fro
from dpcompare.verify.diagnosis.failure_evidence import GradientEvidence
from dpcompare.verify.diagnosis.explanation import EXPLAINED_SHARE, Diagnosis


WAYS = ((True, False), (True, True), (False, True), (False, False))
"""Where an all-reduce on a narrow wire divides by the world size: (before the sum, in the wire's dtype). DDP's
compression hooks cast each rank's gradient to the wire and divide it there; a hook that divides in float32 casts
the quotient; Horovod's Compression sums on the wire and scales the sum in its dtype; a loop may decompress the sum
and divide it in float32. By a power of two the four are the same bits; by 3 each rounds 1/N its own way."""


def wire_range_diagnoses(ev: GradientEvidence, local: list[Grads], base: Grads, share: float, wire_name: str,
                         declared: bool, remaining: list[str]) -> list[Diagnosis]:
    """An all-reduce of the ranks' `local` gradients on the `wire_name` wire, whose range the gradients leave: the
    diagnosis that claims the failing parameters whose reduced gradient it reproduces, where elements flushed to
    zero or turned into inf (against `base`, the mean of `local`), not the wire's rounding, make them fail.
    `declared`: the run declared this wire (--compression)."""
    g, o, n = ev.grads, ev.oracle_grads, ev.world_size
    wire = getattr(torch, wire_name)
    info = torch.finfo(wire)
    # The wire's own rounding differs from the simulation's by the order of the sum: allow that much.
    wire_tol = TOLERANCE_FACTOR * n * UNIT_ROUNDOFF[wire_name]
    claimed, flushed, overflowed, elements, sizes, dominant, summed_first = [], 0, 0, 0, [], False, False
    for p in remaining:
        err = rel_fro(g[p], o[p], share) if bool(torch.isfinite(g[p]).all()) else math.inf
        for pre_divide, on_wire in WAYS:
            sim = _simulate_wire(local, [p], wire, pre_divide, on_wire)[p]
            finite = torch.isfinite(sim)
            if not _same_non_finite(g[p], sim):
                continue
            residual = rel_fro(g[p][finite], sim[finite], share)
            if not (residual <= max(ev.tolerance[p], wire_tol) and residual <= EXPLAINED_SHARE * err):
                continue
            terms = torch.stack([(l[p].float() / n if pre_divide else l[p].float()) for l in local])
            lost = (sim == 0) & (terms != 0).any(dim=0)
            over = ~finite & torch.isfinite(base[p])
            off = torch.isfinite(g[p]) & torch.isfinite(o[p])
            error = float(torch.linalg.vector_norm((g[p] - o[p])[off]))
            # The range, not the rounding, must be what makes this parameter fail.
            dominant |= bool(over.any()) or float(torch.linalg.vector_norm(base[p][lost])) >= 0.5 * error > 0
            claimed.append(p)
            flushed, overflowed = flushed + int(lost.sum()), overflowed + int(over.sum())
            elements += sim.numel()
            # What travelled: the terms and, for an overflow, their sum (it overflows first when divided after).
            on_wire = terms.abs().amax(dim=0).double()
            on_wire = torch.maximum(on_wire, terms.double().sum(dim=0).abs()) if over.any() else on_wire
            sizes.append(on_wire[over if over.any() else lost])
            summed_first |= bool(over.any()) and not pre_divide
            break
    if not claimed or not dominant or not (flushed or overflowed):
        return []
    short = {"float16": "fp16", "bfloat16": "bf16"}[wire_name]
    size = torch.cat(sizes)
    undeclared = ("" if declared else f"; the backend all-reduces in {wire_name} though no --compression was given "
                  f"(pass --compression {short} to judge its rounding with that wire's tolerance)")
    wider = "use a wider wire (bf16 keeps float32's range)" if wire_name == "float16" else "all-reduce in float32"
    if overflowed:
        return [Diagnosis("wire_overflow", f"gradients of size up to ~{float(size.max()):.1e} exceed {short}'s "
                          f"largest value {info.max:g} on the wire and become inf: {overflowed} of {elements} "
                          "elements overflowed; scale the loss down before the all-reduce, "
                          f"{'divide by the world size before summing, ' if summed_first else ''}or "
                          f"{wider}{undeclared}", claimed)]
    tiny = info.smallest_normal * info.eps
    return [Diagnosis("wire_underflow", f"gradients of size ~{float(size.median()):.1e} underflow to zero on the "
                      f"{short} wire (its smallest subnormal is {tiny:.1e}): {flushed} of {elements} elements "
                      "flushed; scale the loss before the all-reduce (a GradScaler / loss scaling) or "
                      f"{wider}{undeclared}", claimed)]


def wire_rounding_diagnoses(ev: GradientEvidence, local: list[Grads], base: Grads, share: float,
                            remaining: list[str]) -> list[Diagnosis]:
    """The rounding of an fp16 or bf16 wire the run did not declare: the diagnosis that claims the failing
    parameters whose error from `base` (the mean of the ranks' `local` gradients) an all-reduce on that wire
    accounts for."""
    g = ev.grads
    tolerance = ev.judged_tolerance or ev.tolerance
    declared = WIRE_DTYPE[ev.compression]
    for wire_name in ("float16", "bfloat16"):
        if declared == wire_name:
            continue
        short = {"float16": "fp16", "bfloat16": "bf16"}[wire_name]
        wire = getattr(torch, wire_name)
        explained = []
        for p in remaining:  # a parameter at a time: its simulations are held only while it is judged
            # Rounding's exact size depends on the backend's order of summation: the simulation is only
            # asked to account for most of the error, not to match within the float32 tolerance.
            d0 = rel_fro(g[p], base[p], share)
            if d0 <= tolerance[p]:
                continue
            d1 = min(rel_fro(g[p], _in_nearest_order(g[p], local, p, wire, way), share) for way in WAYS)
            if d1 <= EXPLAINED_SHARE * d0:
                explained.append(p)
        if explained:
            err = max(rel_fro(g[p], base[p], share) for p in explained)
            return [Diagnosis("wire_dtype", f"rounding of the size of {wire_name} on the wire (error {err:.2e} = "
                              f"{err / UNIT_ROUNDOFF[wire_name]:.2f} x its unit roundoff; an all-reduce in {wire_name} "
                              "reproduces the reduced gradient): the backend compresses gradients it did not declare; "
                              f"pass --compression {short} to judge it with that wire's tolerance, or turn the "
                              "compression off", explained)]
    return []


def _in_nearest_order(value: torch.Tensor, local: list[Grads], name: str, wire: torch.dtype,
                      way: tuple[bool, bool]) -> torch.Tensor:
    """Parameter `name`'s `_simulate_wire` where the order of the sum may change along the gradient: a ring all-reduce
    adds each chunk's terms starting from another rank, so from three ranks on a narrow wire's sum rounds another way
    chunk by chunk, as much as the wire itself rounds. Each element is the one, over the ranks' order turned round the
    ring (both ways), nearest the backend's `value`, kept as the orders are simulated one by one (two tensors held
    whatever the world size); at two ranks both orders are the one sum (an addition commutes, to the bit)."""
    n = len(local)
    orders = sorted({tuple((start + step * k) % n for k in range(n)) for start in range(n) for step in (1, -1)})
    target = value.double()
    nearest, apart = None, None
    for order in orders:
        sim = _simulate_wire([local[r] for r in order], [name], wire, *way)[name]
        off = (sim - target).abs()
        if nearest is None:
            nearest, apart = sim, off
        else:
            closer = off < apart
            nearest, apart = torch.where(closer, sim, nearest), torch.where(closer, off, apart)
    return nearest


def _simulate_wire(local: list[Grads], names: list[str], wire: torch.dtype, pre_divide: bool,
                   on_wire: bool = False) -> Grads:
    """The average of the ranks' float32 gradients all-reduced in `wire`: divided before the sum or after it, in the
    wire's dtype (`on_wire`) or in float32 (`WAYS`), each partial sum rounded to `wire`."""
    n = len(local)
    out = {}
    for p in names:
        acc = None
        for l in local:
            term = l[p].float()
            if pre_divide:
                term = term.to(wire) / n if on_wire else term / n
            term = term.to(wire)
            acc = term if acc is None else (acc.float() + term.float()).to(wire)
        if not pre_divide:
            acc = acc / n if on_wire else acc.float() / n
        out[p] = acc.double()
    return out


def _same_non_finite(values: torch.Tensor, simulated: torch.Tensor) -> bool:
    """Inf and NaN at the same places, infs of the same sign: what a simulated overflow must reproduce."""
    a, b = ~torch.isfinite(values), ~torch.isfinite(simulated)
    return bool(torch.equal(a, b)) and bool(torch.equal(torch.sign(values[a & ~values.isnan()]),
                                                        torch.sign(simulated[b & ~simulated.isnan()])))
