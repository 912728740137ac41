"""Deliberately broken DDP adapters for the negative tests (test_negative.py).

Each one plants a single, well-known data-parallel bug behind the unchanged adapter contract
(dpcompare.contract.Adapter), so that the verdict and its diagnosis can be held against a fault whose
step, parameter and cause are known in advance. They are loaded the way a user's adapter is:
`--backend tests.faulty_adapters:SummingDDP` with the repository root on PYTHONPATH.

Not a test module (no `test_` prefix): pytest does not collect it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dpcompare.adapters.ddp import DDPAdapter
from dpcompare.adapters.deepspeed import DeepSpeedAdapter
from dpcompare.adapters.horovod import HorovodAdapter
from dpcompare.adapters.reference import ReferenceAdapter
from dpcompare import block_modules
from dpcompare.contract import Wrapped


def _sum_hook(state, bucket):
    # No annotations: DDP checks that `bucket` is annotated with dist.GradBucket itself, and under
    # `from __future__ import annotations` the annotation would be the string "dist.GradBucket".
    """A DDP communication hook that all-reduces each bucket and forgets to divide by the world size.

    DDP's default hook (allreduce_hook) divides by the world size; this is the classic bug of a
    hand-written hook or of Horovod's op=Sum: `.grad` becomes N times the global-batch gradient.
    """
    fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


class SummingDDP(DDPAdapter):
    """DDP whose gradients are summed over ranks instead of averaged (wrong from step 0, every parameter)."""

    name = "summing-ddp"

    def wrap(self, module, optimizer, local_batch: int, global_batch: int) -> Wrapped:
        wrapped = super().wrap(module, optimizer, local_batch, global_batch)
        wrapped.model.register_comm_hook(state=None, hook=_sum_hook)
        return wrapped


class SkipSyncOnceDDP(DDPAdapter):
    """DDP that silently runs the second step (step 1) under `no_sync()`: that step's `.grad` stays local.

    The trainer opens `sync(True)` once per training step, so the second call is step 1.
    """

    name = "skip-sync-once-ddp"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._sync_calls = 0

    def sync(self, enabled: bool):
        self._sync_calls += 1
        if self._sync_calls == 2:
            assert self.wrapped is not None
            return self.wrapped.model.no_sync()
        return super().sync(enabled)


class DriftedInitDDP(DDPAdapter):
    """DDP whose rank 1 ends up with a different last parameter after wrapping (DDP's initial broadcast
    is undone), as when a rank re-initialises or loads another checkpoint after the wrapper was built."""

    name = "drifted-init-ddp"

    def wrap(self, module, optimizer, local_batch: int, global_batch: int) -> Wrapped:
        wrapped = super().wrap(module, optimizer, local_batch, global_batch)
        if self.env.rank == 1:
            with torch.no_grad():
                list(wrapped.module.parameters())[-1].add_(1e-3)
        return wrapped


class NoBroadcastDDP(DDPAdapter):
    """DDP whose ranks keep the weights each built: DDP's broadcast of rank 0's at wrap time undone (as
    DistributedDataParallel(init_sync=False) leaves them)."""

    name = "no-broadcast-ddp"

    def wrap(self, module, optimizer, local_batch: int, global_batch: int) -> Wrapped:
        built = {n: p.detach().clone() for n, p in module.named_parameters()}
        wrapped = super().wrap(module, optimizer, local_batch, global_batch)
        with torch.no_grad():
            for n, p in wrapped.module.named_parameters():
                p.copy_(built[n])
        return wrapped


class _LinearScaledLR:
    """The linear-scaling rule applied in one backend only: the learning rate multiplied by the world size."""

    def wrap(self, module, optimizer, local_batch: int, global_batch: int) -> Wrapped:
        for group in optimizer.param_groups:
            group["lr"] *= self.env.world_size
        return super().wrap(module, optimizer, local_batch, global_batch)


class LinearScaledLRHorovod(_LinearScaledLR, HorovodAdapter):
    """Horovod with the linear-scaling rule applied here only: the optimizer's learning rate multiplied by
    hvd.size(), as many Horovod scripts do (while the DDP script beside them does not)."""

    name = "linear-scaled-lr-horovod"


class LinearScaledLRDDP(_LinearScaledLR, DDPAdapter):
    """DDP with the linear-scaling rule applied here only: the learning rate multiplied by the world size (the
    update is N times the reference's from step 0, gradient right)."""

    name = "linear-scaled-lr-ddp"


class LocalClipDDP(DDPAdapter):
    """DDP whose loop clips each rank's local gradient to a total norm of 1e-3 before the all-reduce (a
    clip_grad_norm_ placed between backward and a hand-written reduce, or a hook that clips per rank): the reduced
    gradient is the mean of differently scaled local gradients, not the global-batch gradient clipped."""

    name = "local-clip-ddp"

    def sync(self, enabled: bool):
        return self.wrapped.model.no_sync()  # every backward local: the reduce below is the only one

    def reduce(self) -> None:
        params = [p for p in self.wrapped.module.parameters() if p.grad is not None]
        torch.nn.utils.clip_grad_norm_(params, max_norm=1e-3)
        for p in params:
            dist.all_reduce(p.grad)
            p.grad.div_(self.env.world_size)


class ClipByPartsDDP(DDPAdapter):
    """DDP whose step clips the gradient in two parts, each by its own norm (the first half of the parameters and the
    rest), as ZeRO-2 does when each rank clips its partition by the partition's norm instead of the global one."""

    name = "clip-by-parts-ddp"

    def step(self) -> None:
        params = [p for p in self.wrapped.module.parameters() if p.grad is not None]
        half = len(params) // 2
        for part in (params[:half], params[half:]):
            torch.nn.utils.clip_grad_norm_(part, max_norm=1e-3)
        super().step()


class RankScaledUnscaleDDP(DDPAdapter):
    """DDP under --amp fp16 whose last rank undoes the loss scale twice over after the reduce (a rank-local scaler
    state): rank 0's gradient is right, the last rank's is half of it, and the replicas part at the step."""

    name = "rank-scaled-unscale-ddp"

    def unscale(self) -> None:
        super().unscale()
        if self.env.rank == self.env.world_size - 1:
            with torch.no_grad():
                for p in self.wrapped.module.parameters():
                    if p.grad is not None:
                        p.grad.mul_(0.5)


class DoubleStepDDP(DDPAdapter):
    """DDP whose step() runs the optimizer twice (a wrapper that steps and a loop that steps again)."""

    name = "double-step-ddp"

    def step(self) -> None:
        super().step()
        super().step()


class ClippingDDP(DDPAdapter):
    """DDP that clips the gradient's total norm before the step (DeepSpeed's default since 0.19.3 is 1.0),
    while the other backends do not clip."""

    name = "clipping-ddp"

    def step(self) -> None:
        torch.nn.utils.clip_grad_norm_(self.wrapped.module.parameters(), max_norm=1e-3)
        super().step()


class StateLostDDP(DDPAdapter):
    """DDP whose optimizer loses its state after every step (a training loop that builds a new optimizer each step):
    from step 1 on, every step starts with no momentum where the previous step left some."""

    name = "state-lost-ddp"

    def step(self) -> None:
        super().step()
        self.wrapped.optimizer.state.clear()


class StaleGradDDP(DDPAdapter):
    """DDP that hands the optimizer the previous step's reduced gradient from step 1 on (a reducer that
    returns before this step's all-reduce lands and leaves last step's buffer in `.grad`)."""

    name = "stale-grad-ddp"

    def reduce(self) -> None:
        super().reduce()
        params = [p for p in self.wrapped.module.parameters() if p.grad is not None]
        current = [p.grad.detach().clone() for p in params]
        previous = getattr(self, "_previous", None)
        if previous is not None:
            for p, g in zip(params, previous):
                p.grad.copy_(g)
        self._previous = current


class UnsyncedBiasDDP(DDPAdapter):
    """DDP told to ignore every bias (`_set_params_and_buffers_to_ignore_for_model`, the hook libraries use to
    keep parameters out of DDP): the biases' gradients stay local while the weights are averaged."""

    name = "unsynced-bias-ddp"

    def wrap(self, module, optimizer, local_batch: int, global_batch: int) -> Wrapped:
        biases = [n for n, _ in module.named_parameters() if n.endswith("bias")]
        torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, biases)
        return super().wrap(module, optimizer, local_batch, global_batch)


