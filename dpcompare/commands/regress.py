"""regress: a noise-aware regression gate over repeated pytest-benchmark runs.

Reads two directories of pytest-benchmark JSON files, one file per run, and exits 1 when a benchmark got
slower beyond the noise. A single run against a single saved run (pytest-benchmark's --benchmark-compare-fail)
cannot tell a slowdown from a noisy neighbour; this gate repeats whole runs and tests the runs.

Per benchmark (matched by its pytest-benchmark fullname), each run contributes one figure: its
stats[--statistic] (its fastest round by default). The rounds of one run are autocorrelated, so the test
is over runs, never over the rounds of one run. Why the fastest: on a shared machine noise only ever adds
time (a neighbour, a preempted rank), so each run's fastest step is its steadiest figure, and a slower
build makes every step slower, the fastest included. A regression that only widens the tail (a straggler
now and then) shows in --statistic median, not min: gate on both when that is what you guard against.
Then (dpcompare.measure.gate):

Interleaved runs (A B A B ..., told by pytest-benchmark's `datetime`) are paired, the k-th of each side,
since neighbouring runs share the machine's state: a one-sided Wilcoxon signed-rank test over the pairs'
log ratios, the ratio being the median per-pair ratio (needs 5 pairs at alpha 0.05). Otherwise, unpaired:

  ratio r       median(current figures) / median(baseline figures)
  90% CI        bootstrap of r, resampling each side's runs (10,000 resamples, fixed seed)
  regression    one-sided Mann-Whitney U (current slower) p < --alpha  AND  r >= 1 + --min-effect
  improvement   one-sided Mann-Whitney U (current faster) p < --alpha  AND  r <= 1 / (1 + --min-effect)
  same          otherwise: not significant, or significant but smaller than the minimum effect

At least 3 runs per side. With n runs per side the smallest one-sided p-value is 1/C(2n, n) (3: 0.05,
4: 0.014, 5: 0.004), so alpha 0.05 needs 4 runs per side and alpha 0.01 needs 5; a configuration that could
never flag anything is refused with the runs it needs. On a shared machine 12 per side, of 60 steps each,
leave room for a few runs that land in a slow spell (benchmarks/test_regression_gate.py).

Producing the inputs: run baseline and current alternately (B C B C ...), so that drift of the machine
(heat, a noisy neighbour, a background job) falls on both sides alike, each run writing its own file. Each side
runs in its own checkout with its own environment (the suite imports dpcompare from the environment it runs in).
The measured recipe, from the current checkout's root, with the baseline set up in ../dpcompare-baseline
(README, "A regression gate in CI"; docs/regression-gate.md):

  suite() {
    OMP_NUM_THREADS=1 .venv/bin/python -m pytest --pyargs dpcompare.regression --dpcompare-backends ddp \\
      --dpcompare-world-sizes 2 --dpcompare-global-batch 2048 --dpcompare-steps 60 --dpcompare-warmup 3 \\
      -q --benchmark-json "$1"
  }
  gate=$PWD/gate; mkdir -p "$gate/baseline" "$gate/current"
  for k in $(seq 12); do
    (cd ../dpcompare-baseline && suite "$gate/baseline/run-$k.json")
    suite "$gate/current/run-$k.json"
  done
  .venv/bin/python -m dpcompare regress --baseline "$gate/baseline" --current "$gate/current"

Both sides must come from one machine: the runs' machine_info["dpcompare"] (written by dpcompare's pytest
plugin) must agree on the hardware (devices, CPU count, architecture; software versions may differ); where
no run has it, machine_info's node, machine and cpu brand are compared. --allow-other-machine compares
anyway.

Benchmarks on one side only are listed as not compared. Exit status: 1 if any benchmark regressed, 0
otherwise, 2 for unusable inputs. --json FILE writes every decision (kind: regress).

Owns: reading the run files, the machine check, the table and the JSON; the statistics live in
dpcompare.measure.gate. Imports no adapter and no torch: runs can be gated on any machine.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from dpcompare import json_files
from dpcompare.commands.pytest_plugin import HARDWARE_KEYS
from dpcompare.measure import gate

STATISTICS = ("median", "min", "mean")

FALLBACK_MACHINE_KEYS = (("node",), ("machine",), ("cpu", "brand_raw"))
VERDICT_STYLE = {"regression": "bold red", "improvement": "green", "same": ""}


@dataclass
class Side:
    """One side's runs: the files, each file's machine_info, and each benchmark's figure per run (seconds)."""

    flag: str
    directory: Path
    files: list[Path] = field(default_factory=list)
    machine_info: list[dict[str, Any]] = field(default_factory=list)
    figures_s: dict[str, list[float]] = field(default_factory=dict)
    """Each benchmark's figure per run, in the order the runs started."""
    started: dict[str, list[str]] = field(default_factory=dict)
    """Each benchmark's runs' start times (pytest-benchmark's `datetime`), in the same order."""

    @property
    def where(self) -> str:
        return f"{self.flag} {self.directory}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--baseline", required=True, metavar="DIR", help="pytest-benchmark JSON files of the baseline, one per run")
    p.add_argument("--current", required=True, metavar="DIR", help="pytest-benchmark JSON files of the current build, one per run")
    p.add_argument("--alpha", type=float, default=0.05, help="significance level of the one-sided test (default: 0.05)")
    p.add_argument("--min-effect", type=float, default=0.05,
                   help="smallest slowdown that counts, as a fraction: 0.05 flags 5%% or more (default: 0.05)")
    p.add_argument("--statistic", choices=STATISTICS, default="min",
                   help="each run's figure: this statistic of its rounds (default: min, the steadiest on a shared "
                        "machine, where noise only ever adds time; median also sees slower tails)")
    p.add_argument("--pairing", choices=("auto", "paired", "unpaired"), default="auto",
                   help="paired: the k-th baseline and current runs, interleaved in time, form a pair (Wilcoxon "
                        "signed-rank); unpaired: Mann-Whitney U over the sides; auto: paired when the runs interleave")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the decisions to this JSON file")
    p.add_argument("--allow-other-machine", action="store_true",
                   help="compare even when the two sides' machine_info differ")


