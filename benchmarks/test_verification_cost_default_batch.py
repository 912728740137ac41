"""The verification's cost at the batch a user runs: one process, the run's defaults (4 checked steps, a global batch of
24 sequences of 128 tokens, momentum SGD and AdamW), on the Llama-style configs of test_verification_cost.py:

    python -m dpcompare --backend reference --model hf:DIR [--optimizer adamw] --measure-steps 3 --warmup-steps 1

(the measurement phase shortened to 3 timed steps: its step p50 is the step the checks are held to.) What it prints:
each size's step, the checks' time per checked step against it (`verify_ms_per_step` / `step_ms_p50`), the parts
(`verify_ms_by_part`), bytes per parameter above start, and what the checks took again rather than compute twice
(`equivalence.oracle_reuse`); then, per optimizer, the ratio's spread over the sizes. Record:
docs/results/2026-11-29-verification-default-batch-cpu.md. `test_the_checks_at_the_default_batch_across_world_sizes`
runs the 11 M config at the same defaults at 1, 2 and 4 ranks (ddp under torchrun beyond one): rank 0's checks
against the step as the ranks divide the oracle's forwards.

test_verification_cost.py's series keep 2 sequences of 16 tokens a rank: there a step is 32 tokens and what the checks
do per parameter (the comparisons, the update's replay, loading the copies) outweighs the step's arithmetic; here the
forwards and backwards dominate, as they do where users train. Marked `deep` (about 30 minutes on the 2-core box, at
its peak 6 GiB): never collected by the default or slow tiers.

    cd /work/main && OMP_NUM_THREADS=1 .venv/bin/python -m pytest benchmarks/test_verification_cost_default_batch.py \\
        -m deep -s -p no:cacheprovider
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console
from rich.table import Table

from benchmarks.conftest import spread
from benchmarks.test_verification_cost import MARGIN_BYTES, MIB, RUN_TIMEOUT_S, SIZES, _mem_available, _run_watched

pytestmark = [pytest.mark.deep, pytest.mark.timeout(3 * 3600)]

PLAN = [("11M", "sgd"), ("22M", "sgd"), ("39M", "sgd"), ("11M", "adamw"), ("22M", "adamw"), ("39M", "adamw"),
        ("74M", "sgd")]
"""In this order: the 74 M config last, where the time budget allows it."""
ARGS = ["--backend", "reference", "--measure-steps", "3", "--warmup-steps", "1", "--timeout-s", "3600"]
BUDGET_S = float(os.environ.get("DPCOMPARE_VCOST_BUDGET_S", 50 * 60))
BYTES_PER_PARAM_BOUND = 130.0
"""A bound on one process's peak per parameter at this batch, beside a fixed 2 GiB (activations of 3072 tokens in
float64): a size is run only where that fits MemAvailable with the margin."""


def _run(label: str, optimizer: str, root: Path, world_size: int = 1) -> dict:
    """One point: the reference backend in one process, or ddp under torchrun at `world_size` ranks (the same global
    batch, divided over them; the oracle's arithmetic divided too)."""
    size = next(s for s in SIZES if s.label == label)
    need = world_size * (2 * 2**30 + BYTES_PER_PARAM_BOUND * size.parameters)
    if need + MARGIN_BYTES > _mem_available():
        return {"size": label, "optimizer": optimizer, "skipped": f"predicted {need / 2**30:.1f} GiB > available"}
    folder = size.write(root)
    work = root / "runs" / f"{label}-{optimizer}-ws{world_size}"
    args = [*ARGS, "--model", f"hf:{folder}", "--optimizer", optimizer, "--out", str(work / "out")]
    if world_size == 1:
        cmd = [sys.executable, "-m", "dpcompare", *args]
    else:
        launcher = [str(Path(sys.executable).with_name("torchrun")), "--standalone", f"--nproc_per_node={world_size}"]
        cmd = [*launcher, "-m", "dpcompare", *args[args.index("--backend") + 2:], "--backend", "ddp"]
    watched = _run_watched(cmd, work, RUN_TIMEOUT_S)
    if watched.killed or watched.code != 0:
        return {"size": label, "optimizer": optimizer, "error": watched.killed or f"exit status {watched.code}",
                "log": (work / "run.log").read_text()[-3000:]}
    (path,) = (work / "out").glob("*.json")
    result = json.loads(path.read_text())
    m, eqv = result["metrics"], result["equivalence"]
    params = result["model_info"]["parameters"]
    return {"size": label, "optimizer": optimizer, "world_size": world_size, "parameters": params,
            "verdict": eqv["verdict"], "verify_ms_per_step_per_rank": m.get("verify_ms_per_step_per_rank"),
            "step_ms_p50": m["step_ms_p50"], "verify_ms_per_step": m["verify_ms_per_step"],
            "ratio": m["verify_ms_per_step"] / m["step_ms_p50"], "checked_steps": m["verify_checked_steps"],
            "parts_ms": m["verify_ms_by_part"], "above_start_b_per_param": m["verify_above_start_mib"] * MIB / params,
            "checking_b_per_param": (m["verify_checking_mib"] * MIB / params
                                     if m.get("verify_checking_mib") is not None else None),
            "oracle_reuse": eqv.get("oracle_reuse"), "wall_s": watched.wall_s}


def _print_table(title: str, columns: tuple[str, ...], rows: list[dict], cells) -> None:
    """`rows` as a table: size, optimizer, `cells(row)` under `columns` where it was measured (blank where it was
    skipped or failed), then its verdict or why it has none."""
    table = Table(title=title, title_justify="left")
    for col in ("size", "opt", *columns, "verdict / why not"):
        table.add_column(col, justify="left" if col in ("size", "opt", "verdict / why not") else "right")
    for r in rows:
        measured = "ratio" in r
        table.add_row(r["size"], r["optimizer"], *(cells(r) if measured else [""] * len(columns)),
                      r["verdict"] if measured else r.get("skipped") or r.get("error"))
    Console(width=160, force_terminal=False).print(table)


def test_verification_cost_at_the_default_batch(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    started = time.monotonic()
    rows = []
    for label, optimizer in PLAN:
        if time.monotonic() - started > BUDGET_S:
            rows.append({"size": label, "optimizer": optimizer, "skipped": "over the time budget"})
            continue
        print(f"  {label} {optimizer} ...", flush=True)
        rows.append(row := _run(label, optimizer, tmp_path))
        if "ratio" in row:
            print(f"    {row['verdict']}: step {row['step_ms_p50']:.0f} ms, checks {row['verify_ms_per_step']:.0f} ms "
                  f"a step ({row['ratio']:.1f}x), {row['above_start_b_per_param']:.0f} B/param above start, parts "
                  f"{ {k: round(v) for k, v in row['parts_ms'].items() if v >= 1} }", flush=True)
    _print_table("the checks at the run's defaults (4 checked steps, 24 x 128 tokens, one process)",
                 ("step ms", "checks ms/step", "ratio", "B/param above start"), rows,
                 lambda r: (f"{r['step_ms_p50']:.0f}", f"{r['verify_ms_per_step']:.0f}", f"{r['ratio']:.1f}",
                            f"{r['above_start_b_per_param']:.0f}"))
    measured = [r for r in rows if "ratio" in r]
    summary = {opt: spread([r["ratio"] for r in measured if r["optimizer"] == opt]) for opt in ("sgd", "adamw")
               if any(r["optimizer"] == opt for r in measured)}
    record = {"command": ["python", "-m", "dpcompare", *ARGS], "rows": rows, "ratio": summary,
              "wall_s": time.monotonic() - started}
    (tmp_path / "verification_cost_default_batch.json").write_text(json.dumps(record, indent=2))
    print(json.dumps(record, indent=2), flush=True)
    assert not [r for r in rows if "error" in r], [(r["size"], r["optimizer"], r["error"]) for r in rows if "error" in r]
    assert measured and all(r["verdict"] == "equivalent" for r in measured)
    for r in measured:  # one process at the defaults: each reuse took place (Verdict.oracle_reuse)
        reuse = r["oracle_reuse"] or {}
        assert reuse.get("regrouped_floor", {}).get("identical") is True, r
        assert reuse.get("trajectory", {}).get("gradients_from_oracle") == [0], r


WS_PLAN = [("11M", "sgd"), ("11M", "adamw")]
"""The world-size series at the defaults: the smallest config (four ranks of its float64 copies fit beside the run)."""


def test_the_checks_at_the_default_batch_across_world_sizes(tmp_path: Path) -> None:
    """The same global batch at 1, 2 and 4 ranks (ddp under torchrun beyond one; every rank runs its own forwards of the
    oracle): rank 0's checks per checked step against the step, printed per world size. Every run `equivalent`."""
    pytest.importorskip("transformers")
    rows = []
    for label, optimizer in WS_PLAN:
        for world_size in (1, 2, 4):
            print(f"  {label} {optimizer} ws={world_size} ...", flush=True)
            rows.append(row := _run(label, optimizer, tmp_path, world_size))
            if "ratio" in row:
                print(f"    {row['verdict']}: step {row['step_ms_p50']:.0f} ms, checks {row['verify_ms_per_step']:.0f} ms"
                      f" a step on rank 0 ({row['ratio']:.1f}x), per rank {row['verify_ms_per_step_per_rank']}",
                      flush=True)
    _print_table("the checks at the run's defaults (4 checked steps, 24 x 128 tokens) across world sizes",
                 ("ranks", "step ms", "checks ms/step (rank 0)", "ratio"), rows,
                 lambda r: (str(r["world_size"]), f"{r['step_ms_p50']:.0f}", f"{r['verify_ms_per_step']:.0f}",
                            f"{r['ratio']:.1f}"))
    (tmp_path / "verification_cost_default_batch_ws.json").write_text(json.dumps(rows, indent=2))
    print(json.dumps(rows, indent=2), flush=True)
    assert not [r for r in rows if "error" in r], [(r["size"], r["world_size"], r["error"]) for r in rows if "error" in r]
    measured = [r for r in rows if "ratio" in r]
    assert measured and all(r["verdict"] == "equivalent" for r in measured)