class Fp16WireDDP(DDPAdapter):
    """DDP that all-reduces in fp16 (DDP's fp16_compress_hook) without declaring it: the run's
    `--compression` stays `none`, so the float32 tolerance applies."""

    name = "fp16-wire-ddp"

    def wrap(self, module, optimizer, local_batch: int, global_batch: int) -> Wrapped:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        wrapped = super().wrap(module, optimizer, local_batch, global_batch)
        wrapped.model.register_comm_hook(dist.group.WORLD, default_hooks.fp16_compress_hook)
        return wrapped


class SameSeedDDP(DDPAdapter):
    """DDP under a script that seeds every rank the same after setting up (torch.manual_seed(0) everywhere):
    with dropout, every rank draws the same masks."""

    name = "same-seed-ddp"

    def wrap(self, module, optimizer, local_batch: int, global_batch: int) -> Wrapped:
        torch.manual_seed(0)
        return super().wrap(module, optimizer, local_batch, global_batch)


class SelfSyncingBatchNormDDP(DDPAdapter):
    """DDP that synchronises BatchNorm statistics although --sync-bn was not given (a wrapper converting BatchNorm
    behind the user's back): the gradient is the global batch's, where data parallelism without SyncBN computes
    each replica's own. Wrong from step 0 on every parameter before the last BatchNorm."""

    name = "self-syncing-bn-ddp"

    def wrap(self, module, optimizer, local_batch: int, global_batch: int) -> Wrapped:
        from dpcompare.contract import syncbn

        return super().wrap(syncbn.convert_global_batchnorm(module, syncbn.process_group_allreduce_sum()), optimizer, local_batch,
                            global_batch)


