"""fsdp: PyTorch FSDP2 (`torch.distributed.fsdp.fully_shard`) over a torch.distributed process group.

Each rank holds a 1/N shard (dim 0, padded) of every parameter, of its gradient and of the optimizer state: the
parameters are DTensors, and the run's torch optimizer steps those shards itself (no master copy). Before a module's
forward FSDP all-gathers its parameters; after its backward it reduce-scatters their gradients (float32: the process
group's ReduceOp.AVG), so each rank's `.grad` is its shard of the global mean when `loss.backward()` returns. On CUDA
the root's final backward callback makes the current stream wait for the last reduce-scatter, so `reduce` has nothing
left to wait for.

Which modules are `fully_shard`ed, bottom-up, then the root (whose group takes every parameter left): the model's
blocks, `dpcompare.block_modules` (the rule --activation-checkpointing uses too):
  1. the modules whose class the model names in `_no_split_modules` (the Hugging Face convention), if it has one;
  2. else the elements of the model's outermost containers: every direct child of an `nn.Sequential` or
     `nn.ModuleList` found walking down from the root without entering a container's elements (a Sequential root's
     own layers: mlp, cnn; the transformer blocks of `gpt-*`'s `h` and `lm`'s `blocks`; ResNet's residual blocks),
     each only if it holds parameters.
A container's element runs its parameters in its own forward, so its group is unsharded exactly while it runs. A
parameter the model uses outside its module's forward (GPT's output head tied to `wte.weight`) belongs to a module
that is no container element and stays in the root's group, which is unsharded around the whole forward.

`--opt reshard_after_forward=true|false` is passed to every `fully_shard` call, the root's included: true frees each
group's unsharded parameters after its forward and all-gathers them again in backward, false keeps them until the
backward (one all-gather per group per step, more memory).

`--opt replicas=R` (HSDP; variant `hsdp`, R=2): the N ranks form a 2-D device mesh (replicate, shard) of R rows of
N/R ranks, passed whole to every `fully_shard` call. Each rank holds a 1/(N/R) shard, the same as the other ranks of
its column; after a group's backward FSDP reduce-scatters the gradients within the rank's row (its shard group) and
all-reduces the resulting shard across the R rows (its replicate group), both with ReduceOp.AVG, so `.grad` is the
shard of the mean over all N ranks. R must divide N (refused in `__init__`, before the process group starts); R=1 is
a 1-D mesh of every rank, plain FSDP. `capabilities.shard_replicas` = R tells measurement that the sharding degree is
N/R (the memory formula's divisor, the reduce-scatter's and all-gather's ranks) and that the all-reduce spans R
ranks. A replica group that reduces only within itself (pytorch/pytorch#140183, HYBRID_SHARD training as if on one
node) holds the mean over N/R ranks: the gradient check names it, cause `replica_group_only`.

Gradient accumulation and the exposed-communication ablation: `set_requires_gradient_sync(False)` keeps the
micro-batches' unsharded gradients local (no reduce-scatter); the parameter all-gathers still run, so the ablation's
unsynced arm measures the reduce-scatter only.

The verification's full-value reads are collectives, called on every rank at the same point: `full_params()` and
`master_params()` all-gather every parameter (`DTensor.full_tensor()`), `reduced_grads()` every sharded gradient,
`optimizer_state()` every DTensor in the optimizer's state. `optimizer_view()` is not a collective: it returns the
torch optimizer and the sharded parameters its state is keyed by. `model_state_tensors()` lists this rank's local
shards (`DTensor.to_local()`); FSDP holds no communication buffer between steps (its all-gather outputs and
reduce-scatter inputs live for one group's forward or backward), so `comm_buffer_bytes` is an analytic peak.

Dropout: fully_shard keeps every module object (it only swaps their classes), so the verification's forward hooks on
the dropout modules of `wrapped.module` capture each rank's masks as under DDP (`rng_replay_reason()` is None).

Mixed precision: the base class's autocast recipe (float32 sharded parameters, the forward under torch.autocast) and,
for fp16, its torch.amp.GradScaler: its inf/NaN check over DTensor gradients is reduced over the mesh (max) by
DTensor's own handler of `_amp_foreach_non_finite_check_and_unscale_`, so every rank skips the same steps. FSDP's
MixedPrecisionPolicy (16-bit all-gathers and reduce-scatters) is not offered.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any

import torch
from torch import nn

from dpcompare import (DIST_BACKEND, Adapter, Capabilities, Note, Option, ProcessGroupMixin, Settings, Wrapped,
                       block_modules, ensure_rendezvous)

def _dtensor():
    from torch.distributed.tensor import DTensor

    return DTensor


def _padded_bytes(p: torch.Tensor, shard_ranks: int) -> int:
    """Bytes of `p` unsharded as FSDP lays it out for its collectives: dim 0 padded to a multiple of the ranks it is
    sharded over (the world size, or the shard group's size under HSDP)."""
    rows = p.shape[0] if p.dim() else 1
    per_row = p.numel() // rows if rows else 0
    return math.ceil(rows / shard_ranks) * shard_ranks * per_row * p.element_size()


class FSDPAdapter(ProcessGroupMixin, Adapter):
    name = "fsdp"
    capabilities = Capabilities(
        multi_process=True,
        launchers=frozenset({"python", "torchrun", "mpirun", "slurm", "deepspeed"}),
        launch_hint="torchrun --nproc_per_node=N -m dpcompare --backend fsdp  (or mpirun -np N python -m dpcompare --backend fsdp)",
        native_launcher="torchrun",
        can_disable_sync=True,
        shards="parameters",
        compiles=True,
    )
    OPTIONS = (
        DIST_BACKEND,
        Option("reshard_after_forward", bool, True,
               "free each group's unsharded parameters after its forward and all-gather them again in backward (false: "
               "keep them until the backward, one all-gather per group per step and more memory)"),
        Option("replicas", int, 1,
               "HSDP: the ranks form this many replica groups, each sharding over world_size / replicas ranks, and "
               "the groups all-reduce their sharded gradients (1: every rank in one shard group); must divide the "
               "world size"),
    )
    VARIANTS = {"noreshard": {"reshard_after_forward": False}, "hsdp": {"replicas": 2}}

    @classmethod
    def world_size_refusal(cls, world_size: int, options) -> str | None:
        replicas = int(options.get("replicas", 1))
        if replicas >= 1 and world_size % replicas == 0:
            return None
        divisors = ", ".join(str(d) for d in range(1, world_size + 1) if world_size % d == 0)
        return (f"--opt replicas={replicas} is invalid at world size {world_size}: replicas must divide the world size "
                f"(HSDP puts world_size / replicas ranks in every shard group); use one of {divisors} (1: plain FSDP), "
                f"or start a world size that {replicas} divides")

    @classmethod
    def sparse_gradient_refusal(cls, settings: Settings) -> str:
        # torch 2.13: the post-backward reduce-scatter copies every gradient into one flat buffer (fsdp::chunk_cat,
        # foreach_reduce_scatter_copy_in), which has no sparse kernel; a sparse DTensor shard does not exist either
        return "FSDP2 shards every gradient by copying it into a flat dense buffer for its reduce-scatter"

    @classmethod
    def shared_device_refusal(cls) -> str:
        return ("FSDP cannot put two ranks on one GPU: NCCL refuses two ranks on one device, and FSDP2's collectives "
                "over gloo on CUDA tensors crash every rank (SIGSEGV, torch 2.11 on an H200); run at most one rank per "
                "GPU, or --device cpu")

    def dist_backend(self) -> str:
        """NCCL, one rank per GPU; gloo on the CPU. Ranks sharing a GPU, or gloo asked for on CUDA, are refused."""
        shared = self.device.type == "cuda" and self.env.local_world_size > torch.cuda.device_count()
        if self.device.type == "cuda" and (shared or self.settings.options.get("dist_backend") == "gloo"):
            raise ValueError(self.shared_device_refusal())
        return super().dist_backend()

    def __init__(self, env, device, settings=None) -> None:
        super().__init__(env, device, settings)
        self.replicas = int(self.settings.options.get("replicas", 1))
        ws = env.world_size
        refusal = self.world_size_refusal(ws, self.settings.options)
        if refusal:
            raise ValueError(refusal)
        self.shard_ranks = ws // self.replicas
        """The ranks each parameter is sharded over (the mesh's shard dimension)."""
        self.capabilities = dataclasses.replace(type(self).capabilities, shard_replicas=self.replicas)

    def setup(self, timeout_s: float) -> None:
        ensure_rendezvous(self.env)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # FSDP's CUDA mesh communicates on the current device
        self.init_process_group(timeout_s)
        from torch.distributed.device_mesh import init_device_mesh

        if self.replicas == 1:
            self.mesh = init_device_mesh(self.device.type, (self.env.world_size,))
        else:  # HSDP: fully_shard shards over the last dimension and all-reduces over the first
            self.mesh = init_device_mesh(self.device.type, (self.replicas, self.shard_ranks),
                                         mesh_dim_names=("replicate", "shard"))

    def wrap(self, module: nn.Module, optimizer, local_batch: int, global_batch: int) -> Wrapped:
        from torch.distributed.fsdp import fully_shard

        if optimizer.state:
            raise ValueError("--backend fsdp: the optimizer already holds state before wrapping; FSDP replaces the "
                             "parameters with sharded ones, so it must be a fresh optimizer")
        if self.env.world_size > 1 and (varying := self.model_facts.varying_use()) is not None:
            raise ValueError(f"--backend fsdp cannot run this model: {varying}, so ranks would use different "
                             "parameters at a step, and FSDP gathers and reduces each block's parameters on every rank "
                             "together: use --backend ddp (it finds the parameters a rank left out) or horovod")
        reshard = self.settings.options["reshard_after_forward"]
        ws, shard_ranks = self.env.world_size, self.shard_ranks
        names = {id(p): n for n, p in module.named_parameters()}
        blocks = block_modules(module)
        self._blocks = [b for _, b in blocks]
        # The parameter groups FSDP makes (bottom-up: a block takes its parameters not already taken), their unsharded
        # sizes as the collectives lay them out; for comm_buffer_bytes and message_bytes.
        taken: set[int] = set()
        self._group_bytes: list[int] = []
        for _, block in reversed(blocks):
            params = [p for p in block.parameters() if id(p) not in taken]
            taken |= {id(p) for p in params}
            self._group_bytes.append(sum(_padded_bytes(p, shard_ranks) for p in params))
        rest = [p for p in module.parameters() if id(p) not in taken]
        if rest:
            self._group_bytes.append(sum(_padded_bytes(p, shard_ranks) for p in rest))
        for _, block in reversed(blocks):  # bottom-up, as FSDP requires
            fully_shard(block, mesh=self.mesh, reshard_after_forward=reshard)
        fully_shard(module, mesh=self.mesh, reshard_after_forward=reshard)
        # fully_shard replaced every parameter with a sharded DTensor parameter: the optimizer (built before
        # wrapping, by the trainer) must step those.
        sharded = dict(module.named_parameters())
        for group in optimizer.param_groups:
            group["params"] = [sharded[names[id(p)]] for p in group["params"]]
        shown = ", ".join(n for n, _ in blocks[:6]) + (f" and {len(blocks) - 6} more" if len(blocks) > 6 else "")
        notes = [Note("fsdp.sharding",
                      f"fsdp: FSDP2 fully_shard on {len(blocks)} block(s)" + (f" ({shown})" if blocks else "") +
                      f" and the root, reshard_after_forward={str(reshard).lower()}: " + (
                          f"each of the {ws} rank(s) holds 1/{ws} of every parameter, gradient and optimizer state"
                          if self.replicas == 1 else
                          f"HSDP, a {self.replicas}x{shard_ranks} mesh (replicate, shard): the {ws} ranks form "
                          f"{self.replicas} replica groups of {shard_ranks}, each rank holds 1/{shard_ranks} of every "
                          f"parameter, gradient and optimizer state, the gradients are reduce-scattered within a group "
                          f"and all-reduced across the {self.replicas} groups") +
                      "; the checks all-gather the full values (DTensor.full_tensor) on every rank",
                      ("masters", "grads", "optimizer"))]
        notes.append(Note("fsdp.ablation",
                          "fsdp: the exposed-communication ablation's unsynced arm (set_requires_gradient_sync(False)) "
                          "still all-gathers the parameters: the exposed communication it measures is the gradients' "
                          "reduce-scatter only"))
        if self.settings.bucket_mb:
            notes.append(Note("knob_not_applicable",
                              "fsdp: --bucket-mb does not apply to FSDP2: each fully_shard group is one all-gather and "
                              "one reduce-scatter"))
        self.wrapped = Wrapped(module, module, optimizer, notes)
        return self.wrapped

    def compile(self) -> None:
        # Block by block, as torchtitan compiles FSDP2 models: each fully_shard'ed block's forward compiled in place,
        # its all-gather and reduce-scatter hooks around it, eager. A compiled root alone would compile nothing
        # between its blocks' hooks, which Dynamo does not trace (a graph break at each), and a block whose forward is
        # torch's own (nn.Linear) is a frame Dynamo skips.
        for block in self._blocks or [self.wrapped.module]:
            self.compile_module(block)
        self.wrapped.notes.append(Note("compile", f"fsdp: compiled block by block ({len(self._blocks)} fully_shard'ed "
                                       "block(s)), FSDP's all-gathers and reduce-scatters eager around them"))

    # -- checkpoints ---------------------------------------------------------------------------------------
    @classmethod
    def checkpoint_formats(cls) -> tuple[str, ...]:
        return ("dcp", "torch")  # its own: each rank writes its shards (DCP); torch: the full state on rank 0

    # -- synchronisation -------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def sync(self, enabled: bool):
        assert self.wrapped is not None
        model = self.wrapped.model
        model.set_requires_gradient_sync(enabled)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    def comm_off(self):
        # The unsynced arm of the ablation: no reduce-scatter; FSDP still all-gathers the parameters for the forward
        # and the backward, so the ablation measures the reduce-scatter only (the fsdp.ablation note says so).
        return self.sync(False)

    def zero_grad(self) -> None:
        super().zero_grad()
        # A backward without gradient sync (the ablation's unsynced arm, whose update is dropped) leaves its
        # unsharded gradients in FSDP's own parameters, where the next synced backward would add them in.
        for m in self.wrapped.module.modules():
            get_state = getattr(m, "_get_fsdp_state", None)
            if get_state is None:
                continue
            for group in getattr(get_state(), "_fsdp_param_groups", []):
                for fsdp_param in group.fsdp_params:
                    unsharded = getattr(fsdp_param, "_unsharded_param", None)
                    if unsharded is not None:
                        unsharded.grad = None
                    fsdp_param.unsharded_accumulated_grad = None

    def clip_grad_norm(self, max_norm: float) -> float | None:
        # clip_grad_norm_ on DTensor gradients: each rank's norm of its shards is a partial norm, reduced over the mesh
        # before the coefficient is taken, so every shard is clipped by the global norm. The total norm it returns is a
        # DTensor: full_tensor() gives the global value whatever placement it is left in (torch 2.13: Replicate,
        # reduced already). A norm taken by hand over `p.grad.to_local()` would be this rank's shards' only.
        assert self.wrapped is not None
        params = [p for p in self.wrapped.module.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return float(self._full(norm))

    # -- full values: collectives, every rank calls them ------------------------------------------------------
    @staticmethod
    def _full(t: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return t.detach().full_tensor() if isinstance(t, _dtensor()) else t.detach()

    def full_params(self) -> dict[str, torch.Tensor]:
        assert self.wrapped is not None
        return {n: self._full(p) for n, p in self.wrapped.module.named_parameters()}

    def reduced_grads(self) -> dict[str, torch.Tensor | None]:
        assert self.wrapped is not None
        return {n: None if p.grad is None else self._full(p.grad)
                for n, p in self.wrapped.module.named_parameters() if p.requires_grad}

    def master_params(self) -> dict[str, torch.Tensor]:
        # FSDP2 in float32 steps the sharded parameters themselves: the values the optimizer steps are the parameters.
        return self.full_params()

    def optimizer_state(self) -> dict[str, dict[str, Any]] | None:
        assert self.wrapped is not None
        state = self.wrapped.optimizer.state
        out: dict[str, dict[str, Any]] = {}
        for n, p in self.wrapped.module.named_parameters():  # the same order on every rank
            entries = state.get(p)
            if entries is None:
                continue
            out[n] = {k: (self._full(v).to("cpu", copy=True) if torch.is_tensor(v) else v) for k, v in entries.items()}
        return out

    def optimizer_view(self) -> tuple[torch.optim.Optimizer | None, dict[str, torch.Tensor]]:
        # Not a collective (rank 0 alone calls it): the optimizer and the sharded parameters its state is keyed by.
        assert self.wrapped is not None
        return self.wrapped.optimizer, dict(self.wrapped.module.named_parameters())

    def model_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        assert self.wrapped is not None
        dtensor = _dtensor()

        def local(t: torch.Tensor) -> torch.Tensor:
            return t.to_local() if isinstance(t, dtensor) else t

        params = list(self.wrapped.module.parameters())
        state = [local(v) for p in params for v in self.wrapped.optimizer.state.get(p, {}).values()
                 if torch.is_tensor(v)]
        return {"params": [local(p) for p in params], "grads": [local(p.grad) for p in params if p.grad is not None],
                "optimizer": state, "master_params": [], "comm_buffers": []}

    # -- measurement -------------------------------------------------------------------------------------------
    def message_bytes(self, grad_bytes: int) -> tuple[int | None, str | None]:
        # One reduce-scatter per group: its input is the group's unsharded gradient (dim 0 padded); the mean over the
        # groups that hold parameters (each also all-gathers a message of the same size).
        sizes = [b for b in self._group_bytes if b]
        if not sizes:
            return None, "no parameter group"
        return sum(sizes) // len(sizes), None

    def comm_buffer_bytes(self, grad_bytes: int) -> int | None:
        # Transient, not held between steps: the all-gather outputs alive at once (reshard_after_forward=true: the
        # largest group's, plus the one prefetched beside it; false: every group's, from its forward to its backward)
        # and one reduce-scatter input (the largest group's unsharded gradient).
        sizes = sorted(self._group_bytes, reverse=True)
        if not sizes:
            return 0
        gathered = sum(sizes) if not self.settings.options["reshard_after_forward"] else sum(sizes[:2])
        return gathered + sizes[0]
