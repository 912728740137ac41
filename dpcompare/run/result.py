"""The result a run writes: rank 0 assembles it from the run's parts, records the facts derived from the run once,
checks it against the schema and writes it atomically (dpcompare.results). Readers read those facts back through
dpcompare.result_view and never derive them again.

Owns: the payload's assembly and the facts this layer derives: the named variant the run's options make
(dpcompare.run.backend.variant_name) and its knobs (what it changes from its backend's baseline computation). The
verdict records its own (its floors and its power: dpcompare.verify). Imports no command.
"""

from __future__ import annotations

import time
from typing import Any, Mapping

from dpcompare import results
from dpcompare.contract import Adapter, activation_checkpointing
from dpcompare.contract import launch_env as launch
from dpcompare.run import backend, compilation
from dpcompare.run.config import RunConfig
from dpcompare.run.workloads import Workload
from dpcompare.verify.oracle import gradient_oracle as eq

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
    payload = results.base_payload(
        backend=cfg.backend, variant=variant, knobs=knobs(cfg, type(adapter), options), launcher=env.launcher,
        world_size=env.world_size, device=str(adapter.device),
        model=workload.name, model_info={"source": workload.source,
                                         "parameters": sum(p.numel() for p in workload.model.parameters())},
        global_batch=global_batch, local_batch=local_batch, scaling=cfg.scaling,
        steps=cfg.steps, tag=cfg.tag, config=cfg.to_dict(),
        capabilities={"multi_process": caps.multi_process, "native_launcher": caps.native_launcher,
                      "scaling_baseline": caps.scaling_baseline, "shards": caps.shards,
                      "shard_replicas": caps.shard_replicas},
        equivalence=verdict.to_dict(policy), metrics=metrics, env=results.environment(), created_unix=time.time(),
    )
    if cfg.dump_grads:
        payload["grad_dump"] = str(cfg.dump_grads)
    if compile_log is not None:
        payload["compile"] = {**compile_log.to_dict(), **(metrics or {}).pop("compile", {})}
    payload["activation_checkpointing"] = activation_checkpointing.record(adapter.wrapped.module)
    payload["state"] = state  # what each rank held for the model's state (dpcompare.run.state_table)
    path = results.result_path(cfg.out, cfg.backend, env.world_size, workload.name, variant)
    payload = results.sanitize(payload)
    results.validate(payload)
    results.write_atomic(path, payload, unless=cfg.closed_if)
    payload["result_path"] = str(path)
    return payload
