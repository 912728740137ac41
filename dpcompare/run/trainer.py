"""The Trainer: one training loop for every backend, with the equivalence check built in.

Owns: the run from launch detection to the written result. It never branches on a backend's name:
what differs between backends is behind the adapter contract (dpcompare.contract) and its declared
capabilities. Reads top to bottom as: detect -> validate -> set up -> build -> check initial weights ->
loop (shard, forward, backward, reduce, check, step) -> gather -> write.
"""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from dpcompare.verify import equivalence as eq
from dpcompare import results
from dpcompare.run import launch
from dpcompare.measure import clocks
from dpcompare.measure import summary as measure
from dpcompare.measure.bandwidth import busbw_at
from dpcompare.run import registry
from dpcompare.verify import stochastic
from dpcompare.verify import verifier
from dpcompare.run.config import RunConfig
from dpcompare.contract import Adapter
from dpcompare.run.syncbn import has_batchnorm
from dpcompare.run.watchdog import Watchdog
from dpcompare.run.workloads import Workload, shard


ABLATION_BLOCK = 5
"""Steps per block of one ablation arm before switching to the other."""


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


def check_options(adapter_cls: type[Adapter], cfg: RunConfig) -> None:
    caps = adapter_cls.capabilities
    if cfg.compression not in caps.compressions:
        raise ValueError(f"--compression={cfg.compression} is not available for --backend {cfg.backend}: "
                         f"it supports {', '.join(sorted(caps.compressions))}")


def load_workload(cfg: RunConfig) -> Workload:
    factory = registry.load(cfg.model, registry.MODELS, "model")
    workload = factory(cfg.seed)
    if not isinstance(workload, Workload):
        raise ValueError(f"--model {cfg.model}: the function must return dpcompare.run.workloads.Workload, got {type(workload).__name__}")
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


class _Step:
    """One training step's pieces, shared by the verification and the measurement phase."""

    def __init__(self, adapter: Adapter, workload: Workload, device: torch.device, dtype: torch.dtype,
                 grad_accum: int) -> None:
        self.adapter, self.workload, self.device, self.dtype = adapter, workload, device, dtype
        self.grad_accum = grad_accum

    def inputs(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.to(self.device)
        return (x.to(self.dtype) if x.is_floating_point() else x), y.to(self.device)

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, comm: bool = True) -> None:
        """Forward and backward over the rank's shard in `grad_accum` equal micro-batches. Only the last
        one synchronises (when the backend can switch sync off); each loss is scaled by 1/grad_accum so
        the accumulated gradient is the mean over the shard. comm=False is the ablation's unsynced arm:
        the whole step inside the adapter's comm_off()."""
        if not comm:
            with self.adapter.comm_off():
                self._micro_batches(x, y, lambda last: contextlib.nullcontext())
            return
        can_skip = self.adapter.capabilities.can_disable_sync
        self._micro_batches(x, y, lambda last: self.adapter.sync(last or not can_skip))

    def _micro_batches(self, x: torch.Tensor, y: torch.Tensor, context) -> None:
        wrapped = self.adapter.wrapped
        k = self.grad_accum
        for j, (xj, yj) in enumerate(zip(x.chunk(k), y.chunk(k))):
            with context(j == k - 1):
                loss = self.workload.loss_fn(wrapped.model(xj), yj)
                self.adapter.backward(loss / k if k > 1 else loss)

    def update(self) -> None:
        self.adapter.step()
        self.adapter.zero_grad()


