"""The tolerance policy and the power of a check: the only place either is written.

Owns: how one quantity (a reduced gradient, a parameter update) is held against its references, per parameter and
as one vector of the whole model; the smallest uniform relative change each comparison would flag
(`min_detectable_rel`); which parameters are too noisy to judge (left out, counted: coverage); and the power a
verdict must have to say `equivalent`. Imports nothing of the run.

Two ways to judge, by what the check can hold the quantity against:

  against the run-precision reference (`spread` given; the gradient check). The backend's value `g` is held
  against `r`, the same global batch computed on one process in the run's own precision recipe and split the way
  the ranks split it: `g` and `r` share every rounding of the forward and backward, so what remains between them is
  what data parallelism itself changes (the order and grouping of the reduction, a narrower wire). Its floor is
  measured, not assumed: `s`, a second run-precision computation of the same function grouped as data parallelism
  may group it (the ranks' forwards summed in another order; a forward that stands for several ranks' samples, as
  global BatchNorm does, with its samples in the ranks' order), gives floor_p = rel_fro(s, r).
      judged error  rel_fro(g, r)
  The float64 oracle `o` stays the reported reference: rel_fro_err = rel_fro(g, o) and the precision floor
  rel_fro(r, o) (what the run's precision costs on this model) are stated, not judged: on a deep network at
  TF32 or bf16 that floor can exceed 1, and a tolerance built on it would pass a doubled or vanished gradient.

  against the float64 reference (`spread` None; the update check). The backend's value is held against `o`, the
  same operation in float64 on the same inputs, and the floor is the same operation in the run dtype: the update
  check replays the optimizer on the backend's own parameters, gradient and state, so the floor is the optimizer's
  arithmetic and the float32 storage of the weights, nothing else.
      judged error  rel_fro(g, o),  floor_p = rel_fro(r, o)

Both pass a parameter when
    judged error <= FACTOR * (max(floor_p, floor_model, depth * u) + world_size * u_wire)
(`u`: the run dtype's unit roundoff; `u_wire`: u, or the compressed wire dtype's; the world_size term bounds the
N-1 additions and one division of an average), and the whole model, all parameters as one vector, when its error
is within FACTOR * (max(floor_model, depth * u) + world_size * u_wire). rel_fro is ||a - b||_F divided by
max(||o_p||_F, ||o||_F / sqrt(T)) (T parameter tensors): a parameter whose gradient is analytically about 0 is
measured against its share of the model's.

Power. A comparison flags a uniform relative change eps of its quantity (g -> (1 + eps) g) once eps * ||r_p|| /
denominator_p exceeds its tolerance: `min_detectable_rel` = tolerance * denominator / ||r_p||, per parameter and
for the whole model; a check's is the smallest over the model and the judged parameters. A parameter whose
tolerance exceeds UNJUDGEABLE times its denominator (it would pass a zero or doubled value) is left out of the
per-parameter check and counted in `coverage`; a parameter whose gradient is analytically zero is still judged,
against its share of the model's.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field
from typing import Iterable, Mapping

import torch

from dpcompare.verify.judgement.held_values import Compact, Difference

FACTOR = 10.0
TOLERANCE_FACTOR = FACTOR
UNIT_ROUNDOFF = {"float64": 2.0**-53, "float32": 2.0**-24, "bfloat16": 2.0**-8, "float16": 2.0**-11}
WIRE_DTYPE = {"none": None, "fp16": "float16", "bf16": "bfloat16"}

UNJUDGEABLE = 1.0
"""A parameter whose own tolerance would pass a change of its whole value (a zero or a doubled gradient) says nothing
about that parameter: it is left out of the per-parameter check and of the whole-model vector, and counted."""

REQUIRED_POWER = 0.1
"""`equivalent` needs every checked step to catch a 10 % change of the gradient and of the update; a run whose
checks cannot is `unverifiable`, with the cause."""

MODEL = "(all parameters)"
"""The name of the whole-model comparison."""

Grads = dict[str, torch.Tensor]


def finite(t: torch.Tensor) -> bool:
    """Whether every element of `t` is finite: its sum is unless an element is inf or NaN (one pass, no mask), or
    unless the sum of finite elements overflowed, which the elementwise test then settles."""
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


_finite = finite


def rel_fro(g: torch.Tensor, o: torch.Tensor, min_denom: float = 0.0) -> float:
    return rel_ratio(_norm(g - o), _norm(o), min_denom)


def rel_ratio(diff: float, norm: float, min_denom: float = 0.0) -> float:
    """`diff` over max(`norm`, `min_denom`); 0 where both are 0, inf where only the denominator is."""
    denom = max(norm, min_denom)
    if denom == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / denom


def flat(grads: Grads, names: Iterable[str]) -> torch.Tensor:
    """`grads` as one vector: for a diagnosis that fits one figure over the parameters. A norm or a distance over the
    whole model is `norm_of` / `rel_fro_of`, reduced parameter by parameter, never a concatenated copy."""
    return torch.cat([grads[n].reshape(-1) for n in names])


def norm_of(grads: Grads, names: Iterable[str]) -> float:
    """The 2-norm of `grads` over `names` as one vector, reduced parameter by parameter in float64."""
    names = list(names)
    figures = per_parameter("norm", (grads,), names)
    return math.sqrt(sum(figures[n] ** 2 for n in names))


def rel_fro_of(a: Grads, b: Grads, names: Iterable[str], min_denom: float = 0.0) -> float:
    """rel_fro of `a` against `b` over `names` as one vector, reduced parameter by parameter (no concatenated copy)."""
    names = list(names)
    figures = per_parameter("fro", (a, b), names)
    return rel_ratio(math.sqrt(sum(figures[n][0] ** 2 for n in names)),
                     math.sqrt(sum(figures[n][1] ** 2 for n in names)), min_denom)


def all_finite(grads: Grads) -> bool:
    """Whether every tensor of `grads` is finite (each read as held)."""
    return all(per_parameter("finite", (grads,), list(grads)).values())


def range_figures(op: str, mappings: tuple[Mapping[str, torch.Tensor], ...], names: Iterable[str],
                  u: float = 0.0) -> dict:
    """Per parameter of `names`, one reduction over `mappings`: "finite" (the first, read as held), "norm" (its
    float64 2-norm), "fro" (||a - b||, ||b||), "sums" (`_param_sums`): what an owner computes for its range of sums
    held in ranges (dpcompare.verify.memory.divider), and one process for all: the same figures either way."""
    if op == "finite":
        m = mappings[0]
        return {n: finite(m.held(n) if isinstance(m, Compact) else m[n]) for n in names}
    if op == "norm":
        m = mappings[0]
        # a Difference (an update replayed as it is read) a chunk at a time: never a float64 copy of a parameter whole
        return {n: chunked_norm(m, n) if isinstance(m, Difference) else _norm(m[n]) for n in names}
    if op == "fro":
        a, b = mappings
        out = {}
        for n in names:
            y, x = b[n], a[n]
            # a float64 copy made for this read (a Compact's value held below float64, a Difference's) takes the
            # difference in place: the values of x - y without a second parameter-sized temporary; `b` is read once
            fresh = isinstance(a, Difference) or (isinstance(a, Compact) and a.held(n).dtype != torch.float64)
            out[n] = (_norm(x.sub_(y) if fresh else x - y), _norm(y))
        return out
    if op == "sums":
        return {n: _param_sums(n, mappings, u) for n in names}
    raise ValueError(f"unknown reduction {op!r}")


def per_parameter(op: str, mappings: tuple[Mapping[str, torch.Tensor], ...], names: list[str],
                  u: float = 0.0) -> dict:
    """`range_figures` over `names` where the sums are held: by each owner for its range where `mappings` are held
    in ranges (dpcompare.verify.ranks.verifier_group.Remote, one holder; under "sums" the first may be rank 0's own); else here."""
    holders = {getattr(m, "divided_by", None) for m in (mappings[1:] if op == "sums" else mappings)}
    holder = holders.pop() if len(holders) == 1 else None
    if holder is not None and (op == "sums" or getattr(mappings[0], "divided_by", None) is holder):
        return holder.per_parameter(op, mappings, names, u)
    return range_figures(op, mappings, names, u)


@dataclass(slots=True)
class ParamError:
    parameter: str
    max_abs_err: float
    """max |g - o| against the float64 reference."""
    max_rel_err: float
    """max |g - o| / (|o| + u max|o|) over the elements; NaN where o is zero throughout (`max_rel_err_reason`)."""
    rel_fro_err: float
    """Against the float64 reference (reported)."""
    floor_rel_fro_err: float
    """The run-precision reference's distance from the float64 one: what the precision costs (reported)."""
    noise_ratio: float
    """The judged error over the effective floor with the reduction's allowance (the tolerance / FACTOR): it passes
    at or below FACTOR."""
    tolerance_rel_fro: float
    """The judged error's bound."""
    ok: bool
    judged_rel_fro_err: float = 0.0
    """The error that is judged: against the run-precision reference (gradient), or the float64 one (update)."""
    judged_floor_rel_fro: float = 0.0
    """Its measured floor: what data parallelism alone changes (gradient), or the run dtype's arithmetic (update)."""
    min_detectable_rel: float = 0.0
    """The smallest uniform relative change of this value the comparison flags."""
    judged: bool = True
    """False: the floor is too large to judge this parameter (left out, counted in coverage)."""
    elements: int = 0
    max_rel_err_reason: str | None = None
    """Why `max_rel_err` is undefined (None: it is defined)."""


@dataclass(slots=True)
class Coverage:
    """A check's coverage: the parameters (and their elements) it judged one by one, and those too noisy to judge
    alone (left out). Not the oracle coverage (dpcompare.verify.memory.oracle_coverage: the parameters the float64 oracle
    checks at all, --check-coverage)."""

    parameters: int
    parameters_judged: int
    elements: int
    elements_judged: int
    left_out: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _norm(t: torch.Tensor) -> float:
    """The 2-norm in float64, whatever `t` is stored in (a norm of 1e4 float32 elements rounds by about 1e-4 in
    float32: these figures are compared against floors of 1e-7)."""
    return float(torch.linalg.vector_norm(t, dtype=torch.float64) if t.is_floating_point() and t.dtype != torch.float64
                 else torch.linalg.vector_norm(t))


@dataclass(slots=True)
class _Sums:
    """One parameter's figures for `compare`, each a full pass over it once: squared norms add up over parameters to
    the whole model's, so no whole-model vector is ever built (nor held: a 1 B model's is 8 GB in float64)."""

    o2: float  # ||o||^2 (float64 reference)
    a2: float  # ||against||^2 (what the value is judged against)
    go2: float  # ||g - o||^2
    ga2: float  # ||g - against||^2
    fo2: float  # ||floor - o||^2
    oa2: float  # ||other - against||^2 (the floor's two computations)
    max_abs: float  # max |g - o|
    max_rel: float  # max |g - o| / (|o| + u max|o|) (NaN where o is zero throughout)
    finite: bool  # g is finite
    g2: float = 0.0  # ||g||^2 (the value's own norm, for a caller that states it: compare's `norms`)


CHUNK = 1 << 18
"""Elements a comparison reads at a time: its temporaries stay a few float64 chunks, whatever the parameter's size."""


class _Chunked:
    """A `Difference`'s parameter, flattened, computed a chunk at a time where it is read (never whole)."""

    __slots__ = ("after", "before")

    def __init__(self, after: torch.Tensor, before: torch.Tensor) -> None:
        self.after, self.before = after, before

    def __getitem__(self, part: slice) -> torch.Tensor:
        # in place on a float64 copy of `after`: the same values as `after.double() - before`, at half its time on the
        # CPU, where a subtraction of a float32 from a float64 makes a temporary of the promoted float32 first
        return self.after[part].to(torch.float64, copy=True).sub_(self.before[part])

    def numel(self) -> int:
        return self.after.numel()

    @property
    def dtype(self) -> torch.dtype:
        """What its two sides are stored in, together (the difference itself is computed in float64)."""
        return torch.promote_types(self.after.dtype, self.before.dtype)


def _raw(grads: Mapping[str, torch.Tensor], name: str) -> "torch.Tensor | _Chunked":
    """`grads[name]` as held (a Compact's in its own dtype; a Difference's two sides), flattened: read chunk by chunk
    in float64."""
    if isinstance(grads, Difference):
        return _Chunked(*grads.pieces(name))
    t = grads.held(name) if isinstance(grads, Compact) else grads[name]
    return t.detach().reshape(-1)


def chunked_norm(grads: Mapping[str, torch.Tensor], name: str) -> float:
    """The 2-norm of `grads[name]` in float64, read `CHUNK` elements at a time."""
    t = _raw(grads, name)
    n = t.numel()
    return math.sqrt(sum(_norm(t[slice(a, min(a + CHUNK, n))].double()) ** 2 for a in range(0, n, CHUNK)))


def _fmax(a: float, b: float) -> float:
    """max that keeps a NaN, as torch's max does."""
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


def _sums(g: torch.Tensor, o: torch.Tensor, against: torch.Tensor, floor: torch.Tensor, other: torch.Tensor,
          u: float) -> _Sums:
    """One parameter's figures, read `CHUNK` elements at a time in float64, in one pass over the comparison. Each
    input's chunk is read into float64 once, whichever figures use it (the floor is often what the value is judged
    against), and the differences are worked on in place. The relative error's scale is the whole parameter's max |o|:
    read first where `o` is a float64 tensor (one read). Where it is computed as it is read (a `Difference`: an update)
    or converted, it is known only once every chunk is read: each chunk's relative error is taken at the largest |o|
    read so far, which bounds its error at the whole's from above, and after the pass only a chunk read before the
    scale grew, whose bound still exceeds the largest exact one, is read again (`_max_rel`). Either way the same figure
    to the bit as a first pass over `o` for the scale, which a parameter of one chunk never makes."""
    same_against, same_other, one_floor = against is o, other is floor and against is o, other is against
    sq = [0.0] * 6  # o2, a2, go2, ga2, fo2, oa2
    max_abs, scale, finite, max_rel, g2 = 0.0, 0.0, True, 0.0, 0.0
    # A value held below float64 is finite exactly where its squared norm is (a float32's square cannot overflow a
    # float64): one pass fewer. A float64 value is tested element by element.
    squares_tell = g.dtype != torch.float64
    n = o.numel()
    parts = [slice(start, min(start + CHUNK, n)) for start in range(0, n, CHUNK)]
    bounds: list[tuple[float, float, slice]] = []  # each chunk's relative error at the scale read so far
    # a float64 tensor's max |o| is one read of it: taken first, every chunk's figure is then exact
    first = isinstance(o, torch.Tensor) and o.dtype == torch.float64
    for part in parts if first else ():
        low, high = torch.aminmax(o[part])
        scale = _fmax(scale, _fmax(-float(low), float(high)))
    for part in parts:
        read: dict[int, torch.Tensor] = {}

        def chunk(t: torch.Tensor) -> torch.Tensor:
            if id(t) not in read:
                read[id(t)] = t[part].double()
            return read[id(t)]

        gc, oc = chunk(g), chunk(o)
        if not first:
            low, high = torch.aminmax(oc)  # max |o| in one pass
            scale = _fmax(scale, _fmax(-float(low), float(high)))
        g_norm = _norm(gc)
        finite = finite and (math.isfinite(g_norm) if squares_tell else _finite(gc))
        g2 += g_norm ** 2
        diff = gc - oc
        sq[0] += _norm(oc) ** 2
        sq[2] += _norm(diff) ** 2
        diff.abs_()
        max_abs = _fmax(max_abs, float(diff.max()))
        bounds.append((scale, float(diff.div_(oc.abs().add_(u * scale)).max()) if scale > 0 else math.inf, part))
        if not same_against:
            ac = chunk(against)
            sq[1] += _norm(ac) ** 2
            sq[3] += _norm(gc - ac) ** 2
        sq[4] += _norm(chunk(floor) - oc) ** 2
        if not same_other and not one_floor:  # one_floor: a reused twin, no distance
            sq[5] += _norm(chunk(other) - (ac if not same_against else oc)) ** 2
    if same_against:
        sq[1], sq[3] = sq[0], sq[2]
    if same_other:
        sq[5] = sq[4]
    max_rel = _max_rel(g, o, bounds, scale, u) if scale > 0 else math.nan
    return _Sums(sq[0], sq[1], sq[2], sq[3], sq[4], sq[5], max_abs, max_rel, finite, g2)


def _max_rel(g, o, bounds: list[tuple[float, float, slice]], scale: float, u: float) -> float:
    """max |g - o| / (|o| + u `scale`) over the chunks, from each chunk's figure at the scale read when it was read
    (`bounds`: scale, figure, chunk). A figure at the whole's scale is exact; one at a smaller scale is an upper bound
    (a larger scale only grows each denominator, in floating point too), so such a chunk is read again only where its
    bound exceeds the largest figure known exact, the largest bound first."""
    # a chunk whose figure is NaN (a NaN in the value: judged non-finite) adds nothing, as a max from 0 keeps
    best = functools.reduce(max, (r for s, r, _ in bounds if s == scale), 0.0)
    stale = [b for b in bounds if b[0] != scale and not math.isnan(b[1])]
    for _, bound, part in sorted(stale, key=lambda b: -b[1]):
        if not bound > best:
            break
        oc = o[part].double()
        diff = (g[part].double() - oc).abs_()
        best = max(best, float(diff.div_(oc.abs().add_(u * scale)).max()))
    return best


def _param_sums(name: str, mappings: tuple[Mapping[str, torch.Tensor], ...], u: float) -> tuple[_Sums, int]:
    """`_sums` of one parameter, each mapping read once (one given twice is the same tensor: its figures are shared),
    and its number of elements (the second mapping's, as held); a lazy mapping (a `Difference`, a replay stepped as it
    is read) computes just this parameter, once."""
    read: dict[int, torch.Tensor] = {}
    for m in mappings:
        if id(m) not in read:
            read[id(m)] = _raw(m, name)
    return _sums(*(read[id(m)] for m in mappings), u), read[id(mappings[1])].numel()


def compare(values: Grads, reference: Grads, floor: Grads, *, dtype: str, world_size: int, depth: int,
            u_sum: float | None = None, names: Iterable[str] | None = None,
            spread: Grads | None = None, norms: dict[str, tuple[float, float]] | None = None
            ) -> tuple[list[ParamError], ParamError]:
    """Per-parameter errors of `values` and the whole model's (see the module docstring). `reference`: float64;
    `floor`: the run-precision computation of the same quantity; `spread`: a second run-precision computation, given
    when `values` is to be judged against `floor` (the gradient check). A non-finite value is an error of +inf, never a
    pass. Every figure is reduced parameter by parameter (the whole model's from the parameters' squared norms): a
    check holds no copy of the model beyond its inputs. `norms` receives each (||values||, ||reference||)."""
    names = list(reference) if names is None else list(names)
    against, other = (floor, spread) if spread is not None else (reference, floor)
    return judge_figures(per_parameter("sums", (values, reference, against, floor, other), names, UNIT_ROUNDOFF[dtype]),
                         names, dtype=dtype, world_size=world_size, depth=depth, u_sum=u_sum, norms=norms)


def judge_figures(figures: dict, names: list[str], *, dtype: str, world_size: int, depth: int,
                  u_sum: float | None = None, norms: dict[str, tuple[float, float]] | None = None
                  ) -> tuple[list[ParamError], ParamError]:
    """`compare`'s judgement of `range_figures` "sums" already reduced where they were (update_ranges' owners)."""
    u = UNIT_ROUNDOFF[dtype]
    u_sum, sums = u if u_sum is None else u_sum, {n: figures[n][0] for n in names}
    sizes: dict[str, int] = {n: figures[n][1] for n in names}  # as held: a Difference's is never computed whole
    if norms is not None:  # (||values||, ||reference||) by name, from the same pass
        norms.update({n: (math.sqrt(t.g2), math.sqrt(t.o2)) for n, t in sums.items()})
    share = math.sqrt(sum(s.o2 for s in sums.values())) / math.sqrt(max(len(names), 1))
    minimum, reduction = depth * u, world_size * u_sum
    own = {n: rel_ratio(math.sqrt(s.oa2), math.sqrt(s.a2), share) for n, s in sums.items()}
    # A parameter too noisy to judge alone (its own floor would pass a change of its whole value) is left out, and out
    # of the model's floor and vector: one noisy parameter must not set the power of the rest.
    judged = [n for n in names if FACTOR * (max(own[n], minimum) + reduction) <= UNJUDGEABLE]
    model_floor = rel_ratio(math.sqrt(sum(sums[n].oa2 for n in judged)), math.sqrt(sum(sums[n].a2 for n in judged)),
                         math.sqrt(sum(sums[n].o2 for n in judged))) if judged else 0.0
    out = []
    for name in names:
        s, numel = sums[name], sizes[name]
        why = None if not math.isnan(s.max_rel) else (
            f"the float64 reference of {name} is zero throughout: no relative error (max_abs_err is its distance)"
            if numel else f"{name} has no elements")
        denom = max(math.sqrt(s.o2), share)
        err = rel_ratio(math.sqrt(s.go2), math.sqrt(s.o2), share) if s.finite else math.inf
        judged_err = rel_ratio(math.sqrt(s.ga2), math.sqrt(s.a2), share) if s.finite else math.inf
        floor_p = max(own[name], model_floor, minimum)
        tol = FACTOR * (floor_p + reduction)
        size = math.sqrt(s.a2)
        detect = tol * denom / size if size > 0 else math.inf
        alone = name in judged
        out.append(ParamError(name, s.max_abs, s.max_rel if s.finite else math.inf, err,
                              rel_ratio(math.sqrt(s.fo2), math.sqrt(s.o2), share), judged_err / (floor_p + reduction), tol,
                              judged_err <= tol or (not alone and s.finite), judged_err, own[name], detect, alone,
                              numel, why if s.finite else None))
    return out, _model([sums[n] for n in (judged or names)], sum(sizes[n] for n in (judged or names)),
                       model_floor, minimum, reduction)


def _model(sums: list[_Sums], elements: int, model_floor: float, minimum: float, reduction: float) -> ParamError:
    """All judged parameters as one vector (from their squared norms): a fault spread thin over many parameters adds
    up here."""
    finite = all(s.finite for s in sums)
    denom = math.sqrt(sum(s.o2 for s in sums))
    err = rel_ratio(math.sqrt(sum(s.go2 for s in sums)), denom) if finite else math.inf
    size = math.sqrt(sum(s.a2 for s in sums))
    judged_err = rel_ratio(math.sqrt(sum(s.ga2 for s in sums)), size, denom) if finite else math.inf
    floor_eff = max(model_floor, minimum)
    tol = FACTOR * (floor_eff + reduction)
    detect = tol * denom / size if size > 0 else math.inf
    return ParamError(MODEL, functools.reduce(_fmax, (s.max_abs for s in sums), 0.0) if elements else 0.0, math.nan,
                      err, rel_ratio(math.sqrt(sum(s.fo2 for s in sums)), denom),
                      judged_err / (floor_eff + reduction) if floor_eff + reduction > 0 else math.inf, tol,
                      judged_err <= tol, judged_err, model_floor, detect, True, elements)


def min_detectable(params: list[ParamError], model: ParamError | None) -> float:
    """A check's power: the smallest uniform relative change the whole-model comparison or any judged parameter flags."""
    candidates = [p.min_detectable_rel for p in params if p.judged]
    if model is not None:
        candidates.append(model.min_detectable_rel)
    return min(candidates, default=math.inf)


def coverage(params: list[ParamError]) -> Coverage:
    """The coverage of a check that compared `params`."""
    judged = [p for p in params if p.judged]
    return Coverage(len(params), len(judged), sum(p.elements for p in params), sum(p.elements for p in judged),
                    [p.parameter for p in params if not p.judged])


def allowed_floor(floor: float, *, depth: int, unit_roundoff: float, world_size: int, u_sum: float) -> float:
    """The floor a judged error is divided by (its noise ratio's denominator, the tolerance / FACTOR): the measured
    floor, at least depth * u, plus the reduction's allowance world_size * u_sum."""
    return max(floor, depth * unit_roundoff) + world_size * u_sum


def wire_roundoff(dtype: str, compression: str = "none") -> float:
    """Unit roundoff of the reduction: the run dtype's, or the compressed wire dtype's when it is coarser."""
    wire, u = WIRE_DTYPE[compression], UNIT_ROUNDOFF[dtype]
    return max(u, UNIT_ROUNDOFF[wire]) if wire else u


def classic_tolerance(params: list[ParamError], model_floor: float, depth: int, dtype: str, world_size: int,
                      u_wire: float) -> dict[str, float]:
    """Per parameter, the distance from the float64 reference the run's precision alone explains (FACTOR x its floor):
    how close a fault's float64-built candidate must come to the backend's value for the diagnosis to name it."""
    u = UNIT_ROUNDOFF[dtype]
    return {p.parameter: FACTOR * (max(p.floor_rel_fro_err, model_floor, depth * u) + world_size * u_wire)
            for p in params}


def describe(policy_dtype: str) -> dict:
    return {
        "rule": "judged_rel_fro_err <= factor * (max(floor_param, floor_model, depth*u) + world_size*u_wire); gradient: "
                "judged against the run-precision reference split as the ranks split it, floor: a second run-precision "
                "computation grouped differently (what data parallelism alone changes)",
        "update_rule": "rel_fro_err(update) <= factor * (max(floor_param, floor_model, depth*u) + world_size*u_wire), "
                       "reference: the optimizer replayed in float64 on the backend's parameters, reduced gradient and "
                       "optimizer state; floor: the same replay in the run dtype",
        "trajectory_rule": "rel_param_distance(step k) <= factor * (max(floor_k, (k+1)*depth*u) + (k+1)*world_size*u_wire), "
                           "floor_k: distance of a run-dtype single-process trajectory from the float64 one",
        "model_rule": "all parameters as one vector: judged_rel_fro_err <= factor * (max(floor_model, depth*u) + "
                      "world_size*u_wire)",
        "min_detectable_rel": "tolerance * denominator / ||reference||: the smallest uniform relative change flagged",
        "unjudgeable_above": UNJUDGEABLE,
        "required_power": REQUIRED_POWER,
    }
