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
  --power MAX      the verdict states its power and it resolves MAX: equivalence.min_detectable_rel <= MAX.
  --cause NAME     the first divergence names the cause NAME (a planted fault's twin: with --verdict different).
  --tf32-off       the checked steps ran with TF32 off on CUDA (equivalence.precision.tf32.checked_*_allow_tf32 false
                   and checked there, not "as set" as on a CPU).
  --compiled       torch.compile compiled something: the result's compile section counts at least one graph.
  --partial-coverage  --check-coverage auto planned a part of the model from the CUDA free memory
                   (equivalence.oracle_coverage: fraction < 1, planned from torch.cuda.mem_get_info).
  --saving         two results, with and without --activation-checkpointing: the one that recomputes has the
                   smaller metrics.peak_above_start_mib.
  --profiled       --profile's traces hold CUDA kernels and the step's ranges; MFU against both peaks (stated)
  --cost           the verification's cost is recorded: metrics.verify_ms_per_step, step_ms_p50 and
                   verify_above_start_mib, with the bytes per parameter, the ratio to the step and the time by part
                   of the checks (verify_ms_by_part, where recorded) in the line.
  --cells N        a `dpcompare checkpoint` step (DIR/<timestamp>/checkpoint.json, not run results): exactly N cells,
                   each one ran, its save and its load `equivalent`, and every part of the loaded state as saved.
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
    p.add_argument("--power", type=_fraction, default=None, metavar="MAX",
                   help="equivalence.min_detectable_rel at most MAX (e.g. 0.1)")
    p.add_argument("--cause", default=None, metavar="NAME", help="the first divergence's cause is NAME")
    p.add_argument("--tf32-off", action="store_true", help="the checked steps ran with TF32 off on CUDA")
    p.add_argument("--compiled", action="store_true", help="torch.compile compiled at least one graph")
    p.add_argument("--partial-coverage", action="store_true",
                   help="the oracle checked part of the model, planned from CUDA's free memory")
    p.add_argument("--saving", action="store_true",
                   help="activation checkpointing lowered the peak above the start (two results)")
    p.add_argument("--cost", action="store_true", help="the verification's cost is recorded (and stated)")
    p.add_argument("--profiled", action="store_true",
                   help="--profile's traces hold CUDA kernels and the step's ranges, and MFU is given against the "
                        "measured peak and the datasheet (stated)")
    p.add_argument("--cells", type=_count, default=None, metavar="N",
                   help="a checkpoint step: exactly N cells, each saved and loaded equivalent, the state as saved")
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
    if ns.saving and ns.count not in (None, 2):
        raise UsageError("--saving compares two results: drop --count or give --count 2")
    if ns.saving:
        ns.count = 2
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


def check_power(result: dict[str, Any], most: float) -> list[str]:
    """The verdict resolves a relative change of `most`: equivalence.min_detectable_rel <= most."""
    power = (result.get("equivalence") or {}).get("min_detectable_rel")
    if not isinstance(power, (int, float)):
        return [f"--power: equivalence.min_detectable_rel is {power!r}: the verdict states no power"]
    return [] if power <= most else [f"--power: catches a change of {power:.3g}, more than {most:g}"]


def check_cause(result: dict[str, Any], cause: str) -> list[str]:
    divergence = (result.get("equivalence") or {}).get("first_divergence")
    found = divergence.get("cause") if isinstance(divergence, dict) else None
    return [] if found == cause else [f"--cause: the first divergence's cause is {found!r}, expected {cause!r}"]


def check_tf32_off(result: dict[str, Any]) -> list[str]:
    precision = (result.get("equivalence") or {}).get("precision") or {}
    tf32 = precision.get("tf32") if isinstance(precision, dict) else None
    if not isinstance(tf32, dict):
        return ["--tf32-off: equivalence.precision.tf32 is missing"]
    problems = [f"--tf32-off: {k} is {tf32.get(k)!r} in the checked steps"
                for k in ("checked_matmul_allow_tf32", "checked_cudnn_allow_tf32") if tf32.get(k) is not False]
    if "CUDA setting" in str(tf32.get("checked_with")):
        problems.append(f"--tf32-off: the checked steps ran {tf32.get('checked_with')!r}: not on CUDA")
    return problems


def check_compiled(result: dict[str, Any]) -> list[str]:
    compiled = result.get("compile")
    graphs = compiled.get("graphs") if isinstance(compiled, dict) else None
    if not isinstance(graphs, int) or graphs < 1:
        return [f"--compiled: the compile section counts {graphs!r} graphs: nothing was compiled"]
    return []


def check_partial_coverage(result: dict[str, Any]) -> list[str]:
    coverage = (result.get("equivalence") or {}).get("oracle_coverage")
    if not isinstance(coverage, dict):
        return ["--partial-coverage: equivalence.oracle_coverage is null: the oracle checked the whole model"]
    problems = []
    if not 0 < float(coverage.get("fraction") or 0) < 1:
        problems.append(f"--partial-coverage: fraction {coverage.get('fraction')!r}, expected between 0 and 1")
    if "mem_get_info" not in str(coverage.get("reason")):
        problems.append(f"--partial-coverage: not planned from CUDA's free memory ({_clip(coverage.get('reason'))})")
    return problems


def cost_of(result: dict[str, Any]) -> tuple[list[str], str]:
    """(what is missing, 'verify X ms/step = Rx the step, B B/param')."""
    metrics = result.get("metrics") if isinstance(result.get("metrics"), dict) else {}
    params = (result.get("model_info") or {}).get("parameters")
    names = ("verify_ms_per_step", "step_ms_p50", "verify_above_start_mib")
    missing = [f"--cost: metrics.{n} is missing" for n in names if not isinstance(metrics.get(n), (int, float))]
    if not isinstance(params, int) or params <= 0:
        missing.append(f"--cost: model_info.parameters is {params!r}")
    if missing:
        return missing, ""
    verify, step, above = (float(metrics[n]) for n in names)
    parts = metrics.get("verify_ms_by_part") if isinstance(metrics.get("verify_ms_by_part"), dict) else {}
    by_part = ", ".join(f"{name} {ms:.0f}" for name, ms in sorted(parts.items(), key=lambda kv: -kv[1]) if ms >= 0.5)
    return [], (f"verify {verify:.0f} ms/step = {verify / step:.1f}x the step ({step:.1f} ms), "
                f"{above * 2**20 / params:.0f} B/param above the start ({params / 1e6:.0f} M parameters)"
                + (f"; by part (ms/step): {by_part}" if by_part else ""))


def check_saving(results: list[tuple[Path, dict[str, Any]]]) -> tuple[list[str], str]:
    """(shortfalls, 'peak above start X -> Y MiB') for a pair with and without activation checkpointing."""
    by = {bool(r.get("activation_checkpointing")): r for _, r in results}
    if set(by) != {True, False}:
        return ["--saving: expected one result with --activation-checkpointing and one without"], ""
    peaks = [((by[k].get("metrics") or {}).get("peak_above_start_mib")) for k in (False, True)]
    if not all(isinstance(p, (int, float)) for p in peaks):
        return [f"--saving: metrics.peak_above_start_mib is {peaks[0]!r} without, {peaks[1]!r} with"], ""
    said = f"peak above the start {peaks[0]:.0f} MiB without, {peaks[1]:.0f} MiB recomputing"
    return ([] if peaks[1] < peaks[0] else [f"--saving: no saving: {said}"]), said


def judge_cells(ns: argparse.Namespace) -> tuple[list[str], str]:
    """--cells: the cells of `dpcompare checkpoint`'s checkpoint.json file(s) in DIR's subdirectories."""
    cells: list[dict[str, Any]] = []
    lines: list[str] = []
    for path in sorted(ns.dir.glob("*/checkpoint.json")):
        try:
            cells += json.loads(path.read_text()).get("cells") or []
        except (OSError, ValueError, AttributeError) as exc:
            lines.append(f"{ns.step}: {path.name}: not a readable checkpoint record ({type(exc).__name__}: {exc})")
    if len(cells) != ns.cells:
        lines.append(f"{ns.step}: {len(cells)} cell(s) in {ns.dir}/*/checkpoint.json, expected exactly {ns.cells}")
    said = []
    for cell in cells:
        name = cell.get("cell")
        if cell.get("status") != "ran":
            lines.append(f"{ns.step}: {name}: {cell.get('status')}: {_clip(cell.get('refusal') or cell.get('error'))}")
            continue
        for side in ("save", "load"):
            run = cell.get(f"{side}_run") or {}
            if run.get("verdict") != "equivalent":
                lines.append(f"{ns.step}: {name}: the {side} run is {run.get('verdict')}, expected equivalent"
                             + (f" ({run.get('cause')}: {_clip(run.get('first_divergence'))})" if run.get("cause") else ""))
        loaded = (((cell.get("load_run") or {}).get("checkpoint") or {}).get("loaded") or {}).get("parts")
        if not isinstance(loaded, dict) or not loaded:
            lines.append(f"{ns.step}: {name}: the load run recorded no loaded state (equivalence.checkpoint)")
        else:
            differ = [f"{k} ({_clip(v)})" for k, v in loaded.items() if str(v).startswith("differs")]
            if differ:
                lines.append(f"{ns.step}: {name}: loaded other than saved: {', '.join(differ)}")
        said.append(f"{name} {cell.get('wall_s', 0):.0f} s")
    return lines, f"{ns.step}: ok: {len(cells)} cell(s) saved and loaded equivalent, the state as saved: {', '.join(said)}"


def profiled_of(result: dict[str, Any]) -> tuple[list[str], str]:
    """(what is missing, 'N kernels in the trace, exposed comm X ms, MFU m (datasheet d)') for a --profile run."""
    metrics = result.get("metrics") if isinstance(result.get("metrics"), dict) else {}
    profile = metrics.get("profile") if isinstance(metrics.get("profile"), dict) else {}
    missing, kernels = [], 0
    for trace in profile.get("traces") or [None]:
        try:
            events = json.loads(Path(str(trace)).read_text()).get("traceEvents", [])
        except (OSError, ValueError, TypeError):
            missing.append(f"--profiled: trace {trace!r} cannot be read")
            continue
        kernels += sum(1 for e in events if e.get("cat") == "kernel")
        if not any(str(e.get("name", "")).startswith("dpcompare.step ") for e in events):
            missing.append(f"--profiled: {trace} holds no dpcompare.step range")
    if not kernels:
        missing.append("--profiled: the traces hold no CUDA kernel")
    for name in ("comm_exposed_trace_ms", "mfu", "mfu_datasheet"):
        if not isinstance(metrics.get(name), (int, float)):
            missing.append(f"--profiled: metrics.{name} is {metrics.get(name)!r} "
                           f"({_clip((metrics.get('reasons') or {}).get(name))})")
    if missing:
        return missing, ""
    return [], (f"{kernels} kernels traced, exposed comm {metrics['comm_exposed_trace_ms']:.2f} ms (trace) / "
                f"{metrics.get('comm_exposed_ms')} (ablation), MFU {metrics['mfu']:.1%} of the measured peak "
                f"{metrics.get('peak_tflops_measured')} TFLOP/s, {metrics['mfu_datasheet']:.1%} of the datasheet's "
                f"{metrics.get('peak_tflops_datasheet')} ({metrics.get('compute_dtype')}); link {metrics.get('comm_link')}")


def judge(ns: argparse.Namespace) -> tuple[list[str], str]:
    """(every shortfall as a printed line, the one-line summary when there is none)."""
    if ns.cells is not None:
        return judge_cells(ns)
    results, unreadable, others = load_results(ns.dir)
    lines = [f"{ns.step}: {u}" for u in unreadable]
    found = f"{len(results)} result(s) in {ns.dir}" if results else (
        f"no result file found in {ns.dir}" + (f" ({others} other JSON file(s), not run results)" if others else ""))
    if ns.count is None and not results:
        lines.append(f"{ns.step}: {found}")
    elif ns.count is not None and len(results) != ns.count:
        lines.append(f"{ns.step}: {found}, expected exactly {ns.count}")
    figures: list[str] = []
    powers: list[Any] = []
    for path, result in results:
        problems = check_verdict(result, ns.verdict)
        if ns.skips:
            problems += check_skips(result)
        if ns.memory:
            problems += check_memory(result, ns.memory_tolerance)
        if ns.power is not None:
            problems += check_power(result, ns.power)
        if ns.cause:
            problems += check_cause(result, ns.cause)
        if ns.tf32_off:
            problems += check_tf32_off(result)
        if ns.compiled:
            problems += check_compiled(result)
        if ns.partial_coverage:
            problems += check_partial_coverage(result)
        if ns.cost:
            missing, said = cost_of(result)
            problems += missing
            figures.append(said)
        if ns.profiled:
            missing, said = profiled_of(result)
            problems += missing
            figures.append(said)
        powers.append((result.get("equivalence") or {}).get("min_detectable_rel"))
        lines += [f"{ns.step}: {describe(path, result)}: {p}" for p in problems]
    if ns.saving and len(results) == 2:
        missing, said = check_saving(results)
        lines += [f"{ns.step}: {m}" for m in missing]
        figures.append(said)
    verdicts = sorted({str((r.get("equivalence") or {}).get("verdict")) for _, r in results
                       if isinstance(r.get("equivalence"), dict)})
    flags = ("skips", "memory", "power", "cause", "tf32_off", "compiled", "partial_coverage", "saving", "cost",
             "profiled")
    checked = ["verdict"] + [f.replace("_", "-") for f in flags if getattr(ns, f) not in (None, False)]
    said = [f for f in figures if f]
    if ns.power is not None:
        said.append("catches " + ", ".join(f"{p:.3g}" for p in powers if isinstance(p, (int, float))))
    summary = (f"{ns.step}: ok: {len(results)} result(s)" + (f", {', '.join(verdicts)}" if verdicts else "")
               + (f" ({', '.join(checked)} held)" if results else ", as expected")
               + (f"; {'; '.join(said)}" if said else ""))
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
