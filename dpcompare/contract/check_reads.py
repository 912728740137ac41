"""What the checks read from a backend: the part of the adapter contract that says where the backend keeps the values
the verification judges (and the memory census counts), and the facts about its computation the references must
reproduce.

Owns: `CheckReads`. One of the four parts `dpcompare.contract.adapter.Adapter` is composed of; it reads the state
the training protocol's `__init__` and `wrap` set (`settings`, `wrapped`) and its loss scaler (`grad_scaling`).
Imports no adapter.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # set by TrainingProtocol: the parts import nothing from one another at run time
    from dpcompare.contract import amp as precision
    from dpcompare.contract.amp import ScalerState
    from dpcompare.contract.capabilities import Settings
    from dpcompare.contract.training_protocol import Wrapped


class CheckReads:
    """Where the backend keeps what the checks judge, with defaults that are right for a single-process backend (the
    module wrapped or not, every parameter whole in this process, its reduced gradient in `.grad`, a plain torch
    optimizer stepping the parameters themselves), so a backend overrides only what it keeps elsewhere:

      full_params, reduced_grads, master_params   the wrapped module's parameters and their `.grad` (a sharded
                                   backend assembles the full tensors: ZeRO, FSDP; one with fp32 masters apart
                                   from 16-bit weights names them in master_params: DeepSpeed's engine)
      optimizer_view, optimizer_state   the torch optimizer behind `wrapped.optimizer` (through `.optimizer`
                                   wrappers) over the masters, and its state by parameter name
      model_state_tensors          the parameters, their gradients, that optimizer's state and the masters apart from
                                   the parameters, no communication buffers (the memory census counts them)
      scaler_state, amp_recipe     the base class's GradScaler under --amp fp16; autocast under --amp
      gradient_wire                the --compression given (none unless the backend declares compressions)
      gradient_wire_parameters, gathered_parameters, wraps_module_boundaries   None (every parameter on that wire),
                                   none gathered, no boundaries: a plain model's computation
      optimizer_prestep, rng_replay_reason   no step before step 0; every random draw inside `wrapped.module`
      replicas_per_process         one replica a process
    """

    settings: Settings
    wrapped: Wrapped | None
    grad_scaling: precision.GradScaling | None

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

    def rng_replay_reason(self) -> str | None:
        """Why rank 0 cannot check this backend's random numbers: they are drawn somewhere the dropout modules'
        captured masks do not reach (not in the modules of `wrapped.module`), or None when they are captured."""
        return None

    def replicas_per_process(self) -> int:
        """Model replicas one process runs per step (nn.DataParallel over several devices; else 1): each
        normalises its own part of a micro-batch, and each draws its own dropout masks."""
        return 1
