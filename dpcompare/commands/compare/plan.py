"""What `compare` will run: one job per available backend (or named variant of one: `deepspeed:zero2`) and world
size, each as the command its users type under the launcher its adapter declares, plus the --sweep jobs (one knob
at a time), under --amp a job for each other precision recipe a backend declares (deepspeed's engine), and the
bench-collectives JSON the runs quote busbw from. Every job's run is the spec's template with the job's own changes
(CompareSpec.job_run), launched with the argv RunConfig.to_args builds. Refuses, before anything starts, a batch the
world sizes cannot shard, with the run's own message.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from dpcompare.commands.compare.entries import (Entry, adapter_class, amp_recipe_choices, capabilities,
                                                declared_launcher)
from dpcompare.commands.compare.spec import CompareSpec
from dpcompare.result_view import RunResult
from dpcompare.run import registry
from dpcompare.run.config import RunConfig
from dpcompare.run.launchers import native_command


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


def plan(spec: CompareSpec, run_dir: Path) -> Plan:
    """Every job of this invocation, or ValueError naming the flag and the fix."""
    config = spec.run
    result = Plan(unavailable=[dict(u) for u in spec.missing])
    baseline: list[tuple[Entry, int]] = []
    available: list[Entry] = []
    for entry in spec.entries:
        ok, reason = registry.availability(entry.backend)
        if ok and config.compile and not capabilities(entry.backend).compiles:
            ok, reason = False, (f"--compile: {entry.backend} declares no compiled path "
                                 f"({capabilities(entry.backend).compile_refusal or 'Capabilities.compiles'})")
        if ok:
            available.append(entry)
            for ws in (spec.world_sizes if capabilities(entry.backend).multi_process else [1]):
                refusal = (adapter_class(entry.backend).world_size_refusal(ws, dict(entry.options))
                           or shared_gpu(entry, ws, spec.job_run(entry))[1])
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
    files = {"out": str(run_dir / "runs"), "collectives": collectives_path(spec, run_dir)}
    stems: set[str] = set()

    def add(entry: Entry, ws: int, knob: str, changes: dict[str, Any]) -> None:
        label = f"{entry.name}/{ws}" + ("" if knob == "baseline" else f" {knob}")
        changes = with_shared_gpu(entry, ws, spec.job_run(entry), changes)
        result.jobs.append(make_job(entry, ws, label, knob, run_dir, stems,
                                    spec.job_run(entry, {**files, **changes})))

    for entry, ws in baseline:
        add(entry, ws, "baseline", {})
    result.sweep_skipped = amp_recipes(config.amp, baseline, add)
    if spec.both_normalisations:
        if config.loss_normalisation == "global":
            raise ValueError("--both-normalisations runs local and global side by side: drop --loss-normalisation global")
        for entry, ws in baseline:  # each cell beside itself, its loss normalised over the step's items
            add(entry, ws, "loss_normalisation=global", {"loss_normalisation": "global"})
    if spec.sweep:
        result.sweep_skipped += sweep(spec, available, max(spec.world_sizes), add)
    return result


def make_job(entry: Entry, ws: int, label: str, knob: str, run_dir: Path, stems: set[str], run: RunConfig,
             question: str = "") -> Job:
    """A job as its users would type it under the launcher its adapter declares: `run` with its dump, tag and fence
    (named after the label, unique in `stems`)."""
    stem = unique_stem(label, stems)
    dump = run_dir / "grads" / f"{stem}.npz"
    log = run_dir / "logs" / f"{stem}.log"
    run = replace(run, dump_grads=str(dump), tag=label, closed_if=str(log.with_suffix(".closed")))
    command = native_command(capabilities(entry.backend).native_launcher, ws, run.to_args())
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


def is_amp_recipe(knob: str) -> bool:
    """A job that runs another precision recipe of its backend: the same computation as the baseline, judged alike."""
    return knob.startswith("amp_recipe=")


def amp_recipes(amp: str, baseline: list[tuple[Entry, int]], add: Callable) -> list[dict[str, str]]:
    """Under --amp every job runs the default (autocast) recipe; a backend that declares other recipes (its
    `amp_recipe` option: deepspeed's engine) also runs each of them at each of its world sizes (each variant of
    it too, unless the variant sets the recipe itself). Return a line for each recipe left out and why (an fp16
    engine where the backend's accelerator holds no fp16 weights: `Adapter.precision_refusal`)."""
    if amp == "none":
        return []
    skipped = []
    for entry, ws in baseline:
        if "amp_recipe" in dict(entry.options):
            continue
        for recipe in amp_recipe_choices(entry.backend):
            knob = f"amp_recipe={recipe}"
            refusal = adapter_class(entry.backend).precision_refusal(amp, {**dict(entry.options), "amp_recipe": recipe})
            if refusal is not None:
                if not any(s["backend"] == entry.name and s["knob"] == knob for s in skipped):
                    skipped.append({"backend": entry.name, "knob": knob,
                                    "reason": f"{refusal}; the backend's default recipe runs"})
                continue
            add(entry, ws, knob, {"options": {"amp_recipe": recipe}})
    return skipped


def shared_gpu(entry: Entry, ws: int, run: RunConfig) -> tuple[dict[str, str], str | None]:
    """Where `ws` ranks on this node would outnumber its CUDA devices (the runs go to CUDA: --device auto or cuda), so
    that ranks share a GPU: (the options that let the backend run so, why it cannot). NCCL refuses two ranks on one
    device; a backend that declares --opt dist_backend runs over gloo there unless the user chose its process group.
    ({}, None) where every rank has a device of its own, or on the CPU."""
    if run.device == "cpu" or ws <= 1 or not capabilities(entry.backend).multi_process:
        return {}, None
    devices = _cuda_devices()
    if devices == 0 or ws <= devices:
        return {}, None
    cls = adapter_class(entry.backend)
    refusal = cls.shared_device_refusal()
    if refusal:
        return {}, refusal
    if not any(o.name == "dist_backend" for o in cls.OPTIONS):
        return {}, (f"{ws} ranks would share this node's {devices} CUDA device(s), and {entry.backend} declares no "
                    "--opt dist_backend=gloo to share one: run it where every rank has a GPU of its own")
    if "dist_backend" in entry.options:
        return {}, None
    return {"dist_backend": "gloo"}, None


def with_shared_gpu(entry: Entry, ws: int, run: RunConfig, changes: dict[str, Any]) -> dict[str, Any]:
    """A job's `changes` with shared_gpu's options added (its own options win)."""
    extra, _ = shared_gpu(entry, ws, run)
    if not extra:
        return changes
    return {**changes, "options": {**extra, **changes.get("options", {})}}


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def collectives_path(spec: CompareSpec, run_dir: Path) -> str | None:
    """The bench-collectives JSON the runs quote busbw from (None: no measurement, or --collectives none)."""
    if spec.collectives == "none" or spec.run.measure_steps == 0:
        return None
    if spec.collectives == "auto":
        return str(run_dir / "collectives.json")
    if not Path(spec.collectives).is_file():
        raise ValueError(f"--collectives={spec.collectives!r} is not a file: pass a bench-collectives JSON, auto or "
                         "none")
    return spec.collectives


def sweep(spec: CompareSpec, entries: list[Entry], ws: int, add: Callable) -> list[dict[str, str]]:
    """Plan one knob at a time, at the largest world size, for the multi-process backends (and each variant of
    one) where the knob means something; return a line for each combination left out and why (data the adapters
    declare)."""
    skipped = []
    for entry in entries:
        caps = capabilities(entry.backend)
        if not caps.multi_process:
            continue
        for mb in spec.sweep.bucket_mb:
            if caps.has_buckets:
                add(entry, ws, f"bucket_mb={mb:g}", {"bucket_mb": mb})
            else:
                why = f"{entry.backend} declares none" if entry.variant else "ZeRO stage 0 reduces one flat buffer"
                skipped.append({"backend": entry.name, "knob": f"bucket_mb={mb:g}",
                                "reason": f"no all-reduce bucket to size ({why})"})
        for k in spec.sweep.accum:
            add(entry, ws, f"grad_accum={k}", {"grad_accum": k})
        for c in spec.sweep.compression:
            if c in caps.compressions:
                add(entry, ws, f"compression={c}", {"compression": c})
            else:
                skipped.append({"backend": entry.name, "knob": f"compression={c}",
                                "reason": f"{entry.backend} offers {', '.join(sorted(caps.compressions))}"})
    return skipped
