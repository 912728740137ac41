"""The Trainer: one training loop for every backend, with the equivalence check built in.

Owns: the run from launch detection to the written result. It never branches on a backend's name:
what differs between backends is behind the adapter contract (dpcompare.contract) and its declared
capabilities. Reads top to bottom as: detect -> validate -> set up -> build -> check initial weights ->
loop (shard, forward, backward, reduce, check, step) -> gather -> write.
"""

from __future__ import annotations

import copy
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dpcompare import equivalence as eq
from dpcompare import launch, registry, results
from dpcompare.config import RunConfig
from dpcompare.contract import Adapter
from dpcompare.syncbn import has_batchnorm
from dpcompare.watchdog import Watchdog
from dpcompare.workloads import Workload, shard


def make_optimizer(cfg: RunConfig, params) -> torch.optim.Optimizer:
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def load_adapter_class(cfg: RunConfig, env: launch.LaunchEnv) -> type[Adapter]:
    cls = registry.load(cfg.backend, registry.BACKENDS, "backend")
    if not (isinstance(cls, type) and issubclass(cls, Adapter)):
        raise ValueError(f"backend {cfg.backend!r} is not a dpcompare.contract.Adapter subclass: derive your adapter from it")
    caps = cls.capabilities
    if env.world_size > 1 and not caps.multi_process:
        raise ValueError(
            f"--backend {cfg.backend} runs in one process, but {env.launcher} started {env.world_size}: "
            f"start it as: {caps.launch_hint}"
        )
    if env.world_size > 1 and env.launcher not in caps.launchers:
        raise ValueError(
            f"--backend {cfg.backend} cannot run under {env.launcher} (its ranks would not find each other): "
            f"start it as: {caps.launch_hint}"
        )
    return cls


def load_workload(cfg: RunConfig) -> Workload:
    factory = registry.load(cfg.model, registry.MODELS, "model")
    workload = factory(cfg.seed)
    if not isinstance(workload, Workload):
        raise ValueError(f"--model {cfg.model}: the function must return dpcompare.workloads.Workload, got {type(workload).__name__}")
    return workload


def _inject(cfg: RunConfig, rank: int, step: int) -> None:
    """Testing aid (--inject-fault): make this rank crash or hang at a given step."""
    if not cfg.inject_fault or cfg.inject_fault == "dupdata":
        return
    kind, fault_rank, fault_step = cfg.inject_fault.split(":")
    if int(fault_rank) == rank and int(fault_step) == step:
        if kind == "crash":
            os._exit(17)
        while True:
            time.sleep(3600)


