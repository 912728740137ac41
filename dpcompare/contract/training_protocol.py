"""The training protocol: the part of the adapter contract through which the trainer drives a backend's steps.

Owns: `TrainingProtocol` (the lifecycle and the step: setup -> wrap -> per step [sync(enabled) around the forward
under autocast() and backward, backward, reduce, unscale, clip_grad_norm, step, zero_grad] -> teardown or
before_exit; what a backend declares before it runs: capabilities, OPTIONS, NATIVE_NAMES, VARIANTS and the refusals;
the run's learning-rate schedule; --amp's autocast and loss scaler, --compile, --clip-grad-norm, --sync-bn,
--activation-checkpointing; the control plane: small objects gathered, a small tensor summed), `ModelFacts` (what the
trainer found out about the model before wrapping) and `Wrapped` (what `wrap` returns). One of the four parts
`dpcompare.contract.adapter.Adapter` is composed of; the others are check_reads (what the checks read),
measurement_reads (what measurement reads) and checkpoint_io (`CheckpointIO`). Imports no adapter.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Mapping

import torch
from torch import nn

from dpcompare.contract import amp as precision
from dpcompare.contract.activation_checkpointing import checkpoint_blocks
from dpcompare.contract.capabilities import Capabilities, Note, Option, Settings
from dpcompare.contract.compiling import compile_forward
from dpcompare.contract.launch_env import LaunchEnv
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


class TrainingProtocol:
    """How the trainer drives the backend, with a single process's defaults: one replica, no wrapper, `backward`
    leaving the gradients in `.grad`, a plain torch optimizer stepped (through the GradScaler under --amp fp16).

    Call order per run: setup -> wrap -> per step [sync(enabled) around forward+backward, backward,
    reduce, step, zero_grad] -> teardown. After `reduce()` returns, every parameter's `.grad` on every rank
    holds the mean of the per-rank gradients (the gradient of the global-batch loss).

    What a backend must implement (the defaults are one process's, which hold no other ranks):
      capabilities       declared: `multi_process`, `launchers`, `native_launcher`, `launch_hint`;
      setup              start its runtime (a process group: `ProcessGroupMixin.init_process_group`);
      reduce             make `.grad` the mean over the ranks (or `wrap`, where its wrapper reduces during backward:
                         DDP, Horovod's DistributedOptimizer);
      all_gather_object, all_reduce_sum   the control plane over the ranks;
      sync_batchnorm, allreduce_sum_autograd   BatchNorm over the global batch, for --sync-bn.
    `ProcessGroupMixin` provides the control plane, global BatchNorm and teardown for a torch.distributed backend.
    Everything else has a default that any backend whose gradients stay local until `reduce()` can keep: `sync`
    (the trainer calls `reduce()` on synchronised steps only), autocast and the loss scaler, the scheduler, compile,
    clipping, zero_grad; a backend overrides `wrap`, `sync`, `backward` or `step` where its library does them itself.
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

    # -- control plane (small objects, not gradients) ---------------------------------------------
    def all_gather_object(self, obj: Any) -> list[Any]:
        """Gather a small picklable object from every rank, in rank order."""
        return [obj]

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """A small tensor summed over the ranks by the backend's own collective (the loss's item count under
        --loss-normalisation global, as a training loop sums transformers' num_items_in_batch); one process: itself."""
        return tensor

    def allreduce_sum_autograd(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """A differentiable all-reduce(sum), for global BatchNorm; None when there is one replica."""
        return None


TrainingProtocol.step = then_scheduler(TrainingProtocol.step)  # type: ignore[method-assign]
