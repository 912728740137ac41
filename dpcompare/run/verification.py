"""The verification phase: `cfg.steps` training steps, each held against the float64 oracle.

Owns: the cross-rank side of verification. At checked steps every rank sends rank 0 its shard's digest,
its reduced gradients' digests, how it left unused parameters' gradients and its module buffers before the
forward and after the backward; at every step of a model that draws random numbers, the random numbers its
forward drew (recorded by dpcompare.verify.randomness.draw_recording around the forwards and backwards) and its generator's digest. Rank 0's `Verifier`
(dpcompare.verify.phase.verifier) checks the gradient against the oracle, under --clip-grad-norm the total norm the
backend clipped by against the oracle's, the update against a reference optimizer step (clipped as the run asks)
and, after every step, the parameters against the reference trajectory. The replicas'
weights are compared after checked steps and the last one, and the ranks' generators where the forward
draws random numbers.
"""

from __future__ import annotations

import contextlib
import socket
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from dpcompare import json_files
from dpcompare.contract import batches
from dpcompare.contract import Adapter, Note
from dpcompare.measure import clocks, memory
from dpcompare.run.config import CommandLineError, RunConfig
from dpcompare.run.optim import optimizer_factory
from dpcompare.run import checkpoint, state_table
from dpcompare.run.step import StepRunner
from dpcompare.verify.model_facts import buffer_semantics
from dpcompare.verify.oracle import gradient_oracle as eq
from dpcompare.verify.randomness import draw_recording as mk
from dpcompare.verify.memory import oracle_coverage as oc
from dpcompare.verify.memory import divider
from dpcompare.verify.judgement import held_values
from dpcompare.verify.starting_state import initial_state
from dpcompare.verify.starting_state import loaded_state
from dpcompare.verify.randomness import random_modules
from dpcompare.verify.phase import verifier
from dpcompare.verify.model_facts.replica_forwards import split_masks
from dpcompare.verify.instruments.check_context import CheckContext, CheckSettings
from dpcompare.verify.judgement.precision_recipe import Recipe
from dpcompare.verify.trajectory.reference_trajectory import Trajectory


