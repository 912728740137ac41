"""The verification's cost against model size: rank 0's time and memory for checking, on Llama-style models from
~11 M parameters towards ~1 B, as far as this machine's memory (and a wall-time budget) allows, with the fits.

    cd /work/main && OMP_NUM_THREADS=1 .venv/bin/python -m pytest benchmarks/test_verification_cost.py -m deep \\
        -s -p no:cacheprovider

Marked `deep` (7 to 12 minutes on the 2-core box, at its peak 13 GiB of its 24): the default `pytest` and `pytest -m
slow` never collect it (benchmarks/ is outside pyproject's testpaths, and the mark keeps it out of a plain
`pytest benchmarks` too); `--benchmark-only` skips it (no benchmark fixture).

Each size is a transformers LlamaConfig (untied head, num_key_value_heads = heads / 4) saved into tmp_path and run
as one process of the single-process reference backend, one run at a time:

    python -m dpcompare --backend reference --model hf:DIR --seq-len 16 --global-batch 2 --steps 2 \\
        --measure-steps 2 --warmup-steps 1 [--optimizer adamw] --out OUT

(OMP_NUM_THREADS=1: the box is shared, see THREADS). SGD (with momentum 0.9, the default) at every size memory allows,
AdamW at the smaller sizes (its state enters the verifier's memory). The figures are the result's `metrics`
(dpcompare/run/verification.py, VerificationCost): verify_ms_per_step, verify_setup_ms, verify_peak_mib (the
process's resident high-water mark over the verification phase), verify_above_start_mib (that peak less what was
resident before the verifier was built: on CPU it includes the run's own gradients and optimizer state, which are
first allocated in that phase), beside step_ms_p50 of the measured steps; and the whole process's CPU seconds
(os.wait4), steadier than wall time where other work shares the cores.

Never OOM: before each size its peak is predicted from the runs done so far (a line through their peaks: the
highest of verify_peak_mib, peak_mem_mib and the resident size this benchmark sampled every 0.5 s; before two runs,
a prior of 300 B/parameter + 1 GiB) and compared with MemAvailable (/proc/meminfo) less a 3 GiB margin; a size that
does not fit is skipped and the table says why. A watchdog kills the run's process group should MemAvailable fall
under 1 GiB anyway (the benchmark then fails). Sizes whose predicted wall time exceeds what is left of the budget
are skipped the same way.

Fits (scipy.stats.linregress): verify_above_start_mib and verify_peak_mib = a + b*P (b in bytes per parameter),
verify_ms_per_step = c*P^k (on logs), and the ratio verify_ms_per_step / step_ms_p50. Extrapolated: the verifier at
1 B parameters, and the largest model a host of 16 GB and one 80 GB GPU could judge (the assumptions are printed).
The points and fits go to tmp_path/verification_cost.json and are printed.

`test_verification_cost_across_world_sizes` runs the 11-39 M sizes at 1 rank (the reference backend) and at 2 and 4
(ddp under torchrun, each rank 2 x 16 tokens a step), SGD and AdamW, with the oracle's forwards divided over the ranks:
every rank's bytes per parameter above start and rank 0's checked step in steps, fitted per world size, and how they
move from 1 to 4 ranks (tmp_path/verification_cost_ws.json). Record: docs/results/2026-11-27-verification-cost-cpu.md.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from rich.console import Console
from rich.table import Table
from scipy import stats

from benchmarks.conftest import REPO_ROOT, child_env, print_table, spread

pytestmark = [pytest.mark.deep, pytest.mark.timeout(3 * 3600)]  # a hang guard over the budget below

GIB = 2**30
MIB = 2**20
MARGIN_BYTES = 3 * GIB
"""A size runs only where its predicted peak + this margin fits in MemAvailable."""
KILL_BELOW_BYTES = 1 * GIB
"""The watchdog's floor: MemAvailable under this during a run kills it (should the prediction have been wrong)."""
PRIOR_BYTES_PER_PARAM, PRIOR_FIXED_BYTES = 300.0, 1.0 * GIB
"""The memory prediction before two runs have been measured."""
TIME_BUDGET_S = float(os.environ.get("DPCOMPARE_VCOST_BUDGET_S", 30 * 60))
"""Wall time for all the runs together; a size predicted to overrun what is left is skipped."""
RUN_TIMEOUT_S = 2400.0
THREADS = "1"
"""One thread: with 2 OpenMP threads on two cores that other work was using, a first run (2026-11-26) measured step
times 35x apart between neighbouring sizes (153 ms at 39 M, 5290 ms at 74 M) and failed the time fit."""
HOST_BYTES, GPU_BYTES = 16e9, 80e9
"""The extrapolated limits: a host with 16 GB of memory, one 80 GB GPU (GB = 1e9 bytes)."""
STATE_BYTES_PER_PARAM = {"sgd": 4 + 4 + 4, "adamw": 4 + 4 + 8}
"""The run's own state on rank 0, float32: parameters + gradients + optimizer state (momentum; AdamW's two moments)."""
ARGS = ["--backend", "reference", "--seq-len", "16", "--global-batch", "2", "--steps", "2", "--measure-steps", "2",
        "--warmup-steps", "1", "--timeout-s", "3600"]


