"""The Trainer: one training run for every backend, with the equivalence check built in.

Owns: the run from launch detection to the written result. It never branches on a backend's name: what
differs between backends is behind the adapter contract (dpcompare.contract) and its declared
capabilities. Reads top to bottom as: detect -> choose the backend and its settings -> set up -> build
(model, optimizer, wrap) -> verification phase -> measurement phase -> compare replicas -> write. The step
body is dpcompare.run.step; the phases are dpcompare.run.verification and dpcompare.run.measurement.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import time
from typing import Any, Iterator

from torch import nn

from dpcompare import results
from dpcompare.contract import Adapter, Note
from dpcompare.contract import checkpointing
from dpcompare.contract import launch_env as launch
from dpcompare.contract.workload import block_modules
from dpcompare.run import backend, compilation, hf_models, leave, raised, registry
from dpcompare.run.config import CommandLineError, RunConfig, SaidByAnotherRank
from dpcompare.run.measurement import MeasurementPhase
from dpcompare.run.optim import make_optimizer
from dpcompare.run.step import StepRunner
from dpcompare.run.verification import VerificationPhase
from dpcompare.run.watchdog import Watchdog
from dpcompare.run.workloads import Workload
from dpcompare.verify import equivalence as eq
from dpcompare.verify import float64_paths, initial, stochastic, verifier


def load_workload(cfg: RunConfig) -> Workload:
    if hf_models.is_hf(cfg.model):
        workload = hf_models.build(cfg.model, cfg.seed, cfg.seq_len)
        _check_workload_flags(cfg, workload)
        return workload
    factory = registry.load(cfg.model, registry.MODELS, "model")
    if not callable(factory):
        raise ValueError(f"--model {cfg.model}: {type(factory).__name__} is not callable; give a function (seed) -> Workload")
    try:
        workload = factory(cfg.seed)
    except Exception as exc:
        if cfg.model in registry.MODELS:
            raise
        raise registry.UserCodeError(f"--model {cfg.model}: your function raised {type(exc).__name__}: {exc} "
                                     "(it is called as function(seed: int) and must return a Workload)") from exc
    if not isinstance(workload, Workload):
        raise ValueError(f"--model {cfg.model}: the function must return dpcompare.Workload, got {type(workload).__name__}")
    _check_workload_flags(cfg, workload)
    return workload


def _check_workload_flags(cfg: RunConfig, workload: Workload) -> None:
    if cfg.activation_checkpointing and not block_modules(workload.model):
        raise ValueError(f"--activation-checkpointing is invalid for --model {cfg.model}: it names no block to recompute "
                         "(no _no_split_modules, no nn.Sequential or nn.ModuleList of modules with parameters); drop "
                         "--activation-checkpointing")
    if cfg.sync_bn and not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in workload.model.modules()):
        raise ValueError(f"--sync-bn is invalid for --model {cfg.model}: it has no BatchNorm layer, so there are no "
                         "statistics to synchronise; drop --sync-bn")


@contextlib.contextmanager
def _said_by_rank0() -> Iterator[None]:
    """Settings refused for the command line alone are refused alike on every rank: they leave as CommandLineError."""
    try:
        yield
    except CommandLineError:
        raise
    except ValueError as exc:
        if isinstance(exc, registry.UserCodeError):
            raise
        raise CommandLineError(str(exc)) from exc


def run(cfg: RunConfig) -> dict[str, Any]:
    env = launch.detect()
    with _said_by_rank0():
        cfg.validate()
    if env.is_rank0:
        cfg.check_inputs()  # before any work: an input read only after the run would lose it
        cfg.check_outputs()  # before any work: a result that cannot be written would lose the whole run
    adapter_cls = backend.load_adapter_class(cfg, env)
    with _said_by_rank0():
        settings = backend.settings_for(adapter_cls, cfg)  # every --opt checked before anything starts
        global_batch, local_batch = cfg.batch_sizes(env.world_size)
    if cfg.compile:
        compilation.require_compiler()  # every rank: the compiler is this host's
    workload = load_workload(cfg)
    device = launch.pick_device(cfg.device, env.local_rank)
    adapter = adapter_cls(env, device, settings)
    watchdog: Watchdog | None = None
    clean = False
    try:
        adapter.setup(cfg.timeout_s)
        watchdog = Watchdog(rank=env.rank, world_size=env.world_size, job_id=env.job_id, timeout_s=cfg.timeout_s).start()
        if env.world_size > 1:
            watchdog.name_the_culprit_on_sigterm()
        template = _build(cfg, env, adapter, workload, device, global_batch, local_batch)
        runner = StepRunner(adapter=adapter, workload=workload, device=device, dtype=eq.DTYPES[cfg.dtype],
                            grad_accum=cfg.grad_accum, watchdog=watchdog, rank=env.rank, world_size=env.world_size,
                            global_batch=global_batch, clip_grad_norm=cfg.clip_grad_norm, inject_fault=cfg.inject_fault,
                            inject_slowdown=cfg.inject_slowdown,
                            compile_log=compilation.CompileLog() if cfg.compile else None)
        verification = VerificationPhase(cfg, adapter, runner, template, env.is_rank0)
        verdict = verification.run()
        metrics = MeasurementPhase(cfg, adapter, runner, local_batch, env.is_rank0).run()
        if verification.cost is not None and cfg.check_every:
            metrics = {**(metrics or {"measured_steps": 0}), **verification.cost.figures}
        _compare_final_replicas(adapter, verdict, env.is_rank0)
        payload = None
        if env.is_rank0:
            payload = _write_result(cfg, env, adapter, workload, template, verdict, metrics, global_batch, local_batch,
                                    runner.compile_log)
        # Nobody leaves before rank 0 has written: a launcher may kill stragglers once one rank exits.
        adapter.all_gather_object(None)
        clean = True
        return payload or {}
    except CommandLineError:  # decided on rank 0 for every rank (the oracle's memory): said once, by rank 0
        if watchdog is not None:
            watchdog.quiet_on_sigterm()
        raise
    except raised.ModelRaised as exc:  # the model's own code raised in a step: the build-time line, exit 2
        error = registry.UserCodeError(exc.line(cfg.model, yours=cfg.model not in registry.MODELS))
        _said_by_this_rank(watchdog, env, error)
        raise error from exc.original
    except ValueError as exc:  # a setting the run refused on its way (e.g. DDP's find_unused_parameters=false)
        _said_by_this_rank(watchdog, env, exc)
        raise
    except RuntimeError as exc:
        # A collective that timed out or lost a peer: say which rank fell behind, not only what broke.
        if watchdog is not None and env.world_size > 1:
            if watchdog.peer_said() is not None:  # lost the peer that has said why the run ends: nothing to add
                raise SaidByAnotherRank() from exc
            first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            culprit = watchdog.culprits_after_failure()
            watchdog.end_stopped_peers()  # the launcher could not end a suspended rank; the run is over
            raise RuntimeError(f"{first_line}; culprit: {culprit}") from exc
        raise
    finally:
        if watchdog is not None:
            watchdog.stop(clean=clean)
        _release(adapter)


RANK0_SAYS_WITHIN_S = 3.0
"""How long a rank other than 0 that fails on an error it would say waits for rank 0 to say it (every rank meets
the same model and the same settings): then it leaves the line to rank 0."""


def _said_by_this_rank(watchdog: Watchdog | None, env: launch.LaunchEnv, error: Exception) -> None:
    """This rank leaves on `error`, which it says itself: its heartbeat says so first (its peers, whose collectives fail
    once it is gone or whom the launcher stops, leave without a line of their own). A rank other than 0 whose rank 0
    says it too leaves the line to rank 0 (SaidByAnotherRank: it waits, silent, for the launcher to end it); one whose
    rank 0 stays silent says it at once (`rank0_silent`: the command line need not wait for rank 0 again)."""
    if watchdog is None or env.world_size == 1:
        return
    watchdog.quiet_on_sigterm()
    watchdog.say_leaving()
    if env.rank != 0:
        if watchdog.wait_for_said(0, RANK0_SAYS_WITHIN_S):
            raise SaidByAnotherRank(wait_for_launcher=True) from error
        error.rank0_silent = True  # type: ignore[attr-defined]


def _release(adapter: Adapter) -> None:
    """A backend of one process for all replicas (reference, dp): its full teardown. A backend of one process per
    replica (a process group, Horovod's runtime), one rank or several: only what must happen before a process leaves
    (Adapter.before_exit); its process group and the wrapper holding it stay alive until the command line leaves with
    os._exit (dpcompare.run.leave: destroying a gloo process group can deadlock, one rank's as well)."""
    if not adapter.capabilities.multi_process or not leave.leaves_by_exit():  # in-process (a test): torn down
        adapter.teardown()
        return
    leave.hold(adapter)
    adapter.before_exit()


def _build(cfg: RunConfig, env: launch.LaunchEnv, adapter: Adapter, workload: Workload, device, global_batch: int,
           local_batch: int):
    """Model, optimizer and the backend's wrapper, on every rank; returns the untouched template (the
    architecture the oracle and the reference trajectory copy)."""
    switched = stochastic.switch_off_dropout(workload.model) if cfg.no_dropout else []
    # Before anything is wrapped (a backend broadcasts rank 0's weights, or shards each rank's own): did every rank
    # build the same model? Every rank learns every rank's answer, so a refusal ends them all alike.
    built = initial.compare(adapter.all_gather_object(initial.describe(workload.model)))
    if built.refusal is not None:
        raise CommandLineError(f"--model {cfg.model}: {built.refusal}")
    template = copy.deepcopy(workload.model)
    # Rank 0 probes the model before wrapping (unused parameters decide DDP's find_unused_parameters);
    # every rank takes rank 0's answer.
    facts = None
    if env.is_rank0:
        facts = verifier.probe(template, workload.loss_fn, workload.make_batch(0, global_batch), device)
    facts = dataclasses.replace(adapter.all_gather_object(facts)[0], built_apart=tuple(built.values.items()))
    # Same seed for the weights (above), a seed of its own per rank for what the forward draws (seed 000).
    stochastic.seed_rank(cfg.seed, env.rank)
    module = workload.model.to(device=device, dtype=eq.DTYPES[cfg.dtype])
    if cfg.sync_bn:
        module = adapter.sync_batchnorm(module)
    # The trainable parameters alone: torch never steps a parameter without a gradient, and DeepSpeed's ZeRO 1/2 take
    # their gradient buffers' dtype from the first parameter of the first group (stage_1_and_2.py, `self.dtype`): an
    # integer parameter listed first (an index kept as a parameter) would make them integer.
    optimizer = make_optimizer(cfg, [p for p in module.parameters() if p.requires_grad])
    adapter.model_facts = facts
    blocks = adapter.checkpoint_activations(module) if cfg.activation_checkpointing else []
    wrapped = adapter.wrap(module, optimizer, local_batch, global_batch)
    if blocks:
        wrapped.notes.append(Note("activation_checkpointing", checkpointing.describe(wrapped.module)))
    if cfg.compile:
        adapter.compile()
    if cfg.no_dropout:
        wrapped.notes.append(Note("dropout_off", stochastic.no_dropout_note(switched, facts)))
    wrapped.model.train()  # once: every step trains (the oracle and the shadow have their own copies)
    return template


def _compare_final_replicas(adapter: Adapter, verdict: eq.Verdict, is_rank0: bool) -> None:
    full = adapter.full_params()  # on every rank: gathered where the backend shards its parameters
    mismatch = eq.first_mismatch(adapter.all_gather_object(eq.param_digests(full)), list(full))
    if is_rank0 and mismatch and verdict.replicas_identical:
        verdict.replicas_identical = False
        verdict.note("replicas", f"after the last step rank {mismatch[0]} holds different values of {mismatch[1]}")


def _write_result(cfg: RunConfig, env: launch.LaunchEnv, adapter: Adapter, workload: Workload, template,
                  verdict: eq.Verdict, metrics: dict[str, Any] | None, global_batch: int, local_batch: int,
                  compile_log: compilation.CompileLog | None = None) -> dict[str, Any]:
    caps = adapter.capabilities
    policy = eq.tolerance_policy(cfg.dtype, env.world_size, eq.depth_of(template), adapter.gradient_wire())
    payload = results.base_payload(
        backend=cfg.backend, launcher=env.launcher, world_size=env.world_size, device=str(adapter.device),
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
    variant = backend.variant_name(type(adapter), dict(adapter.settings.options))
    payload["variant"] = variant
    payload["activation_checkpointing"] = checkpointing.record(adapter.wrapped.module)
    path = results.result_path(cfg.out, cfg.backend, env.world_size, workload.name, variant)
    payload = results.sanitize(payload)
    results.validate(payload)
    results.write_atomic(path, payload, unless=cfg.closed_if)
    payload["result_path"] = str(path)
    return payload


def _semantic_facts(e: dict[str, Any]) -> list[str]:
    """What the backend computes that a single process would not, in a phrase each (the notes say it in full)."""
    facts = []
    bn = e.get("batchnorm") or {}
    if bn.get("semantics") == "per_replica":
        distance = (f"{bn['floors']:.3g}x floor from the global batch" if bn.get("floors") is not None
                    else "distance from the global batch not measured")
        facts.append(f"per-replica BatchNorm over {bn['local_batch']} samples: {distance} (--sync-bn makes it one "
                     "computation)")
    split = e.get("split") or {}
    if split.get("semantics") == "per_replica":
        facts.append(f"the forward depends on how the batch is split: judged as the ranks' forwards, "
                     f"{split['distance_rel_fro']:.3g} (relative) from the global batch's gradient")
    elif split.get("semantics") == "loss_not_mean":
        facts.append(f"the loss is not a mean over its samples: the ranks' split computes {split['scale']:.4g}x the "
                     "global batch's gradient")
    if any(n.get("code") == "initial_weights_built_apart" for n in e.get("notes") or []):
        facts.append("the ranks built different initial weights; the backend gave every rank rank 0's")
    differ = [b for b in e.get("buffers") or [] if not b.get("ranks_agree", True)]
    if differ:
        follows = sorted({s for b in differ for s in b.get("nearest", b.get("semantics")) or []}) or ["no known semantics"]
        facts.append(f"{len(differ)} buffer(s) differ across ranks ({', '.join(follows)})")
    return facts


def _precision_facts(e: dict[str, Any]) -> list[str]:
    """The mixed-precision recipe and what its loss scaler skipped, in a phrase each."""
    p = e.get("precision") or {}
    tf32 = p.get("tf32") or {}
    on = [k for k in ("matmul_allow_tf32", "cudnn_allow_tf32") if tf32.get(k)]
    facts = ([f"checked with TF32 off and deterministic cuDNN, measured with the settings as set "
              f"({', '.join(on)})"] if on and str(tf32.get("checked_with", "")).startswith("TF32 off") else [])
    if p.get("amp", "none") == "none":
        return facts
    facts.append(f"--amp {p['amp']} {p['recipe']} recipe")  # a 16-bit wire is said with the tolerance, above
    if p.get("loss_scaler"):
        skipped = p.get("skipped_steps") or []
        total = p.get("skipped_total")
        unchecked = f" ({total} in all, unchecked steps counted)" if total is not None and total > len(skipped) else ""
        facts.append(f"loss scale {_power_of_two(p['initial_scale'])} at the start, " +
                     (f"step(s) {', '.join(map(str, skipped))} skipped on overflow{unchecked}" if skipped else
                      f"no checked step skipped{unchecked}" if unchecked else "no step skipped"))
        if skipped and not e.get("checked_steps"):
            facts.append("every checked step overflowed and was skipped, so no gradient was compared: run more --steps "
                         "or start from a smaller --loss-scale")
    return facts


def _compile_phrase(c: dict[str, Any]) -> str:
    """--compile: compile time, graphs, breaks and recompilations, and the measured steps they cost."""
    def n(x: int | None, word: str) -> str:
        return f"? {word}s" if x is None else f"{x} {word}{'' if x == 1 else 's'}"

    seconds = "?" if c.get("compile_s") is None else f"{c['compile_s']:.1f}"
    text = (f"compiled in {seconds} s apart from the step time: {n(c.get('graphs'), 'graph')} ("
            f"{n(c.get('compiled_graphs'), 'compiled piece')}), {n(c.get('graph_breaks'), 'graph break')}, "
            f"{n(c.get('recompiles'), 'recompilation')}")
    if c.get("graphs") == 0:
        text += " (NOTHING COMPILED: the model ran eagerly)"
    if c.get("measured_steps_excluded"):
        text += f", {c['measured_steps_excluded']} measured step(s) that compiled left out"
    return text


def _power_of_two(x: float) -> str:
    exponent = math.log2(x) if x > 0 else math.nan
    return f"2^{exponent:.0f}" if math.isfinite(exponent) and exponent == round(exponent) else f"{x:g}"


def _coverage_phrase(coverage: dict | None) -> str:
    if not coverage or not coverage.get("left_out"):
        return ""
    return (f", {coverage['parameters_judged']} of {coverage['parameters']} parameters judged one by one "
            f"({coverage['elements_judged']} of {coverage['elements']} elements; the rest too noisy alone, in the "
            "whole-model check)")


def summary_line(payload: dict[str, Any]) -> str:
    e = payload["equivalence"]
    name = payload["backend"] + (f":{payload['variant']}" if payload.get("variant") else "")
    head = f"{name} ws={payload['world_size']} {payload['model']} [{payload['launcher']}]: {e['verdict']}"
    config = payload.get("config") or {}
    about_the_run = []  # what the run chose, and what it did not do
    if config.get("scaling", "strong") == "strong" and "global_batch" in config and config["global_batch"] is None:
        about_the_run.append(f"global batch {payload['global_batch']} chosen for {payload['world_size']} rank(s) "
                             "(--global-batch sets it)")
    if config.get("measure_steps") == 0:
        about_the_run.append("costs not measured (--measure-steps 0): add --measure-steps 20 to measure them")
    if e["verdict"] == "unchecked":
        detail = "; ".join(about_the_run)
        return f"{head}{f' ({detail})' if detail else ''} -> {payload.get('result_path')}"
    def f(x: float | None, spec: str) -> str:  # a non-finite figure is stored as null
        return "non-finite" if x is None else format(x, spec)

    parts = []
    ratio = e["noise_ratio"]
    checks = e.get("checks") or {}
    gradient, update, trajectory = checks.get("gradient") or {}, checks.get("update") or {}, checks.get("trajectory") or {}
    if e["checked_steps"]:
        t = e.get("tolerance") or {}
        dp = gradient.get("dp_floor_rel_fro")
        u_sum = t.get("unit_roundoff") if t.get("wire_rounding") == "measured" else t.get("unit_roundoff_wire")
        floor = (max(dp, t["depth"] * t["unit_roundoff"]) + t["world_size"] * u_sum
                 if dp is not None and {"depth", "unit_roundoff", "world_size", "unit_roundoff_wire"} <= set(t) else dp)
        parts.append(f"gradient: {f(ratio, '.2f')}x its data-parallel floor {f(floor, '.2e')}, "
                     f"max rel fro err {f(e['max_rel_fro_err'], '.2e')} from float64 (the {config.get('dtype', 'float32')}"
                     f"{' ' + config['amp'] if config.get('amp', 'none') != 'none' else ''} reference's "
                     f"{f(e['noise_floor_rel_fro'], '.2e')})")
    if update.get("status") not in (None, "off", "unverifiable"):
        parts.append(f"update: {f(update['noise_ratio'], '.2f')}x floor, ||update||/||reference|| "
                     f"{f(update['norm_ratio'], '.4g')}")
    if trajectory.get("status") not in (None, "off", "unverifiable"):
        parts.append(f"trajectory: {f(trajectory['noise_ratio'], '.2f')}x floor")
    norm = checks.get("grad_norm") or {}
    if norm.get("status") not in (None, "off", "unverifiable"):
        clipped = norm.get("clipped_steps") or []
        parts.append(f"grad_norm: {f(norm['noise_ratio'], '.2f')}x floor, clipped at {norm['clip']:g} at "
                     + (f"step(s) {', '.join(map(str, clipped))} (unclipped norm above it)" if clipped else
                        "no checked step (the unclipped norm stayed below it)"))
    if e.get("min_detectable_rel") is not None:
        parts.append(f"catches a change of {e['min_detectable_rel']:.2g} (relative) in the gradient or the update"
                     + _coverage_phrase(gradient.get("coverage")))
    if (cov := e.get("oracle_coverage")) is not None:
        parts.append(f"ORACLE COVERAGE {cov['fraction']:.0%} of the parameters ({len(cov['units_checked'])} of "
                     f"{len(cov['units_checked']) + len(cov['units_unchecked'])} units; --check-coverage)")
    detail = "; ".join(parts) or "no figures"
    if e["tolerance"].get("compression", "none") != "none":
        detail += (f" ({e['tolerance']['compression']} on the wire, its rounding "
                   + ("measured in the data-parallel floor)" if e["tolerance"].get("wire_rounding") == "measured"
                      else "bounded: tolerance widened to match)"))
    m = payload.get("metrics")
    if m and m.get("step_ms_p50") is not None:
        detail += f"; step p50 {m['step_ms_p50']:.1f} ms, {m['samples_per_s']:.3g} samples/s"
    if payload.get("compile"):
        detail += "; " + _compile_phrase(payload["compile"])
    if e["first_divergence"]:
        d = e["first_divergence"]
        detail += f"; first divergence at step {d['step']} ({d.get('check', 'gradient')} check), {d['parameter']}: {d['reason']}"
    if e.get("unverifiable_reason"):
        detail += f"; unverifiable: {e['unverifiable_reason']}"
    detail += checkpointing.summary_phrase(payload.get("activation_checkpointing"), m)
    detail += "; replicas identical" if e["replicas_identical"] else "; REPLICAS DIFFER"
    detail += "".join(f"; {fact}" for fact in _precision_facts(e) + _semantic_facts(e)
                      + float64_paths.phrases(e.get("oracle_precision")))
    return f"{head} ({'; '.join([detail, *about_the_run])}) -> {payload.get('result_path')}"
