"""The comparisons reduced parameter by parameter (dpcompare.verify.judgement.tolerance): every whole-model figure from the
parameters' squared norms and chunked passes, never a concatenated float64 copy of the model, and checking state held
in the dtype it was computed in (`Compact`, `Difference`). Held against the same figures computed the plain way, on
one concatenated vector, in float64: agreement to float64's rounding, NaN and infinity included; and the negatives: a
figure that does differ is seen."""

from __future__ import annotations

import math

import pytest
import torch

from dpcompare.verify.judgement import held_values
from dpcompare.verify.judgement import tolerance as tol


def _plain(values, reference, floor, spread, names, u):
    """The figures compare reports, computed on concatenated float64 vectors."""
    cat = lambda d: torch.cat([d[n].double().reshape(-1) for n in names])  # noqa: E731
    g, o, r = cat(values), cat(reference), cat(floor if spread is not None else reference)
    return {"rel_fro_err": float(torch.linalg.vector_norm(g - o) / torch.linalg.vector_norm(o)),
            "judged_rel_fro_err": float(torch.linalg.vector_norm(g - r) / max(torch.linalg.vector_norm(r),
                                                                                torch.linalg.vector_norm(o))),
            "max_abs_err": float((g - o).abs().max())}


@pytest.fixture
def grads():
    torch.manual_seed(0)
    o = {"a": torch.randn(3000, 700, dtype=torch.float64), "b": torch.randn(17, dtype=torch.float64),
         "z": torch.zeros(5, dtype=torch.float64)}
    floor = {k: (v + 1e-7 * torch.randn_like(v)).float() for k, v in o.items()}
    spread = {k: (v.double() + 1e-7 * torch.randn_like(v.double())).float() for k, v in floor.items()}
    g = {k: (v.double() + 3e-7 * torch.randn_like(v.double())).float() for k, v in floor.items()}
    return g, o, floor, spread


@pytest.mark.parametrize("judged_against_floor", [True, False])
def test_the_whole_model_figures_are_the_concatenated_vectors(grads, judged_against_floor, monkeypatch):
    monkeypatch.setattr(tol, "CHUNK", 1 << 16)  # several chunks per parameter
    g, o, floor, spread = grads
    spread = spread if judged_against_floor else None
    names = list(o)
    _, model = tol.compare(tol.Compact(g), o, tol.Compact(floor), dtype="float32", world_size=2, depth=3,
                           spread=tol.Compact(spread) if spread is not None else None)
    plain = _plain(g, o, floor, spread, names, tol.UNIT_ROUNDOFF["float32"])
    for key, want in plain.items():
        assert math.isclose(getattr(model, key), want, rel_tol=1e-12), (key, getattr(model, key), want)
    # the negative: one element of the large parameter moved is seen in the whole model's figure
    moved = dict(g)
    moved["a"] = g["a"].clone()
    moved["a"][5, 5] += 1.0
    assert tol.compare(tol.Compact(moved), o, tol.Compact(floor), dtype="float32", world_size=2, depth=3,
                       spread=tol.Compact(spread) if spread is not None else None)[1].max_abs_err > 0.5


def test_a_non_finite_value_or_reference_is_kept_through_the_chunks(grads, monkeypatch):
    monkeypatch.setattr(tol, "CHUNK", 1 << 16)
    g, o, floor, spread = grads
    bad = dict(g)
    bad["a"] = g["a"].clone()
    bad["a"][2999, 699] = float("nan")  # in the last chunk
    params, model = tol.compare(tol.Compact(bad), o, tol.Compact(floor), dtype="float32", world_size=2, depth=3,
                                spread=tol.Compact(spread))
    a = next(p for p in params if p.parameter == "a")
    assert not a.ok and math.isinf(a.rel_fro_err) and math.isnan(model.max_abs_err) and not model.ok
    zero = next(p for p in params if p.parameter == "z")
    assert math.isnan(zero.max_rel_err) and "zero throughout" in zero.max_rel_err_reason