@dataclass(frozen=True)
class Size:
    label: str
    vocab: int
    hidden: int
    layers: int
    heads: int
    intermediate: int

    @property
    def parameters(self) -> int:
        """LlamaForCausalLM's count: embedding and untied head, per layer q/o (H x H), k/v (H x H/4 with heads/4
        key-value heads), the gated MLP (3 x H x I) and two RMSNorms, and the final norm."""
        h, kv = self.hidden, self.hidden // 4
        per_layer = 2 * h * h + 2 * h * kv + 3 * h * self.intermediate + 2 * h
        return 2 * self.vocab * h + self.layers * per_layer + h

    def write(self, root: Path) -> Path:
        from transformers import LlamaConfig

        config = LlamaConfig(vocab_size=self.vocab, hidden_size=self.hidden, num_hidden_layers=self.layers,
                             num_attention_heads=self.heads, num_key_value_heads=self.heads // 4,
                             intermediate_size=self.intermediate, max_position_embeddings=256,
                             tie_word_embeddings=False)
        config.architectures = ["LlamaForCausalLM"]
        folder = root / "configs" / self.label
        config.save_pretrained(str(folder))
        return folder


SIZES = [
    Size("11M", 16000, 256, 4, 8, 688),
    Size("22M", 16000, 384, 6, 8, 1024),
    Size("39M", 16000, 512, 8, 8, 1376),
    Size("74M", 24000, 640, 10, 8, 1728),
    Size("148M", 32000, 768, 16, 12, 2048),
    Size("291M", 32000, 1024, 20, 16, 2816),
    Size("1.03B", 32000, 2048, 20, 32, 5632),
]
ADAMW_SIZES = ("11M", "22M", "39M")
"""AdamW runs after the SGD series (which has the priority on the time budget), at the smaller sizes."""


@dataclass
class Point:
    size: Size
    optimizer: str
    skipped: str | None = None
    wall_s: float | None = None
    sampled_rss_mib: float | None = None
    verdict: str | None = None
    cpu_s: float | None = None
    load1: float | None = None
    """The mean 1-minute load average during the run (the box is shared)."""
    parameters: int | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    @property
    def measured(self) -> bool:
        return self.skipped is None and self.error is None

    def guard_bytes(self) -> float:
        """The highest resident size the run is known to have reached (what the next prediction extrapolates)."""
        m = self.metrics
        return MIB * max(v for v in (m.get("verify_peak_mib"), m.get("peak_mem_mib"), self.sampled_rss_mib)
                         if v is not None)

    def row(self) -> dict[str, Any]:
        m = self.metrics
        out = {"size": self.size.label, "optimizer": self.optimizer,
               "parameters": self.parameters or self.size.parameters,
               "skipped": self.skipped, "error": self.error, "verdict": self.verdict, "wall_s": self.wall_s,
               "cpu_s": self.cpu_s, "sampled_max_rss_mib": self.sampled_rss_mib, "load1_mean": self.load1}
        for k in ("step_ms_p50", "peak_mem_mib", "verify_ms_per_step", "verify_setup_ms", "verify_peak_mib",
                  "verify_above_start_mib", "verify_mem_method"):
            out[k] = m.get(k)
        if self.measured:
            out["ratio_verify_to_step"] = m["verify_ms_per_step"] / m["step_ms_p50"]
            out["above_start_bytes_per_param"] = m["verify_above_start_mib"] * MIB / out["parameters"]
        return out


# -- one run, watched -------------------------------------------------------------------------------
def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable line in /proc/meminfo")


def _rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


@dataclass
class Watched:
    code: int | None
    wall_s: float
    cpu_s: float | None
    """The process's user + system CPU seconds (os.wait4): steadier than wall time on a shared box."""
    rss_mib: float
    load1: float
    """The 1-minute load average, the mean of the samples taken during the run (this run's own process included)."""
    killed: str | None


