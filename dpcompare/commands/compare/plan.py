"""What `compare` will run: one job per available backend (or named variant of one: `deepspeed:zero2`) and world
size, each as the command its users type under the launcher its adapter declares, plus the --sweep jobs (one knob
at a time), under --amp a job for each other precision recipe a backend declares (deepspeed's engine), and the
bench-collectives JSON the runs quote busbw from. A --suite preset fills the flags not given on the command line.
Refuses bad flags before anything starts, with the run's own messages for the run's own flags.

An entry of --backends is a registered backend (`ddp`), a registered backend and one of the variants its adapter
declares (`deepspeed:zero2`, its `VARIANTS`: run with their `--opt` values), or a user's adapter class
(`package.module:Class`, optionally `package.module:Class:variant`). The rule that keeps the two apart: a `:`
names a variant only after a registered backend name, or after a full `package.module:Class`.
"""

from __future__ import annotations

import argparse
import functools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from dpcompare.commands.compare import suites
from dpcompare.contract import Adapter, Capabilities
from dpcompare.result_view import RunResult
from dpcompare.run import registry
from dpcompare.run.config import RunConfig, smallest_multiple
from dpcompare.run.launchers import native_command


@functools.cache
def adapter_class(backend: str) -> type[Adapter]:
    """The backend's adapter class (importing it imports torch, never the backend's runtime)."""
    return registry.load(backend, registry.BACKENDS, "backend")


def capabilities(backend: str) -> Capabilities:
    """What the backend's adapter declares."""
    return adapter_class(backend).capabilities


def declared_launcher(backend: str) -> str:
    """The launcher the backend's adapter declares, or '-' when its adapter cannot be loaded (not registered)."""
    try:
        return capabilities(backend).native_launcher
    except (ValueError, ImportError):
        return "-"


@functools.cache
def amp_recipe_choices(backend: str) -> tuple[str, ...]:
    """The precision recipes besides its default that a backend declares (its `amp_recipe` option), or ()."""
    cls = registry.load(backend, registry.BACKENDS, "backend")
    option = next((o for o in cls.OPTIONS if o.name == "amp_recipe"), None)
    return tuple(c for c in option.choices if c != option.default) if option is not None else ()


@dataclass(slots=True)
class Job:
    backend: str
    world_size: int
    command: list[str]
    label: str
    dump: Path
    log: Path
    knob: str = "baseline"
    """What the job changes from its entry's run: 'baseline', 'knob=value' for a --sweep run (or another precision
    recipe under --amp), a question's flags or 'control'."""
    status: str = "pending"
    result: RunResult | None = None
    wall_s: float | None = None
    error: str | None = None
    result_path: Path | None = None
    backend_variant: str = ""
    """The named variant of the backend this job runs (`zero2` of `deepspeed:zero2`), '' for the backend itself."""
    options: dict[str, Any] = field(default_factory=dict)
    """The `--opt` values of that variant, typed as its adapter declares them."""
    question: str = ""
    """The question of `compare --suite questions` this job is a row of ('' for any other job)."""

    @property
    def entry(self) -> str:
        """The job's --backends entry: `deepspeed:zero2`, or the backend's name."""
        return f"{self.backend}:{self.backend_variant}" if self.backend_variant else self.backend

    @property
    def launcher(self) -> str:
        return capabilities(self.backend).native_launcher

    @property
    def fence(self) -> Path:
        """Created once compare stops waiting for this job; the run writes nothing once it exists (--closed-if)."""
        return self.log.with_suffix(".closed")


@dataclass(slots=True)
class Plan:
    jobs: list[Job] = field(default_factory=list)
    unavailable: list[dict[str, str]] = field(default_factory=list)
    """{'backend', 'reason', 'launcher'} for each backend asked for that is not installed (once for all its
    variants), or that a --suite preset names and this dpcompare does not register."""
    sweep_skipped: list[dict[str, str]] = field(default_factory=list)
    """{'backend' (the --backends entry), 'knob', 'reason'} for each sweep combination or --amp recipe the backend
    does not have."""


