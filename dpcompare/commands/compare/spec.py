"""compare's invocation, parsed once into a frozen CompareSpec: a --suite preset's values filled in for the flags the
command line did not give, --backends read into entries, the lists split, --run-arg read as run flags, and a template
RunConfig holding every run flag compare forwards (dpcompare.run.flags: those declared `compare=Forwarded(...)`) with
the batch compare runs, which every job starts from (`CompareSpec.job_run`). Nothing is changed after it is built.

Owns: reading compare's namespace, the global batch compare picks (the default-global-batch rule at
COMPARE_GLOBAL_BATCH_TARGET), and the refusals that need nothing run. Imports no backend runtime.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from typing import Any, Mapping

from dpcompare.commands.compare import suites
from dpcompare.commands.compare.entries import Entry, comma_separated, parse_backends
from dpcompare.run import flags
from dpcompare.run.config import COMPARE_GLOBAL_BATCH_TARGET, RunConfig, default_global_batch

QUESTIONS_OWN = ("backends", "world_sizes", "model", "global_batch", "scaling", "optimizer", "clip_grad_norm", "amp",
                 "activation_checkpointing", "compile", "sweep")
"""compare's flags that each question of --suite questions sets for itself (or sets apart from its control run)."""
SET_PER_JOB = ("backend", "out", "dump_grads", "tag", "closed_if")
"""Run flags compare sets for each job itself (how it finds and fences each run's files): not a --run-arg."""


@dataclass(frozen=True, slots=True)
class Sweep:
    """--sweep: the values of each knob, varied one at a time at the largest world size."""

    bucket_mb: tuple[float, ...]
    accum: tuple[int, ...]
    compression: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class CompareSpec:
    run: RunConfig
    """The template every job starts from: the run flags compare forwards (a preset's values in), at compare's
    global batch (under weak scaling, the per-rank batch it makes at the largest world size)."""
    suite: str | None
    backends: str
    """--backends as given (or as the preset names them)."""
    entries: tuple[Entry, ...]
    missing: tuple[Mapping[str, str], ...]
    """{'backend', 'reason', 'launcher'} for each backend a preset names that this dpcompare does not register."""
    world_sizes: tuple[int, ...]
    global_batch: int | None
    """compare's global batch: given, or picked (picked_global_batch); None under --suite questions, whose questions
    each set their own."""
    picked_global_batch: bool
    collectives: str
    sweep: Sweep | None
    report: bool
    out: str
    timeout_s: float
    run_args: tuple[str, ...]
    run_arg_values: tuple[tuple[str, Any], ...]
    """What --run-arg says, as run flags by field (only those it gives); applied after every other setting of a
    job."""
    both_normalisations: bool = False
    """--both-normalisations: every cell also runs with --loss-normalisation global (the baseline's is local)."""

    @property
    def questions(self) -> bool:
        """The runs are the rows of --suite questions."""
        return suites.poses_questions(self.suite)

    def job_run(self, entry: Entry, changes: Mapping[str, Any] | None = None) -> RunConfig:
        """A job's run: the template, its entry's backend and variant options, the job's own `changes` (a sweep knob,
        a question's flags), then --run-arg's, each later one winning."""
        changes, given = dict(changes or {}), dict(self.run_arg_values)
        options = {**dict(entry.options), **changes.pop("options", {}), **given.pop("options", {})}
        return replace(self.run, **{**changes, **given, "backend": entry.backend, "options": options})


def compare_global_batch(world_sizes: tuple[int, ...], sweep: Sweep | None) -> int:
    """The global batch compare runs without --global-batch: the default-global-batch rule over every world size
    (and, under --sweep, the largest world size x each accumulation), at COMPARE_GLOBAL_BATCH_TARGET: 2048 at world
    sizes 1, 2, 4, 8; 2052 at 1, 6."""
    accums = sweep.accum if sweep else ()
    return default_global_batch(*world_sizes, *(max(world_sizes) * k for k in accums),
                                target=COMPARE_GLOBAL_BATCH_TARGET)