def _run_watched(cmd: list[str], work_dir: Path, timeout_s: float) -> Watched:
    """Run `cmd` (one process) in a session of its own, output to work_dir/run.log; sample its resident size,
    MemAvailable and the load every 0.5 s; kill its process group past `timeout_s` or when MemAvailable falls under
    the floor. (conftest's run_checked cannot watch memory.)"""
    work_dir.mkdir(parents=True, exist_ok=True)
    env = child_env(work_dir)
    env["OMP_NUM_THREADS"] = THREADS
    log = work_dir / "run.log"
    started = time.monotonic()
    killed = None
    peak, loads = 0.0, []
    status = usage = None
    with log.open("w") as sink:
        sink.write("$ " + " ".join(cmd) + "\n")
        sink.flush()
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            while True:
                pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
                if pid:
                    proc.returncode = os.waitstatus_to_exitcode(status)
                    break
                peak = max(peak, _rss_mib(proc.pid) or 0.0)
                loads.append(os.getloadavg()[0])
                if time.monotonic() - started > timeout_s:
                    killed = f"timed out after {timeout_s:.0f} s"
                elif _mem_available() < KILL_BELOW_BYTES:
                    killed = (f"killed by the watchdog: MemAvailable {_mem_available() / GIB:.2f} GiB < "
                              f"{KILL_BELOW_BYTES / GIB:.0f} GiB at {peak / 1024:.1f} GiB resident")
                if killed:
                    os.killpg(proc.pid, signal.SIGKILL)  # the session this benchmark started, by its id
                    proc.wait()
                    usage = None
                    break
                time.sleep(0.5)
        finally:
            if proc.returncode is None:  # interrupted
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return Watched(proc.returncode, time.monotonic() - started,
                   None if usage is None else usage.ru_utime + usage.ru_stime, peak,
                   float(np.mean(loads)) if loads else os.getloadavg()[0], killed)


def _run(size: Size, optimizer: str, root: Path, folder: Path) -> Point:
    point = Point(size, optimizer)
    work = root / "runs" / f"{size.label}-{optimizer}"
    out = work / "out"
    cmd = [sys.executable, "-m", "dpcompare", *ARGS, "--model", f"hf:{folder}", "--optimizer", optimizer,
           "--out", str(out)]
    w = _run_watched(cmd, work, RUN_TIMEOUT_S)
    point.wall_s, point.cpu_s, point.sampled_rss_mib, point.load1 = w.wall_s, w.cpu_s, w.rss_mib, w.load1
    code, killed = w.code, w.killed
    if killed or code != 0:
        tail = (work / "run.log").read_text()[-3000:]
        point.error = killed or f"exit status {code}"
        print(f"  {size.label} {optimizer}: {point.error}\n{tail}", flush=True)
        return point
    (path,) = out.glob("*.json")
    result = json.loads(path.read_text())
    point.verdict = result["equivalence"]["verdict"]
    point.parameters = result["model_info"]["parameters"]
    point.metrics = result["metrics"]
    return point


# -- predictions --------------------------------------------------------------------------------------
def _line(points: list[Point], y) -> tuple[float, float] | None:
    """(intercept, slope) of y against the parameter count over `points`, None with fewer than two sizes."""
    xs = [float(p.parameters) for p in points]
    if len(set(xs)) < 2:
        return None
    fit = stats.linregress(xs, [float(y(p)) for p in points])
    return float(fit.intercept), float(fit.slope)


def _predict_bytes(params: int, optimizer: str, done: list[Point]) -> tuple[float, str]:
    sgd = [p for p in done if p.optimizer == "sgd"]
    mine = [p for p in done if p.optimizer == optimizer]
    line = _line(mine, Point.guard_bytes)
    if line is not None and line[1] > 0:
        a, b = line
        return max(a + b * params, b * params), f"a line through {len(mine)} {optimizer} runs"
    base = _line(sgd, Point.guard_bytes)
    if base is None or base[1] <= 0:
        one = max(sgd or mine, key=lambda p: p.parameters, default=None)
        estimate = PRIOR_FIXED_BYTES + PRIOR_BYTES_PER_PARAM * params
        how = "the prior"
        if one is not None:  # proportional to one run: its fixed part scales too, so this overestimates
            estimate, how = max(estimate, one.guard_bytes() * params / one.parameters), "proportional to one run"
    else:
        estimate, how = base[0] + base[1] * params, f"a line through {len(sgd)} sgd runs"
    if optimizer != "sgd":  # no line of its own yet: the SGD line scaled by what AdamW took at a shared size
        shared = [(a.guard_bytes() / s.guard_bytes()) for a in mine for s in sgd if s.size == a.size]
        factor = max([1.5, *shared])
        estimate, how = estimate * factor, f"{how}, x{factor:.2f} for {optimizer}"
    return estimate, how