def run(cfg: RunConfig) -> dict[str, Any]:
    cfg.validate()
    env = launch.detect()
    adapter_cls = load_adapter_class(cfg, env)
    global_batch, local_batch = cfg.batch_sizes(env.world_size)
    workload = load_workload(cfg)
    device = launch.pick_device(cfg.device, env.local_rank)
    dtype = eq.DTYPES[cfg.dtype]

    check_options(adapter_cls, cfg)
    adapter = adapter_cls(env, device, {"compression": cfg.compression, "bucket_mb": cfg.bucket_mb, **cfg.extra})
    watchdog: Watchdog | None = None
    clean = False
    try:
        adapter.setup(cfg.timeout_s)
        watchdog = Watchdog(rank=env.rank, world_size=env.world_size, job_id=env.job_id, timeout_s=cfg.timeout_s).start()
        switched = stochastic.switch_off_dropout(workload.model) if cfg.no_dropout else []
        template = copy.deepcopy(workload.model)  # untouched architecture, for the oracle and the reference trajectory
        # Rank 0 probes the model before wrapping (unused parameters decide DDP's find_unused_parameters);
        # every rank takes rank 0's answer.
        facts = None
        if env.is_rank0:
            facts = verifier.probe(template, workload.loss_fn, workload.make_batch(0, global_batch), device)
        facts = adapter.all_gather_object(facts)[0]
        # Same seed for the weights (above), a seed of its own per rank for what the forward draws (seed 000).
        stochastic.seed_rank(cfg.seed, env.rank)
        module = workload.model.to(device=device, dtype=dtype)
        if cfg.sync_bn:
            module = adapter.sync_batchnorm(module)
        optimizer = make_optimizer(cfg, module.parameters())
        adapter.model_facts = facts
        wrapped = adapter.wrap(module, optimizer, local_batch, global_batch)
        if switched:
            wrapped.notes.append(f"--no-dropout: dropout switched off in {', '.join(switched)}")
        wrapped.model.train()  # once: every step trains (the oracle and the shadow have their own copies)
        step_fn = _Step(adapter, workload, device, dtype, cfg.grad_accum)

        verdict = _verify(cfg, env, adapter, workload, template, step_fn, watchdog, global_batch)
        metrics = _measure(cfg, env, adapter, workload, step_fn, watchdog, global_batch, local_batch)

        names = [n for n, _ in wrapped.module.named_parameters()]
        mismatch = eq.first_mismatch(adapter.all_gather_object(eq.param_digests(wrapped.module)), names)
        payload: dict[str, Any] | None = None
        if env.is_rank0:
            if mismatch and verdict.replicas_identical:
                verdict.replicas_identical = False
                verdict.notes.append(f"after the last step rank {mismatch[0]} holds different values of {mismatch[1]}")
            policy = eq.tolerance_policy(cfg.dtype, env.world_size, eq.depth_of(template), cfg.compression)
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
                metrics=metrics,
                env=results.environment(),
                created_unix=time.time(),
            )
            if cfg.dump_grads:
                payload["grad_dump"] = str(cfg.dump_grads)
            path = results.result_path(cfg.out, cfg.backend, env.world_size, workload.name)
            payload = results.sanitize(payload)
            results.validate(payload)
            results.write_atomic(path, payload)
            payload["result_path"] = str(path)
        # Nobody leaves before rank 0 has written: a launcher may kill stragglers once one rank exits.
        adapter.all_gather_object(None)
        clean = True
        return payload or {}
    except RuntimeError as exc:
        # A collective that timed out or lost a peer: say which rank fell behind, not only what broke.
        if watchdog is not None and env.world_size > 1:
            first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise RuntimeError(f"{first_line}; culprit: {watchdog.culprits()}") from exc
        raise
    finally:
        if watchdog is not None:
            watchdog.stop(clean=clean)
        adapter.teardown()


def optimizer_factory(cfg: RunConfig) -> Callable[..., torch.optim.Optimizer]:
    """The run's optimizer over any parameters, with hyper-parameters overridden (for the update check)."""
    return lambda params, **overrides: make_optimizer(replace(cfg, **overrides), params)


