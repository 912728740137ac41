"""Real models on CPU: ResNet-50 and GPT-2 small under every multi-process backend at world size 2, each under
its native launcher, with the throughput each reaches on this machine.

    cd /work/main && OMP_NUM_THREADS=1 .venv/bin/python -m pytest benchmarks/test_real_models.py -s -p no:cacheprovider

Sizes that fit a 2-core box: ResNet-50 at 4 ImageNet-shaped images per step (2 per rank, --sync-bn), GPT-2 small at 2
sequences of 1024 tokens (1 per rank). One verification step (checked against the float64 oracle; GPT-2 with
its dropout on, replayed in the oracle), one warm-up step, 3 measured steps and one synced/unsynced ablation
pair. Every run must finish with a verdict that is not `different`; the table prints step time, throughput and
the communication figures per backend.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from benchmarks.conftest import print_table, run_checked
from dpcompare.run import launchers, registry

CASES = [("resnet50", 4, ["--sync-bn"]), ("gpt2-small", 2, [])]  # BatchNorm over 2 ranks: global statistics
BACKENDS = ("ddp", "horovod", "deepspeed")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} ms"


def _installed(backend: str) -> bool:
    return registry.availability(backend)[0]


@pytest.mark.parametrize(("model", "batch", "extra"), CASES, ids=[c[0] for c in CASES])
def test_real_model_runs_under_every_backend_at_world_size_2(model: str, batch: int, extra: list[str],
                                                             tmp_path: Path) -> None:
    rows = []
    for backend in BACKENDS:
        if not _installed(backend):
            rows.append((f"{backend} ws=2", "not installed", registry.availability(backend)[1]))
            continue
        out = tmp_path / f"{model}-{backend}"
        launcher = registry.load(backend, registry.BACKENDS, "backend").capabilities.native_launcher
        cmd = launchers.native_command(launcher, 2, [
            "--backend", backend, "--model", model, "--global-batch", str(batch), "--steps", "1",
            "--warmup-steps", "1", "--measure-steps", "3", "--ablation-steps", "1", "--timeout-s", "1800",
            "--out", str(out), *extra])
        started = time.perf_counter()
        run_checked(cmd, tmp_path / "work", timeout_s=2400)
        wall_s = time.perf_counter() - started
        (path,) = out.glob("*.json")
        result = json.loads(path.read_text())
        verdict = result["equivalence"]["verdict"]
        m = result.get("metrics") or {}
        assert verdict != "different", result["equivalence"].get("first_divergence") or result["equivalence"]["notes"]
        tokens = f", {m['tokens_per_s']:.0f} tokens/s" if m.get("tokens_per_s") else ""
        comm = (f"; exposed {_ms(m.get('comm_exposed_ms'))}, total {_ms(m.get('comm_total_ms'))}, "
                f"compute {_ms(m.get('compute_ms_p50'))}")
        rows.append((f"{backend} ws=2", f"{m.get('step_ms_p50', float('nan')) / 1e3:.2f} s/step",
                     f"{m.get('samples_per_s', float('nan')):.2f} samples/s{tokens}; {verdict}{comm}; "
                     f"whole run {wall_s:.0f} s"))
        print("  " + " | ".join(rows[-1]), flush=True)
    print_table(f"{model} on this CPU, world size 2 (2 ranks, one core each)", rows)
    if not any("samples/s" in r[2] for r in rows):
        pytest.fail("no backend ran")