@dataclass(frozen=True, slots=True)
class Entry:
    """One item of --backends: a backend, and the named variant of it its adapter declares (VARIANTS), if any."""

    backend: str
    variant: str = ""
    options: tuple[tuple[str, Any], ...] = ()
    """The variant's `--opt` values, typed, in the order the adapter declares them."""

    @property
    def name(self) -> str:
        return f"{self.backend}:{self.variant}" if self.variant else self.backend

    def opt_args(self) -> list[str]:
        """The variant's options as the user would type them: --opt zero_stage=2 ..."""
        return [arg for key, value in self.options for arg in ("--opt", f"{key}={opt_text(value)}")]


def opt_text(value: Any) -> str:
    """An option value as `--opt KEY=VALUE` takes it (true/false for a bool)."""
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def split_entry(item: str) -> tuple[str, str | None]:
    """(backend, variant name or None) of one --backends item. A `:` after a registered backend's name names a
    variant (`deepspeed:zero2`); `package.module:Class` is a user's adapter, and a third part after it a variant
    (`mypkg.adapters:Mine:fast`); `deepspeed:` names an empty variant, refused by resolve_entry."""
    head, sep, rest = item.partition(":")
    if sep and head in registry.BACKENDS:
        return head, rest
    if item.count(":") >= 2:
        backend, _, variant = item.rpartition(":")
        return backend, variant
    return item, None


def backend_variants(backend: str) -> dict[str, dict[str, Any]]:
    """The named variants the backend's adapter declares (its VARIANTS), importing no backend runtime."""
    cls = registry.load(backend, registry.BACKENDS, "backend")
    return {str(name): dict(options) for name, options in (getattr(cls, "VARIANTS", None) or {}).items()}


def resolve_entry(item: str, backend: str, variant: str) -> Entry:
    """The entry of `backend:variant`, its options typed and checked against what the adapter declares, or a
    ValueError naming the variants the backend has."""
    declared = backend_variants(backend)
    if variant not in declared:
        have = (f"choose one of {', '.join(f'{backend}:{v}' for v in declared)}" if declared
                else f"{backend} declares no variants (its adapter's VARIANTS is empty)")
        shown = "an empty variant" if not variant else f"no variant {variant!r}"
        raise ValueError(f"--backends {item!r}: {backend} has {shown}; {have}")
    options = {o.name: o for o in registry.load(backend, registry.BACKENDS, "backend").OPTIONS}
    typed = []
    for key, value in declared[variant].items():
        if key not in options:
            raise ValueError(f"--backends {item!r}: the variant sets {key}, an option {backend} does not declare "
                             f"(it declares {', '.join(options) or 'none'})")
        typed.append((key, options[key].parse(value)))
    order = list(options)
    return Entry(backend, variant, tuple(sorted(typed, key=lambda kv: order.index(kv[0]))))


def parse_backends(text: str, *, lenient: bool = False) -> tuple[list[Entry], list[dict[str, str]]]:
    """The entries of --backends, in order, and {'backend', 'reason', 'launcher'} for each left out. An unknown
    name (no `:`, not registered) is refused, listing the registered ones; `lenient` (a --suite preset's own
    list) leaves it out as unavailable instead, so a preset runs on a dpcompare without that backend."""
    entries: list[Entry] = []
    unknown: list[str] = []
    missing: list[dict[str, str]] = []
    for item in comma_separated(text, "--backends"):
        backend, variant = split_entry(item)
        if ":" not in backend and backend not in registry.BACKENDS:
            if lenient:
                missing.append({"backend": backend, "launcher": "-", "reason": (
                    f"not a registered backend of this dpcompare (it has {', '.join(registry.BACKENDS)})")})
            else:
                unknown.append(item)
            continue
        entry = Entry(backend) if variant is None else resolve_entry(item, backend, variant)
        if entry in entries:
            raise ValueError(f"--backends: {item} is given twice; name each backend or variant once")
        entries.append(entry)
    if unknown:
        raise ValueError(f"--backends: unknown {', '.join(unknown)}; choose from {', '.join(registry.BACKENDS)} "
                         "(BACKEND:VARIANT for a variant its adapter declares, or package.module:Class)")
    return entries, missing