class VerificationPhase:
    def __init__(self, cfg: RunConfig, adapter: Adapter, runner: StepRunner, template: torch.nn.Module,
                 is_rank0: bool) -> None:
        self.cfg, self.adapter, self.runner, self.template = cfg, adapter, runner, template
        self.wrapped = adapter.wrapped
        self.facts = adapter.model_facts
        self.names = [n for n, _ in template.named_parameters()]
        """Every parameter, in the order the ranks' digests list them (the wrapped module's names are the template's)."""
        self.rank0 = is_rank0
        self.check: verifier.Verifier | None = None
        # Under --compile a random forward is unverifiable (verify/opening.py): recording would only keep Dynamo from compiling.
        self.recorder = mk.MaskRecorder(self.wrapped.module) if self.facts.stochastic and not cfg.compile else None
        self.cost = VerificationCost(self.runner.device) if cfg.check_every else None
        """This rank's time and memory for checking (the oracle, the references, the trajectory; on a rank other than
        0, its share of their forwards), beside the step's; rank 0 reports every rank's."""
        crosses = cfg.save_checkpoint is not None or cfg.load_checkpoint is not None
        self.peers = divider.Peers.make() if cfg.check_every and cfg.oracle_ranks == "all" and not crosses else None
        """The verifier's own process group, where there are ranks to share the oracle's forwards with (None: one
        process, or no torch.distributed group: Horovod)."""
        self.divider: divider.Divider | None = None
        self.helper: divider.Helper | None = None
        self.state: dict[str, Any] | None = None
        """What every rank holds for the model's state after the first step (dpcompare.run.state_table); None: the
        run took no step."""
        self.loaded: checkpoint.Loaded | None = None
        """What this run loaded (--load-checkpoint), and the step it starts at."""
        self.start = 0
        if crosses and cfg.check_every and cfg.oracle_ranks == "all" and self.runner.world_size > 1:
            self.wrapped.notes.append(Note("oracle_rank0", "the reference trajectory crosses a checkpoint, so rank 0 "
                                           "holds it whole and runs the oracle's forwards alone (--oracle-ranks rank0)"))

    def run(self) -> eq.Verdict:
        with checked_arithmetic(self.runner.device) as tf32:
            if self.cost is not None:
                self.cost.open(self.adapter)
            if self.cfg.load_checkpoint is not None:  # before the verifier: it judges what was loaded
                self.loaded = checkpoint.load(self.cfg, self.adapter, self.runner.device, self.runner.global_batch)
                self.start = self.loaded.start
            coverage = self._plan_oracle_coverage()
            with self._costed(setup=True):
                self.verdict = self._start(coverage)
            if self.verdict.precision is not None:
                self.verdict.precision.tf32 = tf32
            for step in range(self.start, self.start + self.cfg.steps):
                self._step(step)
            if self.check is not None:
                self.check.finish()
            if self.cfg.save_checkpoint is not None:
                self._save()
            if self.cost is not None:
                self.cost.close(self.cfg.steps, len(self.verdict.checks) if self.check is not None else 0,
                                self.check.part_s if self.check is not None else None)
                self.cost.per_rank(self.adapter.all_gather_object(self.cost.figures))
        if self.check is not None and self.cfg.dump_grads:
            _save_npz_atomic(Path(self.cfg.dump_grads), self.check.dumps, self.cfg.closed_if)
        return self.verdict

    def _plan_oracle_coverage(self) -> oc.OracleCoverage | None:
        """Rank 0 plans what the oracle checks within the memory free (dpcompare.verify.memory.oracle_coverage); every rank
        learns the plan, so a refusal ends every rank alike, in one line said by rank 0."""
        plan: oc.OracleCoverage | str | None = None
        device = self.runner.device
        pools = None
        if self.peers is not None:  # every rank's memory: the ranks that share the oracle's forwards hold copies too
            pool = (socket.gethostname(), device.type, device.index if device.type == "cuda" else None)
            pools = self.adapter.all_gather_object((pool, oc.available_bytes(device)))
        if self.rank0 and self.cfg.check_every:
            kwargs = dict(request=self.cfg.check_coverage, optimizer=self.cfg.optimizer,
                          dtype_bytes=eq.DTYPES[self.cfg.dtype].itemsize, device=device,
                          refuse_partial=self._partial_refusal())
            try:
                plan = oc.plan_ranks(self.template, pools, **kwargs) if pools else oc.plan(self.template, **kwargs)
            except oc.OracleCoverageRefused as exc:
                plan = str(exc)
        plan = self.adapter.all_gather_object(plan)[0]
        if isinstance(plan, str):
            raise CommandLineError(plan)
        return plan

    def _partial_refusal(self) -> str | None:
        if self.cfg.clip_grad_norm is not None:
            return "--clip-grad-norm clips by the global norm of every parameter's gradient"
        if self.cfg.amp == "fp16":
            return "--amp fp16's loss scaler skips a step when any gradient overflows"
        return None

    def _start(self, coverage: oc.OracleCoverage | None) -> eq.Verdict:
        """Rank 0's verifier (initial weights against the workload's), then every rank's initial weights."""
        if self.cfg.check_every:
            ctx = check_context(self.cfg, self.adapter, self.template, self.runner.device, self.runner.world_size,
                                coverage, getattr(self.runner.workload.loss_fn, "count", None),
                                workload=self.runner.workload)
            if self.rank0:
                self.divider = divider.Divider(self.peers, ctx.layout) if self.peers is not None else None
                self.check = verifier.Verifier(ctx, template=self.template, loss_fn=self.runner.workload.loss_fn,
                                               wrapped=self.wrapped, backend=self.adapter, divider=self.divider)
            elif self.peers is not None:
                oc.unchecked_frozen(self.template, ctx.unchecked)  # as rank 0's copies: the same gradients
                loss_fn = self.runner.workload.loss_fn
                # its range of the reference trajectory, built as rank 0's Bench builds its own
                trajectory = Trajectory(self.template, loss_fn, ctx.factory, ctx.settings.dtype, self.runner.device,
                                        ctx.depth, ctx.u_wire, ctx.recipe, prestep=ctx.prestep is not None,
                                        clip=ctx.settings.clip_grad_norm, peers=self.peers)
                self.helper = divider.Helper(self.peers, self.template, loss_fn, layout=ctx.layout,
                                             dtype=eq.DTYPES[self.cfg.dtype], device=self.runner.device,
                                             recipe=ctx.recipe, trajectory=trajectory, factory=ctx.factory)
        full = self.adapter.full_params()  # on every rank: a collective where the backend shards its parameters
        held = self.adapter.all_gather_object(initial_state.held(full, self.wrapped.module))
        verdict = self.check.verdict if self.check is not None else eq.Verdict(notes=list(self.wrapped.notes))
        if self.loaded is not None:  # what was loaded against what was saved, not the workload's initial weights
            self._judge_loaded(verdict, full)
        elif self.rank0:  # every parameter against the workload's where there is a verifier
            initial_state.judge(verdict, self.template, dict(self.facts.built_apart), full, self.wrapped.module, held,
                          every_parameter=self.check is not None)
        return verdict

    def _judge_loaded(self, verdict: eq.Verdict, full: dict[str, torch.Tensor]) -> None:
        """Every rank reads what it loaded (collectives where the backend shards it); rank 0 judges it against what the
        saving run read, and its trajectory continues the saved run's."""
        assert self.loaded is not None
        masters = self.adapter.master_params()
        state = self.adapter.optimizer_state()
        scaler = self.adapter.scaler_state()
        rngs = self.adapter.all_gather_object(random_modules.capture(self.runner.device))
        if not self.rank0:
            return
        saved = self.loaded.saved()
        for text in self.loaded.notes:
            verdict.note("checkpoint", text)
        record = loaded_state.judge_loaded(verdict, saved, self.loaded.loop, params=full, masters=masters, state=state,
                                     scale=scaler.scale if scaler is not None else None, rngs=rngs, start=self.start)
        verdict.checkpoint = {"loaded": dict(record, directory=str(self.loaded.directory))}
        if self.check is not None:
            self.check.resume(saved)

    def _save(self) -> None:
        step = self.start + self.cfg.steps
        trajectory = self.check.bench.trajectory if self.check is not None else None
        checkpoint.save(self.cfg, self.adapter, self.runner.device, step, trajectory)
        if self.rank0:
            self.verdict.checkpoint = dict(self.verdict.checkpoint or {}, saved={
                "directory": self.cfg.save_checkpoint, "step": step,
                "format": checkpoint.format_of(self.cfg, self.adapter, "save-checkpoint")})

    def _step(self, step: int) -> None:
        checked = self.cfg.check_every > 0 and step % self.cfg.check_every == 0
        batch, x, y = self.runner.batch(step)
        rng = random_modules.capture(self.runner.device) if self.facts.stochastic else None
        before = buffer_semantics.snapshot(self.wrapped.module) if checked else None
        gathered: list[dict[str, Any]] = []
        reduced: list[dict[str, Any]] = []

        def after_reduce() -> None:
            # Gradients are global now and the parameters are those the gradients were taken at. Every rank reads
            # them (collectives where the backend shards them); rank 0 judges.
            if forward_dtypes is not None:  # the gradients as this rank holds them after the reduce
                reduced.append(state_table.grads_now(self.adapter))
            reads = self._reads() if checked else None
            if self.cost is not None:  # the run's own gradients and optimizer state, as they stand at the reduce
                self.cost.note_run_state(self.adapter)
            if checked or self.facts.stochastic:
                gathered.extend(self.adapter.all_gather_object(self._evidence(x, rng, reads, before)))
            if self.check is not None:
                with self._costed(), self._sharing():
                    self.check.after_reduce(step, batch, gathered, reads)
            elif self.helper is not None:
                del reads  # sent in its evidence: not held while this rank serves its share of the forwards
                with self._costed():
                    self.helper.serve(batch, self._masks_of(batch, gathered))

        def after_update() -> None:
            if forward_dtypes is not None:  # every rank: what it holds, read after the first step's update
                self.state = state_table.section(self.adapter.all_gather_object(
                    state_table.read(self.adapter, forward_dtypes.close(), reduced[0] if reduced else None)))
            masters = self.adapter.master_params() if self.cfg.check_every else None  # every rank, as above
            if self.check is not None:
                with self._costed(), self._sharing():  # with the norm the backend clipped by (--clip-grad-norm)
                    self.check.after_update(step, masters, self.runner.grad_norm)
            elif self.helper is not None:
                with self._costed():
                    self.helper.serve(batch, self._masks_of(batch, gathered))
            if checked or step == self.start + self.cfg.steps - 1:
                self._compare_replicas(step)

        # Under --compile no hook is added to the compiled forward (it would recompile): its forward is not read.
        forward_dtypes = state_table.ForwardDtypes(self.wrapped.module, hooked=not self.cfg.compile) \
            if step == self.start else None
        try:
            self.runner.step(step, x, y, phase="verify", after_reduce=after_reduce, after_update=after_update,
                             recording=self.recorder.recording if self.recorder is not None else None)
        finally:
            if forward_dtypes is not None:
                forward_dtypes.close()

    @contextlib.contextmanager
    def _sharing(self):
        """Rank 0's checks of one point of the step; then (also where they raised) the helpers stop serving it."""
        if self.divider is not None:
            self.divider.open()
        try:
            yield
        finally:
            if self.divider is not None:
                self.divider.done()

    def _masks_of(self, batch, gathered: list[dict[str, Any]]):
        """The draws of every forward of the step, unpacked on demand from what every rank recorded (None: the forward
        draws nothing, or this step's draws were not gathered)."""
        records = [i.get("masks") for i in gathered]
        if not self.facts.stochastic or not records or any(r is None for r in records):
            return lambda: None
        return lambda: split_masks(eq.Layout(self.runner.world_size, self.cfg.grad_accum,
                                             self.adapter.replicas_per_process()), batches.rows(batch[0]), records)

    @contextlib.contextmanager
    def _costed(self, setup: bool = False):
        """The checks' own work (rank 0's, or a helper's share): timed, and with freed host pages kept for its next
        allocation (held_values.pages_kept)."""
        with self.cost.timing(setup) if self.cost is not None else contextlib.nullcontext(), held_values.pages_kept():
            yield

    def _reads(self) -> verifier.Reads:
        """The reduced gradients, the values the optimizer steps and its state, full, read on every rank."""
        return verifier.Reads(self.adapter.reduced_grads(), self.adapter.master_params(), self.adapter.optimizer_state())

    def _evidence(self, x: torch.Tensor, rng: Any, reads: verifier.Reads | None,
                  before: buffer_semantics.Buffers | None) -> dict[str, Any]:
        mine = {"shard": eq.tensor_digest(x), "rng": rng}
        if self.recorder is not None:
            mine["masks"] = self.recorder.take()
        if reads is not None:
            # Every rank's reduced gradient, by digest: compared across the ranks (one rank: nothing to compare it to)
            mine["grads"] = (eq.grad_digests(reads.grads, self.names) if self.runner.world_size > 1
                             else ["one rank"] * len(self.names))
            mine["grad_norms"] = {n: float(torch.linalg.vector_norm(g.detach().double())) for n, g in reads.grads.items()
                                  if g is not None}
            mine["unused"] = _unused_grad_forms(reads.grads, self.facts.unused)
            mine["buffers"] = {"before": before, "after": buffer_semantics.snapshot(self.wrapped.module)}
        return mine

    def _compare_replicas(self, step: int) -> None:
        """After rank 0's extra work (oracle, trajectory): this gather is also where the ranks line up again. The
        parameters compared are the full ones (gathered where the backend shards them). One rank: one replica."""
        if self.runner.world_size == 1:
            return
        mismatch = eq.first_mismatch(self.adapter.all_gather_object(eq.param_digests(self.adapter.full_params())),
                                     self.names)
        if not (self.rank0 and mismatch):
            return
        self.verdict.replicas_identical = False
        if self.verdict.checks and self.verdict.checks[-1].step == step:
            self.verdict.checks[-1].replicas_identical = False
        self.verdict.diverge(eq.Divergence(
            step, mismatch[1], float("nan"), 0.0, float("nan"),
            f"after the optimizer step rank {mismatch[0]} holds different values of {mismatch[1]} "
            "than rank 0: the replicas diverged", check="replicas", cause="replicas"))