def _predict_wall(params: int, optimizer: str, done: list[Point]) -> float | None:
    mine = [p for p in done if p.optimizer == optimizer] or [p for p in done if p.optimizer == "sgd"]
    factor = 1.0 if any(p.optimizer == optimizer for p in done) else 1.5
    line = _line(mine, lambda p: p.wall_s)
    if line is not None and line[1] > 0:
        return factor * max(line[0] + line[1] * params, line[1] * params)
    if mine:
        one = max(mine, key=lambda p: p.parameters)
        return factor * one.wall_s * params / one.parameters
    return None


# -- fits ---------------------------------------------------------------------------------------------
def _linear_fit(points: list[Point], key: str) -> dict[str, float]:
    xs = np.array([p.parameters for p in points], dtype=float)
    ys = np.array([p.metrics[key] for p in points], dtype=float) * MIB
    fit = stats.linregress(xs, ys)
    return {"a_mib": float(fit.intercept / MIB), "bytes_per_param": float(fit.slope),
            "bytes_per_param_stderr": float(fit.stderr), "r2": float(fit.rvalue**2), "n": int(xs.size)}


def _power_fit(points: list[Point], key: str) -> dict[str, float]:
    xs = np.log([p.parameters for p in points])
    ys = np.log([p.cpu_s * 1e3 if key == "run_cpu_ms" else p.metrics[key] for p in points])
    fit = stats.linregress(xs, ys)
    return {"c_ms": float(math.exp(fit.intercept)), "k": float(fit.slope), "k_stderr": float(fit.stderr),
            "r2": float(fit.rvalue**2), "n": int(xs.size)}


def _largest(capacity: float, fixed_bytes: float, bytes_per_param: float) -> float:
    return (capacity - fixed_bytes) / bytes_per_param


def _fits(points: list[Point]) -> dict[str, Any]:
    fits: dict[str, Any] = {}
    for opt in ("sgd", "adamw"):
        mine = sorted((p for p in points if p.optimizer == opt and p.measured), key=lambda p: p.parameters)
        if len(mine) < 2:
            continue
        f = fits[opt] = {"above_start": _linear_fit(mine, "verify_above_start_mib"),
                         "peak": _linear_fit(mine, "verify_peak_mib")}
        if len(mine) >= 3:
            f["verify_ms_per_step"] = _power_fit(mine, "verify_ms_per_step")
            f["step_ms_p50"] = _power_fit(mine, "step_ms_p50")
            f["run_cpu_ms"] = _power_fit(mine, "run_cpu_ms")  # the whole process: imports, build, checks, steps
        f["ratio_verify_to_step"] = spread([p.metrics["verify_ms_per_step"] / p.metrics["step_ms_p50"] for p in mine])
        above, peak = f["above_start"], f["peak"]
        fixed = peak["a_mib"] * MIB
        stated = above["bytes_per_param"] + STATE_BYTES_PER_PARAM[opt]
        f["at_1B"] = {"verify_above_start_gib": (above["a_mib"] * MIB + above["bytes_per_param"] * 1e9) / GIB,
                      "verify_peak_gib": (fixed + peak["bytes_per_param"] * 1e9) / GIB}
        f["largest"] = {
            "assumed": (f"fixed {peak['a_mib']:.0f} MiB (the peak line's intercept) + (verifier "
                        f"{above['bytes_per_param']:.0f} B/param, the above-start slope, + the run's state "
                        f"{STATE_BYTES_PER_PARAM[opt]} B/param) = {stated:.0f} B/param; the direct whole-process "
                        f"line: {peak['bytes_per_param']:.0f} B/param"),
            "host_16GB_params": _largest(HOST_BYTES, fixed, stated),
            "gpu_80GB_params": _largest(GPU_BYTES, fixed, stated),
            "host_16GB_params_peak_line": _largest(HOST_BYTES, fixed, peak["bytes_per_param"]),
            "gpu_80GB_params_peak_line": _largest(GPU_BYTES, fixed, peak["bytes_per_param"]),
        }
    return fits


