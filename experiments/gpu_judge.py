"""The judge of one `experiments/gpu_check.sh` step: do the results the step wrote show what the step is there to
show? An exit status of 0 only says a run finished (dpcompare exits 0 whatever its verdict), so each step that runs
dpcompare is judged here on the result JSON(s) in its own directory.

    python experiments/gpu_judge.py DIR [--step NAME] [--verdict LIST] [--skips] [--memory]
                                        [--memory-tolerance F] [--count N]

It prints one line per shortfall, `STEP: WHICH RESULT: WHAT FELL SHORT`, and exits 1; when every expectation holds
it prints one line, `STEP: ok: ...`, and exits 0; bad usage is one line on stderr and exit 2.

Expectations:
  --verdict LIST   the verdicts allowed (comma list, default `equivalent`): a run that is `different`,
                   `unverifiable` or `unchecked` where the step expects `equivalent` falls short.
  --skips          the loss scaler's skips were exercised and predicted: at least one checked step in
                   equivalence.precision.steps was skipped, every checked step was skipped exactly where the
                   oracle's rank-by-rank emulation overflows (predicted_overflow), and the verdict is `equivalent`.
                   The verifier already fails a skip it did not predict; this says the run reached that path at all.
  --memory         each rank's measured model state (metrics.model_state_mib_per_rank) holds its parameters and
                   optimizer state within --memory-tolerance of the ZeRO paper's per-rank figure
                   (metrics.model_state_formula_mib); a result without either figure falls short, naming the field.
  --count N        exactly N results (default: at least one). A directory with no result falls short.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any, Sequence

VERDICTS = ("equivalent", "different", "unverifiable", "unchecked")
MEMORY_COMPONENTS = ("params", "optimizer")
"""The model-state components held to the formula. Gradients and fp32 masters are left out: DeepSpeed keeps an fp32
copy of its partition even in float32 and keeps ZeRO-1's gradients as the averaged partition beside the full ones,
which the paper's formula does not count (docs/results/2026-11-25-sharding-cpu.md)."""
MEMORY_REL_TOLERANCE = 0.10
"""How far (relative) a measured component may sit from the formula. What the formula leaves out is small on the
check's models: Adam's step counters (one scalar per parameter tensor) and the padding that makes a flat ZeRO
partition or an FSDP2 dim-0 shard divide by the world size, well under 1 % of gpt-tiny's state. What the check is
there to catch is large: a component that should be sharded but is replicated is N times the formula (+100 % at
world size 2), state kept in the wrong dtype is a factor 2. 10 % sits far from both."""
REASON_CHARS = 300
"""A quoted reason (first divergence, why unverifiable) is cut to this many characters: the line stays one line."""


class UsageError(Exception):
    """Bad command-line input: reported in one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (UsageError) instead of the usage block and exit."""

    def error(self, message: str) -> None:  # noqa: D102
        raise UsageError(message)


def _verdicts(text: str) -> tuple[str, ...]:
    names = tuple(v.strip() for v in text.split(",") if v.strip())
    unknown = [v for v in names if v not in VERDICTS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma list of {', '.join(VERDICTS)}")
    return names


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number of results, 0 or more")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a relative tolerance between 0 and 1, e.g. 0.1")
    return value


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="gpu_judge", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", type=Path, help="the directory the step wrote its result JSON(s) into")
    p.add_argument("--step", default=None, help="the step's name in the lines printed (default: DIR's name)")
    p.add_argument("--verdict", type=_verdicts, default=("equivalent",), metavar="LIST",
                   help="verdicts allowed, comma list (default: equivalent)")
    p.add_argument("--skips", action="store_true", help="the loss scaler skipped at least one checked step, each "
                                                        "one predicted, and the verdict is equivalent")
    p.add_argument("--memory", action="store_true", help="measured parameters and optimizer state per rank within "
                                                         "--memory-tolerance of the ZeRO formula")
    p.add_argument("--memory-tolerance", type=_fraction, default=MEMORY_REL_TOLERANCE, metavar="F",
                   help=f"relative tolerance of --memory (default: {MEMORY_REL_TOLERANCE:g})")
    p.add_argument("--count", type=_count, default=None, metavar="N",
                   help="exactly N results expected (default: at least one)")
    return p


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """The parsed flags; raises UsageError for anything that cannot be judged."""
    ns = parser().parse_args(list(argv))
    if not ns.dir.is_dir():
        raise UsageError(f"{ns.dir} is not a directory: give the directory the step wrote its results into")
    if ns.skips and ns.verdict != ("equivalent",):
        raise UsageError("--skips judges an equivalent run: drop --verdict or give --verdict equivalent")
    if ns.step is None:
        ns.step = ns.dir.resolve().name
    return ns