def main(ns: argparse.Namespace) -> int:
    gate.runs_needed(ns.alpha)
    if not (ns.min_effect >= 0.0 and math.isfinite(ns.min_effect)):
        raise ValueError(f"--min-effect must be 0 or more, got {ns.min_effect:g}: use e.g. --min-effect 0.05 (5%)")
    baseline = load_side("--baseline", Path(ns.baseline), ns.statistic)
    current = load_side("--current", Path(ns.current), ns.statistic)
    if not ns.allow_other_machine:
        check_same_machine(baseline, current)
    common = sorted(set(baseline.figures_s) & set(current.figures_s))
    if not common:
        raise ValueError(f"no benchmark appears in both {baseline.where} and {current.where} (benchmarks are matched "
                         "by fullname, the pytest node id): run the same benchmarks on both sides")
    for name in common:
        gate.check_runs(name, len(baseline.figures_s[name]), len(current.figures_s[name]), ns.alpha,
                        baseline.where, current.where)
    decisions = {name: _decide(ns, baseline, current, name) for name in common}
    not_compared = ([{"name": n, "only_in": "baseline"} for n in sorted(set(baseline.figures_s) - set(current.figures_s))]
                    + [{"name": n, "only_in": "current"} for n in sorted(set(current.figures_s) - set(baseline.figures_s))])
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)
    render(console, ns, decisions, not_compared)
    if ns.json:
        json_files.write_atomic(Path(ns.json), _payload(ns, baseline, current, decisions, not_compared))
    return 1 if any(d.verdict == "regression" for d in decisions.values()) else 0


def interleaved(baseline: list[str], current: list[str]) -> bool:
    """Whether two sides' runs alternate in time (A B A B ... or B A B A ...), so the k-th of each pair up."""
    if len(baseline) != len(current) or "" in baseline + current:
        return False
    merged = sorted([(t, "b") for t in baseline] + [(t, "c") for t in current])
    return all({merged[i][1], merged[i + 1][1]} == {"b", "c"} for i in range(0, len(merged), 2))


