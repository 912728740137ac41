"""The transformers family matrix (issue 39): every family of tests/hf_families.py under ddp, FSDP2 and DeepSpeed
ZeRO-3 at world size 2 on CPU, in float32 and under --amp bf16, with dropout where each family's config has it.

    OMP_NUM_THREADS=1 .venv/bin/python -m experiments.hf_family_matrix --out /tmp/hf-matrix
    OMP_NUM_THREADS=1 .venv/bin/python -m experiments.hf_family_matrix --families bert,resnet --backends ddp \\
        --precisions float32 --out /tmp/hf-small

Each cell is one `torchrun --nproc_per_node=2 -m dpcompare --model hf:tiny-FAMILY` with the run's defaults (4
checked steps, SGD with momentum), `--seq-len 16` for language models and `--measure-steps 0` (the verdict is the
point here, not the timing), on the padded token data (`--token-data padded`, the default); the columns
`float32-global` and `float32-packed` add `--loss-normalisation global` and `--token-data packed` to a language
model's run. An `equivalent` cell whose split moved the gradient names the cause its test found. A cell holds the verdict with its first divergence's cause or the reason it is
unverifiable, the one-line refusal of a run that exits 2, or how a run failed otherwise (its exit status and last
line, or the timeout; a run that wrote its result and then never exited is marked as such). Writes matrix.json and matrix.md (the table docs/results quotes) under --out; exit status 1
when a cell is not `equivalent`. `--eager-experts` builds Mixtral with transformers' eager expert loop
(`experts_implementation: "eager"` in its config.json) instead of its grouped-matmul default.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from hf_families import FAMILIES, IMAGE_FAMILIES, write_family  # noqa: E402

from dpcompare.run import launchers  # noqa: E402

BACKENDS = {"ddp": ["--backend", "ddp"], "fsdp": ["--backend", "fsdp"],
            "zero3": ["--backend", "deepspeed", "--opt", "zero_stage=3"]}
PRECISIONS = {"float32": [], "bf16": ["--amp", "bf16"], "float32-global": ["--loss-normalisation", "global"],
              "float32-packed": ["--token-data", "packed"]}
"""Each column's flags: the precision, and where a token model's loss is normalised over the step's items
(`-global`) or trained on full-length samples (`-packed`)."""


def run_cell(folder: Path, family: str, backend: str, precision: str, out: Path, timeout_s: float) -> dict[str, Any]:
    """One run; returns its cell: verdict, detail, seconds."""
    cell_out = out / "runs" / f"{family}-{backend}-{precision}"
    cell_out.mkdir(parents=True, exist_ok=True)
    token = family not in IMAGE_FAMILIES
    flags = PRECISIONS[precision] if token or precision in ("float32", "bf16") else []
    args = [*BACKENDS[backend], "--model", f"hf:{folder}", *flags, "--measure-steps", "0",
            "--out", str(cell_out), *(["--seq-len", "16"] if token else [])]
    done = launchers.run_process(launchers.native_command("torchrun", 2, args), timeout_s=timeout_s,
                                 log=cell_out / "log.txt", cwd=REPO,
                                 env=launchers.child_env({"PYTHONPATH": str(REPO)}))
    cell: dict[str, Any] = {"family": family, "backend": backend, "precision": precision,
                            "wall_s": round(done.wall_s, 1)}
    results = sorted(cell_out.glob("*.json"))
    if results and (done.returncode == 0 or done.timed_out):
        e = json.loads(results[-1].read_text())["equivalence"]
        first = e.get("first_divergence") or {}
        detail = e.get("unverifiable_reason") or (
            f"step {first.get('step')} ({first.get('check')}), {first.get('parameter')}: {first.get('reason')}"
            if first else "")
        if done.timed_out:  # issue 39 item 7: a finished run whose launch never exits
            detail = f"{detail}; the launch did not exit after writing its result (killed at {timeout_s:.0f} s)"
        split = e.get("split") or {}
        cause = ((split.get("cause") or {}).get("name") or "no tested cause") if split.get("semantics") == "per_replica" else None
        return {**cell, "verdict": e["verdict"], "detail": detail.lstrip("; "), "hung": done.timed_out,
                "split": cause if cause != "rounding" else None,
                "notes": [n["code"] for n in e.get("notes") or [] if n["code"].startswith("split_")]}
    if done.timed_out:
        return {**cell, "verdict": "timeout", "detail": f"no result in {timeout_s:.0f} s"}
    lines = [line.strip() for line in (cell_out / "log.txt").read_text().splitlines() if line.strip()]
    said = [line.split("traceback : ")[-1] for line in lines if "dpcompare: error:" in line or
            line.startswith("dpcompare:")]  # the run's own line (torchrun repeats each rank's in its summary)
    kind = "refused" if done.returncode == 2 else f"exit {done.returncode}"
    return {**cell, "verdict": kind, "detail": (said or lines or [""])[-1]}


def table(cells: list[dict[str, Any]], backends: list[str], precisions: list[str]) -> str:
    """Family rows, backend x precision columns; below, numbered, what the cells that are not `equivalent` said."""
    columns = [(b, p) for p in precisions for b in backends]
    by = {(c["family"], c["backend"], c["precision"]): c for c in cells}
    rows = ["| family | " + " | ".join(f"{b} {p}" for b, p in columns) + " |",
            "| --- | " + " | ".join("---" for _ in columns) + " |"]
    notes: list[str] = []
    numbers: dict[str, int] = {}  # one note per distinct detail, however many cells share it
    for family in dict.fromkeys(c["family"] for c in cells):
        marks = []
        for b, p in columns:
            cell = by.get((family, b, p))
            if cell is None:
                marks.append("")
                continue
            if cell["verdict"] == "equivalent" and not cell.get("hung"):
                marks.append(f"equivalent ({cell['split']})" if cell.get("split") else "equivalent")
                continue
            if cell["detail"] not in numbers:
                numbers[cell["detail"]] = len(notes) + 1
                notes.append(f"{len(notes) + 1}. {cell['detail']}")
            marks.append(f"**{cell['verdict']}** [{numbers[cell['detail']]}]")
        rows.append(f"| {family} | " + " | ".join(marks) + " |")
    return "\n".join(rows + ([""] + notes if notes else [])) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--precisions", default=",".join(PRECISIONS))
    parser.add_argument("--timeout-s", type=float, default=600)
    parser.add_argument("--eager-experts", action="store_true")
    args = parser.parse_args(argv)
    families, backends, precisions = (args.families.split(","), args.backends.split(","),
                                      args.precisions.split(","))
    configs = args.out / "configs"
    cells = []
    start = time.monotonic()
    for family in families:
        extra = {"experts_implementation": "eager"} if args.eager_experts and family == "mixtral" else None
        folder = write_family(configs, family, extra)
        for precision in precisions:
            if family in IMAGE_FAMILIES and "-" in precision:
                continue  # no tokens to count or pack: the float32 column is its run
            for backend in backends:
                cell = run_cell(folder, family, backend, precision, args.out, args.timeout_s)
                cells.append(cell)
                print(f"{family:9s} {backend:6s} {precision:8s} {cell['verdict']:13s} {cell['wall_s']:6.1f} s "
                      f"{cell['detail'][:160]}", flush=True)
    (args.out / "matrix.json").write_text(json.dumps(cells, indent=1))
    (args.out / "matrix.md").write_text(table(cells, backends, precisions))
    print(f"{len(cells)} runs in {time.monotonic() - start:.0f} s -> {args.out / 'matrix.md'}")
    return 0 if all(c["verdict"] == "equivalent" and not c.get("hung") for c in cells) else 1


if __name__ == "__main__":
    sys.exit(main())