def _verify(cfg: RunConfig, env: launch.LaunchEnv, adapter: Adapter, workload: Workload, template: torch.nn.Module,
            step_fn: _Step, watchdog: Watchdog, global_batch: int) -> eq.Verdict:
    """Verification phase: `cfg.steps` steps; at checked steps rank 0 holds the reduced gradient against the
    float64 oracle and the update against a reference optimizer step, after every step the parameters
    against the reference trajectory (dpcompare.verify.verifier); replicas and generators compared across ranks."""
    wrapped = adapter.wrapped
    facts = adapter.model_facts
    names = [n for n, _ in wrapped.module.named_parameters()]
    rank0 = env.is_rank0
    check = None
    if rank0 and cfg.check_every:
        check = verifier.Verifier(
            cfg=cfg, world_size=env.world_size, template=template, loss_fn=workload.loss_fn, facts=facts,
            wrapped=wrapped, device=step_fn.device, factory=optimizer_factory(cfg), has_batchnorm=has_batchnorm(template),
            replay_reason=adapter.rng_replay_reason())
        check.check_initial(wrapped.module)
    verdict = check.verdict if check is not None else eq.Verdict(notes=list(wrapped.notes))
    initial = adapter.all_gather_object(eq.param_digests(wrapped.module))
    mismatch = eq.first_mismatch(initial, names)
    if mismatch:
        verdict.initial_weights_identical = False
        verdict.replicas_identical = False
        verdict.notes.append(f"rank {mismatch[0]} started with different weights at parameter {mismatch[1]}")

    sample_rank = 0 if cfg.inject_fault == "dupdata" else env.rank
    for step in range(cfg.steps):
        checked = cfg.check_every > 0 and step % cfg.check_every == 0
        batch = workload.make_batch(step, global_batch)
        x, y = shard(batch, sample_rank, env.world_size)
        rng = stochastic.capture(step_fn.device) if facts.stochastic else None
        _inject(cfg, env.rank, step)
        watchdog.beat("forward", step)
        step_fn.forward_backward(*step_fn.inputs(x, y))
        watchdog.beat("reduce", step)
        adapter.reduce()
        watchdog.beat("reduced", step)

        info = None
        if checked or facts.stochastic:
            # Gradients are global now and the parameters are those the gradients were taken at.
            mine = {"shard": eq.tensor_digest(x), "rng": rng}
            if checked:
                mine["grads"] = eq.grad_digests(wrapped.module)
                mine["unused"] = _unused_grad_forms(wrapped.module, facts.unused)
            info = adapter.all_gather_object(mine)
        if check is not None:
            if facts.stochastic:
                check.observe_generators(step, [i["rng"] for i in info])
            if checked:
                check.check_gradient(step, batch, info)
            watchdog.beat("checked", step)

        step_fn.update()
        watchdog.beat("stepped", step)
        if check is not None:
            check.check_update(step)
            check.trajectory_step(step, batch, [i["rng"] for i in info] if facts.stochastic else None)

        if checked or step == cfg.steps - 1:
            # After rank 0's extra work (oracle, trajectory): this gather is also where the ranks line up again.
            after = adapter.all_gather_object(eq.param_digests(wrapped.module))
            mismatch = eq.first_mismatch(after, names)
            if rank0 and mismatch:
                verdict.replicas_identical = False
                if verdict.checks and verdict.checks[-1].step == step:
                    verdict.checks[-1].replicas_identical = False
                verdict.diverge(eq.Divergence(
                    step, mismatch[1], float("nan"), 0.0, float("nan"),
                    f"after the optimizer step rank {mismatch[0]} holds different values of {mismatch[1]} "
                    "than rank 0: the replicas diverged", check="replicas", cause="replicas"))
        watchdog.beat("done", step)

    if check is not None and cfg.dump_grads:
        _save_npz_atomic(Path(cfg.dump_grads), check.dumps)
    return verdict


def _unused_grad_forms(module: torch.nn.Module, unused: tuple[str, ...]) -> dict[str, str]:
    """How this rank left the gradients of parameters that take no part in the loss: none, zero or nonzero."""
    params = dict(module.named_parameters())
    forms = {}
    for name in unused:
        g = params[name].grad
        forms[name] = "none" if g is None else ("zero" if not bool(g.any()) else "nonzero")
    return forms