class TwiceForwardBatchNormDDP(DDPAdapter):
    """DDP whose BatchNorm layers run their forward twice per call (an extra training-mode forward, as a wrapper
    that re-runs a module would): the output and the gradient are unchanged, the running statistics are
    updated twice per step."""

    name = "twice-forward-bn-ddp"

    def wrap(self, module, optimizer, local_batch: int, global_batch: int) -> Wrapped:
        for m in module.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                forward = m.forward
                m.forward = lambda x, forward=forward: (forward(x), forward(x))[1]
        return super().wrap(module, optimizer, local_batch, global_batch)


class NeverUnscaledDDP(DDPAdapter):
    """DDP under --amp fp16 whose loop never undoes the loss scale: no scaler.unscale_ after the reduce, and a plain
    optimizer.step() where scaler.step (which unscales) belongs. `.grad` and the update are S times too large."""

    name = "never-unscaled-ddp"

    def unscale(self) -> None:
        pass

    def step(self) -> None:
        self.wrapped.optimizer.step()


class UnscaledTwiceDDP(DDPAdapter):
    """DDP under --amp fp16 that divides the gradients by the loss scale itself after GradScaler.unscale_ has
    already done so (a hand-written unscale left in beside the scaler's): `.grad` is 1/S of the mean."""

    name = "unscaled-twice-ddp"

    def unscale(self) -> None:
        super().unscale()
        inv = 1.0 / self.grad_scaling.scaler.get_scale()
        for p in self.wrapped.module.parameters():
            if p.grad is not None:
                p.grad.mul_(inv)


