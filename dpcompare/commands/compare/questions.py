"""`compare --suite questions`: the questions users keep asking in the backends' trackers, each answered by runs judged
against the float64 oracle, with the figure that settles it.

Owns: the questions (what is asked, the threads that ask it, the workload, and its rows: a backend or variant, a world
size and the run flags that pose it; a row marked `control` is the same run without the feature, there for the cost
it is set against), the jobs they plan, and each row's answer read back from its result: the verdict, its first
divergence, and the question's own figure (the norm clipped by, the communication by kind, the compile time, the peak
memory). A question whose flag this dpcompare does not have is left out, listed with why.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

from dpcompare import verdict_words as words
from dpcompare.commands.compare import plan as planning
from dpcompare.commands.compare.entries import declared_launcher, parse_backends
from dpcompare.commands.compare.spec import CompareSpec
from dpcompare.result_view import Equivalence, Field, Metrics, RunResult
from dpcompare.run import flags, registry
from dpcompare.run.config import RunConfig

Figure = Callable[[RunResult, RunResult | None], str]
"""(a row's result, its question's control run of the same backend at the same world size, or None) -> the row's
figure."""


@dataclass(frozen=True, slots=True)
class Row:
    entry: str
    """The --backends entry: a backend (`ddp`) or one of its declared variants (`fsdp:hsdp`)."""
    world_size: int
    args: tuple[str, ...] = ()
    """The run flags that pose the question (e.g. --clip-grad-norm 0.05), after the question's shared ones."""
    control: bool = False
    """The same run without the feature: the cost the feature's rows are set against."""

    @property
    def knob(self) -> str:
        """What the row adds to the question's flags ('control' for the run without the feature)."""
        return "control" if self.control else " ".join(self.args)


@dataclass(frozen=True, slots=True)
class Question:
    name: str
    asks: str
    threads: tuple[str, ...]
    """The public issue and pull-request threads that ask it (owner/repo#N)."""
    run_flags: tuple[str, ...]
    """The workload and settings every row of the question runs with (model, global batch, optimizer)."""
    rows: tuple[Row, ...]
    figure: Figure
    """The question's own figure, read from one row's result (and the control's, where the question has one for the
    row's backend and world size): a short text."""
    needs_flag: str | None = None
    """A run flag the question poses (e.g. --compile): the question is left out where the run does not have it."""
    figures: tuple[str, ...] = field(default=())
    """Result paths (dotted) the figure reads, kept in compare.json beside the text."""


def _num(x: Any, spec: str = ".3g") -> str:
    return "-" if x is None else format(x, spec)


def clipping_figure(result: RunResult, control: RunResult | None = None) -> str:
    """The clip, the steps where it took effect, and the backend's reported norm against the oracle's."""
    g = result.equivalence.grad_norm
    if g.status in (None, "off"):
        return "no clipping"
    steps = g.clipped_steps
    norms = [s["grad_norm"] for s in result.equivalence.per_step if s.get("grad_norm")]
    first = norms[0] if norms else {}
    took = f"took effect at steps {', '.join(map(str, steps))}" if steps else "never took effect"
    return (f"clip {_num(g.clip.value)} {took}; norm reported {_num(first.get('reported'))} vs the oracle's "
            f"{_num(first.get('oracle'))} (worst rel err {_num(g.max_rel_err.value, words.REL_ERR)}, "
            f"{_num(g.noise_ratio.value, words.X_FLOOR)}x its floor)")


def comm_figure(result: RunResult, control: RunResult | None = None) -> str:
    """Communication per step by kind: measured bytes, against the prediction, and the ranks each kind spans."""
    kinds = result.metrics.comm_by_kind.value or {}
    if not kinds:
        return "no communication measured"
    parts = []
    for kind, row in kinds.items():
        measured, predicted = row.get("bytes_per_step"), row.get("analytic_bytes_per_step")
        ranks = row.get("group_ranks")
        parts.append(f"{kind} {_num(measured, '.0f')} B (predicted {_num(predicted, '.0f')})"
                     + (f" over {ranks} ranks" if ranks else ""))
    state = result.metrics.state_total()
    return "; ".join(parts) + (f"; model state {_num(state)} MiB/rank" if state is not None else "")


def activation_checkpointing_figure(result: RunResult, control: RunResult | None = None) -> str:
    """The blocks recomputed in backward, then peak memory and step time against the run without it."""
    blocks = (result.activation_checkpointing or {}).get("blocks")
    return (f"{blocks} block(s) recomputed; " if blocks else "") + peak_figure(result, control)


