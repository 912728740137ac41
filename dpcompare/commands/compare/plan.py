"""What `compare` will run: one job per available backend and world size, each as the command its users
type under the launcher its adapter declares, plus the --sweep jobs (one knob at a time), under --amp
a job for each other precision recipe a backend declares (deepspeed's engine), and the bench-collectives JSON the runs quote busbw from. Refuses bad flags
before anything starts, with the run's own messages for the run's own flags.
"""

from __future__ import annotations

import argparse
import functools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from dpcompare.contract import Capabilities
from dpcompare.run import registry
from dpcompare.run.config import RunConfig, smallest_multiple
from dpcompare.run.launchers import native_command


@functools.cache
def capabilities(backend: str) -> Capabilities:
    """What the backend's adapter declares (importing the adapter class imports torch, never its runtime)."""
    return registry.load(backend, registry.BACKENDS, "backend").capabilities


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
    variant: str = "baseline"
    """'baseline', or 'knob=value' for a --sweep run."""
    status: str = "pending"
    result: dict[str, Any] | None = None
    wall_s: float | None = None
    error: str | None = None
    result_path: Path | None = None

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
    """{'backend', 'reason'} for each backend asked for that is not installed."""
    sweep_skipped: list[dict[str, str]] = field(default_factory=list)
    """{'backend', 'knob', 'reason'} for each sweep combination or --amp recipe the backend does not have."""


def comma_separated(text: str, option: str, kind: Callable = str) -> list:
    try:
        return [kind(v.strip()) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{option}={text!r} is invalid: use a comma-separated list") from None


def plan(ns: argparse.Namespace, run_dir: Path) -> Plan:
    """Every job of this invocation, or ValueError naming the flag and the fix."""
    backends = comma_separated(ns.backends, "--backends")
    world_sizes = sorted(set(comma_separated(ns.world_sizes, "--world-sizes", int)))
    if not world_sizes or min(world_sizes) < 1:
        raise ValueError(f"--world-sizes={ns.world_sizes!r} is invalid: use positive whole numbers, e.g. 1,2")
    unknown = [b for b in backends if b not in registry.BACKENDS]
    if unknown:
        raise ValueError(f"--backends: unknown {', '.join(unknown)}; choose from {', '.join(registry.BACKENDS)}")
    config = run_config(ns, world_sizes)
    config.validate()
    result = Plan()
    baseline: list[tuple[str, int]] = []
    for backend in backends:
        ok, reason = registry.availability(backend)
        if ok:
            baseline += [(backend, ws) for ws in (world_sizes if capabilities(backend).multi_process else [1])]
        else:
            result.unavailable.append({"backend": backend, "reason": reason})
    for ws in sorted({ws for _, ws in baseline}):
        config.batch_sizes(ws)
    common = _common_args(ns, run_dir, config)

    def add(backend: str, ws: int, variant: str, extra: list[str]) -> None:
        label = f"{backend}/{ws}" + ("" if variant == "baseline" else f" {variant}")
        stem = label.replace("/", "-ws").replace(" ", "-").replace("=", "")
        dump = run_dir / "grads" / f"{stem}.npz"
        log = run_dir / "logs" / f"{stem}.log"
        args = ["--backend", backend, *common, "--dump-grads", str(dump), "--tag", label,
                "--closed-if", str(log.with_suffix(".closed")), *extra, *ns.run_arg]
        command = native_command(capabilities(backend).native_launcher, ws, args)
        result.jobs.append(Job(backend, ws, command, label, dump, log, variant))

    for backend, ws in baseline:
        add(backend, ws, "baseline", [])
    result.sweep_skipped = amp_recipes(config.amp, baseline, add)
    if ns.sweep:
        available = [b for b in backends if all(u["backend"] != b for u in result.unavailable)]
        result.sweep_skipped += sweep(ns, available, max(world_sizes), add)
    return result


FP16_ENGINE_NEEDS_A_DEVICE = ("DeepSpeed's fp16 engine needs a device with fp16 weights (its CPU accelerator has none "
                              "here); the autocast recipe runs")
"""Why an fp16 engine recipe (16-bit weights: deepspeed's, the one backend that declares one) is not planned here."""


def is_amp_recipe(variant: str) -> bool:
    """A job that runs another precision recipe of its backend: the same computation as the baseline, judged alike."""
    return variant.startswith("amp_recipe=")


def amp_recipes(amp: str, baseline: list[tuple[str, int]], add: Callable) -> list[dict[str, str]]:
    """Under --amp every job runs the default (autocast) recipe; a backend that declares other recipes (its
    `amp_recipe` option: deepspeed's engine) also runs each of them at each of its world sizes. Return a line for
    each recipe left out and why (an fp16 engine without CUDA)."""
    if amp == "none":
        return []
    skipped = []
    for backend, ws in baseline:
        for recipe in amp_recipe_choices(backend):
            knob = f"amp_recipe={recipe}"
            if amp == "fp16" and recipe == "engine" and not _cuda():
                if not any(s["backend"] == backend and s["knob"] == knob for s in skipped):
                    skipped.append({"backend": backend, "knob": knob, "reason": FP16_ENGINE_NEEDS_A_DEVICE})
                continue
            add(backend, ws, knob, ["--opt", knob])
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
                  amp=ns.amp)
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


def sweep(ns: argparse.Namespace, backends: list[str], ws: int, add: Callable) -> list[dict[str, str]]:
    """Plan one knob at a time, at the largest world size, for the multi-process backends where the knob
    means something; return a line for each combination left out and why (data the adapters declare)."""
    skipped = []
    for backend in backends:
        caps = capabilities(backend)
        if not caps.multi_process:
            continue
        for mb in comma_separated(ns.sweep_bucket_mb, "--sweep-bucket-mb", float):
            if caps.has_buckets:
                add(backend, ws, f"bucket_mb={mb:g}", ["--bucket-mb", str(mb)])
            else:
                skipped.append({"backend": backend, "knob": f"bucket_mb={mb:g}",
                                "reason": "no all-reduce bucket to size (ZeRO stage 0 reduces one flat buffer)"})
        for k in comma_separated(ns.sweep_accum, "--sweep-accum", int):
            add(backend, ws, f"grad_accum={k}", ["--grad-accum", str(k)])
        for c in comma_separated(ns.sweep_compression, "--sweep-compression"):
            if c in caps.compressions:
                add(backend, ws, f"compression={c}", ["--compression", c])
            else:
                skipped.append({"backend": backend, "knob": f"compression={c}",
                                "reason": f"{backend} offers {', '.join(sorted(caps.compressions))}"})
    return skipped
