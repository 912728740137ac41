"""The adapter contract: the only surface through which the trainer touches a backend.

Owns: the `Adapter` base class, `ModelFacts` (what the trainer found out about the model before wrapping) and
`Wrapped` (what `wrap` returns). The data an adapter declares (`Capabilities`, `Option`, `Settings`, `Note`) is
dpcompare.contract.capabilities', its native communication counter (`CommCounter` -> `CommCounts`)
dpcompare.contract.comm_counter's; both are importable from here too. An adapter translates; it holds no timers,
no comparisons and no file I/O: measurement times what the counter points at. Imports no adapter.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Mapping

import torch
from torch import nn

from dpcompare.contract import amp as precision
from dpcompare.contract.activation_checkpointing import checkpoint_blocks
from dpcompare.contract.checkpoint_io import load_state, save_state
from dpcompare.contract.launch_env import LaunchEnv
from dpcompare.contract.amp import ScalerState
from dpcompare.contract.capabilities import Capabilities, Note, Option, Settings
from dpcompare.contract.comm_counter import CommCounter, CommCounts, CounterWindow
from dpcompare.contract.compiling import compile_forward
from dpcompare.contract.scheduling import then_scheduler, wrap_step_override


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What the trainer found out about the model before wrapping it (one float64 forward/backward of the
    first global batch on rank 0, shared with every rank), for adapters whose wrapper must know."""

    unused: tuple[str, ...] = ()
    """Trainable parameters that take no part in the loss (their gradient stays None)."""
    frozen: tuple[str, ...] = ()
    """Parameters with requires_grad=False: never updated, left out of every check."""
    random_modules: tuple[str, ...] = ()
    """Modules that draw random numbers in training mode (dropout, drop path, any random op in their forward)."""
    random_ops: tuple[str, ...] = ()
    """What they draw with, each as "module (Type) op", in the order the forward first calls it."""
    stochastic: bool = False
    """Two forwards of the same input differ: the forward draws random numbers."""
    uncaptured: str | None = None
    """The module that draws random numbers no replay reaches, and how (None: every draw is replayed)."""
    built_apart: tuple[tuple[str, tuple[int, ...]], ...] = ()
    """Parameters and buffers whose values the ranks built differently (before wrapping), each with the ranks whose
    values differ from rank 0's."""
    data_reads: str | None = None
    """Where the forward reads the data into Python ('module (Class) (call)'): a tensor's value (`.item()`, `if t:`) or
    a size its values decide (`nonzero`, `x[mask]`); where it branches on the data, if anywhere; None when it never
    reads it. Only there can which parameters take part change with the batch."""
    branches_on_data: bool = False
    """The forward sizes tensors by their values (`nonzero`, `x[mask]`: routing samples to experts) or the model's own
    code reads a tensor's value into Python (`if t.any():`): the parameters it uses can change with the data."""
    left_out_by_parts: tuple[str, ...] = ()
    """Trainable parameters the whole first batch uses but some part of it (a rank's shard, say) leaves out."""
    sparse_grads: tuple[str, ...] = ()
    """Parameters whose gradient is sparse (nn.Embedding(sparse=True); dpcompare.contract.sparse)."""

    def varying_use(self) -> str | None:
        """Why the parameters one rank's forward uses can differ from another's at a step, as the probe saw it (parts of
        the first batch leave some out), in words; None when it saw no such part."""
        if not self.left_out_by_parts:
            return None
        names, more = ", ".join(self.left_out_by_parts[:4]), len(self.left_out_by_parts) - 4
        return (f"parts of the first batch leave {names}{f' and {more} more' if more > 0 else ''} out (the forward "
                f"reads the data at {self.data_reads})")


@dataclass(slots=True)
class Wrapped:
    model: nn.Module
    """What the trainer calls for the forward pass (DDP module, DeepSpeed engine, DataParallel, ...)."""
    module: nn.Module
    """The underlying module whose parameters hold the weights and the reduced gradients."""
    optimizer: Any
    notes: list[Note] = field(default_factory=list)
    """Known semantic differences this backend introduces, stated for the verdict."""