# -- printing -----------------------------------------------------------------------------------------
def _print_points(points: list[Point]) -> None:
    table = Table(title="reference backend, one process, seq 16 x batch 2, 2 verification steps: rank 0's checking "
                  "cost per model size", title_justify="left")
    cols = ("size", "opt", "P", "step ms", "verify ms/step", "ratio", "setup ms", "verify peak MiB",
            "above start MiB", "B/param", "sampled RSS MiB", "wall s", "CPU s", "load", "verdict / why not run")
    for col in cols:
        table.add_column(col, justify="left" if col in ("size", "opt", "verdict / why not run") else "right")
    for p in points:
        r = p.row()
        if not p.measured:
            table.add_row(p.size.label, p.optimizer, f"{r['parameters'] / 1e6:.1f} M", *[""] * 11,
                          p.skipped or p.error)
            continue
        table.add_row(p.size.label, p.optimizer, f"{r['parameters'] / 1e6:.1f} M", f"{r['step_ms_p50']:.0f}",
                      f"{r['verify_ms_per_step']:.0f}", f"{r['ratio_verify_to_step']:.1f}",
                      f"{r['verify_setup_ms']:.0f}", f"{r['verify_peak_mib']:.0f}",
                      f"{r['verify_above_start_mib']:.0f}", f"{r['above_start_bytes_per_param']:.0f}",
                      f"{r['sampled_max_rss_mib']:.0f}", f"{p.wall_s:.0f}", f"{p.cpu_s:.0f}", f"{p.load1:.1f}",
                      p.verdict)
    Console(width=200, force_terminal=False).print(table)


def _print_fits(fits: dict[str, Any]) -> None:
    for opt, f in fits.items():
        rows: list[tuple[str, Any, str]] = []
        for key, what in (("above_start", "verify_above_start_mib"), ("peak", "verify_peak_mib")):
            g = f[key]
            rows.append((f"{what} = a + b*P: b", g["bytes_per_param"],
                         f"bytes/param (+- {g['bytes_per_param_stderr']:.1f}), a = {g['a_mib']:.0f} MiB, "
                         f"R2 = {g['r2']:.4f}, n = {g['n']}" + (" (two points: R2 is 1 by construction)"
                                                                  if g["n"] == 2 else "")))
        for key in ("verify_ms_per_step", "step_ms_p50", "run_cpu_ms"):
            if key in f:
                g = f[key]
                rows.append((f"{key} = c*P^k: k", g["k"], f"+- {g['k_stderr']:.3f}, c = {g['c_ms']:.3g} ms, "
                             f"R2 = {g['r2']:.4f}, n = {g['n']} (log-log)"))
        rows.append(("verify_ms_per_step / step_ms_p50", f["ratio_verify_to_step"], "per size"))
        rows.append(("verifier at 1 B params: above start", f["at_1B"]["verify_above_start_gib"], "GiB (the line)"))
        rows.append(("process peak at 1 B params", f["at_1B"]["verify_peak_gib"], "GiB (the peak line)"))
        lim = f["largest"]
        rows.append(("largest judged, host 16 GB", lim["host_16GB_params"] / 1e6,
                     f"M params (peak line alone: {lim['host_16GB_params_peak_line'] / 1e6:.0f} M)"))
        rows.append(("largest judged, one 80 GB GPU", lim["gpu_80GB_params"] / 1e6,
                     f"M params (peak line alone: {lim['gpu_80GB_params_peak_line'] / 1e6:.0f} M); "
                     "extrapolated from CPU"))
        print_table(f"fits, {opt} (P = parameters); limits assume {lim['assumed']}", rows)