def _largest_rel(g: torch.Tensor, o: torch.Tensor, u: float) -> float:
    """max |g - o| / (|o| + u max|o|) over the whole parameter at once, in float64."""
    o = o.double()
    return float(((g.double() - o).abs() / (o.abs() + u * float(o.abs().max()))).max())


def _scale_read_so_far(g, o, bounds, scale, u):
    """The twin: each chunk's figure at the largest |o| read when it was read, never read again."""
    return max(r for _, r, _ in bounds)


@pytest.mark.parametrize("held", ["float64", "update"])
@pytest.mark.parametrize("twin", [False, True])
def test_the_largest_relative_error_takes_the_whole_parameters_scale_in_one_pass(held, twin, monkeypatch):
    """A parameter of many chunks whose largest |o| is read last (its |o| growing chunk by chunk; its first chunks
    zero; its scale in the last element): the largest relative error is the whole parameter's formula to the bit,
    whether `o` is a float64 tensor (its scale read first) or an update computed as it is read (the scale known after
    the pass). The twin, which keeps each chunk's figure at the scale read so far, is caught where the scale is known
    after the pass, and changes nothing where it is read first."""
    monkeypatch.setattr(tol, "CHUNK", 64)
    torch.manual_seed(3)
    if twin:
        monkeypatch.setattr(tol, "_max_rel", _scale_read_so_far)
    u, n = tol.UNIT_ROUNDOFF["float32"], 64 * 9 + 5
    growing = torch.sort(torch.randn(n, dtype=torch.float64).abs() * torch.logspace(-6, 1, n, dtype=torch.float64))[0]
    zeros_first = growing.clone()
    zeros_first[:100] = 0.0
    peak_last = torch.randn(n, dtype=torch.float64)
    peak_last[-1] = 1e4
    caught = []
    for o in (growing, zeros_first, peak_last):
        g = (o + 1e-6 * torch.randn(n, dtype=torch.float64)).float()
        start = torch.randn(n, dtype=torch.float64)
        reference = {"w": o} if held == "float64" else held_values.Difference({"w": start + o}, {"w": start})
        (p,), _ = tol.compare(tol.Compact({"w": g}), reference, tol.Compact({"w": o.float()}), dtype="float32",
                              world_size=1, depth=2)
        caught.append(p.max_rel_err != _largest_rel(g, reference["w"], u))
    assert caught == [twin and held == "update"] * 3, caught


def test_finite_is_one_sum_and_falls_back_where_the_sum_overflows():
    assert tol.finite(torch.ones(10))
    assert not tol.finite(torch.tensor([1.0, float("inf")])) and not tol.finite(torch.tensor([float("nan"), 1.0]))
    assert not tol.finite(torch.tensor([float("inf"), -float("inf")]))  # the sum is NaN
    assert tol.finite(torch.full((4,), 3e38))  # finite elements whose float32 sum overflows


def test_compact_holds_its_own_dtype_reads_float64_and_snapshots():
    live = torch.ones(4)
    held = tol.Compact({"w": live, "none": None})
    live.mul_(3)  # the run changes its tensor in place afterwards
    assert held["w"].dtype == torch.float64 and held["w"].tolist() == [1.0] * 4 and held["none"] is None
    assert held.held("w").dtype == torch.float32 and held.nbytes == 16 and held.none == {"none"}
    assert held.without(["w"])["w"] is None


def test_difference_is_computed_where_it_is_read_and_rounds_its_start_as_asked():
    before = tol.Compact({"w": torch.tensor([1.0 + 2**-30], dtype=torch.float64)})
    after = {"w": torch.tensor([1.5], dtype=torch.float32)}
    assert tol.Difference(after, before)["w"].item() == 0.5 - 2**-30
    assert tol.Difference(after, before, round_to=torch.float32)["w"].item() == 0.5  # the start rounded first
    assert list(tol.Difference(after, before)) == ["w"]