def check_context(cfg: RunConfig, adapter: Adapter, template: torch.nn.Module, device: torch.device, world_size: int,
                  coverage: oc.OracleCoverage | None, items: Callable[[torch.Tensor], int] | None = None,
                  workload: Any = None) -> CheckContext:
    """What every check of this run is judged with, built once on rank 0 after wrapping (the backend's precision recipe
    and its wire are known then): the run's settings the checks read, typed, and the facts of the run. `items`: how
    many items a forward's targets hold, for a loss over items (dpcompare.contract.normalisation)."""
    settings = CheckSettings(dtype=cfg.dtype, amp=cfg.amp, sync_bn=cfg.sync_bn, compile=cfg.compile,
                             clip_grad_norm=cfg.clip_grad_norm, grad_accum=cfg.grad_accum, lr=cfg.lr,
                             weight_decay=cfg.weight_decay, check_every=cfg.check_every, dump_grads=cfg.dump_grads)
    unchecked = coverage.unchecked if coverage is not None else frozenset()
    named = list(template.named_parameters())
    batchnorms = tuple(n for n, m in template.named_modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm))
    return CheckContext(
        settings=settings, world_size=world_size, depth=eq.depth_of(template),
        names=tuple(n for n, p in named if p.requires_grad and n not in unchecked),
        all_names=tuple(n for n, _ in named), factory=optimizer_factory(cfg, template, workload), device=device,
        layout=eq.Layout(world_size, cfg.grad_accum, adapter.replicas_per_process(), items,
                         cfg.loss_normalisation == "global"), facts=adapter.model_facts,
        batchnorms=batchnorms, oracle_coverage=coverage, recipe=Recipe(adapter.amp_recipe(), cfg.amp, device.type, adapter.gathered_parameters,
                                                                 adapter.wraps_module_boundaries()),
        wire=adapter.gradient_wire(), wired=adapter.gradient_wire_parameters(), prestep=adapter.optimizer_prestep(),
        shards=getattr(adapter.capabilities, "shards", "none"), replay_reason=adapter.rng_replay_reason())


