"""A fixed set of runs whose verdicts and results must not change across a change of the code's shape alone.

    OMP_NUM_THREADS=1 .venv/bin/python -m experiments.identity_runs run --out /tmp/before
    OMP_NUM_THREADS=1 .venv/bin/python -m experiments.identity_runs run --out /tmp/after
    .venv/bin/python -m experiments.identity_runs compare /tmp/before /tmp/after

`run` launches every cell of CELLS under its backend's own launcher (world size 2, or 1 for dp and the checkpoint
cells), `--measure-steps 0`, and keeps each cell's result JSON. The set covers every backend (ddp, fsdp, horovod, dp,
DeepSpeed ZeRO 0-3), every precision (float32, float64, bf16 autocast, fp16 with its loss scaler, a DeepSpeed fp16
engine), every check of the list (gradient, update, trajectory, power, rng, buffers, grad_norm, loss_scale), the
split's causes, the diagnosis of planted faults, the user's optimizer and schedule, dict batches, and a checkpoint
saved and loaded (the loaded-state check). Two cells run twice (`again`): what differs between them is what a run
does not hold still (wall clocks, memory, host names), and `compare` leaves exactly those keys out.

`compare` prints, per cell, whether the two results are byte-identical once the keys that differ between two
launches of one cell are dropped, and exits 1 when any cell differs (naming the first differing key).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Iterator

from dpcompare.run import launchers

REPO = Path(__file__).resolve().parents[1]
RUN = ["--steps", "4", "--measure-steps", "0", "--warmup-steps", "0"]

# name: (backend, launcher, world size, model, extra flags)
CELLS: dict[str, tuple[str, str, int, str, list[str]]] = {
    "ddp": ("ddp", "torchrun", 2, "mlp", []),
    "ddp-again": ("ddp", "torchrun", 2, "mlp", []),
    "ddp-float64": ("ddp", "torchrun", 2, "mlp", ["--dtype", "float64"]),
    "ddp-bf16": ("ddp", "torchrun", 2, "mlp", ["--amp", "bf16"]),
    "ddp-fp16": ("ddp", "torchrun", 2, "mlp", ["--amp", "fp16"]),
    "ddp-clip": ("ddp", "torchrun", 2, "mlp", ["--clip-grad-norm", "0.5"]),
    "ddp-dropout": ("ddp", "torchrun", 2, "mlp-dropout", []),
    "ddp-cnn-batchnorm": ("ddp", "torchrun", 2, "cnn", []),
    "ddp-lm": ("ddp", "torchrun", 2, "lm", []),
    "ddp-lm-again": ("ddp", "torchrun", 2, "lm", []),
    "ddp-lm-global": ("ddp", "torchrun", 2, "lm", ["--loss-normalisation", "global", "--grad-accum", "2"]),
    "ddp-unused": ("ddp", "torchrun", 2, "mlp-unused", []),
    "ddp-adamw-schedule": ("ddp", "torchrun", 2, "mlp", ["--optimizer", "tests.optim_workloads:adamw_groups",
                                                        "--scheduler", "tests.optim_workloads:warmup_cosine"]),
    "ddp-dict-batch": ("ddp", "torchrun", 2, "tests.batch_models:dict_attention", []),
    "fsdp": ("fsdp", "torchrun", 2, "mlp", []),
    "fsdp-bf16": ("fsdp", "torchrun", 2, "lm", ["--amp", "bf16"]),
    "horovod": ("horovod", "horovodrun", 2, "mlp", []),
    "horovod-fp16-wire": ("horovod", "horovodrun", 2, "mlp", ["--compression", "fp16"]),
    "dp": ("dp", "python", 1, "mlp", []),
    **{f"zero{s}": ("deepspeed", "torchrun", 2, "mlp", ["--opt", f"zero_stage={s}"]) for s in range(4)},
    "zero2-fp16": ("deepspeed", "torchrun", 2, "mlp", ["--opt", "zero_stage=2", "--amp", "fp16"]),
    "zero3-bf16-lm": ("deepspeed", "torchrun", 2, "lm", ["--opt", "zero_stage=3", "--amp", "bf16"]),
    "fault-summing": ("tests.faulty_adapters:SummingDDP", "torchrun", 2, "mlp", []),
    "fault-state-lost": ("tests.faulty_adapters:StateLostDDP", "torchrun", 2, "mlp", []),
    "fault-fp16-wire": ("tests.faulty_adapters:Fp16WireDDP", "torchrun", 2, "mlp", []),
    "fault-same-seed": ("tests.faulty_adapters:SameSeedDDP", "torchrun", 2, "mlp-dropout", []),
    "fault-local-clip": ("tests.faulty_adapters:LocalClipDDP", "torchrun", 2, "mlp", ["--clip-grad-norm", "0.5"]),
    "fault-never-unscaled": ("tests.faulty_adapters:NeverUnscaledDDP", "torchrun", 2, "mlp", ["--amp", "fp16"]),
    "checkpoint-save": ("ddp", "python", 1, "mlp-dropout", ["--save-checkpoint", "{out}/ckpt"]),
    "checkpoint-load": ("ddp", "python", 1, "mlp-dropout", ["--load-checkpoint", "{out}/ckpt"]),
}
AGAIN = {"ddp": "ddp-again", "ddp-lm": "ddp-lm-again"}


def run_cell(name: str, out: Path, timeout_s: float) -> str:
    backend, launcher, world, model, extra = CELLS[name]
    cell_out = out / name
    cell_out.mkdir(parents=True, exist_ok=True)
    args = ["--backend", backend, "--model", model, *RUN, *(a.replace("{out}", str(out)) for a in extra),
            "--out", str(cell_out)]
    done = launchers.run_process(launchers.native_command(launcher, world, args), timeout_s=timeout_s,
                                 log=cell_out / "log.txt", cwd=REPO, env=launchers.child_env({"PYTHONPATH": str(REPO)}))
    results = sorted(cell_out.glob("*.json"))
    verdict = json.loads(results[-1].read_text())["equivalence"]["verdict"] if results else "no result"
    return f"{name}: exit {done.returncode}, {verdict} ({done.wall_s:.0f} s)"


def _leaves(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _leaves(v, f"{path}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _leaves(v, f"{path}[{i}]")
    else:
        yield path, value


def _generic(path: str) -> str:
    """A leaf's path with list indices and per-run names folded, so a key that moves in one pair moves in all."""
    import re
    return re.sub(r"\[\d+\]", "[]", path)