# -- the benchmark ------------------------------------------------------------------------------------
def test_verification_cost_grows_linearly_with_model_size(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    started = time.monotonic()
    points: list[Point] = []
    plan = [(s, "sgd") for s in SIZES] + [(s, "adamw") for s in SIZES if s.label in ADAMW_SIZES]
    too_big: dict[str, int] = {}  # optimizer -> the smallest size skipped for memory: larger ones are skipped too
    for size, opt in plan:
        done = [p for p in points if p.measured]
        need, how = _predict_bytes(size.parameters, opt, done)
        available = _mem_available()
        left = TIME_BUDGET_S - (time.monotonic() - started)
        wall = _predict_wall(size.parameters, opt, done)
        if opt in too_big and size.parameters > too_big[opt]:
            reason = f"larger than a size already too large for memory ({too_big[opt] / 1e6:.0f} M)"
        elif need + MARGIN_BYTES > available:
            reason = (f"predicted {need / GIB:.1f} GiB ({how}) + {MARGIN_BYTES / GIB:.0f} GiB margin > available "
                      f"{available / GIB:.1f} GiB")
            too_big[opt] = size.parameters
        elif wall is not None and wall > left:
            reason = f"predicted {wall:.0f} s of wall time > {left:.0f} s left of the {TIME_BUDGET_S:.0f} s budget"
        else:
            reason = None
        if reason is not None:
            points.append(Point(size, opt, skipped=reason))
            print(f"  {size.label} {opt}: skipped: {reason}", flush=True)
            continue
        print(f"  {size.label} {opt} ({size.parameters / 1e6:.1f} M): predicted {need / GIB:.1f} GiB ({how}), "
              f"available {available / GIB:.1f} GiB, predicted wall "
              f"{'-' if wall is None else f'{wall:.0f} s'}, {left:.0f} s left ...", flush=True)
        point = _run(size, opt, tmp_path, size.write(tmp_path))
        points.append(point)
        if point.measured:
            m = point.metrics
            print(f"    {point.verdict}; step {m['step_ms_p50']:.0f} ms, verify {m['verify_ms_per_step']:.0f} ms/step, "
                  f"peak {m['verify_peak_mib']:.0f} MiB ({m['verify_above_start_mib']:.0f} above start), sampled "
                  f"RSS {point.sampled_rss_mib:.0f} MiB, wall {point.wall_s:.0f} s, CPU {point.cpu_s:.0f} s, "
                  f"load {point.load1:.1f}", flush=True)

    fits = _fits(points)
    _print_points(points)
    _print_fits(fits)
    record = {"command": ["python", "-m", "dpcompare", *ARGS, "--model", "hf:DIR", "--optimizer", "OPT"],
              "omp_num_threads": THREADS, "points": [p.row() for p in points], "fits": fits,
              "wall_s": time.monotonic() - started}
    (tmp_path / "verification_cost.json").write_text(json.dumps(record, indent=2))
    print(json.dumps(record, indent=2), flush=True)

    failed = [p for p in points if p.error]
    assert not failed, [(p.size.label, p.optimizer, p.error) for p in failed]
    measured = [p for p in points if p.measured]
    assert all(p.verdict == "equivalent" for p in measured), [(p.size.label, p.optimizer, p.verdict) for p in measured]
    assert all(p.parameters == p.size.parameters for p in measured), \
        [(p.size.label, p.parameters, p.size.parameters) for p in measured]
    sgd = sorted((p for p in measured if p.optimizer == "sgd"), key=lambda p: p.parameters)
    adamw = [p for p in measured if p.optimizer == "adamw"]
    assert len(sgd) >= 3, f"only {len(sgd)} SGD sizes measured: no fit"
    assert len(adamw) >= 2, f"only {len(adamw)} AdamW sizes measured"
    above = [p.metrics["verify_above_start_mib"] for p in sgd]
    assert all(b > a for a, b in zip(above, above[1:])), f"the verifier's memory does not grow with P: {above}"
    for a, s in ((a, s) for a in adamw for s in sgd if s.size == a.size):  # the optimizer's state enters it
        assert a.metrics["verify_above_start_mib"] > s.metrics["verify_above_start_mib"], (a.size.label, a.metrics,
                                                                                           s.metrics)
    f = fits["sgd"]
    assert f["above_start"]["r2"] > 0.98 and f["peak"]["r2"] > 0.98, f
    assert f["above_start"]["bytes_per_param"] > STATE_BYTES_PER_PARAM["sgd"], f
    assert f["verify_ms_per_step"]["r2"] > 0.9, f
    assert 0.5 < f["verify_ms_per_step"]["k"] < 1.5, f


# -- the same checks divided over ranks ---------------------------------------------------------------
WORLD_SIZES = (1, 2, 4)
WS_SIZES = ("11M", "22M", "39M")
WS_OPTIMIZERS = ("sgd", "adamw")
WS_PER_RANK_BATCH = 2
"""Weak scaling: every rank runs 2 sequences of 16 tokens a step (global batch 2N), as the single process did."""
WS_ARGS = ["--seq-len", "16", "--steps", "2", "--measure-steps", "2", "--warmup-steps", "1", "--timeout-s", "3600"]


@dataclass
class WsPoint:
    size: Size
    optimizer: str
    world_size: int
    error: str | None = None
    skipped: str | None = None
    wall_s: float | None = None
    verdict: str | None = None
    parameters: int | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    division: dict | None = None

    @property
    def measured(self) -> bool:
        return self.error is None and self.skipped is None

    def per_rank(self, key: str) -> list[float]:
        m = self.metrics
        return m.get(f"{key}_per_rank") or [m[key]]

    def row(self) -> dict[str, Any]:
        out = {"size": self.size.label, "optimizer": self.optimizer, "world_size": self.world_size,
               "parameters": self.parameters or self.size.parameters, "verdict": self.verdict,
               "error": self.error, "skipped": self.skipped, "wall_s": self.wall_s, "oracle_division": self.division}
        if self.measured:
            p = out["parameters"]
            above = self.per_rank("verify_above_start_mib")
            out.update({
                "step_ms_p50": self.metrics["step_ms_p50"],
                "verify_ms_per_step_per_rank": self.per_rank("verify_ms_per_step"),
                "ratio_verify_to_step": self.metrics["verify_ms_per_step"] / self.metrics["step_ms_p50"],
                "above_start_bytes_per_param_per_rank": [a * MIB / p for a in above],
                "above_start_bytes_per_param_rank0": above[0] * MIB / p,
                "above_start_bytes_per_param_max": max(above) * MIB / p,
                "above_start_bytes_per_param_mean": float(np.mean(above)) * MIB / p,
                # less the run's own gradients and optimizer state first allocated in the phase (absent before them)
                "checking_bytes_per_param_per_rank": ([c * MIB / p for c in self.per_rank("verify_checking_mib")]
                                                      if self.metrics.get("verify_checking_mib") is not None else None),
            })
        return out


def _run_ws(size: Size, optimizer: str, world_size: int, root: Path, folder: Path) -> WsPoint:
    point = WsPoint(size, optimizer, world_size)
    work = root / "ws-runs" / f"{size.label}-{optimizer}-ws{world_size}"
    out = work / "out"
    args = [*WS_ARGS, "--global-batch", str(WS_PER_RANK_BATCH * world_size), "--model", f"hf:{folder}",
            "--optimizer", optimizer, "--out", str(out)]
    if world_size == 1:
        cmd = [sys.executable, "-m", "dpcompare", "--backend", "reference", *args]
    else:
        cmd = [str(Path(sys.executable).with_name("torchrun")), "--standalone", f"--nproc_per_node={world_size}",
               "-m", "dpcompare", "--backend", "ddp", *args]
    w = _run_watched(cmd, work, RUN_TIMEOUT_S)
    point.wall_s = w.wall_s
    if w.killed or w.code != 0:
        point.error = w.killed or f"exit status {w.code}"
        print(f"  {size.label} {optimizer} ws={world_size}: {point.error}\n{(work / 'run.log').read_text()[-3000:]}",
              flush=True)
        return point
    (path,) = out.glob("*.json")
    result = json.loads(path.read_text())
    point.verdict = result["equivalence"]["verdict"]
    point.division = result["equivalence"].get("oracle_division")
    point.parameters = result["model_info"]["parameters"]
    point.metrics = result["metrics"]
    return point


def _ws_fits(points: list[WsPoint]) -> dict[str, Any]:
    """Per optimizer and world size: bytes per parameter per rank (rank 0's, the largest rank's) against P, and the
    checked step's cost in steps; per size, how rank 0's verify time and bytes move from 1 to 4 ranks."""
    fits: dict[str, Any] = {}
    for opt in WS_OPTIMIZERS:
        for ws in WORLD_SIZES:
            mine = sorted((p for p in points if p.measured and p.optimizer == opt and p.world_size == ws),
                          key=lambda p: p.parameters)
            if len(mine) < 2:
                continue
            xs = np.array([p.parameters for p in mine], dtype=float)
            f = fits.setdefault(opt, {})[f"ws{ws}"] = {}
            for key, pick in (("rank0", lambda p: p.per_rank("verify_above_start_mib")[0]),
                              ("max_rank", lambda p: max(p.per_rank("verify_above_start_mib")))):
                fit = stats.linregress(xs, np.array([pick(p) for p in mine]) * MIB)
                f[f"above_start_{key}"] = {"bytes_per_param": float(fit.slope), "a_mib": float(fit.intercept / MIB),
                                           "r2": float(fit.rvalue**2), "n": len(mine)}
            if all(p.metrics.get("verify_checking_mib") is not None for p in mine):
                for key, pick in (("rank0", lambda p: p.per_rank("verify_checking_mib")[0]),
                                  ("max_rank", lambda p: max(p.per_rank("verify_checking_mib")))):
                    fit = stats.linregress(xs, np.array([pick(p) for p in mine]) * MIB)
                    f[f"checking_{key}"] = {"bytes_per_param": float(fit.slope), "a_mib": float(fit.intercept / MIB),
                                            "r2": float(fit.rvalue**2), "n": len(mine)}
            f["ratio_verify_to_step"] = spread([p.row()["ratio_verify_to_step"] for p in mine])
    growth: dict[str, Any] = {}
    for opt in WS_OPTIMIZERS:
        for label in WS_SIZES:
            by_ws = {p.world_size: p for p in points
                     if p.measured and p.optimizer == opt and p.size.label == label}
            if 1 in by_ws and len(by_ws) > 1:
                base = by_ws[1]
                growth[f"{label}-{opt}"] = {
                    f"ws{ws}": {"verify_ms_rank0_over_ws1": p.metrics["verify_ms_per_step"]
                                / base.metrics["verify_ms_per_step"],
                                "ratio_over_ws1": p.row()["ratio_verify_to_step"] / base.row()["ratio_verify_to_step"],
                                "bytes_rank0_over_ws1": p.row()["above_start_bytes_per_param_rank0"]
                                / base.row()["above_start_bytes_per_param_rank0"],
                                "bytes_max_rank_over_ws1": p.row()["above_start_bytes_per_param_max"]
                                / base.row()["above_start_bytes_per_param_rank0"]}
                    for ws, p in sorted(by_ws.items()) if ws != 1}
    fits["growth_from_ws1"] = growth
    return fits


def _print_ws(points: list[WsPoint]) -> None:
    table = Table(title="checking divided over ranks (ws=1: the reference backend; ws>1: ddp under torchrun, each rank "
                  "2 x 16 tokens a step): per-rank cost", title_justify="left")
    for col in ("size", "opt", "ws", "step ms", "verify ms/step (per rank)", "ratio", "B/param above start (per rank)",
                "B/param checking (per rank)", "divided", "verdict / why not"):
        table.add_column(col, justify="left" if col in ("size", "opt", "verdict / why not") else "right")
    for p in points:
        if not p.measured:
            table.add_row(p.size.label, p.optimizer, str(p.world_size), *[""] * 6, p.skipped or p.error)
            continue
        r = p.row()
        table.add_row(p.size.label, p.optimizer, str(p.world_size), f"{r['step_ms_p50']:.0f}",
                      " / ".join(f"{v:.0f}" for v in r["verify_ms_per_step_per_rank"]),
                      f"{r['ratio_verify_to_step']:.1f}",
                      " / ".join(f"{v:.0f}" for v in r["above_start_bytes_per_param_per_rank"]),
                      " / ".join(f"{v:.0f}" for v in r["checking_bytes_per_param_per_rank"] or []) or "-",
                      str((p.division or {}).get("divided", "-")), p.verdict)
    Console(width=200, force_terminal=False).print(table)


def test_verification_cost_across_world_sizes(tmp_path: Path) -> None:
    """The same Llama-style sizes at 1, 2 and 4 ranks: each rank's checking bytes per parameter and rank 0's checked
    step in steps, with the oracle's forwards divided over the ranks (equivalence.oracle_division)."""
    pytest.importorskip("transformers")
    started = time.monotonic()
    points: list[WsPoint] = []
    measured_ws1: dict[tuple[str, str], float] = {}
    for opt in WS_OPTIMIZERS:
        for size in (s for s in SIZES if s.label in WS_SIZES):
            folder = size.write(tmp_path)
            for ws in WORLD_SIZES:
                left = TIME_BUDGET_S - (time.monotonic() - started)
                # a bound: every rank as large as one process (the run's own state and the copies each rank holds)
                one = measured_ws1.get((size.label, opt))
                need = ws * (one if one is not None else PRIOR_FIXED_BYTES + PRIOR_BYTES_PER_PARAM * size.parameters)
                if need + MARGIN_BYTES > _mem_available():
                    points.append(WsPoint(size, opt, ws, skipped=f"predicted {need / GIB:.1f} GiB > available"))
                    continue
                if left < 60:
                    points.append(WsPoint(size, opt, ws, skipped=f"{left:.0f} s left of the time budget"))
                    continue
                print(f"  {size.label} {opt} ws={ws} ...", flush=True)
                point = _run_ws(size, opt, ws, tmp_path, folder)
                points.append(point)
                if point.measured:
                    if ws == 1:
                        measured_ws1[(size.label, opt)] = MIB * point.metrics["verify_peak_mib"]
                    r = point.row()
                    print(f"    {point.verdict}; step {r['step_ms_p50']:.0f} ms, verify/step "
                          f"{r['ratio_verify_to_step']:.1f}x, B/param per rank "
                          f"{[round(v) for v in r['above_start_bytes_per_param_per_rank']]}", flush=True)
    fits = _ws_fits(points)
    _print_ws(points)
    record = {"command_ws1": ["python", "-m", "dpcompare", "--backend", "reference", *WS_ARGS],
              "command_wsN": ["torchrun", "--standalone", "--nproc_per_node=N", "-m", "dpcompare", "--backend", "ddp",
                              *WS_ARGS, "--global-batch", "2N"],
              "points": [p.row() for p in points], "fits": fits, "wall_s": time.monotonic() - started}
    (tmp_path / "verification_cost_ws.json").write_text(json.dumps(record, indent=2))
    print(json.dumps(record, indent=2), flush=True)
    failed = [p for p in points if p.error]
    assert not failed, [(p.size.label, p.optimizer, p.world_size, p.error) for p in failed]
    measured = [p for p in points if p.measured]
    assert all(p.verdict == "equivalent" for p in measured), [(p.size.label, p.world_size, p.verdict) for p in measured]
    assert all((p.division or {}).get("ranks") == p.world_size for p in measured if p.world_size > 1)
    assert any(p.world_size == 4 for p in measured), "no run at 4 ranks"