class SteppingOnInfDDP(DDPAdapter):
    """DDP under --amp fp16 that steps the optimizer whatever the scaler found (optimizer.step() then
    scaler.update(), instead of scaler.step): an overflowing step moves the weights to inf/NaN."""

    name = "stepping-on-inf-ddp"

    def step(self) -> None:
        self.wrapped.optimizer.step()
        self.grad_scaling.scaler.update()


class SkipSecondStepDDP(DDPAdapter):
    """DDP under --amp fp16 whose loss scaler skips the second step (step 1) although its gradient is finite (an
    overflow check on a stale flag): the weights stay, the skip is counted, the scale halves."""

    name = "skip-second-step-ddp"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._steps = 0

    def step(self) -> None:
        self._steps += 1
        if self._steps != 2:
            return super().step()
        scaler = self.grad_scaling.scaler
        scaler.update(scaler.get_scale() / 2)
        self.grad_scaling.skipped += 1


class NotScalingDDP(DDPAdapter):
    """DDP under --amp fp16 that calls scaler.scale(loss) but runs backward on the unscaled loss (the scaled one
    assigned to the wrong name), while the GradScaler still unscales and steps: its gradients never overflow where
    the recipe does, so it steps where every other backend skips."""

    name = "not-scaling-ddp"

    def backward(self, loss) -> None:
        self.grad_scaling.scale(loss)  # the scaled loss, dropped
        loss.backward()


class DroppedPartitionZeRO(DeepSpeedAdapter):
    """DeepSpeed ZeRO-2 (give --opt zero_stage=2) whose reduce-scatter result for the last rank's partition is never
    written: that rank's partition of the reduced gradient stays zero, so the parameters it owns step on nothing."""

    name = "dropped-partition-zero"

    def reduce(self) -> None:
        super().reduce()
        if self.env.rank == self.env.world_size - 1:
            for group in self.wrapped.model.optimizer.averaged_gradients.values():
                for g in (group if isinstance(group, list) else [group]):
                    g.zero_()


class FivePercentGradientDeepSpeed(DeepSpeedAdapter):
    """DeepSpeed whose reduced gradient reaches the optimizer 5 % too large (a gradient_predivide_factor undone on
    one side of the all-reduce only): under the bf16 engine, whose 16-bit wire a bound of world_size x its unit
    roundoff would widen past 5 %, only a measured wire floor catches it."""

    name = "five-percent-gradient-deepspeed"

    def reduce(self) -> None:
        super().reduce()
        for p in self.wrapped.module.parameters():
            if p.grad is not None:
                p.grad.mul_(1.05)


class ScaleLeftInDeepSpeed(DeepSpeedAdapter):
    """DeepSpeed's fp16 engine (give --amp fp16 --opt amp_recipe=engine) whose master step finds the loss scale left
    in: the gradients the wrapped torch optimizer steps on are multiplied back by the current loss scale after the
    engine unscaled them (a hand-written loop that scales the loss itself and forgets to undo it). The reduced
    gradient is right; the update is the scale times too large from step 0 (CUDA only: the fp16 engine is refused on
    the CPU accelerator)."""

    name = "scale-left-in-deepspeed"

    def wrap(self, module, optimizer, local_batch: int, global_batch: int) -> Wrapped:
        wrapped = super().wrap(module, optimizer, local_batch, global_batch)
        inner = wrapped.model.optimizer.optimizer  # the torch optimizer DeepSpeed steps on its fp32 masters
        step = inner.step

        def scaled_step(*args, **kwargs):
            scale = self._engine_scale()
            with torch.no_grad():
                for group in inner.param_groups:
                    for p in group["params"]:
                        if p.grad is not None:
                            p.grad.mul_(scale)
            return step(*args, **kwargs)

        inner.step = scaled_step
        return wrapped