@dataclass(slots=True)
class _Shadow:
    """The reference trajectory: a plain single-process copy trained on the global batch (rank 0)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer

    def step(self, workload: Workload, x: torch.Tensor, y: torch.Tensor) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        workload.loss_fn(self.model(x), y).backward()
        self.optimizer.step()


def run(cfg: RunConfig) -> dict[str, Any]:
    cfg.validate()
    env = launch.detect()
    adapter_cls = load_adapter_class(cfg, env)
    global_batch, local_batch = cfg.batch_sizes(env.world_size)
    workload = load_workload(cfg)
    device = launch.pick_device(cfg.device, env.local_rank)
    dtype = eq.DTYPES[cfg.dtype]

    adapter = adapter_cls(env, device, cfg.extra)
    watchdog: Watchdog | None = None
    try:
        adapter.setup(cfg.timeout_s)
        watchdog = Watchdog(rank=env.rank, world_size=env.world_size, job_id=env.job_id, timeout_s=cfg.timeout_s).start()
        template = copy.deepcopy(workload.model)  # untouched architecture, for the oracle and the shadow
        module = workload.model.to(device=device, dtype=dtype)
        if cfg.sync_bn:
            module = adapter.sync_batchnorm(module)
        optimizer = make_optimizer(cfg, module.parameters())
        wrapped = adapter.wrap(module, optimizer, local_batch, global_batch)
        names = [n for n, _ in wrapped.module.named_parameters()]

        verdict = eq.Verdict(notes=list(wrapped.notes))
        initial = adapter.all_gather_object(eq.param_digests(wrapped.module))
        mismatch = eq.first_mismatch(initial, names)
        if mismatch:
            verdict.initial_weights_identical = False
            verdict.replicas_identical = False
            verdict.notes.append(f"rank {mismatch[0]} started with different weights at parameter {mismatch[1]}")

        rank0 = env.is_rank0
        depth = eq.depth_of(template)
        oracle = eq.Oracle(template, workload.loss_fn, cfg.dtype, device) if rank0 and cfg.check_every else None
        shadow = None
        if oracle is not None:
            shadow_model = copy.deepcopy(template).to(device=device, dtype=dtype)
            shadow = _Shadow(shadow_model, make_optimizer(cfg, shadow_model.parameters()))
        dumps: dict[str, np.ndarray] = {}
        sample_rank = 0 if cfg.inject_fault == "dupdata" else env.rank

        for step in range(cfg.steps):
            checked = cfg.check_every > 0 and step % cfg.check_every == 0
            batch = workload.make_batch(step, global_batch)
            x, y = shard(batch, sample_rank, env.world_size)
            _inject(cfg, env.rank, step)
            watchdog.beat("forward", step)

            wrapped.model.train()
            with adapter.sync(True):
                x_dev = x.to(device)
                loss = workload.loss_fn(wrapped.model(x_dev.to(dtype) if x_dev.is_floating_point() else x_dev), y.to(device))
                watchdog.beat("backward", step)
                adapter.backward(loss)
            adapter.reduce()
            watchdog.beat("reduced", step)

            if checked:
                # Gradients are global now and the parameters are those the gradients were taken at.
                info = adapter.all_gather_object({
                    "grads": eq.grad_digests(wrapped.module),
                    "shard": eq.tensor_digest(x),
                })
                if rank0:
                    assert oracle is not None
                    state = {k: v.detach().clone() for k, v in wrapped.module.state_dict().items()}
                    grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().double().cpu()
                             for n, p in wrapped.module.named_parameters()}
                    oracle_grads = oracle.oracle(state, *batch)
                    floor_grads = oracle.floor(state, *batch)
                    params = eq.compare_grads(grads, oracle_grads, floor_grads, dtype=cfg.dtype,
                                              world_size=env.world_size, depth=depth)
                    check = eq.StepCheck(step, params, True, eq.first_mismatch([i["grads"] for i in info], names) is None)
                    verdict.checks.append(check)
                    failing = next((p for p in params if not p.ok), None)
                    if failing is not None and verdict.first_divergence is None:
                        shards = [shard(batch, r, env.world_size) for r in range(env.world_size)]
                        reason = eq.diagnose(
                            grads=grads, oracle_grads=oracle_grads, oracle=oracle, state=state, global_batch=batch,
                            shards=shards, shard_digests=[i["shard"] for i in info],
                            expected_digests=[eq.tensor_digest(s[0]) for s in shards],
                            tolerance=failing.tolerance_rel_fro, has_batchnorm=has_batchnorm(template),
                            sync_bn=cfg.sync_bn,
                        )
                        verdict.first_divergence = eq.Divergence(
                            step, failing.parameter, failing.rel_fro_err, failing.tolerance_rel_fro,
                            failing.noise_ratio, reason)
                    if cfg.dump_grads:
                        for kind, g in (("reduced", grads), ("oracle", oracle_grads), ("floor", floor_grads)):
                            for n, t in g.items():
                                dumps[f"{step}/{kind}/{n}"] = t.numpy()
                watchdog.beat("checked", step)

            adapter.step()
            adapter.zero_grad()
            watchdog.beat("stepped", step)

            if checked or step == cfg.steps - 1:
                after = adapter.all_gather_object(eq.param_digests(wrapped.module))
                mismatch = eq.first_mismatch(after, names)
                if rank0 and mismatch:
                    verdict.replicas_identical = False
                    if verdict.checks and verdict.checks[-1].step == step:
                        verdict.checks[-1].replicas_identical = False
                    if verdict.first_divergence is None:
                        verdict.first_divergence = eq.Divergence(
                            step, mismatch[1], float("nan"), 0.0, float("nan"),
                            f"after the optimizer step rank {mismatch[0]} holds different values of {mismatch[1]} "
                            "than rank 0: the replicas diverged")
            if shadow is not None:
                shadow.step(workload, batch[0].to(device).to(dtype) if batch[0].is_floating_point() else batch[0].to(device),
                            batch[1].to(device))
                ref = torch.cat([p.detach().double().reshape(-1) for p in shadow.model.parameters()])
                mine = torch.cat([p.detach().double().reshape(-1) for p in wrapped.module.parameters()])
                verdict.drift.append({"step": step, "rel_param_distance": eq.rel_fro(mine, ref)})
            watchdog.beat("done", step)

        payload: dict[str, Any] | None = None
        if rank0:
            policy = eq.tolerance_policy(cfg.dtype, env.world_size, depth)
            payload = results.base_payload(
                backend=cfg.backend,
                launcher=env.launcher,
                world_size=env.world_size,
                device=str(device),
                model=workload.name,
                global_batch=global_batch,
                local_batch=local_batch,
                scaling=cfg.scaling,
                steps=cfg.steps,
                tag=cfg.tag,
                config=cfg.to_dict(),
                equivalence=verdict.to_dict(policy),
                env=results.environment(),
                created_unix=time.time(),
            )
            if cfg.dump_grads:
                _save_npz_atomic(Path(cfg.dump_grads), dumps)
                payload["grad_dump"] = str(cfg.dump_grads)
            path = results.result_path(cfg.out, cfg.backend, env.world_size, workload.name)
            payload = results.sanitize(payload)
            results.validate(payload)
            results.write_atomic(path, payload)
            payload["result_path"] = str(path)
        # Nobody leaves before rank 0 has written: a launcher may kill stragglers once one rank exits.
        adapter.all_gather_object(None)
        return payload or {}
    finally:
        if watchdog is not None:
            watchdog.stop()
        adapter.teardown()


def _save_npz_atomic(path: Path, arrays: dict[str, np.ndarray]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp.npz")
    np.savez(tmp, **arrays)
    os.replace(tmp, path)


def summary_line(payload: dict[str, Any]) -> str:
    e = payload["equivalence"]
    head = f"{payload['backend']} ws={payload['world_size']} {payload['model']} [{payload['launcher']}]: {e['verdict']}"
    if e["verdict"] == "unchecked":
        return f"{head} -> {payload.get('result_path')}"
    ratio = e["noise_ratio"]
    detail = (f"max rel fro err {e['max_rel_fro_err']:.2e}, {ratio:.2f}x noise floor {e['noise_floor_rel_fro']:.2e}"
              if ratio is not None else "no gradient figures")
    if e["first_divergence"]:
        d = e["first_divergence"]
        detail += f"; first divergence at step {d['step']}, {d['parameter']}: {d['reason']}"
    detail += "; replicas identical" if e["replicas_identical"] else "; REPLICAS DIFFER"
    return f"{head} ({detail}) -> {payload.get('result_path')}"