# -- the results -------------------------------------------------------------------------------------------------
def load_results(directory: Path) -> tuple[list[tuple[Path, dict[str, Any]]], list[str], int]:
    """(the run results in `directory` (not its subdirectories), 'FILE: why' for JSON that cannot be read, how many
    readable JSON files are not run results). A result is an object with `backend` and `equivalence`."""
    results: list[tuple[Path, dict[str, Any]]] = []
    unreadable: list[str] = []
    others = 0
    for path in sorted(directory.glob("*.json")):
        if path.name.startswith("."):  # hidden: no run writes its result so (its temporary file is .NAME.json.*.tmp)
            continue
        try:
            payload = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            unreadable.append(f"{path.name}: not readable JSON ({type(exc).__name__}: {exc})")
            continue
        if isinstance(payload, dict) and "backend" in payload and "equivalence" in payload:
            results.append((path, payload))
        else:
            others += 1
    return results, unreadable, others


def describe(path: Path, result: dict[str, Any]) -> str:
    """'BACKEND ws=N MODEL (FILE)': which result a line is about."""
    return f"{result.get('backend')} ws={result.get('world_size')} {result.get('model')} ({path.name})"


def _clip(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    text = re.sub(r"\s+", " ", text).strip()
    return text if len(text) <= REASON_CHARS else text[:REASON_CHARS - 3] + "..."


def _mib(value: float) -> str:
    return f"{value:.4g} MiB"


# -- the checks: each returns what fell short, one string per shortfall --------------------------------------------
def check_verdict(result: dict[str, Any], allowed: Sequence[str]) -> list[str]:
    """The verdict is one of `allowed`; a shortfall quotes the first divergence or why it is unverifiable."""
    equivalence = result.get("equivalence")
    if not isinstance(equivalence, dict):
        return ["equivalence is missing: the run wrote no verdict"]
    verdict = equivalence.get("verdict")
    if verdict in allowed:
        return []
    line = f"verdict {verdict}, expected {' or '.join(allowed)}"
    divergence = equivalence.get("first_divergence")
    if isinstance(divergence, dict):
        where = ", ".join(str(divergence[k]) for k in ("check", "parameter") if divergence.get(k))
        line += f" (first divergence at step {divergence.get('step')}{', ' + where if where else ''}: " \
                f"{_clip(divergence.get('reason'))})"
    elif divergence:
        line += f" (first divergence: {_clip(divergence)})"
    if equivalence.get("unverifiable_reason"):
        line += f" ({_clip(equivalence['unverifiable_reason'])})"
    return [line]


def check_skips(result: dict[str, Any]) -> list[str]:
    """At least one checked step skipped by the loss scaler, and every checked step skipped exactly where the oracle
    predicted an overflow (equivalence.precision.steps). That the verdict is `equivalent` is check_verdict's part:
    parse_args lets --skips go with no other --verdict."""
    equivalence = result.get("equivalence") if isinstance(result.get("equivalence"), dict) else {}
    problems: list[str] = []
    precision = equivalence.get("precision")
    if not isinstance(precision, dict):
        return problems + ["--skips: equivalence.precision is missing: the run recorded no loss scaler"]
    records = [r for r in precision.get("steps") or [] if isinstance(r, dict)]
    if not records:
        return problems + [f"--skips: no checked step recorded a loss scale (equivalence.precision.steps is empty; "
                           f"--amp {precision.get('amp')}, loss scaler {precision.get('loss_scaler')})"]
    unknown = [r.get("step") for r in records if not isinstance(r.get("skipped"), bool)]
    if unknown:
        problems.append(f"--skips: the backend did not say whether it skipped checked step(s) "
                        f"{', '.join(map(str, unknown))}")
    unpredicted = [f"{r.get('step')} ({'skipped' if r['skipped'] else 'applied'}, overflow "
                   f"{'predicted' if r.get('predicted_overflow') else 'not predicted'})"
                   for r in records if isinstance(r.get("skipped"), bool)
                   and r["skipped"] != bool(r.get("predicted_overflow"))]
    if unpredicted:
        problems.append(f"--skips: checked step(s) {', '.join(unpredicted)}: skipped other than where the oracle "
                        f"predicts an overflow")
    if not any(r.get("skipped") is True for r in records):
        scales = [r.get("scale") for r in records]
        problems.append(f"--skips: none of the {len(records)} checked step(s) was skipped (loss scale {scales[0]} to "
                        f"{scales[-1]}): the overflow path was not exercised")
    return problems


def check_memory(result: dict[str, Any], tolerance: float) -> list[str]:
    """Every rank's measured parameters and optimizer state within `tolerance` (relative) of the ZeRO formula."""
    metrics = result.get("metrics")
    if not isinstance(metrics, dict):
        return ["--memory: metrics is missing (null): the run measured nothing (--measure-steps 0?)"]
    reasons = metrics.get("reasons") if isinstance(metrics.get("reasons"), dict) else {}
    formula = metrics.get("model_state_formula_mib")
    per_rank = metrics.get("model_state_mib_per_rank")
    problems = []
    for name, value in (("model_state_formula_mib", formula), ("model_state_mib_per_rank", per_rank)):
        if not value:
            why = reasons.get(name)
            problems.append(f"--memory: metrics.{name} is missing" + (f" ({_clip(why)})" if why else ""))
    if problems:
        return problems
    if not isinstance(formula, dict) or not isinstance(per_rank, list):
        return ["--memory: metrics.model_state_formula_mib is not an object or metrics.model_state_mib_per_rank "
                "not a list"]
    for rank, census in enumerate(per_rank):
        for component in MEMORY_COMPONENTS:
            expected = formula.get(component)
            measured = census.get(component) if isinstance(census, dict) else None
            if not isinstance(expected, (int, float)) or not isinstance(measured, (int, float)):
                problems.append(f"--memory: rank {rank} {component}: measured {measured!r}, formula {expected!r}: "
                                f"not both numbers")
                continue
            if expected == 0:
                off = 0.0 if measured == 0 else float("inf")
            else:
                off = (measured - expected) / expected
            if abs(off) > tolerance:
                problems.append(f"--memory: rank {rank} {component} measured {_mib(measured)}, formula "
                                f"{_mib(expected)} ({off:+.0%}, tolerance {tolerance:.0%}; "
                                f"{_clip(formula.get('formula', 'ZeRO formula'))})")
    return problems


def judge(ns: argparse.Namespace) -> tuple[list[str], str]:
    """(every shortfall as a printed line, the one-line summary when there is none)."""
    results, unreadable, others = load_results(ns.dir)
    lines = [f"{ns.step}: {u}" for u in unreadable]
    found = f"{len(results)} result(s) in {ns.dir}" if results else (
        f"no result file found in {ns.dir}" + (f" ({others} other JSON file(s), not run results)" if others else ""))
    if ns.count is None and not results:
        lines.append(f"{ns.step}: {found}")
    elif ns.count is not None and len(results) != ns.count:
        lines.append(f"{ns.step}: {found}, expected exactly {ns.count}")
    for path, result in results:
        problems = check_verdict(result, ns.verdict)
        if ns.skips:
            problems += check_skips(result)
        if ns.memory:
            problems += check_memory(result, ns.memory_tolerance)
        lines += [f"{ns.step}: {describe(path, result)}: {p}" for p in problems]
    verdicts = sorted({str((r.get("equivalence") or {}).get("verdict")) for _, r in results
                       if isinstance(r.get("equivalence"), dict)})
    checked = ["verdict"] + (["skips"] if ns.skips else []) + (["memory"] if ns.memory else [])
    summary = (f"{ns.step}: ok: {len(results)} result(s)" + (f", {', '.join(verdicts)}" if verdicts else "")
               + (f" ({', '.join(checked)} held)" if results else ", as expected"))
    return lines, summary


def main(argv: Sequence[str]) -> int:
    try:
        ns = parse_args(argv)
    except UsageError as exc:
        print(f"gpu_judge: {exc} (see python experiments/gpu_judge.py --help)", file=sys.stderr)
        return 2
    lines, summary = judge(ns)
    print("\n".join(lines) if lines else summary)
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