class VerificationCost:
    """Rank 0's cost of checking: the wall time of its verifier's work (building the float64 oracle and the references,
    then each step's checks and reference trajectory; CUDA synchronised at both ends), and the peak memory of the
    verification phase with what it rose above the memory held before the verifier was built (CUDA:
    max_memory_allocated; CPU: the resident high-water mark). The figures go to the result's metrics beside the
    measured step's own: `verify_ms_per_step`, `verify_setup_ms`, `verify_peak_mib`, `verify_above_start_mib`. The
    run's own gradients and optimizer state are first allocated by its first step, inside the window: what they add
    (`verify_run_state_mib`: the adapter's model_state_tensors() other than the parameters, counted once per storage,
    at its largest over the phase's reduces, less what it was at the start) is stated, and the rest is the checks'
    own (`verify_checking_mib`)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.window = clocks.MemoryWindow(device)
        self.setup_s = 0.0
        self.steps_s = 0.0
        self.figures: dict[str, Any] = {}
        self._run_state: list[int | None] = []
        """The run's own state bytes (not its parameters) at the start, then at each reduce (None: unreadable)."""

    def open(self, adapter: Any = None) -> None:
        self.window.reset()
        if adapter is not None:
            self.note_run_state(adapter)

    def note_run_state(self, adapter: Any) -> None:
        """The run's own gradients, optimizer state, master copies and communication buffers, now."""
        try:
            census = memory.census_bytes(adapter.model_state_tensors())
        except Exception:  # noqa: BLE001 - an adapter that cannot list them: the figure is not stated
            self._run_state.append(None)
            return
        self._run_state.append(sum(v for k, v in census.items() if k != "params"))

    def _run_state_mib(self) -> float | None:
        if len(self._run_state) < 2 or any(v is None for v in self._run_state):
            return None
        return max(0, max(self._run_state[1:]) - self._run_state[0]) / 2**20

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def timing(self, setup: bool):
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            elapsed = time.perf_counter() - start
            if setup:
                self.setup_s += elapsed
            else:
                self.steps_s += elapsed

    def per_rank(self, every: list[dict[str, Any]]) -> None:
        """Every rank's figures (`every`, in rank order) beside this rank's: `verify_*_per_rank`."""
        if len(every) > 1:
            for key in ("verify_ms_per_step", "verify_peak_mib", "verify_above_start_mib", "verify_checking_mib"):
                self.figures[f"{key}_per_rank"] = [f.get(key) for f in every]

    def close(self, steps: int, checked: int, parts: dict[str, float] | None = None) -> None:
        """`parts`: the verifier's seconds by part of the checks (Verifier.part_s), stated per step beside the whole as
        `verify_ms_by_part`."""
        peak = self.window.peak()
        above, run = self.window.above_start(peak), self._run_state_mib()
        self.figures = {
            "verify_ms_per_step": 1e3 * self.steps_s / steps if steps else None,
            "verify_ms_by_part": ({name: 1e3 * s / steps for name, s in parts.items()} if parts and steps else None),
            "verify_setup_ms": 1e3 * self.setup_s,
            "verify_steps": steps,
            "verify_checked_steps": checked,
            "verify_peak_mib": peak.get("peak_mem_mib"),
            "verify_above_start_mib": above,
            "verify_run_state_mib": run,
            "verify_checking_mib": None if run is None or above is None else above - run,
            "verify_mem_method": ("cuda max_memory_allocated" if self.device.type == "cuda" else
                                  "resident high-water mark (VmHWM)") if peak.get("peak_mem_mib") is not None
            else self.window.reason,
        }


