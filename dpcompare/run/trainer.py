"""The Trainer: one training run for every backend, with the equivalence check built in.

Owns: the run from launch detection to the written result. It never branches on a backend's name: what
differs between backends is behind the adapter contract (dpcompare.contract) and its declared
capabilities. Reads top to bottom as: detect -> choose the backend and its settings -> set up -> build
(model, optimizer, wrap) -> verification phase -> measurement phase -> compare replicas -> write. The step
body is dpcompare.run.step; the phases are dpcompare.run.verification and dpcompare.run.measurement; the result
written is dpcompare.run.result_writer's, the line printed dpcompare.run.line's.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import os
from pathlib import Path
from typing import Any, Iterator

from torch import nn

from dpcompare.contract import Adapter, Note
from dpcompare.contract import batches, activation_checkpointing
from dpcompare.contract import launch_env as launch
from dpcompare.contract import sparse
from dpcompare.contract import normalisation
from dpcompare.contract.normalisation import counted
from dpcompare.contract.workload import block_modules
from dpcompare.measure import link
from dpcompare.run import backend, checkpoint, compilation, hf_models, leave, raised, registry, result_writer
from dpcompare.run.config import CommandLineError, RunConfig, SaidByAnotherRank
from dpcompare.run.line import summary_line  # noqa: F401 - the run's line, printed by the command line
from dpcompare.run.measurement import MeasurementPhase
from dpcompare.run import optim
from dpcompare.run.step import StepRunner
from dpcompare.run.verification import VerificationPhase
from dpcompare.run.watchdog import Watchdog
from dpcompare.run.workloads import Workload
from dpcompare.verify.oracle import gradient_oracle as eq
from dpcompare.verify.starting_state import initial_state
from dpcompare.verify.randomness import random_modules
from dpcompare.verify.phase import verifier

FLIGHT_RECORDER_ENTRIES = 2000
"""Collectives each process group's Flight Recorder keeps (TORCH_FR_BUFFER_SIZE, unless the environment sets it)."""


def load_workload(cfg: RunConfig) -> Workload:
    if hf_models.is_hf(cfg.model):
        workload = hf_models.build(cfg.model, cfg.seed, cfg.seq_len, cfg.token_data)
        _check_workload_flags(cfg, workload)
        return workload
    factory = registry.load(cfg.model, registry.MODELS, "model")
    if not callable(factory):
        raise ValueError(f"--model {cfg.model}: {type(factory).__name__} is not callable; give a function (seed) -> Workload")
    try:
        workload = factory(cfg.seed, **_token_data(cfg, factory))
    except Exception as exc:
        if cfg.model in registry.MODELS:
            raise
        raise registry.UserCodeError(f"--model {cfg.model}: your function raised {type(exc).__name__}: {exc} "
                                     "(it is called as function(seed: int) and must return a Workload)") from exc
    if not isinstance(workload, Workload):
        raise ValueError(f"--model {cfg.model}: the function must return dpcompare.Workload, got {type(workload).__name__}")
    _check_workload_flags(cfg, workload)
    return workload


def counting(workload: Workload) -> Workload:
    """`workload` with its loss as the trainer and the checks call it (dpcompare.contract.normalisation.Counted)."""
    workload.loss_fn = counted(workload.loss_fn, workload.ignore_index, workload.items)
    return workload


def _token_data(cfg: RunConfig, factory: Any) -> dict[str, str]:
    """--token-data for a built-in token model (its factory takes `token_data`); refused for any other model."""
    takes = cfg.model in registry.MODELS and "token_data" in inspect.signature(factory).parameters
    if takes:
        return {"token_data": cfg.token_data}
    if cfg.token_data != "padded":
        raise CommandLineError(f"--token-data {cfg.token_data} is invalid for --model {cfg.model}: it sets the data of "
                               "the built-in token models (lm, gpt-*) and of hf: language models, and --model "
                               f"{cfg.model} makes batches of its own: drop --token-data")
    return {}


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
    if env.is_rank0:
        checkpoint.check_paths(cfg, adapter_cls)
    with _said_by_rank0():
        settings = backend.settings_for(adapter_cls, cfg)  # every --opt checked before anything starts
        global_batch, local_batch = cfg.batch_sizes(env.world_size)
        if cfg.inject_slowdown_rank is not None and not 0 <= cfg.inject_slowdown_rank < env.world_size:
            raise CommandLineError(f"--inject-slowdown-rank {cfg.inject_slowdown_rank}: use a rank from 0 to "
                                   f"{env.world_size - 1}")
    if cfg.compile:
        compilation.require_compiler()  # every rank: the compiler is this host's
    workload = counting(load_workload(cfg))
    with batches.convention(workload.forward, workload.sample_dim):  # every copy of the model called as the run calls it
        return _run(cfg, env, adapter_cls, settings, workload, global_batch, local_batch)