def _decide(ns: argparse.Namespace, baseline: Side, current: Side, name: str) -> gate.Decision:
    paired = ns.pairing == "paired" or (ns.pairing == "auto" and interleaved(baseline.started[name], current.started[name]))
    if ns.pairing == "paired" and not interleaved(baseline.started[name], current.started[name]):
        raise ValueError(f"--pairing paired: the runs of {name} do not alternate in time between {baseline.where} and "
                         f"{current.where} (or their counts differ): run them A B A B ..., or use --pairing unpaired")
    decide = gate.decide_paired if paired else gate.decide
    return decide(baseline.figures_s[name], current.figures_s[name], ns.alpha, ns.min_effect, name)


# -- inputs ---------------------------------------------------------------------------------------------
def load_side(flag: str, directory: Path, statistic: str) -> Side:
    """Every *.json in directory, each a pytest-benchmark run; one line of ValueError for anything else."""
    side = Side(flag=flag, directory=directory)
    if not directory.is_dir():
        raise ValueError(f"{side.where} does not exist or is not a directory: expected a directory of "
                         "pytest-benchmark JSON files, one per run (pytest --benchmark-json DIR/run-K.json)")
    side.files = sorted(directory.glob("*.json"))
    if not side.files:
        raise ValueError(f"{side.where} holds no .json file: write one per run with "
                         f"pytest --benchmark-json {directory}/run-K.json")
    runs = sorted((read_run(path, statistic) + (path,) for path in side.files), key=lambda run: (run[2], str(run[3])))
    for machine_info, figures, started, _ in runs:
        side.machine_info.append(machine_info)
        for name, figure in figures.items():
            side.figures_s.setdefault(name, []).append(figure)
            side.started.setdefault(name, []).append(started)
    return side


def read_run(path: Path, statistic: str) -> tuple[dict[str, Any], dict[str, float], str]:
    """One pytest-benchmark JSON file: its machine_info, {fullname: stats[statistic]} in seconds, and when the
    run started (its ISO `datetime`; empty when absent)."""
    hint = "expected the file pytest --benchmark-json writes"
    try:
        obj = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not readable JSON ({str(exc).splitlines()[0]}): {hint}") from None
    if not (isinstance(obj, dict) and isinstance(obj.get("benchmarks"), list)
            and isinstance(obj.get("machine_info"), dict)):
        raise ValueError(f"{path} is not pytest-benchmark JSON (no 'benchmarks' list and 'machine_info'): {hint}")
    figures: dict[str, float] = {}
    for bench in obj["benchmarks"]:
        name = bench.get("fullname") if isinstance(bench, dict) else None
        stats = bench.get("stats") if isinstance(bench, dict) else None
        figure = stats.get(statistic) if isinstance(stats, dict) else None
        if not isinstance(name, str) or isinstance(figure, bool) or not isinstance(figure, (int, float)):
            raise ValueError(f"{path}: a benchmark lacks a fullname or a numeric stats.{statistic}: {hint}")
        if not (math.isfinite(figure) and figure > 0):
            raise ValueError(f"{path}: stats.{statistic} of {name} is {figure!r}, not a positive time in seconds")
        if name in figures:
            raise ValueError(f"{path} lists {name} twice: one file must hold one run of each benchmark")
        figures[name] = float(figure)
    started = obj.get("datetime")
    return obj["machine_info"], figures, started if isinstance(started, str) else ""


# -- one machine ----------------------------------------------------------------------------------------
def fingerprint(machine_info: dict[str, Any], plugin: bool) -> dict[str, Any] | None:
    """What identifies the machine: the hardware keys of dpcompare's plugin dict (None when this run lacks
    it), or else node, machine and cpu brand, where present."""
    if plugin:
        found = machine_info.get("dpcompare")
        # The hardware only: a candidate built on newer software is exactly what a gate compares.
        return {f"dpcompare.{k}": found.get(k) for k in HARDWARE_KEYS} if isinstance(found, dict) else None
    picked: dict[str, Any] = {}
    for keys in FALLBACK_MACHINE_KEYS:
        value: Any = machine_info
        for key in keys:
            value = value.get(key) if isinstance(value, dict) else None
        if value is not None:
            picked[".".join(keys)] = value
    return picked