def _measure(cfg: RunConfig, env: launch.LaunchEnv, adapter: Adapter, workload: Workload, step_fn: _Step,
             watchdog: Watchdog, global_batch: int, local_batch: int) -> dict[str, Any] | None:
    """Measurement phase: warm-up, then `measure_steps` timed steps with nothing else running, then the
    ablation (pairs of the same step with gradient synchronisation on and off, no optimizer step)."""
    if cfg.measure_steps == 0:
        return None
    wrapped = adapter.wrapped
    first = cfg.steps  # steps continue the verification phase's data stream
    for i in range(cfg.warmup_steps):
        x, y = step_fn.inputs(*shard(workload.make_batch(first + i, global_batch), env.rank, env.world_size))
        step_fn.forward_backward(x, y)
        adapter.reduce()
        step_fn.update()
        watchdog.beat("warmup", first + i)

    batches = [step_fn.inputs(*shard(workload.make_batch(first + cfg.warmup_steps + i, global_batch), env.rank,
                                     env.world_size)) for i in range(cfg.measure_steps)]
    clock = clocks.SegmentClock(step_fn.device, enabled=cfg.instrument)
    memory = clocks.MemoryWindow(step_fn.device)
    comm_reason = adapter.no_communication_reason()
    workdir = tempfile.mkdtemp(prefix="dpcompare-")
    adapter.all_gather_object(None)  # line the ranks up: the window starts together
    if cfg.instrument:
        memory.reset()
        if comm_reason is None:
            adapter.comm_counters_begin(workdir)
    loop_start = time.perf_counter()
    for i, (x, y) in enumerate(batches):
        clock.start()
        step_fn.forward_backward(x, y)
        adapter.reduce()
        step_fn.update()
        clock.stop()
        clock.end_step()
        if cfg.instrument and comm_reason is None:
            adapter.comm_counters_step()
        watchdog.beat("measured", first + cfg.warmup_steps + i)
    if step_fn.device.type == "cuda":
        torch.cuda.synchronize()
    loop_ms = (time.perf_counter() - loop_start) * 1e3 / cfg.measure_steps
    comm = None
    mem = {"peak_mem_mib": None, "peak_mem_reserved_mib": None}
    if cfg.instrument:
        mem = memory.peak()
        comm = adapter.comm_counters_end() if comm_reason is None else None
        if comm and "total_ms" in comm:
            comm["steps"] = cfg.measure_steps
    shutil.rmtree(workdir, ignore_errors=True)

    # Ablation: the same step with gradient synchronisation on and off, in alternating blocks run like
    # the measured loop (no barrier between steps, so ranks run free as they do in training). No optimizer
    # step in either arm: the weights stay where the run left them, and the arms differ only by
    # communication. Medians absorb the one step per block that pays for the ranks drifting apart.
    synced = clocks.SegmentClock(step_fn.device)
    unsynced = clocks.SegmentClock(step_fn.device)
    pairs = cfg.measure_steps if cfg.ablation_steps is None else cfg.ablation_steps
    if comm_reason is None and not adapter.capabilities.can_disable_sync:
        comm_reason = f"{adapter.name} cannot switch gradient synchronisation off"
    if cfg.instrument and comm_reason is None and pairs:
        block = min(ABLATION_BLOCK, pairs)
        done = {True: 0, False: 0}
        sync = True
        while done[True] < pairs or done[False] < pairs:
            arm = synced if sync else unsynced
            for _ in range(min(block, pairs - done[sync])):
                x, y = batches[(done[True] + done[False]) % len(batches)]
                arm.start()
                step_fn.forward_backward(x, y, comm=sync)
                if sync:
                    adapter.reduce()
                adapter.zero_grad()
                arm.stop()
                arm.end_step()
                done[sync] += 1
            watchdog.beat("ablation", done[True] + done[False])
            sync = not sync

    sample = measure.RankSample(clock.step_ms(), synced.step_ms(), unsynced.step_ms(), mem, memory.reason, comm)
    gathered = adapter.all_gather_object((sample, loop_ms))
    if not env.is_rank0:
        return None
    grad_bytes = sum(p.numel() * p.element_size() for p in wrapped.module.parameters() if p.requires_grad)
    message, message_reason = adapter.message_bytes(grad_bytes)
    microbench, microbench_reason = _microbench_busbw(cfg, adapter.capabilities.collective_transport, env.world_size,
                                                    message or grad_bytes)
    metrics = measure.summarize(
        [g[0] for g in gathered], world_size=env.world_size, local_batch=local_batch,
        tokens_per_sample=workload.tokens_per_sample, warmup_steps=cfg.warmup_steps, grad_bytes=grad_bytes,
        message_bytes=message, message_reason=message_reason,
        model_state=clocks.model_state_mib(wrapped.module, wrapped.optimizer, adapter.comm_buffer_bytes(grad_bytes)),
        microbench_busbw=microbench, microbench_reason=microbench_reason, scaling=cfg.scaling,
        comm_possible=comm_reason, instrumented=cfg.instrument,
    )
    metrics["loop_ms_per_step"] = max(g[1] for g in gathered)
    return metrics