def _run_arg_options(run_args: list[str]) -> dict[str, str]:
    """The `--opt KEY=VALUE` values among the --run-arg words (--opt=K=V, or --opt then K=V)."""
    found: dict[str, str] = {}
    for i, word in enumerate(run_args):
        if word == "--opt" and i + 1 < len(run_args):
            item = run_args[i + 1]
        elif word.startswith("--opt="):
            item = word[len("--opt="):]
        else:
            continue
        key, sep, value = item.partition("=")
        if sep:
            found[key] = value
    return found


def _check_run_args(entries: list[Entry], run_args: list[str]) -> None:
    """A --run-arg --opt must not quietly undo what a variant entry sets (the run would not be what it is named)."""
    given = _run_arg_options(run_args)
    for entry in entries:
        for key, value in entry.options:
            if key in given and given[key] != opt_text(value):
                raise ValueError(f"--run-arg --opt {key}={given[key]} contradicts --backends {entry.name}, which "
                                 f"runs {key}={opt_text(value)}: drop one of them")


def comma_separated(text: str, option: str, kind: Callable = str) -> list:
    try:
        return [kind(v.strip()) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{option}={text!r} is invalid: use a comma-separated list") from None


def plan(ns: argparse.Namespace, run_dir: Path) -> Plan:
    """Every job of this invocation, or ValueError naming the flag and the fix. A --suite preset fills the flags
    the command line did not give first (suites.apply)."""
    suites.apply(ns)
    entries, missing = parse_backends(ns.backends, lenient=suites.lists_backends(ns))
    world_sizes = sorted(set(comma_separated(ns.world_sizes, "--world-sizes", int)))
    if not world_sizes or min(world_sizes) < 1:
        raise ValueError(f"--world-sizes={ns.world_sizes!r} is invalid: use positive whole numbers, e.g. 1,2")
    run_args = list(ns.run_arg)
    _check_run_args(entries, run_args)
    config = run_config(ns, world_sizes)
    config.validate()
    result = Plan(unavailable=missing)
    baseline: list[tuple[Entry, int]] = []
    available: list[Entry] = []
    for entry in entries:
        ok, reason = registry.availability(entry.backend)
        if ok and config.compile and not capabilities(entry.backend).compiles:
            ok, reason = False, f"--compile: {entry.backend} declares no compiled path ({capabilities(entry.backend).compile_refusal or 'Capabilities.compiles'})"
        if ok:
            available.append(entry)
            for ws in (world_sizes if capabilities(entry.backend).multi_process else [1]):
                refusal = adapter_class(entry.backend).world_size_refusal(ws, dict(entry.options))
                if refusal is None:
                    baseline.append((entry, ws))
                else:  # e.g. fsdp:hsdp (2 replica groups) at world size 1: said, not run
                    result.unavailable.append({"backend": f"{entry.name}/{ws}", "reason": refusal,
                                               "launcher": declared_launcher(entry.backend)})
        elif all(u["backend"] != entry.backend for u in result.unavailable):  # once for all its variants
            result.unavailable.append({"backend": entry.backend, "reason": reason,
                                       "launcher": declared_launcher(entry.backend)})
    for ws in sorted({ws for _, ws in baseline}):
        config.batch_sizes(ws)
    common = _common_args(ns, run_dir, config)
    stems: set[str] = set()

    def add(entry: Entry, ws: int, knob: str, extra: list[str]) -> None:
        label = f"{entry.name}/{ws}" + ("" if knob == "baseline" else f" {knob}")
        result.jobs.append(make_job(entry, ws, label, knob, run_dir, stems, [*common, *entry.opt_args()],
                                    [*extra, *run_args]))

    for entry, ws in baseline:
        add(entry, ws, "baseline", [])
    result.sweep_skipped = amp_recipes(config.amp, baseline, add)
    if ns.sweep:
        result.sweep_skipped += sweep(ns, available, max(world_sizes), add)
    return result


def make_job(entry: Entry, ws: int, label: str, knob: str, run_dir: Path, stems: set[str], before: list[str],
             after: list[str], question: str = "") -> Job:
    """A job as its users would type it under the launcher its adapter declares: the run flags `before`, its dump,
    tag and fence (named after the label, unique in `stems`), then the flags `after`."""
    stem = unique_stem(label, stems)
    dump = run_dir / "grads" / f"{stem}.npz"
    log = run_dir / "logs" / f"{stem}.log"
    args = ["--backend", entry.backend, *before, "--dump-grads", str(dump), "--tag", label,
            "--closed-if", str(log.with_suffix(".closed")), *after]
    command = native_command(capabilities(entry.backend).native_launcher, ws, args)
    return Job(entry.backend, ws, command, label, dump, log, knob, backend_variant=entry.variant,
               options=dict(entry.options), question=question)


def unique_stem(label: str, taken: set[str]) -> str:
    """The file name stem of a job's dump, log and fence: `deepspeed:zero2/2 bucket_mb=25` ->
    `deepspeed-zero2-ws2-bucket_mb25`, only letters, digits and -_. (a user's `pkg.mod:Class` too), and unique."""
    stem = label.replace("/", "-ws").replace(" ", "-").replace("=", "").replace(":", "-")
    stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in stem)
    unique, n = stem, 1
    while unique in taken:
        n += 1
        unique = f"{stem}-{n}"
    taken.add(unique)
    return unique