class StaleGatherZeRO(DeepSpeedAdapter):
    """DeepSpeed ZeRO-1 (give --opt zero_stage=1) whose all-gather of the updated partitions never reaches rank 0:
    after each step rank 0's model keeps the old values of the parameters another rank owns (their fp32 copy and
    optimizer state moved on)."""

    name = "stale-gather-zero"

    def step(self) -> None:
        module = self.wrapped.module
        foreign = [p for p in module.parameters() if getattr(p, "_hp_mapping", None) is None]
        before = [p.detach().clone() for p in foreign]
        super().step()
        if self.env.rank == 0:
            with torch.no_grad():
                for p, old in zip(foreign, before):
                    p.copy_(old)


class NarrowNormsZeRO(DeepSpeedAdapter):
    """DeepSpeed ZeRO-3 under its torch_autocast section (give --opt zero_stage=3 --amp bf16) configured to treat
    LayerNorm as lower-precision safe too, while declaring the default list: its LayerNorm parameters are all-gathered
    and their gradients reduced in bf16, where the run says they stay float32."""

    name = "narrow-norms-zero"

    def wrap(self, module, optimizer, local_batch, global_batch):
        import dpcompare.adapters.deepspeed as ds

        built = ds.engine_config

        def with_norms(*args, **kwargs):
            config = built(*args, **kwargs)
            if "torch_autocast" in config:
                from deepspeed.runtime.torch_autocast import get_default_autocast_lower_precision_modules

                config["torch_autocast"]["lower_precision_safe_modules"] = [
                    *get_default_autocast_lower_precision_modules(), "torch.nn.LayerNorm"]
            return config

        ds.engine_config = with_norms
        try:
            return super().wrap(module, optimizer, local_batch, global_batch)
        finally:
            ds.engine_config = built

    def _autocast_wire_params(self, module):
        return [n for n in super()._autocast_wire_params(module)
                if not isinstance(module.get_submodule(n.rpartition(".")[0]), torch.nn.LayerNorm)]


from dpcompare.adapters.fsdp import FSDPAdapter  # noqa: E402 - the FSDP twins below


class NeverSyncedFSDP(FSDPAdapter):
    """FSDP2 whose loop switches gradient synchronisation off for every micro-batch, the last one too: no
    reduce-scatter runs, so the sharded parameters are handed no gradient."""

    name = "never-synced-fsdp"

    def sync(self, enabled: bool):
        return super().sync(False)


class StaleShardFSDP(FSDPAdapter):
    """FSDP2 whose last rank never writes the optimizer's update into its shard of one parameter (2.weight): that
    shard keeps its old values after every step (as when the step updates a copy and the parameter is rebuilt from
    the stale buffer). Every later all-gather hands every rank the same full parameter, part new and part stale, so the
    replicas agree with each other: only the update check sees it."""

    name = "stale-shard-fsdp"
    STALE = "2.weight"

    def step(self) -> None:
        param = dict(self.wrapped.module.named_parameters())[self.STALE]
        with torch.no_grad():
            shard = param.to_local()
            before = shard.clone() if self.env.rank == self.env.world_size - 1 else None
        super().step()
        if before is not None:
            with torch.no_grad():
                shard.copy_(before)


class _BlockScaledReference(ReferenceAdapter):
    """The single process whose gradient of one block reaches the optimizer 5 % too large: a fault confined to one
    block, for the oracle's coverage (--check-coverage) to see where it checks that block and miss where it does not."""

    BLOCK = 0

    def reduce(self) -> None:
        super().reduce()
        _, block = block_modules(self.wrapped.module)[self.BLOCK]
        for p in block.parameters():
            if p.grad is not None:
                p.grad.mul_(1.05)


class FirstBlockScaledReference(_BlockScaledReference):
    name = "first-block-scaled-reference"
    BLOCK = 0


class LastBlockScaledReference(_BlockScaledReference):
    name = "last-block-scaled-reference"
    BLOCK = -1


