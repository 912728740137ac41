"""What each rank built, before the backend wraps it, and what the ranks hold before step 0.

Owns: each rank's description of the model it built (`describe`: every parameter's and buffer's name, shape, dtype
and a digest of its values), read before the backend wraps the model, gathered from every rank and compared
(`compare`): ranks that built different models (a name, shape or dtype that differs) are refused in one line
(`BuiltApart.refusal`), ranks that built different values are recorded (`BuiltApart.values`, which ranks differ from
rank 0 by name). After wrapping, rank 0 judges what the ranks hold before step 0 (`judge`) against what they built:
its own full weights against the workload's (the template), every rank's against rank 0's. Values built apart and
made rank 0's by the backend (a broadcast at wrap time, observed, not declared) are a note; values built apart that
the backend did not replace (a sharded backend keeps each rank's own shard) are `different`, with that cause; values
that changed although the ranks built them alike are the initial check's other cause (an optimizer step while
wrapping, a checkpoint load). Imports no adapter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from dpcompare.verify.oracle.model_dtypes import is_float, non_float_divergence
from dpcompare.verify.oracle.gradient_oracle import tensor_digest
from dpcompare.verify.judgement.tolerance import rel_fro
from dpcompare.verify.judgement.verdict import Divergence, Verdict

Entry = tuple[str, str, tuple[int, ...] | None, str, str]
"""(kind: "parameter" or "buffer", name, shape (None: not materialised yet), dtype, digest of the values)."""

SHOWN = 4
"""Names listed in a line before "and N more"."""


def describe(module: nn.Module) -> list[Entry]:
    """This rank's model as built: every parameter, then every buffer (tied tensors once, under their first name)."""
    out: list[Entry] = []
    for kind, named in (("parameter", module.named_parameters()), ("buffer", module.named_buffers())):
        for name, t in named:
            if isinstance(t, nn.parameter.UninitializedTensorMixin):  # a lazy module's: no shape, no values yet
                out.append((kind, name, None, str(t.dtype).removeprefix("torch."), "uninitialized"))
                continue
            digest = "meta" if t.is_meta else tensor_digest(t)  # a deferred initialisation's: no values yet
            out.append((kind, name, tuple(t.shape), str(t.dtype).removeprefix("torch."), digest))
    return out


@dataclass(slots=True)
class BuiltApart:
    """How the ranks' models, as built, differ."""

    refusal: str | None = None
    """The first name, shape or dtype that differs, in one line (None: every rank built the same model)."""
    values: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Parameter or buffer -> the ranks whose values differ from rank 0's."""
    kinds: dict[str, str] = field(default_factory=dict)
    """Name -> "parameter" or "buffer", for those in `values`."""


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _shape(shape: tuple[int, ...] | None) -> str:
    return "uninitialized" if shape is None else f"({', '.join(map(str, shape))}{',' if len(shape) == 1 else ''})"


def compare(per_rank: list[list[Entry]]) -> BuiltApart:
    """Every rank's description (in rank order) against the others: the structure first (names, shapes, dtypes:
    refused), then the values (recorded)."""
    tables = [{(kind, name): (shape, dtype, digest) for kind, name, shape, dtype, digest in entries}
              for entries in per_rank]
    keys = list(dict.fromkeys(key for table in tables for key in table))
    differing = []
    for key in keys:
        seen = [table.get(key) for table in tables]
        if any(s is None for s in seen):
            what = ["missing" if s is None else f"shape {_shape(s[0])}" for s in seen]
        elif len({s[0] for s in seen}) > 1:
            what = [f"shape {_shape(s[0])}" for s in seen]
        elif len({s[1] for s in seen}) > 1:
            what = [f"dtype {s[1]}" for s in seen]
        else:
            continue
        groups: dict[str, list[int]] = {}
        for rank, w in enumerate(what):
            groups.setdefault(w, []).append(rank)
        differing.append(f"{key[0]} {key[1]}: " + ", ".join(f"{w} on {_ranks(r)}" for w, r in groups.items()))
    out = BuiltApart()
    if differing:
        more = f" (and {len(differing) - 1} more name(s), shape(s) or dtype(s) that differ)" if len(differing) > 1 else ""
        out.refusal = (f"the ranks built different models before wrapping: {differing[0]}{more}; every rank must build "
                       "the same parameters and buffers (names, shapes, dtypes): build the model from the seed alone, "
                       "not from the rank or the host")
        return out
    for key in keys:
        ranks = tuple(r for r in range(1, len(tables)) if tables[r][key][2] != tables[0][key][2])
        if ranks:
            out.values[key[1]] = ranks
            out.kinds[key[1]] = key[0]
    return out


def held(full: dict[str, torch.Tensor], module: nn.Module) -> dict[str, list[str]]:
    """What this rank holds after wrapping, before step 0: a digest per parameter (full values, in their order) and
    per buffer (the wrapped module's, in its order); every rank sends it to rank 0."""
    return {"parameters": [tensor_digest(p) for p in full.values()],
            "buffers": [tensor_digest(b) for _, b in module.named_buffers()]}


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:SHOWN])
    return shown + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")


