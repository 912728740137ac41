"""The adapter contract: the only surface through which the trainer touches a backend.

Owns: the `Adapter` base class, `Capabilities` (what an adapter declares instead of the trainer branching
on its name) and `Wrapped`. An adapter translates; it holds no timers, no comparisons and no file I/O.
Imports no adapter.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager

import torch
from torch import nn

from dpcompare.run.launch import LaunchEnv


@dataclass(frozen=True, slots=True)
class Capabilities:
    multi_process: bool
    """One process per replica (ddp, horovod, deepspeed) rather than one process for all (reference, dp)."""
    launchers: frozenset[str]
    """Launchers this backend can run under; the trainer refuses others with the right command."""
    launch_hint: str
    """How to start it, shown when it was started wrongly."""
    can_disable_sync: bool = True
    """`sync(False)` really skips gradient communication for one step."""
    native_comm_counters: bool = False
    compressions: frozenset[str] = frozenset({"none"})
    """Gradient compressions (`--compression`) the backend offers."""
    has_buckets: bool = False
    """`--bucket-mb` changes its all-reduce message size."""
    collective_transport: str = "torch"
    """Which bench-collectives transport measures the link this backend's all-reduce uses."""


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What the trainer found out about the model before wrapping it (one float64 forward/backward of the
    first global batch on rank 0, shared with every rank), for adapters whose wrapper must know."""

    unused: tuple[str, ...] = ()
    """Trainable parameters that take no part in the loss (their gradient stays None)."""
    frozen: tuple[str, ...] = ()
    """Parameters with requires_grad=False: never updated, left out of every check."""
    random_modules: tuple[str, ...] = ()
    """Modules that draw random numbers in training mode (dropout)."""
    stochastic: bool = False
    """Two forwards of the same input differ: the forward draws random numbers."""


@dataclass(slots=True)
class Wrapped:
    model: nn.Module
    """What the trainer calls for the forward pass (DDP module, DeepSpeed engine, DataParallel, ...)."""
    module: nn.Module
    """The underlying module whose parameters hold the weights and the reduced gradients."""
    optimizer: Any
    notes: list[str] = field(default_factory=list)
    """Known semantic differences this backend introduces, stated for the verdict."""


class Adapter:
    """Base class with the single-process behaviour; backends override what differs.

    Call order per run: setup -> wrap -> per step [sync(enabled) around forward+backward, backward,
    reduce, step, zero_grad] -> teardown. After `reduce()` returns, every parameter's `.grad` on every rank
    holds the mean of the per-rank gradients (the gradient of the global-batch loss).
    """

    name = "base"
    capabilities = Capabilities(multi_process=False, launchers=frozenset({"python"}), launch_hint="python -m dpcompare")

    def __init__(self, env: LaunchEnv, device: torch.device, options: dict[str, str] | None = None) -> None:
        self.env = env
        self.device = device
        self.options = dict(options or {})
        self.wrapped: Wrapped | None = None
        self.model_facts = ModelFacts()
        """Set by the trainer before `wrap` (DDP needs `unused` for find_unused_parameters)."""

    # -- lifecycle -------------------------------------------------------------------------------
    def setup(self, timeout_s: float) -> None:
        """Start the backend's runtime (process group, hvd.init, ...)."""

    def sync_batchnorm(self, module: nn.Module) -> nn.Module:
        """Return the module with BatchNorm computing global-batch statistics (identity when one replica)."""
        return module

    def wrap(self, module: nn.Module, optimizer: torch.optim.Optimizer, local_batch: int, global_batch: int) -> Wrapped:
        self.wrapped = Wrapped(module, module, optimizer)
        return self.wrapped

    def sync(self, enabled: bool) -> ContextManager[None]:
        """Context for forward+backward; with enabled=False the step's gradients stay local."""
        return contextlib.nullcontext()

    def comm_off(self) -> ContextManager[None]:
        """Context for the unsynced arm of the exposed-communication ablation: the enclosed forward and
        backward run as a synced step would, minus the communication. Default: sync(False)."""
        return self.sync(False)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def reduce(self) -> None:
        """Return when `.grad` holds the global mean (wait for outstanding communication)."""

    def step(self) -> None:
        assert self.wrapped is not None
        self.wrapped.optimizer.step()

    def zero_grad(self) -> None:
        assert self.wrapped is not None
        self.wrapped.optimizer.zero_grad()  # set_to_none is the default; Horovod takes no argument

    def teardown(self) -> None:
        """Stop the backend's runtime; must not raise when setup failed half-way."""

    # -- what measurement needs to know (translations of the backend's own facts) -----------------
    def no_communication_reason(self) -> str | None:
        """Why this run has no gradient communication to measure, or None when it has some."""
        return "one process, no gradient communication" if self.env.world_size == 1 else None

    def message_bytes(self, grad_bytes: int) -> tuple[int | None, str | None]:
        """Size of one all-reduce message (bucket / fusion buffer) for this model, or (None, reason)."""
        return None, "this backend does not bucket its gradients"

    def comm_buffer_bytes(self, grad_bytes: int) -> int | None:
        """Memory the backend holds for communication (buckets, fusion buffer, flat buffers)."""
        return 0

    def comm_counters_begin(self, workdir: str) -> None:
        """Start the backend's own communication counter for a measurement window."""

    def comm_counters_step(self) -> None:
        """Called after every measured step, for counters that only hold the latest step."""

    def comm_counters_end(self) -> dict[str, Any]:
        """The window's totals: {'total_ms', 'overlap_ms' (or None), 'method'} or {'reason'}."""
        return {"reason": f"{self.name} exposes no communication counter"}

    # -- control plane (small objects, not gradients) ---------------------------------------------
    def all_gather_object(self, obj: Any) -> list[Any]:
        """Gather a small picklable object from every rank, in rank order."""
        return [obj]

    def rng_replay_reason(self) -> str | None:
        """Why rank 0 cannot replay this backend's random numbers from each rank's generator state (they are
        drawn somewhere else than in the rank's own forward), or None when it can."""
        return None

    def allreduce_sum_autograd(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """A differentiable all-reduce(sum), for global BatchNorm; None when there is one replica."""
        return None