def test_the_norms_compare_reads_are_the_chunked_norms_of_both_sides(grads, monkeypatch):
    """The update check states ||update|| / ||reference|| from compare's own pass (no second pass over either): the
    same figures, to the bit, as reading each side's norm alone; a moved element moves its side's norm."""
    monkeypatch.setattr(tol, "CHUNK", 1 << 16)
    g, o, floor, _ = grads
    before = tol.Compact({n: t.float() for n, t in o.items()})
    after = {n: (t.float() + 1e-3) for n, t in o.items()}  # an update held as the values it reached
    delta = tol.Difference(after, before)
    norms: dict[str, tuple[float, float]] = {}
    tol.compare(delta, o, tol.Compact(floor), dtype="float32", world_size=1, depth=3, norms=norms)
    assert set(norms) == set(o)
    for n in o:
        assert norms[n] == (tol.chunked_norm(delta, n), tol.chunked_norm(o, n)), n
    moved = dict(after)
    moved["a"] = after["a"].clone()
    moved["a"][7, 7] += 10.0
    again: dict[str, tuple[float, float]] = {}
    tol.compare(tol.Difference(moved, before), o, tol.Compact(floor), dtype="float32", world_size=1, depth=3,
                norms=again)
    assert again["a"][0] > norms["a"][0] and again["a"][1] == norms["a"][1] and again["b"] == norms["b"]


@pytest.mark.parametrize("held", [torch.float32, torch.float64, "dict", "difference"])
def test_a_distance_in_place_on_its_own_copy_is_the_whole_formula_and_leaves_the_values_held(held):
    """`rel_fro_of`'s per-parameter distance takes a - b in place only on a float64 copy made for the read (a Compact
    held below float64, a Difference): the same figures to the bit as _norm(a - b), and every value held unchanged. A
    twin that subtracts in place whatever `a` holds writes into a float64 Compact's own tensor."""
    g = torch.Generator().manual_seed(4)
    base = {"w": torch.randn(300, 7, generator=g), "b": torch.randn(7, generator=g)}
    against = {n: t.double() * (1 + 1e-6 * torch.randn(t.shape, generator=g, dtype=torch.float64))
               for n, t in base.items()}
    if held == "difference":
        before = {n: torch.randn(t.shape, generator=g) for n, t in base.items()}
        after = {n: (before[n].double() + base[n].double()).float() for n in base}
        a = held_values.Difference(after, held_values.Compact(before))
        plain = {n: after[n].double() - before[n] for n in base}
    elif held == "dict":
        a, plain = {n: t.double() for n, t in base.items()}, {n: t.double() for n, t in base.items()}
    else:
        a = held_values.Compact({n: t.to(held) for n, t in base.items()})
        plain = {n: t.to(held).double() for n, t in base.items()}
    kept = {n: (a.held(n) if isinstance(a, held_values.Compact) else plain[n]).clone() for n in base}
    b = held_values.Compact(against)
    want = tol.rel_ratio(math.sqrt(sum(tol._norm(plain[n] - against[n]) ** 2 for n in base)),
                         math.sqrt(sum(tol._norm(against[n]) ** 2 for n in base)))
    assert tol.rel_fro_of(a, b, list(base)) == want
    if isinstance(a, held_values.Compact):
        assert all(torch.equal(a.held(n), kept[n]) for n in base), "the values held are unchanged"
    assert all(torch.equal(b.held(n), against[n]) for n in base)


def test_a_distance_taken_in_place_on_a_float64_value_held_is_caught(monkeypatch):
    real = tol.range_figures

    def twin(op, mappings, names, u=0.0):
        if op != "fro":
            return real(op, mappings, names, u)
        a, b = mappings
        return {n: (tol._norm(a[n].sub_(b[n])), tol._norm(b[n])) for n in names}

    monkeypatch.setattr(tol, "range_figures", twin)
    with pytest.raises(AssertionError, match="the values held are unchanged"):
        test_a_distance_in_place_on_its_own_copy_is_the_whole_formula_and_leaves_the_values_held(torch.float64)
