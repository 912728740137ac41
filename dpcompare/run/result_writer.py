"""The one writer of a run's result: rank 0 assembles it from the run's parts, records the facts derived from the run
once, names its file, checks it against the schema and writes it atomically (dpcompare.json_files). Readers read those facts back through
dpcompare.result_view and never derive them again.

Owns: the payload's assembly and the facts this layer derives: the named variant the run's options make
(dpcompare.run.backend.variant_name) and its knobs (what it changes from its backend's baseline computation). The
verdict records its own (its floors and its power: dpcompare.verify). Imports no command.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Mapping

from dpcompare import json_files
from dpcompare.contract import Adapter, activation_checkpointing
from dpcompare.contract import launch_env as launch
from dpcompare.run import backend, compilation
from dpcompare.run.config import RunConfig
from dpcompare.run.workloads import Workload
from dpcompare.verify.oracle import gradient_oracle as eq

SCHEMA_PATH = Path(__file__).resolve().parents[1] / "schema" / "result.schema.json"
"""The published schema every result is checked against before it is written."""
SWEEP_KNOBS = ("compression", "grad_accum", "bucket_mb")
"""Run flags that make a run another computation than its backend's baseline (compare --sweep varies them)."""
AMP_RECIPE = "amp_recipe"
"""The backend option naming its mixed-precision recipes (compare --amp runs each one beside the default)."""


def knobs(cfg: RunConfig, adapter_cls: type[Adapter], options: Mapping[str, Any]) -> dict[str, Any]:
    """What the run changes from its backend's baseline computation: each sweep flag away from its default, then
    each backend option one of its named variants sets (VARIANTS), or its precision recipe, away from the default
    its adapter declares, in the order of its OPTIONS. {} for a baseline run; other options (a dist_backend, a
    clip) leave the run its backend's baseline."""
    defaults = RunConfig()
    found = {k: getattr(cfg, k) for k in SWEEP_KNOBS if getattr(cfg, k) != getattr(defaults, k)}
    varied = {key for values in adapter_cls.VARIANTS.values() for key in values} | {AMP_RECIPE}
    found.update({o.name: options[o.name] for o in adapter_cls.OPTIONS
                  if o.name in varied and o.name in options and options[o.name] != o.default})
    return found


def write(cfg: RunConfig, env: launch.LaunchEnv, adapter: Adapter, workload: Workload, template,
          verdict: eq.Verdict, metrics: dict[str, Any] | None, global_batch: int, local_batch: int,
          compile_log: compilation.CompileLog | None = None, state: dict[str, Any] | None = None) -> dict[str, Any]:
    """Rank 0: the result, validated and written; returned with its `result_path`."""
    caps = adapter.capabilities
    policy = eq.tolerance_policy(cfg.dtype, env.world_size, eq.depth_of(template), adapter.gradient_wire())
    options = dict(adapter.settings.options)
    variant = backend.variant_name(type(adapter), options)
    payload = json_files.base_payload(
        backend=cfg.backend, variant=variant, knobs=knobs(cfg, type(adapter), options), launcher=env.launcher,
        world_size=env.world_size, device=str(adapter.device),
        model=workload.name, model_info={"source": workload.source,
                                         "parameters": sum(p.numel() for p in workload.model.parameters())},
        global_batch=global_batch, local_batch=local_batch, scaling=cfg.scaling,
        steps=cfg.steps, tag=cfg.tag, config=cfg.to_dict(),
        capabilities={"multi_process": caps.multi_process, "native_launcher": caps.native_launcher,
                      "scaling_baseline": caps.scaling_baseline, "shards": caps.shards,
                      "shard_replicas": caps.shard_replicas},
        equivalence=verdict.to_dict(policy), metrics=metrics, env=json_files.environment(), created_unix=time.time(),
    )
    if cfg.dump_grads:
        payload["grad_dump"] = str(cfg.dump_grads)
    if compile_log is not None:
        payload["compile"] = {**compile_log.to_dict(), **(metrics or {}).pop("compile", {})}
    payload["activation_checkpointing"] = activation_checkpointing.record(adapter.wrapped.module)
    payload["state"] = state  # what each rank held for the model's state (dpcompare.run.state_table)
    path = result_path(cfg.out, cfg.backend, env.world_size, workload.name, variant)
    payload = json_files.sanitize(payload)
    validate(payload)
    json_files.write_atomic(path, payload, unless=cfg.closed_if)
    payload["result_path"] = str(path)
    return payload


def result_path(out_dir: str | os.PathLike, backend: str, world_size: int, model: str, variant: str = "") -> Path:
    """OUT/<time>-<backend>[-<variant>]-ws<N>-<model>-<pid>.json. `variant`: the named variant of the backend the
    run's options make (`zero2` for deepspeed's zero_stage=2), '' for none, so variants of one backend at one world
    size are told apart by name; the pid keeps any two runs' files apart."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    safe_backend = "".join(c if c.isalnum() or c in "-_" else "_" for c in backend)
    safe_variant = "".join(c if c.isalnum() or c in "-_" else "_" for c in variant)
    name = safe_backend + (f"-{safe_variant}" if safe_variant else "")
    return Path(out_dir) / f"{stamp}-{name}-ws{world_size}-{file_stem_of_model(model)}-{os.getpid()}.json"


def file_stem_of_model(model: str) -> str:
    """A model's name as a file name's part: `hf:meta-llama/Llama-3.2-1B` and `hf:./configs/llama/` name a path or a
    hub repository, whose last part names the model (`hf-Llama-3.2-1B`, `hf-llama`); any other character a file name
    should not hold becomes `_`."""
    kind, sep, rest = model.partition(":")
    if sep and "/" in rest:
        model = f"{kind}-{rest.rstrip('/').rsplit('/', 1)[-1] or 'model'}"
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in model)


def validate(payload: dict[str, Any]) -> None:
    """Raise jsonschema.ValidationError when the payload does not follow the published schema."""
    import jsonschema

    jsonschema.validate(payload, json.loads(SCHEMA_PATH.read_text()))