def judge(verdict: Verdict, template: nn.Module, built_apart: dict[str, tuple[int, ...]], full: dict[str, torch.Tensor],
          module: nn.Module, per_rank: list[dict[str, list[str]]], every_parameter: bool = True) -> None:
    """Rank 0: what the ranks hold before step 0 (`full`: rank 0's full parameters; `module`: its wrapped module,
    for the buffers; `per_rank`: every rank's `held`), against what they built (`template`: rank 0's model as built;
    `built_apart`: the values the ranks built differently). `every_parameter` False (an unchecked run): only the
    values built apart are held to what rank 0 built, the rest only to each other across ranks."""
    names = list(full)
    buffers = [n for n, _ in module.named_buffers()]
    built = dict(template.named_parameters())
    carried = [n for n, t in built.items() if not is_float(t) and n not in built_apart]
    if (changed := non_float_divergence(0, "initial", full, built, carried, "before step 0")) is not None:
        verdict.initial_weights_identical = False  # a non-float parameter converted or rounded while wrapping
        verdict.diverge(changed)
        return
    apart_after: dict[str, list[int]] = {}  # name -> the ranks that hold other values than rank 0 after wrapping
    for rank, mine in enumerate(per_rank[1:], start=1):
        for kind, order in (("parameters", names), ("buffers", buffers)):
            for name, digest, ref in zip(order, mine[kind], per_rank[0][kind]):
                if digest != ref and (kind == "parameters" or name in built_apart):
                    apart_after.setdefault(name, []).append(rank)
    # Buffers only where the ranks built them apart: whether the backend made them rank 0's. Buffers built alike are
    # the buffer check's, step by step (a backend may legitimately recast them when it wraps).
    now = {**{n: b for n, b in module.named_buffers() if n in built_apart}, **full}
    moved = _moved(template, {n: t for n, t in now.items() if every_parameter or n in built_apart})
    apart = [n for n in built_apart if n in moved or n in apart_after]
    if built_apart:
        _built_apart(verdict, built_apart, apart, moved, apart_after)
    other = [n for n in moved if n not in built_apart]
    if other:
        name = other[0]
        verdict.initial_weights_identical = False
        verdict.diverge(Divergence(
            0, name, moved[name], 0.0, math.nan,
            f"the weights before step 0 are not the workload's initial weights ({name} moved by {moved[name]:.2e} "
            "relative) although every rank built them alike: something changed them after the model was built, such "
            "as an optimizer step while wrapping (Horovod's broadcast_optimizer_state on a fresh optimizer runs step() "
            "on zero gradients, horovod/horovod#3743) or a checkpoint load", check="initial", cause="initial_weights",
            parameters=other))
    rest = [n for n in apart_after if n not in built_apart]
    if rest:
        verdict.initial_weights_identical = False
        verdict.replicas_identical = False
        verdict.note("initial_weights", f"rank {apart_after[rest[0]][0]} started with different weights at "
                     f"{'parameter' if rest[0] in full else 'buffer'} {rest[0]}")


def _moved(template: nn.Module, now: dict[str, torch.Tensor]) -> dict[str, float]:
    """The values rank 0 holds (`now`) that are not the ones it built, with how far they moved (relative)."""
    built = {**dict(template.named_buffers()), **dict(template.named_parameters())}
    moved = {}
    for name, have in now.items():
        want = built.get(name)
        if want is None or want.shape != have.shape:
            continue
        have = have.detach().cpu()
        want = want.detach().to(dtype=have.dtype)
        if not torch.equal(have, want):
            moved[name] = rel_fro(have.double(), want.double()) if have.is_floating_point() else math.nan
    return moved


def _built_apart(verdict: Verdict, built_apart: dict[str, tuple[int, ...]], apart: list[str], moved: dict[str, float],
                 apart_after: dict[str, list[int]]) -> None:
    """Values the ranks built differently: made rank 0's by the backend (a note), or left apart (`different`)."""
    names = list(built_apart)
    ranks = sorted({r for rs in built_apart.values() for r in rs})
    built = (f"the ranks built different initial values of {_listed(names)} ({_ranks(ranks)} against rank 0's, "
             "before wrapping: a rank-dependent seed or initialisation)")
    if not apart:
        verdict.note("initial_weights_built_apart",
                     f"{built}; the backend gave every rank rank 0's values when it wrapped the model (every rank holds "
                     "them before step 0), so the run trains rank 0's model, the one the oracle checks")
        return
    name = apart[0]
    if name in moved:
        held_how = (f"rank 0 no longer holds the values it built ({name} is {moved[name]:.2e} relative from them): a "
                    "sharded backend assembles each parameter from every rank's own shard, so the model it trains is "
                    "a patchwork of the ranks' models" if math.isfinite(moved[name]) else
                    f"rank 0 no longer holds the values it built of {name}")
    else:
        one = len(apart_after[name]) == 1
        held_how = f"{_ranks(apart_after[name])} still hold{'s its' if one else ' their'} own {name}"
    verdict.initial_weights_identical = False
    verdict.diverge(Divergence(
        0, name, moved.get(name, math.nan), 0.0, math.nan,
        f"{built}, and the backend did not replace them with rank 0's: {held_how}; no single process trains this "
        "model. Build the model from the seed alone, not from the rank (or broadcast rank 0's weights before wrapping)",
        check="initial", cause="weights_built_apart", parameters=apart))