def _microbench_busbw(cfg: RunConfig, adapter_transport: str, world_size: int, nbytes: int) -> tuple[float | None, str | None]:
    if world_size < 2:
        return None, "one rank: nothing crosses a link"
    if not cfg.collectives:
        return None, "no microbenchmark given: run `python -m dpcompare bench-collectives` and pass --collectives FILE"
    import json

    try:
        data = json.loads(Path(cfg.collectives).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--collectives={cfg.collectives!r} cannot be read as JSON ({exc}): pass a bench-collectives result") from None
    transport = adapter_transport
    value = busbw_at(data, transport, world_size, nbytes)
    return value, None if value is not None else f"the microbenchmark has no {transport} entry at world size {world_size}"


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
    def f(x: float | None, spec: str) -> str:  # a non-finite figure is stored as null
        return "non-finite" if x is None else format(x, spec)

    parts = []
    ratio = e["noise_ratio"]
    if e["checked_steps"]:
        parts.append(f"gradient: max rel fro err {f(e['max_rel_fro_err'], '.2e')}, {f(ratio, '.2f')}x noise floor "
                     f"{f(e['noise_floor_rel_fro'], '.2e')}")
    checks = e.get("checks") or {}
    update, trajectory = checks.get("update") or {}, checks.get("trajectory") or {}
    if update.get("status") not in (None, "off", "unverifiable"):
        parts.append(f"update: {f(update['noise_ratio'], '.2f')}x floor, ||update||/||reference|| "
                     f"{f(update['norm_ratio'], '.4g')}")
    if trajectory.get("status") not in (None, "off", "unverifiable"):
        parts.append(f"trajectory: {f(trajectory['noise_ratio'], '.2f')}x floor")
    detail = "; ".join(parts) or "no figures"
    if e["tolerance"].get("compression", "none") != "none":
        detail += f" ({e['tolerance']['compression']} on the wire, tolerance widened to match)"
    m = payload.get("metrics")
    if m and m.get("step_ms_p50") is not None:
        detail += f"; step p50 {m['step_ms_p50']:.1f} ms, {m['samples_per_s']:.0f} samples/s"
    if e["first_divergence"]:
        d = e["first_divergence"]
        detail += f"; first divergence at step {d['step']} ({d.get('check', 'gradient')} check), {d['parameter']}: {d['reason']}"
    if e.get("unverifiable_reason"):
        detail += f"; unverifiable: {e['unverifiable_reason']}"
    detail += "; replicas identical" if e["replicas_identical"] else "; REPLICAS DIFFER"
    return f"{head} ({detail}) -> {payload.get('result_path')}"