def compile_figure(result: RunResult, control: RunResult | None = None) -> str:
    """What torch.compile did (its time apart from the steps, graphs, breaks, recompilations, steps left out), then
    the step time against the run without it."""
    c = result.compile
    if not c:
        return _step_against(result, control)
    pieces = c.get("compiled_graphs")
    graphs = f"{_num(c.get('graphs'))} graph(s)" + (f" ({pieces} compiled piece(s))" if pieces not in (None, c.get("graphs"))
                                                   else "")
    left_out = c.get("measured_steps_excluded")
    return (f"compile {_num(c.get('compile_s'))} s apart from the steps, {graphs}, {c.get('graph_breaks')} graph "
            f"break(s), {_num(c.get('recompiles'))} recompilation(s)"
            + (f", {left_out} measured step(s) left out for compiling" if left_out else "") + "; "
            + _step_against(result, control))


def _step_against(result: RunResult, control: RunResult | None) -> str:
    return _against(result, control, Metrics.step_ms_p50, "ms", "step p50")


def _against(result: RunResult, control: RunResult | None, field: Field, unit: str, what: str) -> str:
    value = result.metrics.figure(field).value
    base = control.metrics.figure(field).value if control is not None and control is not result else None
    vs = f" ({value / base - 1:+.0%} against {_num(base)} without)" if value is not None and base else ""
    return f"{what} {_num(value)} {unit}{vs}"


def peak_figure(result: RunResult, control: RunResult | None = None) -> str:
    """Peak memory per rank and step time, each set against the control's (the same run without the feature)."""
    return ", ".join((_against(result, control, Metrics.peak_mem_mib, "MiB/rank", "peak"),
                      _step_against(result, control)))


QUESTIONS: tuple[Question, ...] = (
    Question(
        name="clipping",
        asks="Is the update clipped by the global norm under every backend, and is the norm it reports the global one?",
        threads=("deepspeedai/DeepSpeed#7220", "deepspeedai/DeepSpeed#5188"),
        run_flags=("--model", "mlp", "--global-batch", "24", "--optimizer", "sgd"),
        rows=(Row("reference", 1, ("--clip-grad-norm", "0.05")), Row("ddp", 2, ("--clip-grad-norm", "0.05")),
              Row("fsdp", 2, ("--clip-grad-norm", "0.05")),
              Row("deepspeed:zero2", 2, ("--clip-grad-norm", "0.05")),
              Row("horovod", 2, ("--clip-grad-norm", "0.05"))),
        figure=clipping_figure, needs_flag="--clip-grad-norm",
        figures=("equivalence.checks.grad_norm",),
    ),
    Question(
        name="hsdp",
        asks="Does HSDP (replicate across groups, shard within) train as plain FSDP does, and what does it send?",
        threads=("pytorch/pytorch#140183", "pytorch/torchtitan#813", "NVIDIA/Megatron-LM#4891"),
        run_flags=("--model", "mlp", "--global-batch", "24", "--optimizer", "sgd"),
        rows=(Row("fsdp:hsdp", 4), Row("fsdp", 4, control=True)),
        figure=comm_figure,
        figures=(Metrics.comm_by_kind.path, Metrics.model_state_mib.path + ".total"),
    ),
    Question(
        name="activation_checkpointing",
        asks="With dropout on, does activation checkpointing recompute each block with the masks its forward drew, "
             "and what does it save and cost?",
        threads=("allenai/OLMo-core#828",),
        run_flags=("--model", "gpt-tiny", "--global-batch", "24", "--optimizer", "sgd"),
        rows=(Row("reference", 1, ("--activation-checkpointing",)),
              Row("ddp", 2, ("--activation-checkpointing",)), Row("ddp", 2, control=True),
              Row("fsdp", 2, ("--activation-checkpointing",)), Row("fsdp", 2, control=True)),
        figure=activation_checkpointing_figure, needs_flag="--activation-checkpointing",
        figures=("activation_checkpointing", Metrics.peak_mem_mib.path, Metrics.peak_above_start_mib.path,
                 Metrics.step_ms_p50.path),
    ),
    Question(
        name="compile",
        asks="Does torch.compile under data parallelism keep the gradients synchronised and BatchNorm's numerics, "
             "and what does compiling cost?",
        threads=("pytorch/pytorch#109774", "pytorch/pytorch#187444"),
        run_flags=("--model", "cnn", "--global-batch", "24", "--optimizer", "sgd"),
        rows=(Row("reference", 1, ("--compile",)), Row("ddp", 2, ("--compile",)), Row("ddp", 2, control=True)),
        figure=compile_figure, needs_flag="--compile",
        figures=("compile", Equivalence.noise_ratio.path, Metrics.step_ms_p50.path),
    ),
)


