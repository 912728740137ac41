"""The tolerance matrix on deep models: every backend at world size 2 on models x optimizers x precisions, and planted
faults on a deep model in each precision, with each check's power.

    OMP_NUM_THREADS=1 .venv/bin/python -m experiments.tolerance_matrix --out /tmp/matrix
    OMP_NUM_THREADS=1 .venv/bin/python -m experiments.tolerance_matrix --models resnet18-cifar --precisions bf16 \\
        --optimizers adamw --backends ddp --twins none --out /tmp/small

One `dpcompare compare` per (model, optimizer, precision) cell, with `--world-sizes 2 --steps S --measure-steps 0`
and the cell's backends; the planted twins (tests/faulty_adapters.py) run as backends of their own on the twin model.
A correct backend must be `equivalent` (anything else is a false alarm, counted); a twin must be `different`. For
every run the table gives the verdict, the power of the gradient and update checks (`min_detectable_rel`), the
data-parallel floor, the precision's own distance from float64, and the coverage. Writes matrix.json and matrix.md
under --out; the markdown is what docs/results quotes. Exit status 1 when a false alarm or a missed twin was seen.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from dpcompare.result_view import RunResult

MODELS = {  # model -> global batch: small enough for two CPU cores, deep enough to matter
    "resnet18-cifar": 8, "resnet50-cifar": 8, "cnn": 24, "gpt-tiny": 8, "gpt2-small": 4,
}
MODEL_ARGS = {"gpt2-small": ["--no-dropout"]}
FP16_LOSS_SCALE = {"resnet50-cifar": 16, "resnet18-cifar": 256}
"""fp16's initial loss scale where the default 2^16 overflows for more steps than a short run has (ResNet-50 with
BatchNorm over 4 samples has parameter gradients up to ~1e3 at initialisation)."""
TWINS = {
    "tests.faulty_adapters:LinearScaledLRDDP": "lr x N",
    "tests.faulty_adapters:LocalClipDDP": "local clipping",
    "tests.faulty_adapters:Fp16WireDDP": "undeclared fp16 wire",
    "tests.faulty_adapters:SkipSyncOnceDDP": "sync skipped on step 1",
    "tests.faulty_adapters:DoubleStepDDP": "double step",
}
PRECISIONS = ("float32", "bf16", "fp16")


def compare(out: Path, model: str, optimizer: str, precision: str, backends: list[str], steps: int,
            timeout_s: float) -> Path | None:
    """One compare; returns its folder (None when it wrote none)."""
    out.mkdir(parents=True, exist_ok=True)
    before = set(out.iterdir())
    cmd = [sys.executable, "-m", "dpcompare", "compare", "--backends", ",".join(backends), "--world-sizes", "2",
           "--model", model, "--optimizer", optimizer, "--steps", str(steps), "--measure-steps", "0",
           "--global-batch", str(MODELS.get(model, 8)), "--collectives", "none", "--no-report", "--out", str(out),
           "--timeout-s", str(timeout_s)]
    if precision != "float32":
        cmd += ["--amp", precision]
    if precision == "fp16" and model in FP16_LOSS_SCALE:
        cmd += [f"--run-arg=--loss-scale={FP16_LOSS_SCALE[model]}"]
    cmd += [f"--run-arg={a}" for a in MODEL_ARGS.get(model, [])]
    # Rank 0's checks (and a fault's diagnosis: a forward and backward per hypothesis) on a deep model can outlast the
    # waiting ranks' default stall timeout on a loaded box.
    cmd += [f"--run-arg=--timeout-s={int(timeout_s)}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [str(Path.cwd()),
                                                                                          os.environ.get("PYTHONPATH")])))
    subprocess.run(cmd, env=env, check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    made = [p for p in out.iterdir() if p not in before and p.is_dir() and (p / "runs").is_dir()]
    return max(made, key=lambda p: p.stat().st_mtime) if made else None


def rows_of(folder: Path | None, model: str, optimizer: str, precision: str, backends: list[str]) -> list[dict]:
    runs = {}
    if folder is not None:
        for path in sorted((folder / "runs").glob("*.json")):
            run = json.loads(path.read_text())
            runs[RunResult(run).name] = run  # `deepspeed:zero2`: its backend and named variant
    rows = []
    for backend in backends:
        run = runs.get(backend) or next((r for k, r in runs.items() if k.startswith(backend)), None)
        row: dict[str, Any] = {"model": model, "optimizer": optimizer, "precision": precision, "backend": backend,
                               "twin": TWINS.get(backend)}
        if run is None:
            row["verdict"] = "failed"
            rows.append(row)
            continue
        e = run["equivalence"]
        checks = e.get("checks") or {}
        grad, upd = checks.get("gradient") or {}, checks.get("update") or {}
        d = e.get("first_divergence") or {}
        row.update(verdict=e["verdict"], min_detectable_rel=e.get("min_detectable_rel"),
                   gradient_min_detectable=grad.get("min_detectable_rel"), update_min_detectable=upd.get("min_detectable_rel"),
                   dp_floor=grad.get("dp_floor_rel_fro"), precision_floor=grad.get("noise_floor_rel_fro"),
                   gradient_ratio=grad.get("noise_ratio"), update_ratio=upd.get("noise_ratio"),
                   coverage=(grad.get("coverage") or {}).get("parameters_judged"),
                   parameters=(grad.get("coverage") or {}).get("parameters"),
                   divergence=(f"step {d.get('step')} {d.get('check')}: {d.get('cause')}" if d else None),
                   reason=(d.get("reason") or e.get("unverifiable_reason") or "")[:300])
        rows.append(row)
    return rows


def ok(row: dict) -> bool:
    return row["verdict"] == ("different" if row["twin"] else "equivalent")


def _g(x: Any) -> str:
    return "-" if x is None else (f"{x:.2g}" if isinstance(x, float) else str(x))


def markdown(rows: list[dict], header: str) -> str:
    lines = [header, "",
             "| model | optimizer | precision | backend | verdict | catches (gradient / update) | data-parallel floor | "
             "precision vs float64 | judged / all parameters | first divergence |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        name = f"{r['backend'].split(':')[-1]} ({r['twin']})" if r["twin"] else r["backend"]
        mark = "" if ok(r) else " **(!)**"
        lines.append(f"| {r['model']} | {r['optimizer']} | {r['precision']} | {name} | {r['verdict']}{mark} | "
                     f"{_g(r.get('gradient_min_detectable'))} / {_g(r.get('update_min_detectable'))} | "
                     f"{_g(r.get('dp_floor'))} | {_g(r.get('precision_floor'))} | "
                     f"{_g(r.get('coverage'))} / {_g(r.get('parameters'))} | {r.get('divergence') or ''} |")
    false_alarms = [r for r in rows if not r["twin"] and r["verdict"] != "equivalent"]
    missed = [r for r in rows if r["twin"] and r["verdict"] != "different"]
    lines += ["", f"{len(rows)} runs: {len(false_alarms)} correct backend(s) not `equivalent`, "
                  f"{len(missed)} planted fault(s) not `different`."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS), help="'none' for the planted faults alone")
    parser.add_argument("--optimizers", default="sgd,adamw")
    parser.add_argument("--precisions", default=",".join(PRECISIONS))
    parser.add_argument("--backends", default="ddp,horovod,deepspeed,fsdp")
    parser.add_argument("--twin-model", default="resnet50-cifar")
    parser.add_argument("--twins", default="all", help="'all', 'none', or tests.faulty_adapters:Class,...")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--twin-steps", type=int, default=2, help="steps of a planted-fault run (each acts by step 1)")
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    backends = args.backends.split(",")
    models = [] if args.models == "none" else args.models.split(",")
    twins = [] if args.twins == "none" else list(TWINS) if args.twins == "all" else args.twins.split(",")
    rows: list[dict] = []
    started = time.time()

    def record(new: list[dict]) -> None:
        rows.extend(new)
        for r in new:
            print(f"{r['model']:15s} {r['optimizer']:6s} {r['precision']:8s} {r['backend'][-28:]:28s} {r['verdict']:13s} "
                  f"catches {_g(r.get('min_detectable_rel'))}  {r.get('divergence') or ''}", flush=True)
        (args.out / "matrix.json").write_text(json.dumps(rows, indent=1))

    for model in models:
        for optimizer in args.optimizers.split(","):
            for precision in args.precisions.split(","):
                folder = compare(args.out / "compares", model, optimizer, precision, backends, args.steps, args.timeout_s)
                record(rows_of(folder, model, optimizer, precision, backends))
    for precision in args.precisions.split(",") if twins else []:
        folder = compare(args.out / "compares", args.twin_model, "sgd", precision, twins, args.twin_steps,
                         args.timeout_s)
        record(rows_of(folder, args.twin_model, "sgd", precision, twins))
    header = (f"Measured {time.strftime('%Y-%m-%d')} in {(time.time() - started) / 60:.0f} min, world size 2, "
              f"--steps {args.steps} (planted faults: {args.twin_steps}), --measure-steps 0; global batch per model: "
              + ", ".join(f"{m} {MODELS.get(m, 8)}" for m in models + ([args.twin_model] if twins else [])))
    (args.out / "matrix.md").write_text(markdown(rows, header))
    print(markdown(rows, header))
    return 0 if all(ok(r) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