def parse(ns: argparse.Namespace) -> CompareSpec:
    """The spec of compare's parsed command line, or ValueError naming the flag and the fix (the run's own message
    for a run flag the run would refuse)."""
    given = suites.given(ns)
    read = {**vars(ns), **suites.preset(ns.suite, given)}
    if suites.poses_questions(ns.suite):
        _refuse_questions_own(given)
    entries, missing = parse_backends(read["backends"], lenient=suites.lists_backends(ns.suite, given))
    world_sizes = tuple(sorted(set(comma_separated(read["world_sizes"], "--world-sizes", int))))
    if not world_sizes or min(world_sizes) < 1:
        raise ValueError(f"--world-sizes={read['world_sizes']!r} is invalid: use positive whole numbers, e.g. 1,2")
    run_arg_values = _run_arg_values(read["run_arg"], entries)
    sweep = Sweep(tuple(comma_separated(read["sweep_bucket_mb"], "--sweep-bucket-mb", float)),
                  tuple(comma_separated(read["sweep_accum"], "--sweep-accum", int)),
                  tuple(comma_separated(read["sweep_compression"], "--sweep-compression"))) if read["sweep"] else None
    global_batch = read["global_batch"]
    picked = global_batch is None and not suites.poses_questions(ns.suite)
    if picked:
        global_batch = compare_global_batch(world_sizes, sweep)
    template = _template({name: read[name] for name in flags.forwarded(RunConfig)}, global_batch, world_sizes)
    template.validate()
    return CompareSpec(run=template, suite=ns.suite, backends=read["backends"], entries=tuple(entries),
                       missing=tuple(missing), world_sizes=world_sizes, global_batch=global_batch,
                       picked_global_batch=picked, collectives=read["collectives"], sweep=sweep,
                       both_normalisations=bool(read.get("both_normalisations")),
                       report=read["report"], out=read["out"], timeout_s=read["timeout_s"],
                       run_args=tuple(read["run_arg"]), run_arg_values=tuple(run_arg_values.items()))


def _template(forwarded: dict[str, Any], global_batch: int | None, world_sizes: tuple[int, ...]) -> RunConfig:
    """The run flags every job shares, as the run itself will read them. Weak scaling fixes the per-rank batch at
    the global batch over the largest world size."""
    if forwarded["scaling"] == "weak" and global_batch is not None:
        return RunConfig(**{**forwarded, "global_batch": None}, local_batch=max(global_batch // max(world_sizes), 1))
    return RunConfig(**{**forwarded, "global_batch": global_batch})


def _refuse_questions_own(given: frozenset[str]) -> None:
    clashing = sorted(flags.dashed(dest) for dest in QUESTIONS_OWN if dest in given)
    if clashing:
        raise ValueError(f"{', '.join(clashing)} cannot be given with --suite questions: each question runs the "
                         "backends, world sizes and workload that pose it; drop the flag (or run compare without the "
                         "suite)")


def _run_arg_values(run_args: list[str], entries: list[Entry]) -> dict[str, Any]:
    """The run flags --run-arg gives (read by the run's own flags), refusing one compare sets per job, one the run
    does not take, and an --opt that would quietly undo what a variant entry sets (the run would not be what it is
    named)."""
    try:
        values = flags.parse(RunConfig, run_args, defaults=False)
    except ValueError as exc:
        raise ValueError(f"--run-arg {' '.join(run_args)!r}: {exc} (the run's flags: python -m dpcompare run "
                         "--help)") from None
    for name in SET_PER_JOB:
        if name in values:
            raise ValueError(f"--run-arg {flags.dashed(name)}: compare sets it for each run itself; drop it")
    for entry in entries:
        for key, value in entry.options:
            given = values.get("options", {}).get(key)
            if given is not None and given != flags.option_text(value):
                raise ValueError(f"--run-arg --opt {key}={given} contradicts --backends {entry.name}, which "
                                 f"runs {key}={flags.option_text(value)}: drop one of them")
    return values