def _run(cfg: RunConfig, env: launch.LaunchEnv, adapter_cls: type[Adapter], settings, workload: Workload,
         global_batch: int, local_batch: int) -> dict[str, Any]:
    device = launch.pick_device(cfg.device, env.local_rank)
    adapter = adapter_cls(env, device, settings)
    watchdog: Watchdog | None = None
    clean = False
    try:
        # PyTorch's Flight Recorder keeps each process group's last collectives (NCCL and, since torch 2.8, gloo): a
        # rank the watchdog ends writes them beside the results (Watchdog.dump_collectives)
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(FLIGHT_RECORDER_ENTRIES))
        # NCCL says which algorithm and protocol it chose only in its own log: a traced CUDA run asks for it
        nccl_log = (link.ask_nccl_tuning(Path(cfg.out) / "nccl") if cfg.profile and device.type == "cuda" else
                    (None, "NCCL's choices are logged on runs asked to trace (--profile) on CUDA"))
        adapter.setup(cfg.timeout_s)
        watchdog = Watchdog(rank=env.rank, world_size=env.world_size, job_id=env.job_id, timeout_s=cfg.timeout_s).start()
        watchdog.dump_to = Path(cfg.out) / "flight-recorder" / watchdog.dir.name
        if env.world_size > 1:
            watchdog.name_the_culprit_on_sigterm()
        template = _build(cfg, env, adapter, workload, device, global_batch, local_batch)
        runner = StepRunner(adapter=adapter, workload=workload, device=device, dtype=eq.DTYPES[cfg.dtype],
                            grad_accum=cfg.grad_accum, watchdog=watchdog, rank=env.rank, world_size=env.world_size,
                            global_batch=global_batch, clip_grad_norm=cfg.clip_grad_norm, inject_fault=cfg.inject_fault,
                            inject_slowdown=cfg.inject_slowdown, slow_rank=cfg.inject_slowdown_rank,
                            compile_log=compilation.CompileLog() if cfg.compile else None,
                            loss_normalisation=cfg.loss_normalisation)
        verification = VerificationPhase(cfg, adapter, runner, template, env.is_rank0)
        verdict = verification.run()
        metrics = MeasurementPhase(cfg, adapter, runner, local_batch, env.is_rank0, template, nccl_log).run()
        if verification.cost is not None and env.is_rank0:
            metrics = {**(metrics or {"measured_steps": 0}), **verification.cost.figures}
        _compare_final_replicas(adapter, verdict, env.is_rank0)
        payload = None
        if env.is_rank0:
            payload = result_writer.write(cfg, env, adapter, workload, template, verdict, metrics, global_batch, local_batch,
                                   runner.compile_log, state=verification.state)
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
    except RuntimeError as exc:  # a collective that lost a peer names the culprit; this rank's own failure does not
        _failed(watchdog, env, exc)
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
    rank 0 stays silent says it at once (`rank0_silent`: the command line need not wait for rank 0 again).

    A rank other than 0 marks its heartbeat only once it knows it says the line: marked while it waited, a rank 0
    failing on the same error a moment later took the mark for the line said, left silent, and the launcher ended the
    waiting rank silent too (the run ended without a word)."""
    if watchdog is None or env.world_size == 1:
        return
    watchdog.quiet_on_sigterm()
    if env.rank != 0:
        if watchdog.wait_for_said(0, RANK0_SAYS_WITHIN_S):
            raise SaidByAnotherRank(wait_for_launcher=True) from error
        error.rank0_silent = True  # type: ignore[attr-defined]
    watchdog.say_leaving()


def _failed(watchdog: Watchdog | None, env: launch.LaunchEnv, exc: RuntimeError) -> None:
    """This rank fails on `exc`, not the model's code nor a setting. A collective that lost its peer or timed out
    (raised.collective_failed), or any failure while a peer is visibly gone: the line names the rank that stalled or
    was lost (the culprit), or none where that peer has said why the run ends (SaidByAnotherRank). Any other error is
    this rank's own (torch's, the backend's; nothing stalled): `exc` is its line, with no culprit, said as the model's
    errors are (`_said_by_this_rank`). Returns where `exc` is to be raised as it is."""
    if watchdog is None or env.world_size == 1:
        return
    if watchdog.peer_said() is not None:  # lost the peer that has said why the run ends: nothing to add
        raise SaidByAnotherRank() from exc
    if not raised.collective_failed(exc) and not watchdog.lost_peers():
        _said_by_this_rank(watchdog, env, exc)
        return
    first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    culprit = watchdog.culprits_after_failure()
    watchdog.end_stopped_peers()  # the launcher could not end a suspended rank; the run is over
    raise RuntimeError(f"{first_line}; culprit: {culprit}") from exc


def _probe(template: nn.Module, workload: Workload, batch, device, env: launch.LaunchEnv):
    """Rank 0's probe of the model (verifier.probe): the model's own code raising in its float64 forward or backward
    of the first global batch is the model's error (raised.ModelRaised), said as in a step."""
    try:
        return verifier.probe(template, workload.loss_fn, batch, device)
    except Exception as exc:
        if raised.model_raised(exc, raised.model_files(template, workload.loss_fn), frozenset()):
            raise raised.ModelRaised(exc, step=0, phase="probe, in float64 before wrapping", part=raised.part_of(exc),
                                     rank=env.rank, world_size=env.world_size) from exc
        raise


