"""The loss's normalisation under every backend (issue 62): one token model at world size 2, each backend with its loss
normalised by each rank's own count (`--loss-normalisation local`, the default) and by the step's count
(`global`), with and without gradient accumulation.

    OMP_NUM_THREADS=1 .venv/bin/python -m experiments.normalisation_matrix --out /tmp/norm
    OMP_NUM_THREADS=1 .venv/bin/python -m experiments.normalisation_matrix --model gpt-tiny --backends ddp,zero3 \\
        --grad-accums 1,4 --out /tmp/norm-gpt

Each cell is one run at the run's defaults (4 checked steps, SGD with momentum), `--measure-steps 0`. A cell holds the
verdict, the split's semantics and its cause as tested (`equivalence.split.cause`), the split's float64 distance
from the global batch and in noise floors, the items per rank at step 0, the gradient check's noise ratio and the
split notes. Writes matrix.json and matrix.md under --out; exit status 1 when a cell is not `equivalent`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from dpcompare.run import launchers

REPO = Path(__file__).resolve().parents[1]
BACKENDS = {"ddp": (["--backend", "ddp"], "torchrun"), "fsdp": (["--backend", "fsdp"], "torchrun"),
            "horovod": (["--backend", "horovod"], "horovodrun"),
            **{f"zero{s}": (["--backend", "deepspeed", "--opt", f"zero_stage={s}"], "torchrun") for s in range(4)}}


def run_cell(model: str, backend: str, normalisation: str, grad_accum: int, out: Path, timeout_s: float) -> dict:
    cell_out = out / "runs" / f"{backend.rsplit(':', 1)[-1]}-{normalisation}-ga{grad_accum}"
    cell_out.mkdir(parents=True, exist_ok=True)
    flags, launcher = BACKENDS.get(backend, (["--backend", backend], "torchrun"))  # a class: a twin adapter
    args = [*flags, "--model", model, "--loss-normalisation", normalisation, "--grad-accum", str(grad_accum),
            "--measure-steps", "0", "--out", str(cell_out)]
    done = launchers.run_process(launchers.native_command(launcher, 2, args), timeout_s=timeout_s,
                                 log=cell_out / "log.txt", cwd=REPO, env=launchers.child_env({"PYTHONPATH": str(REPO)}))
    cell: dict[str, Any] = {"backend": backend, "normalisation": normalisation, "grad_accum": grad_accum,
                            "wall_s": round(done.wall_s, 1)}
    results = sorted(cell_out.glob("*.json"))
    if not results:
        return {**cell, "verdict": "timeout" if done.timed_out else f"exit {done.returncode}"}
    e = json.loads(results[-1].read_text())["equivalence"]
    split = e.get("split") or {}
    cause = split.get("cause") or {}
    counts = ((cause.get("evidence") or {}).get("normalisation") or {}).get("items_per_rank")
    return {**cell, "verdict": e["verdict"], "semantics": split.get("semantics"), "cause": cause.get("name"),
            "distance_rel_fro": split.get("distance_rel_fro"), "floors": split.get("floors"), "items_per_rank": counts,
            "noise_ratio": e["checks"]["gradient"]["noise_ratio"],
            "notes": [n["code"] for n in e["notes"] if n["code"].startswith("split_")],
            "first_divergence": (e.get("first_divergence") or {}).get("reason")}


def _figure(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def table(cells: list[dict]) -> str:
    rows = ["| backend | normalisation | --grad-accum | verdict | split | cause | from the global batch (rel) | "
            "floors | items per rank | gradient noise ratio | notes |", "| --- " * 11 + "|"]
    for c in cells:
        rows.append(f"| {c['backend']} | {c['normalisation']} | {c['grad_accum']} | {c['verdict']} | "
                    f"{c.get('semantics') or '-'} | {c.get('cause') or '-'} | {_figure(c.get('distance_rel_fro'))} | "
                    f"{_figure(c.get('floors'))} | {', '.join(map(str, c.get('items_per_rank') or [])) or '-'} | "
                    f"{_figure(c.get('noise_ratio'))} | {', '.join(c.get('notes') or []) or '-'} |")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default="lm")
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--normalisations", default="local,global")
    parser.add_argument("--grad-accums", default="1,4")
    parser.add_argument("--timeout-s", type=float, default=600)
    args = parser.parse_args(argv)
    cells, start = [], time.monotonic()
    for backend in args.backends.split(","):
        for k in map(int, args.grad_accums.split(",")):
            for normalisation in args.normalisations.split(","):
                cell = run_cell(args.model, backend, normalisation, k, args.out, args.timeout_s)
                cells.append(cell)
                print(f"{backend:8s} {normalisation:6s} ga{k} {cell['verdict']:12s} {cell.get('cause') or '-':14s} "
                      f"{_figure(cell.get('distance_rel_fro')):>8s} {cell['wall_s']:6.1f} s", flush=True)
    (args.out / "matrix.json").write_text(json.dumps(cells, indent=1))
    (args.out / "matrix.md").write_text(table(cells))
    print(f"{len(cells)} runs in {time.monotonic() - start:.0f} s -> {args.out / 'matrix.md'}")
    return 0 if all(c["verdict"] == "equivalent" for c in cells) else 1


if __name__ == "__main__":
    sys.exit(main())