FP16_ENGINE_NEEDS_A_DEVICE = ("DeepSpeed's fp16 engine needs a device with fp16 weights (its CPU accelerator has none "
                              "here); the autocast recipe runs")
"""Why an fp16 engine recipe (16-bit weights: deepspeed's, the one backend that declares one) is not planned here."""


def is_amp_recipe(knob: str) -> bool:
    """A job that runs another precision recipe of its backend: the same computation as the baseline, judged alike."""
    return knob.startswith("amp_recipe=")


def amp_recipes(amp: str, baseline: list[tuple[Entry, int]], add: Callable) -> list[dict[str, str]]:
    """Under --amp every job runs the default (autocast) recipe; a backend that declares other recipes (its
    `amp_recipe` option: deepspeed's engine) also runs each of them at each of its world sizes (each variant of
    it too, unless the variant sets the recipe itself). Return a line for each recipe left out and why (an fp16
    engine without CUDA)."""
    if amp == "none":
        return []
    skipped = []
    for entry, ws in baseline:
        if "amp_recipe" in dict(entry.options):
            continue
        for recipe in amp_recipe_choices(entry.backend):
            knob = f"amp_recipe={recipe}"
            if amp == "fp16" and recipe == "engine" and not _cuda():
                if not any(s["backend"] == entry.name and s["knob"] == knob for s in skipped):
                    skipped.append({"backend": entry.name, "knob": knob, "reason": FP16_ENGINE_NEEDS_A_DEVICE})
                continue
            add(entry, ws, knob, ["--opt", knob])
    return skipped


def _cuda() -> bool:
    import torch  # only --amp fp16 with an engine recipe asks about the device

    return torch.cuda.is_available()


DEFAULT_GLOBAL_BATCH = 2048
"""compare's global batch when --global-batch is not given (rounded up to what every world size divides)."""


def default_global_batch(ns: argparse.Namespace, world_sizes: list[int]) -> int:
    """The smallest multiple of every world size (and, under --sweep, of the largest world size x each
    accumulation) that is at least DEFAULT_GLOBAL_BATCH: 2048 at world sizes 1, 2, 4, 8; 2052 at 1, 6."""
    unit = math.lcm(*world_sizes)
    if ns.sweep:
        unit = math.lcm(unit, *(max(world_sizes) * k for k in comma_separated(ns.sweep_accum, "--sweep-accum", int)))
    return smallest_multiple(unit, DEFAULT_GLOBAL_BATCH)