def batch_refusal(model: str, batch: Any, global_batch: int) -> str | None:
    """Why the first global batch cannot be split by samples (its structure, tensors that disagree on the number of
    samples, or not the global batch's number), or None."""
    try:
        n = batches.rows(*batches.pair(batch))
    except batches.BatchError as exc:
        return f"--model {model}: {exc}"
    if n != global_batch:
        return (f"--model {model}: make_batch(0, {global_batch}) returned {n} samples; it returns the whole global "
                f"batch of the step ({global_batch} samples), from which every rank takes its own")
    return None


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
    switched = random_modules.switch_off_dropout(workload.model) if cfg.no_dropout else []
    # Before anything is wrapped (a backend broadcasts rank 0's weights, or shards each rank's own): did every rank
    # build the same model? Every rank learns every rank's answer, so a refusal ends them all alike.
    built = initial_state.compare(adapter.all_gather_object(initial_state.describe(workload.model)))
    if built.refusal is not None:
        raise CommandLineError(f"--model {cfg.model}: {built.refusal}")
    template = copy.deepcopy(workload.model)
    # Rank 0 probes the model before wrapping (unused parameters decide DDP's find_unused_parameters);
    # every rank takes rank 0's answer.
    facts = refused = None
    if env.is_rank0:
        first = workload.make_batch(0, global_batch)
        refused = batch_refusal(cfg.model, first, global_batch)
        if refused is None:
            try:
                facts = _probe(template, workload, first, device, env)
                refused = normalisation.refusal(cfg.loss_normalisation, workload.loss_fn, batches.pair(first)[1],
                                                cfg.model)
            except normalisation.LossError as exc:  # what the loss returned: said before anything trains
                refused = f"--model {cfg.model}: {exc}"
    facts, refused = adapter.all_gather_object((facts, refused))[0]
    if refused is not None:
        raise CommandLineError(refused)
    facts = dataclasses.replace(facts, built_apart=tuple(built.values.items()))
    # A sparse gradient (nn.Embedding(sparse=True)) the backend or torch cannot take: refused before anything trains.
    refused = sparse.refusal(
        facts.sparse_grads, sparse.tables(template), cfg.backend, adapter.sparse_gradient_refusal(adapter.settings),
        optimizer=cfg.optimizer, weight_decay=cfg.weight_decay, clip_grad_norm=cfg.clip_grad_norm, dtype=cfg.dtype,
        compression=cfg.compression) if facts.sparse_grads else None
    if refused is not None:
        raise CommandLineError(refused)
    with _said_by_rank0():
        choice = optim.choose(cfg, workload)
    if (refused := optim.refusal(cfg, choice, template, adapter)) is not None:
        raise CommandLineError(refused)
    # Same seed for the weights (above), a seed of its own per rank for what the forward draws (seed 000).
    random_modules.seed_rank(cfg.seed, env.rank)
    module = workload.model.to(device=device, dtype=eq.DTYPES[cfg.dtype])
    if cfg.sync_bn:
        module = adapter.sync_batchnorm(module)
    # The run's optimizer (--optimizer, or the workload's) and schedule, refused on every rank alike where they cannot
    # run (probed on throwaway builds over copies of the template); each backend builds the scheduler its own way.
    optimizer = optim.build(cfg, choice, module)
    adapter.scheduler_factory = choice.scheduler
    adapter.model_facts = facts
    blocks = adapter.checkpoint_activations(module) if cfg.activation_checkpointing else []
    wrapped = adapter.wrap(module, optimizer, local_batch, global_batch)
    adapter.start_scheduler()
    if blocks:
        wrapped.notes.append(Note("activation_checkpointing", activation_checkpointing.describe(wrapped.module)))
    if cfg.compile:
        adapter.compile()
    if cfg.no_dropout:
        wrapped.notes.append(Note("dropout_off", random_modules.no_dropout_note(switched, facts)))
    if facts.sparse_grads:
        wrapped.notes.append(Note("sparse_gradients", sparse.note(facts.sparse_grads, sparse.tables(template))))
    wrapped.model.train()  # once: every step trains (the oracle and the shadow have their own copies)
    return template


def _compare_final_replicas(adapter: Adapter, verdict: eq.Verdict, is_rank0: bool) -> None:
    full = adapter.full_params()  # on every rank: gathered where the backend shards its parameters
    mismatch = eq.first_mismatch(adapter.all_gather_object(eq.param_digests(full)), list(full))
    if is_rank0 and mismatch and verdict.replicas_identical:
        verdict.replicas_identical = False
        verdict.note("replicas", f"after the last step rank {mismatch[0]} holds different values of {mismatch[1]}")