def check_same_machine(baseline: Side, current: Side) -> None:
    """Refuse runs from different machines, naming what differs: every run is held against the first
    baseline run."""
    runs = [(baseline, i) for i in range(len(baseline.files))] + [(current, i) for i in range(len(current.files))]
    plugin = any(isinstance(side.machine_info[i].get("dpcompare"), dict) for side, i in runs)
    reference = fingerprint(baseline.machine_info[0], plugin)
    first = f"{baseline.flag} {baseline.files[0]}"
    fix = "run baseline and current on one machine, or pass --allow-other-machine to compare anyway"
    for side, i in runs:
        this = fingerprint(side.machine_info[i], plugin)
        here = f"{side.flag} {side.files[i]}"
        if (this is None) != (reference is None):
            lacking, having = (here, first) if this is None else (first, here)
            raise ValueError(f"{lacking} has no machine_info.dpcompare (written by dpcompare's pytest plugin) "
                             f"while {having} has: {fix}")
        if this is None or reference is None:
            continue
        differing = sorted(k for k in set(this) | set(reference) if this.get(k) != reference.get(k))
        if differing:
            raise ValueError(f"{here} ran on another machine than {first} (machine_info differs in: "
                             f"{', '.join(differing)}): {fix}")


# -- outputs --------------------------------------------------------------------------------------------
def render(console: Console, ns: argparse.Namespace, decisions: dict[str, gate.Decision],
           not_compared: list[dict[str, str]]) -> None:
    """The decision table, the benchmarks not compared, and one summary line."""
    table = Table(title=f"regress: each run's {ns.statistic}, median over runs (alpha {ns.alpha:g}, "
                        f"min effect {ns.min_effect * 100:g}%)")
    for header in ("benchmark", "runs (base/cur)", "baseline ms", "current ms", "ratio", "90% CI", "p", "verdict"):
        table.add_column(header, justify="left" if header in ("benchmark", "verdict") else "right",
                         overflow="fold")
    for name, d in decisions.items():
        table.add_row(Text(name), f"{d.n_baseline}/{d.n_current}", f"{d.baseline_median_s * 1e3:.3f}",
                      f"{d.current_median_s * 1e3:.3f}", f"{d.ratio:.3f}", f"{d.ci90[0]:.3f}-{d.ci90[1]:.3f}",
                      f"{d.p_value:.3g}", Text(d.verdict, style=VERDICT_STYLE[d.verdict]))
    console.print(table)
    for name, d in decisions.items():
        if d.verdict != "same":
            console.print(Text(f"{name}: {d.reason}", style=VERDICT_STYLE[d.verdict]))
    for entry in not_compared:
        console.print(Text(f"not compared: {entry['name']} (only in --{entry['only_in']})"))
    console.print(Text(summary_line(decisions, not_compared)))


def summary_line(decisions: dict[str, gate.Decision], not_compared: list[dict[str, str]]) -> str:
    counts = {v: sum(d.verdict == v for d in decisions.values()) for v in ("regression", "improvement", "same")}
    text = (f"regress: {counts['regression']} regression(s), {counts['improvement']} improvement(s), "
            f"{counts['same']} same, {len(not_compared)} not compared")
    return text + (": FAIL" if counts["regression"] else ": pass")


def _payload(ns: argparse.Namespace, baseline: Side, current: Side, decisions: dict[str, gate.Decision],
             not_compared: list[dict[str, str]]) -> dict[str, Any]:
    return json_files.base_payload(
        kind="regress",
        created_unix=time.time(),
        baseline_dir=str(baseline.directory), current_dir=str(current.directory),
        baseline_files=[str(p) for p in baseline.files], current_files=[str(p) for p in current.files],
        statistic=ns.statistic, alpha=ns.alpha, min_effect=ns.min_effect,
        bootstrap={"resamples": gate.RESAMPLES, "seed": gate.SEED, "level": gate.CI_LEVEL},
        machine_check="skipped (--allow-other-machine)" if ns.allow_other_machine else "same machine",
        decisions=[{"name": name, **asdict(d), "ci90": list(d.ci90)} for name, d in decisions.items()],
        not_compared=not_compared,
        regressions=sorted(name for name, d in decisions.items() if d.verdict == "regression"),
    )