class Adapter:
    """Base class with the single-process behaviour; backends override what differs.

    Call order per run: setup -> wrap -> per step [sync(enabled) around forward+backward, backward,
    reduce, step, zero_grad] -> teardown. After `reduce()` returns, every parameter's `.grad` on every rank
    holds the mean of the per-rank gradients (the gradient of the global-batch loss).
    """

    name = "base"
    capabilities = Capabilities(multi_process=False, launchers=frozenset({"python"}), launch_hint="python -m dpcompare")
    OPTIONS: tuple[Option, ...] = ()
    """The `--opt` keys this backend accepts; any other key is refused before the run."""
    NATIVE_NAMES: Mapping[str, str] = {}
    """The backend's own names for settings every backend has (e.g. DDP's bucket_cap_mb for bucket_mb): given
    as `--opt`, they are refused with a pointer to the run flag."""
    VARIANTS: Mapping[str, Mapping[str, Any]] = {}
    """Named variants (`compare --backends deepspeed:zero2`): a name -> the `--opt` values it stands for."""

    @classmethod
    def world_size_refusal(cls, world_size: int, options: Mapping[str, Any]) -> str | None:
        """Why this backend, with these `--opt` values (typed), cannot run at `world_size` (None: it can). The run
        refuses it before it starts; compare leaves that job out and says why."""
        return None

    @classmethod
    def precision_refusal(cls, amp: str, options: Mapping[str, Any]) -> str | None:
        """Why this backend, with these `--opt` values (typed), cannot run `--amp amp` on this machine (None: it can).
        The run refuses it before it starts; compare leaves that job out and says why."""
        return None

    @classmethod
    def sparse_gradient_refusal(cls, settings: Settings) -> str | None:
        """Why this backend, with these settings, cannot take a parameter's sparse gradient (nn.Embedding(sparse=True)),
        as a clause (None: it can). The run refuses such a model before it trains, in one line naming the parameter
        (dpcompare.contract.sparse.refusal)."""
        return None

    @classmethod
    def optimizer_refusal(cls, settings: Settings, optimizer: torch.optim.Optimizer, scheduled: bool) -> str | None:
        """Why this backend, with these settings, cannot take the run's optimizer (a throwaway build over a copy of the
        model) or a learning-rate scheduler (`scheduled`), as a clause saying what to change (None: it can)."""
        return None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        wrap_step_override(cls)  # the scheduler steps once per training step, whatever the override does

    @classmethod
    def shared_device_refusal(cls) -> str | None:
        """Why this backend cannot run with several ranks on one GPU (None: it can, where it declares --opt
        dist_backend=gloo). compare leaves such jobs out on a node with fewer GPUs than ranks and says why."""
        return None

    def __init__(self, env: LaunchEnv, device: torch.device, settings: Settings | None = None) -> None:
        self.env = env
        self.device = device
        self.settings = settings or Settings(options={o.name: o.default for o in self.OPTIONS})
        self.wrapped: Wrapped | None = None
        self.model_facts = ModelFacts()
        """Set by the trainer before `wrap` (DDP needs `unused` for find_unused_parameters)."""
        self.scheduler_factory: Callable[[torch.optim.Optimizer], Any] | None = None
        """Set by the trainer before `wrap`: scheduler(optimizer) -> the run's learning-rate scheduler (None: none)."""
        self.scheduler: Any = None
        """The run's scheduler, built by `wrap` (DeepSpeed's `lr_scheduler=`) or `start_scheduler()`; None: none."""
        self.scheduler_steps_in_step = False
        """The backend's own step steps the scheduler (DeepSpeed's engine.step()): `step()` leaves it alone."""
        self._scaling: precision.GradScaling | None = None
        self._step_depth = 0

    # -- lifecycle -------------------------------------------------------------------------------
    def setup(self, timeout_s: float) -> None:
        """Start the backend's runtime (process group, hvd.init, ...)."""

    def sync_batchnorm(self, module: nn.Module) -> nn.Module:
        """Return the module with BatchNorm computing global-batch statistics (identity when one replica)."""
        return module

    def checkpoint_activations(self, module: nn.Module) -> list[str]:
        """Under --activation-checkpointing, before `wrap`: make each of the module's blocks recompute its forward in
        backward, with the generator state of its forward (dropout draws the same masks); returns the blocks' names.
        Default: `dpcompare.checkpoint_blocks` (non-reentrant torch.utils.checkpoint)."""
        return checkpoint_blocks(module)

    def wrap(self, module: nn.Module, optimizer: torch.optim.Optimizer, local_batch: int, global_batch: int) -> Wrapped:
        self.wrapped = Wrapped(module, module, optimizer)
        return self.wrapped

    def start_scheduler(self) -> None:
        """After `wrap`: the run's scheduler, `scheduler_factory(wrapped.optimizer)`, unless `wrap` built it (the
        optimizer the training loop steps: DDP's and FSDP2's torch optimizer, Horovod's DistributedOptimizer)."""
        if self.scheduler is None and self.scheduler_factory is not None:
            assert self.wrapped is not None
            self.scheduler = self.scheduler_factory(self.wrapped.optimizer)

    def sync(self, enabled: bool) -> ContextManager[None]:
        """Context for forward+backward; enabled=False around every micro-batch of a step but its last (gradient
        accumulation) and in the ablation's unsynced arm: the gradients may stay local."""
        return contextlib.nullcontext()

    def comm_off(self) -> ContextManager[None]:
        """Context for the unsynced arm of the exposed-communication ablation: the enclosed forward and
        backward run as a synced step would, minus the communication. Default: sync(False)."""
        return self.sync(False)

    def autocast(self) -> ContextManager[None]:
        """Context for the forward and the loss: torch.autocast in the --amp dtype (a no-op without --amp)."""
        return precision.autocast(self.device, self.settings.amp)

    @property
    def grad_scaling(self) -> precision.GradScaling | None:
        """The torch.amp.GradScaler recipe under --amp fp16 (made on first use; None when the loss is not scaled).
        Backends with a loss scaler of their own (DeepSpeed) never touch it."""
        if self._scaling is None and self.settings.amp == "fp16":
            self._scaling = precision.GradScaling(self.device, self.settings.loss_scale or 2.0**16)
        return self._scaling

    def backward(self, loss: torch.Tensor) -> None:
        scaling = self.grad_scaling
        (scaling.scale(loss) if scaling is not None else loss).backward()

    def reduce(self) -> None:
        """Return when `.grad` holds the global mean (wait for outstanding communication); under a loss scale the
        mean of the scaled gradients."""

    def unscale(self) -> None:
        """After `reduce()`, before anything reads or steps the gradients: undo the loss scale, so `.grad` holds the
        global mean of the unscaled gradients (a no-op when the loss is not scaled). Not called on a step whose
        update is dropped (the ablation's arms)."""
        if self.grad_scaling is not None:
            assert self.wrapped is not None
            self.grad_scaling.unscale(self.wrapped.optimizer)

    def step(self) -> None:
        """The optimizer step; under a loss scale the scaler's, which skips it when the gradients hold inf or NaN.
        Then (any override's too: `__init_subclass__`) the scheduler's step, once, unless the backend's own step took
        it (`scheduler_steps_in_step`)."""
        assert self.wrapped is not None
        if self.grad_scaling is not None:
            self.grad_scaling.step(self.wrapped.optimizer)
        else:
            self.wrapped.optimizer.step()

    def compile(self) -> None:
        """Under --compile, after `wrap` and before the first step (only where `capabilities.compiles`): put the model's
        forward (and so its backward) under torch.compile, the backend's own hooks and communication around it as
        they run uncompiled. Default: `compile_forward(wrapped.module)`, in place, so whatever wrapper the trainer
        calls (DDP, an engine) calls the compiled forward."""
        assert self.wrapped is not None
        self.compile_module(self.wrapped.module)

    def compile_module(self, module: nn.Module) -> None:
        """Compile `module`'s forward in place with torch.compile (`compile_forward`): the default `compile()`'s tool,
        for a backend that compiles its model part by part."""
        compile_forward(module)

    def clip_grad_norm(self, max_norm: float) -> float | None:
        """Under --clip-grad-norm, after `unscale()` and the checks that read the reduced gradients, before `step()`:
        clip the reduced gradients by their global norm (coefficient min(1, max_norm / (norm + 1e-6))) and return that
        norm, taken before clipping, as the backend computed it; None where the backend clips inside its own `step()`
        (then `grad_norm_after_step()` reports it). Default: torch.nn.utils.clip_grad_norm_ on the wrapped module's
        parameters."""
        assert self.wrapped is not None
        params = [p for p in self.wrapped.module.parameters() if p.grad is not None]
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))

    def grad_norm_after_step(self) -> float | None:
        """After `step()`, where `clip_grad_norm` returned None: the total gradient norm the backend computed to clip
        in that step (before clipping), or None when it reports none. Default None."""
        return None

    def zero_grad(self) -> None:
        assert self.wrapped is not None
        self.wrapped.optimizer.zero_grad()  # set_to_none is the default; Horovod takes no argument

    def teardown(self) -> None:
        """Stop the backend's runtime; must not raise when setup failed half-way. Called for a backend of one process
        for all replicas (`capabilities.multi_process` False); one of a process per replica gets `before_exit`
        instead."""

    def before_exit(self) -> None:
        """A rank of a backend of one process per replica (`capabilities.multi_process`) is about to leave with
        os._exit (dpcompare.run.leave), its process group and wrapper left alive, since destroying them can deadlock:
        do what must still happen before a process leaves (MPI_Finalize, a shared file removed); must not raise when
        setup failed half-way. Default: nothing."""

    # -- what verification reads (where the backend keeps it) ------------------------------------
    # The full-value reads below are called on every rank at the same point of a step: where a backend shards
    # what they read (ZeRO, FSDP), each is a collective that assembles the full tensors from the ranks' parts.
    def full_params(self) -> dict[str, torch.Tensor]:
        """Every parameter of the model as the forward uses it (its dtype), full, by name. Called on every rank.
        Default: the wrapped module's parameters."""
        assert self.wrapped is not None
        return {n: p for n, p in self.wrapped.module.named_parameters()}

    def reduced_grads(self) -> dict[str, torch.Tensor | None]:
        """After `unscale()`: every trainable parameter's reduced, unscaled gradient by name, full, in the dtype the
        backend holds it (None: no gradient). Called on every rank. Default: `.grad` of the wrapped module's
        parameters."""
        assert self.wrapped is not None
        return {n: p.grad for n, p in self.wrapped.module.named_parameters() if p.requires_grad}

    def master_params(self) -> dict[str, torch.Tensor]:
        """The values the optimizer steps, full, by parameter name: fp32 master copies where the backend keeps them
        apart from the model's low-precision weights (DeepSpeed's bf16/fp16 engine, ZeRO's partitions), else the
        parameters. Called on every rank."""
        assert self.wrapped is not None
        return {n: p for n, p in self.wrapped.module.named_parameters()}

    def optimizer_state(self) -> dict[str, dict[str, Any]] | None:
        """The optimizer's state by parameter name, full (CPU copies), as a plain torch optimizer of the parameters
        would hold it; None when it cannot be read. Called on every rank. Default: the state of `optimizer_view()`'s
        optimizer, keyed by the tensors it steps."""
        from dpcompare.contract.optim_state import read_state  # the one reader of a torch optimizer's state

        optimizer, masters = self.optimizer_view()
        return read_state(optimizer, masters) if optimizer is not None else None

    def model_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this rank holds for the model's state, by component: params, grads, optimizer, master_params
        (fp32 copies apart from the parameters) and comm_buffers, each rank's own part only; measurement counts
        their bytes once per storage. Default: the parameters, their `.grad`, the state of `optimizer_view()`'s
        optimizer and the masters that are not the parameters."""
        assert self.wrapped is not None
        params = list(self.wrapped.module.parameters())
        own = {id(p) for p in params}
        optimizer, masters = self.optimizer_view()
        inner = optimizer if optimizer is not None else getattr(self.wrapped.optimizer, "optimizer", self.wrapped.optimizer)
        state = [v for per_param in getattr(inner, "state", {}).values() for v in per_param.values() if torch.is_tensor(v)]
        return {"params": params, "grads": [p.grad for p in params if p.grad is not None], "optimizer": state,
                "master_params": [t for t in masters.values() if id(t) not in own], "comm_buffers": []}

    def optimizer_view(self) -> tuple[torch.optim.Optimizer | None, dict[str, torch.Tensor]]:
        """The torch optimizer that steps `master_params()`, and those tensors by name (its state is keyed by
        them), or (None, ...) when no such optimizer can be found behind the backend's."""
        assert self.wrapped is not None
        masters = self.master_params()
        wanted = {id(masters[n]) for n, p in self.wrapped.module.named_parameters() if p.requires_grad}
        obj = self.wrapped.optimizer
        for _ in range(8):  # through wrappers that keep theirs in `.optimizer` (DeepSpeed's engine side)
            if obj is None:
                break
            if isinstance(obj, torch.optim.Optimizer) and wanted <= {id(p) for g in obj.param_groups for p in g["params"]}:
                return obj, masters
            obj = getattr(obj, "optimizer", None)
        return None, masters

    def scaler_state(self) -> ScalerState | None:
        """The loss scaler's scale and skipped steps (None when the loss is not scaled)."""
        return self.grad_scaling.state() if self.grad_scaling is not None else None

    def gradient_wire(self) -> str:
        """The dtype gradients are all-reduced in when it is narrower than the parameters': none, fp16 or bf16
        (the --compression given, or what the backend's precision recipe sends)."""
        return self.settings.compression

    def gradient_wire_parameters(self) -> frozenset[str] | None:
        """The parameters whose gradients travel in gradient_wire()'s dtype where only some do (DeepSpeed ZeRO under
        its torch_autocast section: its lower_precision_safe_modules' parameters); None: all of them."""
        return None

    def gathered_parameters(self) -> frozenset[str]:
        """The parameters the backend's latest forward saw gathered in the --amp dtype, so that every op of it saw them
        rounded (DeepSpeed ZeRO-3 under its torch_autocast section); empty: it saw them as stored."""
        return frozenset()

    def wraps_module_boundaries(self) -> bool:
        """Whether the backend's hooks pass every module's inputs and outputs through autograd functions (DeepSpeed
        ZeRO-3's parameter fetch and release), which sums a rank's gradients in another order than a plain model: the
        run-precision reference then draws the same boundaries (dpcompare.verify.oracle.module_boundaries)."""
        return False

    def optimizer_prestep(self) -> str | None:
        """A phrase naming the optimizer step(s) this backend takes on zero gradients before the first training step
        by design (DeepSpeed's fp16/bf16 optimizer wrappers do it when they are built), or None. The verifier then
        expects that state before step 0, states what it does to the first update, and its reference trajectory takes
        the same step; an undeclared one is a fault (Horovod's broadcast_optimizer_state trap)."""
        return None

    def amp_recipe(self) -> str:
        """The mixed-precision recipe that runs: none, autocast (torch.autocast, float32 parameters) or engine (the
        backend's own low-precision weights with fp32 master copies)."""
        return "none" if self.settings.amp == "none" else "autocast"

    # -- checkpoints (--save-checkpoint, --load-checkpoint) -------------------------------------------
    @classmethod
    def checkpoint_formats(cls) -> tuple[str, ...]:
        """The checkpoint formats (dpcompare.contract.checkpoint_io.FORMATS) this backend writes and reads, its own
        first; empty: none. Default: torch and dcp, through torch.distributed.checkpoint's state-dict API."""
        return ("torch", "dcp")

    def save_checkpoint(self, directory: str, fmt: str) -> None:
        """Write the model's and the optimizer's state to `directory` in `fmt`, by the backend's library; called on
        every rank after a step. Default: dpcompare.contract.checkpoint_io.save_state."""
        assert self.wrapped is not None
        save_state(self.wrapped.module, self.wrapped.optimizer, directory, fmt, self.env.rank)

    def load_checkpoint(self, directory: str, fmt: str) -> None:
        """Load `directory` (in `fmt`) into the wrapped model and its optimizer; called on every rank after `wrap`,
        before the first step. Default: dpcompare.contract.checkpoint_io.load_state."""
        assert self.wrapped is not None
        load_state(self.wrapped.module, self.wrapped.optimizer, directory, fmt)

    # -- what measurement needs to know (translations of the backend's own facts) -----------------
    def no_communication_reason(self) -> str | None:
        """Why this run has no gradient communication to measure, or None when it has some."""
        return "one process, no gradient communication" if self.env.world_size == 1 else None

    def link_transport(self) -> str | None:
        """The transport its gradients' collectives cross (metrics.link names its facts): nccl, gloo or mpi, None
        with one process. Default: the backend of torch.distributed's default process group."""
        import torch.distributed as dist

        if self.env.world_size < 2 or not dist.is_available() or not dist.is_initialized():
            return None
        name = str(dist.get_backend())
        if "nccl" in name and self.device.type == "cuda":
            return "nccl"
        return next((t for t in ("gloo", "mpi", "nccl") if t in name), name)

    def message_bytes(self, grad_bytes: int) -> tuple[int | None, str | None]:
        """Size of one all-reduce message (bucket / fusion buffer) for this model, or (None, reason)."""
        return None, "this backend does not bucket its gradients"

    def comm_buffer_bytes(self, grad_bytes: int) -> int | None:
        """Memory the backend holds for communication (buckets, fusion buffer, flat buffers)."""
        return 0

    def ablation_bytes(self) -> int:
        """Device memory that the ablation's unsynced arm holds for the whole measured window and a training step
        would not (a second wrapper's buckets, say): left out of peak_mem_mib. Asked after comm_off() was
        entered once, empty, before the warm-up. Default 0."""
        return 0

    def comm_counter(self) -> CommCounter | None:
        """The backend's own communication counter for a measured window, or None when it has none. Only
        asked for when instrumentation is on."""
        return None

    # -- control plane (small objects, not gradients) ---------------------------------------------
    def all_gather_object(self, obj: Any) -> list[Any]:
        """Gather a small picklable object from every rank, in rank order."""
        return [obj]

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """A small tensor summed over the ranks by the backend's own collective (the loss's item count under
        --loss-normalisation global, as a training loop sums transformers' num_items_in_batch); one process: itself."""
        return tensor

    def rng_replay_reason(self) -> str | None:
        """Why rank 0 cannot check this backend's random numbers: they are drawn somewhere the dropout modules'
        captured masks do not reach (not in the modules of `wrapped.module`), or None when they are captured."""
        return None

    def replicas_per_process(self) -> int:
        """Model replicas one process runs per step (nn.DataParallel over several devices; else 1): each
        normalises its own part of a micro-batch, and each draws its own dropout masks."""
        return 1

    def allreduce_sum_autograd(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """A differentiable all-reduce(sum), for global BatchNorm; None when there is one replica."""
        return None


Adapter.step = then_scheduler(Adapter.step)  # type: ignore[method-assign]


__all__ = ["Adapter", "Capabilities", "CommCounter", "CommCounts", "CounterWindow", "ModelFacts", "Note", "Option",
           "Settings", "Wrapped"]