def run_config(ns: argparse.Namespace, world_sizes: list[int]) -> RunConfig:
    """The run flags every job shares, as the run itself will read them. Weak scaling fixes the per-rank
    batch at the global batch over the largest world size. Without --global-batch, ns.global_batch is set to
    the one chosen (default_global_batch), which compare then reports."""
    if ns.global_batch is None:
        ns.global_batch = default_global_batch(ns, world_sizes)
    shared = dict(model=ns.model, steps=ns.steps, measure_steps=ns.measure_steps, warmup_steps=ns.warmup_steps,
                  amp=ns.amp, optimizer=ns.optimizer, clip_grad_norm=ns.clip_grad_norm,
                  activation_checkpointing=ns.activation_checkpointing, compile=ns.compile,
                  seq_len=getattr(ns, "seq_len", None), check_coverage=getattr(ns, "check_coverage", "auto"))
    if ns.scaling == "weak":
        return RunConfig(**shared, scaling="weak", local_batch=max(ns.global_batch // max(world_sizes), 1))
    return RunConfig(**shared, global_batch=ns.global_batch)


def _common_args(ns: argparse.Namespace, run_dir: Path, config: RunConfig) -> list[str]:
    collectives = collectives_path(ns, run_dir)
    common = ["--collectives", str(collectives)] if collectives else []
    common += ["--model", config.model, "--steps", str(config.steps), "--measure-steps", str(config.measure_steps),
               "--warmup-steps", str(config.warmup_steps), "--out", str(run_dir / "runs")]
    if config.amp != "none":
        common += ["--amp", config.amp]
    if config.optimizer != RunConfig().optimizer:
        common += ["--optimizer", config.optimizer]
    if config.clip_grad_norm is not None:
        common += ["--clip-grad-norm", repr(config.clip_grad_norm)]
    if config.activation_checkpointing:
        common += ["--activation-checkpointing"]
    if config.compile:
        common += ["--compile"]
    if config.seq_len is not None:
        common += ["--seq-len", str(config.seq_len)]
    if config.check_coverage != RunConfig().check_coverage:
        common += ["--check-coverage", config.check_coverage]
    if config.scaling == "weak":
        return common + ["--scaling", "weak", "--local-batch", str(config.local_batch)]
    return common + ["--global-batch", str(config.global_batch)]


def collectives_path(ns: argparse.Namespace, run_dir: Path) -> Path | None:
    """The bench-collectives JSON the runs quote busbw from (None: no measurement, or --collectives none)."""
    if ns.collectives == "none" or ns.measure_steps == 0:
        return None
    if ns.collectives == "auto":
        return run_dir / "collectives.json"
    path = Path(ns.collectives)
    if not path.is_file():
        raise ValueError(f"--collectives={ns.collectives!r} is not a file: pass a bench-collectives JSON, auto or none")
    return path


def sweep(ns: argparse.Namespace, entries: list[Entry], ws: int, add: Callable) -> list[dict[str, str]]:
    """Plan one knob at a time, at the largest world size, for the multi-process backends (and each variant of
    one) where the knob means something; return a line for each combination left out and why (data the adapters
    declare)."""
    skipped = []
    for entry in entries:
        caps = capabilities(entry.backend)
        if not caps.multi_process:
            continue
        for mb in comma_separated(ns.sweep_bucket_mb, "--sweep-bucket-mb", float):
            if caps.has_buckets:
                add(entry, ws, f"bucket_mb={mb:g}", ["--bucket-mb", str(mb)])
            else:
                why = f"{entry.backend} declares none" if entry.variant else "ZeRO stage 0 reduces one flat buffer"
                skipped.append({"backend": entry.name, "knob": f"bucket_mb={mb:g}",
                                "reason": f"no all-reduce bucket to size ({why})"})
        for k in comma_separated(ns.sweep_accum, "--sweep-accum", int):
            add(entry, ws, f"grad_accum={k}", ["--grad-accum", str(k)])
        for c in comma_separated(ns.sweep_compression, "--sweep-compression"):
            if c in caps.compressions:
                add(entry, ws, f"compression={c}", ["--compression", c])
            else:
                skipped.append({"backend": entry.name, "knob": f"compression={c}",
                                "reason": f"{entry.backend} offers {', '.join(sorted(caps.compressions))}"})
    return skipped