def _result(cell: Path) -> dict:
    """A cell's result, the set's own folder written as `{out}` wherever a value names it (a checkpoint's path)."""
    results = sorted(cell.glob("*.json"))
    return json.loads(results[-1].read_text().replace(str(cell.parent), "{out}")) if results else {}


def _parent(path: str) -> str:
    return path.rsplit(".", 1)[0]


def unsteady(root: Path) -> set[str]:
    """The leaf paths (folded) that differ between two launches of one cell: what a run does not hold still. Where
    every leaf under one object differs (a time by part of the checks), the object's every leaf is left out, so a part
    only some cells have (grad_norm's, rng's) is left out too: recorded as `PARENT.*`."""
    found: set[str] = set()
    for first, second in AGAIN.items():
        a, b = dict(_leaves(_result(root / first))), dict(_leaves(_result(root / second)))
        varied = {_generic(p) for p in a.keys() | b.keys() if a.get(p) != b.get(p)}
        every = {_generic(p) for p in a.keys() | b.keys()}
        found |= varied
        found |= {_parent(p) + ".*" for p in varied
                  if all(q in varied for q in every if _parent(q) == _parent(p))}
    return found


def _left_out(path: str, skip: set[str]) -> bool:
    generic = _generic(path)
    return generic in skip or _parent(generic) + ".*" in skip


def compare(before: Path, after: Path) -> int:
    skip = unsteady(before) | unsteady(after)
    print(f"left out: {len(skip)} keys that differ between two launches of one cell")
    failed = 0
    for name in CELLS:
        a = {p: v for p, v in _leaves(_result(before / name)) if not _left_out(p, skip)}
        b = {p: v for p, v in _leaves(_result(after / name)) if not _left_out(p, skip)}
        if not a:
            print(f"{name}: no result before"); failed += 1
            continue
        same = json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
        first = next((p for p in sorted(a.keys() | b.keys()) if a.get(p) != b.get(p)), None)
        print(f"{name}: {'identical' if same else 'differs at ' + str(first)} ({len(a)} leaves)")
        failed += not same
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--cells", default=",".join(CELLS))
    r.add_argument("--timeout-s", type=float, default=900)
    c = sub.add_parser("compare")
    c.add_argument("before", type=Path)
    c.add_argument("after", type=Path)
    args = parser.parse_args(argv)
    if args.command == "compare":
        return compare(args.before, args.after)
    for name in args.cells.split(","):
        print(run_cell(name, args.out, args.timeout_s), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
