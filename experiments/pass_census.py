"""What the checks do per parameter: the memory each part of the checks reads and writes, counted op by op, in passes
over the model.

    OMP_NUM_THREADS=1 python experiments/pass_census.py --backend reference --model hf:DIR --seq-len 16 \\
        --global-batch 2 --steps 5 --measure-steps 4 --warmup-steps 1 --optimizer sgd --out /tmp/census

Runs `python -m dpcompare` with the same arguments in this process, each part of the checks (the verifier's parts:
the oracle, each check) under a torch dispatch mode that adds up, for every aten op below autograd, the bytes of its
tensor arguments and results (a view, which moves nothing, is left out). The figure is deterministic where times on
a shared machine are not: it is what the checks' cost at small batches is made of (issue 65's "what is done per
parameter"). Printed per checked step, in **passes**: bytes / (8 P), P the model's parameter count, so one pass is
reading (or writing) one float64 copy of the model. Matrix products and convolutions (`COMPUTE`) are counted apart:
their cost is arithmetic, not passes. By part, and by the line of dpcompare that called the op (its innermost frame
in dpcompare/), the 25 largest. With `--census-json FILE` the figures are written as JSON too.

One process (world size 1): the checks' cost at one rank, the figure the verification-cost records compare. It
patches the verifier's `_part` in its own process only.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dpcompare.verify.phase import verifier

try:
    from experiments.in_process import run_dpcompare
except ModuleNotFoundError:  # run as a script (python experiments/NAME.py, torchrun experiments/NAME.py): beside it
    from in_process import run_dpcompare

COMPUTE = {"mm", "addmm", "bmm", "baddbmm", "matmul", "convolution", "convolution_backward", "linear",
           "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
           "_scaled_dot_product_flash_attention_for_cpu_backward", "_scaled_dot_product_efficient_attention",
           "_scaled_dot_product_efficient_attention_backward", "_scaled_dot_product_flash_attention_backward",
           "addbmm", "mkldnn_convolution", "_mkldnn_convolution"}
"""Ops whose cost is their arithmetic (counted apart from the passes)."""
UNMOVED = {"detach", "alias", "lift_fresh", "_local_scalar_dense", "empty", "empty_like", "empty_strided", "set_"}
"""Ops that read and write no elements (a view is left out by its schema)."""
PICKING = {"index", "index_select", "gather", "masked_select", "nonzero", "take"}
PUTTING = {"index_put", "index_put_", "scatter", "scatter_", "_index_put_impl_"}
"""Ops that read or write some elements of a tensor: counted by those elements (read and written) and their
positions."""


def _site() -> str:
    """The innermost frame in dpcompare's own code (file:line function)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename.replace("\\", "/")
        if "/dpcompare/" in name:
            return f"{name.split('/dpcompare/')[-1]}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return "outside dpcompare"


def _nbytes(values) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(values) if isinstance(t, torch.Tensor))


def _unreturned_writes(func, args, kwargs, out) -> int:
    """The bytes of the arguments `func` may write in place (its schema marks them `a!`) and does not return: a fused
    optimizer step's parameters and state (and its gradients, which the schema marks too), a foreach op's tensors. An
    in-place op that returns what it wrote (add_, copy_) has them counted among its results already."""
    returned = {id(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor)}
    written = 0
    for i, argument in enumerate(func._schema.arguments):
        info = argument.alias_info
        if info is None or not info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(argument.name)
        written += sum(t.numel() * t.element_size() for t in tree_leaves(value)
                       if isinstance(t, torch.Tensor) and id(t) not in returned)
    return written