def _rank1_range(module: torch.nn.Module, world_size: int) -> list[tuple[str, slice]]:
    """The elements rank 1 holds of the checks' ranges (dpcompare.verify.ranks.range_plan: pieces of the flattened parameters, a
    parameter cut where the ranks' shares cross it), by parameter."""
    from dpcompare.verify.ranks.range_plan import of_model

    plan = of_model(module, world_size)
    return [(n, slice(p.start, p.stop)) for n in plan.names(1) for p in [plan.piece(n, 1)]]


class Rank1RangeGradientDDP(DDPAdapter):
    """DDP whose reduced gradient reaches the optimizer 5 % too large on the parameters of rank 1's range alone (on
    every rank, so the replicas stay identical): a fault no parameter of rank 0's range shows."""

    name = "rank1-range-gradient-ddp"

    def reduce(self) -> None:
        super().reduce()
        named = dict(self.wrapped.module.named_parameters())
        for n, part in _rank1_range(self.wrapped.module, self.env.world_size):
            if named[n].grad is not None:
                named[n].grad.view(-1)[part].mul_(1.05)


class Rank1RangeDoubleStepDDP(DDPAdapter):
    """DDP whose optimizer step moves the parameters of rank 1's range twice as far as it should (the step's update
    added a second time): the gradient is right everywhere, the update wrong in rank 1's range alone."""

    name = "rank1-range-double-step-ddp"

    def step(self) -> None:
        named = dict(self.wrapped.module.named_parameters())
        mine = [named[n].view(-1)[part] for n, part in _rank1_range(self.wrapped.module, self.env.world_size)]
        before = [p.detach().clone() for p in mine]
        super().step()
        with torch.no_grad():
            for p, b in zip(mine, before):
                p.add_(p - b)


class Rank1RangeUncheckedDoubleStepDDP(Rank1RangeDoubleStepDDP):
    """Rank1RangeDoubleStepDDP at the second step of the run alone (step 1): under --check-every 2 that step's gradient
    and update are not checked, so only the reference trajectory, whose range rank 1 holds and judges, can see it."""

    name = "rank1-range-unchecked-double-step-ddp"

    def step(self) -> None:
        self._steps = getattr(self, "_steps", 0) + 1
        if self._steps == 2:
            super().step()
        else:
            DDPAdapter.step(self)


class LocalCountDDP(DDPAdapter):
    """DDP whose training loop leaves out the item count's all-reduce under --loss-normalisation global: each rank
    takes its own count for every rank's (its count times the world size), so each rank divides its loss by its own
    items, and the step's gradient is the mean of the ranks' own means (transformers#34191's class of bug)."""

    name = "local-count-ddp"

    def all_reduce_sum(self, tensor):
        return tensor * self.env.world_size


def _rank1_doubled_sparse_hook(state, bucket):
    # No annotations (as _sum_hook): DDP checks `bucket`'s annotation itself.
    """DDP's mean all-reduce of every bucket, with rank 1's sparse gradients (nn.Embedding(sparse=True): DDP gives each
    its own bucket) doubled first: the hand-written hook that treats one rank's sparse rows apart."""
    tensor = bucket.buffer()
    if tensor.is_sparse and dist.get_rank() == 1:
        tensor = tensor * 2
    tensor = tensor / dist.get_world_size()
    fut = dist.all_reduce(tensor, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


class Rank1SparseScaledDDP(DDPAdapter):
    """DDP whose reduced sparse gradient counts rank 1's rows twice: (g0 + 2 g1) / 2 on every rank, so the replicas
    stay identical and the dense parameters right; only the oracle sees the embedding table's gradient wrong."""

    name = "rank1-sparse-scaled-ddp"

    def wrap(self, module, optimizer, local_batch: int, global_batch: int) -> Wrapped:
        wrapped = super().wrap(module, optimizer, local_batch, global_batch)
        wrapped.model.register_comm_hook(state=None, hook=_rank1_doubled_sparse_hook)
        return wrapped