def by_name() -> dict[str, Question]:
    return {q.name: q for q in QUESTIONS}


def _has_flag(flag: str) -> bool:
    """The run takes `flag` (a RunConfig field of that name)."""
    return flag.removeprefix("--").replace("-", "_") in {f.name for f in fields(RunConfig)}


def plan(spec: CompareSpec, run_dir: Path) -> planning.Plan:
    """A job for each row of each question this dpcompare can pose, each run as its users type it under the launcher
    its adapter declares: the spec's template with the question's flags, then the row's, then --run-arg's. A question
    whose flag the run lacks, and a row whose backend is not installed, are listed as unavailable with why. Refuses
    (ValueError) a question's setting the run would refuse, before anything starts."""
    result = planning.Plan()
    stems: set[str] = set()
    files = {"out": str(run_dir / "runs"), "collectives": planning.collectives_path(spec, run_dir)}
    for q in QUESTIONS:
        if q.needs_flag and not _has_flag(q.needs_flag):
            result.unavailable.append({"backend": f"question {q.name}", "launcher": "-",
                                       "reason": f"this dpcompare's run has no {q.needs_flag}"})
            continue
        for row in q.rows:
            entries, missing = parse_backends(row.entry, lenient=True)
            if missing:
                result.unavailable += [u for u in missing if u not in result.unavailable]
                continue
            (entry,) = entries
            ok, reason = registry.availability(entry.backend)
            if not ok:
                if all(u["backend"] != entry.backend for u in result.unavailable):
                    result.unavailable.append({"backend": entry.backend, "reason": reason,
                                               "launcher": declared_launcher(entry.backend)})
                continue
            label = f"{q.name}: {entry.name}/{row.world_size}" + (f" {row.knob}" if row.knob else "")
            _, shared = planning.shared_gpu(entry, row.world_size, spec.job_run(entry))
            if shared:
                result.unavailable.append({"backend": f"question {q.name}: {entry.name}/{row.world_size}",
                                           "reason": shared, "launcher": declared_launcher(entry.backend)})
                continue
            changes = {**files, **_said(q.run_flags), **_said(row.args)}
            run = spec.job_run(entry, planning.with_shared_gpu(entry, row.world_size, spec.job_run(entry), changes))
            run.validate()
            result.jobs.append(planning.make_job(entry, row.world_size, label, row.knob, run_dir, stems, run,
                                                 question=q.name))
    return result


def _said(words: tuple[str, ...]) -> dict[str, Any]:
    """The run flags a question or a row gives, by field."""
    return flags.parse(RunConfig, words, defaults=False)


def answers(jobs: list[planning.Job]) -> list[dict[str, Any]]:
    """compare.json's `questions`: each question posed, with each row's verdict, first divergence and figure."""
    out = []
    for q in QUESTIONS:
        rows = [j for j in jobs if j.question == q.name]
        if not rows:
            continue
        out.append({"name": q.name, "asks": q.asks, "threads": list(q.threads), "run_flags": list(q.run_flags),
                    "rows": [_answer(q, j, _control(rows, j)) for j in rows]})
    return out


def _control(rows: list[planning.Job], job: planning.Job) -> planning.Job | None:
    """The question's control run of the job's backend (or variant) at its world size, or None."""
    return next((j for j in rows if j.knob == "control" and (j.entry, j.world_size) == (job.entry, job.world_size)),
                None)


def _answer(q: Question, job: planning.Job, control: planning.Job | None) -> dict[str, Any]:
    result = job.result
    d = result.equivalence.first_divergence if result is not None else None
    return {"label": job.label, "entry": job.entry, "world_size": job.world_size, "knob": job.knob,
            "control": job.knob == "control", "status": job.status, "error": job.error,
            "first_divergence": words.divergence(d) if d is not None else None,
            "figure": q.figure(result, control.result if control is not None else None) if result else None,
            "figures": {path: result.at(path) for path in q.figures} if result else {},
            "result_path": None if job.result_path is None else str(job.result_path)}