@contextlib.contextmanager
def checked_arithmetic(device: torch.device):
    """The verification steps on CUDA run float32 as float32: TF32 off for matmuls and convolutions and cuDNN's
    deterministic algorithms, restored afterwards, so the measured steps keep the user's settings. With TF32 a
    float32 run's reference is ~1e-3 relative from float64 per layer, and its floor on a deep network can exceed 1:
    no check would see a doubled update. Yields what was set and what the checks ran with, for the result."""
    cuda = torch.backends.cuda.matmul
    cudnn = torch.backends.cudnn
    user = {"matmul_allow_tf32": bool(cuda.allow_tf32), "cudnn_allow_tf32": bool(cudnn.allow_tf32),
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "cudnn_benchmark": bool(cudnn.benchmark), "cudnn_deterministic": bool(cudnn.deterministic)}
    if device.type != "cuda":
        yield dict(user, checked_with="as set (TF32 is a CUDA setting)", checked_matmul_allow_tf32=False,
                   checked_cudnn_allow_tf32=False)
        return
    precision = user["float32_matmul_precision"]
    try:
        cuda.allow_tf32, cudnn.allow_tf32 = False, False
        torch.set_float32_matmul_precision("highest")
        cudnn.benchmark, cudnn.deterministic = False, True
        yield dict(user, checked_with="TF32 off and deterministic cuDNN during the checked steps; the measured steps "
                   "keep the settings above", checked_matmul_allow_tf32=False, checked_cudnn_allow_tf32=False)
    finally:
        cuda.allow_tf32, cudnn.allow_tf32 = user["matmul_allow_tf32"], user["cudnn_allow_tf32"]
        torch.set_float32_matmul_precision(precision)
        cudnn.benchmark, cudnn.deterministic = user["cudnn_benchmark"], user["cudnn_deterministic"]


def _unused_grad_forms(grads: dict[str, torch.Tensor | None], unused: tuple[str, ...]) -> dict[str, str]:
    """How this rank left the gradients of parameters that take no part in the loss: none, zero or nonzero."""
    forms = {}
    for name in unused:
        g = grads.get(name)
        forms[name] = "none" if g is None else ("zero" if not bool(g.any()) else "nonzero")
    return forms


def _save_npz_atomic(path: Path, arrays: dict[str, np.ndarray], unless: str | None) -> None:
    with json_files.atomic_file(path, "wb", unless=unless) as f:
        np.savez(f, **arrays)