class Passes(TorchDispatchMode):
    """Adds up the bytes each aten op reads and writes, by kind (`moved` or `compute`), part and site."""

    def __init__(self, part: str, totals: dict) -> None:
        super().__init__()
        self.part, self.totals = part, totals

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        op = func.__name__.split(".")[0]
        if func.is_view or op in UNMOVED:
            return out
        if op in PICKING or op in PUTTING:
            # what is read is what is picked or written, and the positions, not the whole of the tensor picked from
            leaves = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            positions = sum(t.numel() * t.element_size() for t in leaves
                            if not t.is_floating_point() and not t.is_complex())
            picked = _nbytes(out) if op in PICKING else _nbytes(args[2:])
            moved = 2 * picked + positions
        else:
            moved = _nbytes((args, kwargs)) + _nbytes(out) + _unreturned_writes(func, args, kwargs, out)
        kind = "compute" if op in COMPUTE else "moved"
        self.totals[kind][self.part] += moved
        self.totals["sites"][(kind, self.part, f"{_site()} [{func.__name__}]")] += moved
        self.totals["ops"][self.part] += 1
        return out


TOTALS: dict = {"moved": Counter(), "compute": Counter(), "sites": Counter(), "ops": Counter()}
REPORTED, JSON_OUT = [False], [None]


def _patch() -> None:
    part = verifier.Verifier._part

    @contextlib.contextmanager
    def counted_part(self, name):
        with part(self, name), Passes(name, TOTALS):
            yield
    verifier.Verifier._part = counted_part


def _result() -> tuple[int, int] | None:
    """The model's parameter count and the checked steps, from the result the run wrote into --out (its newest)."""
    args = sys.argv[1:]
    if "--out" not in args:
        return None
    files = sorted(Path(args[args.index("--out") + 1]).glob("*.json"), key=lambda f: f.stat().st_mtime)
    if not files:
        return None
    result = json.loads(files[-1].read_text())
    return int(result["model_info"]["parameters"]), len(result["equivalence"].get("checked_steps") or ())


def _report() -> None:
    if REPORTED[0]:
        return
    REPORTED[0] = True
    found = _result()
    if found is None or not found[1]:
        print("pass_census: no result with checked steps in --out (give --out DIR)", file=sys.stderr)
        return
    P, checked = found
    unit = 8.0 * P * checked
    rows = {kind: {p: b / unit for p, b in TOTALS[kind].items()} for kind in ("moved", "compute")}
    total = sum(rows["moved"].values())
    print(f"pass_census: P = {P:,} parameters, {checked} checked steps; passes per checked step (bytes / 8P)",
          file=sys.stderr)
    for p in sorted(rows["moved"], key=lambda k: -rows["moved"][k]):
        print(f"  {rows['moved'][p]:8.1f}  {p}  (+{rows['compute'].get(p, 0.0):.1f} in matrix products; "
              f"{TOTALS['ops'][p] / checked:.0f} ops)", file=sys.stderr)
    print(f"  {total:8.1f}  all parts (+{sum(rows['compute'].values()):.1f} in matrix products)", file=sys.stderr)
    print("  by site (moved):", file=sys.stderr)
    sites = [(k, b) for k, b in TOTALS["sites"].items() if k[0] == "moved"]
    for (_, part, site), b in sorted(sites, key=lambda kv: -kv[1])[:int(os.environ.get("PASS_CENSUS_SITES", "25"))]:
        print(f"  {b / unit:8.1f}  {part:>10}  {site}", file=sys.stderr)
    if JSON_OUT[0]:
        Path(JSON_OUT[0]).write_text(json.dumps(
            {"parameters": P, "checked_steps": checked, "passes": rows,
             "sites": [[kind, part, site, b / unit] for (kind, part, site), b in TOTALS["sites"].items()],
             "ops_per_checked_step": {p: n / checked for p, n in TOTALS["ops"].items()}}, indent=1))
    sys.stderr.flush()


def main() -> None:
    args = sys.argv[1:]
    if "--census-json" in args:
        i = args.index("--census-json")
        JSON_OUT[0] = args[i + 1]
        del args[i:i + 2]
    _patch()
    run_dpcompare(args, _report)

if __name__ == "__main__":
    main()
