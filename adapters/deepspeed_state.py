"""The full values a DeepSpeed engine holds in pieces, assembled for the checks: the parameters, the reduced
gradients, the fp32 master copies and the optimizer state by parameter name, and this rank's model-state tensors by
component. Under ZeRO these are collectives (DeepSpeed's own accessors: `safe_get_full_grad`,
`safe_get_full_fp32_param`, `safe_get_full_optimizer_state`, `zero.GatheredParameters`): every rank calls them.

`ZeroStateReader` is mixed into `DeepSpeedAdapter` ahead of the contract's defaults, which serve stage 0.
"""

from __future__ import annotations

import torch


class ZeroStateReader:
    """The adapter's readers of full values; it uses the adapter's `stage`, `clip`, `deepspeed`, `wrapped`,
    `_engine_recipe`, `_autocast_scaler()` and `_engine_scale()`."""

    # -- full values (collectives under ZeRO: every rank calls them) --------------------------------------------
    @staticmethod
    def _shape(p: torch.Tensor) -> torch.Size:
        return getattr(p, "ds_shape", p.shape)  # ZeRO-3 leaves an empty placeholder in the module

    def full_params(self) -> dict[str, torch.Tensor]:
        if self.stage < 3:
            return super().full_params()
        named = list(self.wrapped.module.named_parameters())
        with self.deepspeed.zero.GatheredParameters([p for _, p in named], modifier_rank=None):
            return {n: p.detach().clone() for n, p in named}

    def reduced_grads(self) -> dict[str, torch.Tensor | None]:
        if self.stage:
            from deepspeed.utils import safe_get_full_grad

            grads = {}
            for n, p in self.wrapped.module.named_parameters():
                if p.requires_grad:
                    g = safe_get_full_grad(p)
                    grads[n] = None if g is None else g.detach().reshape(self._shape(p)).clone()
        else:
            grads = super().reduced_grads()
        if not self._engine_recipe:
            scaler = self._autocast_scaler() if self.stage or self.clip else None
            if scaler is None:
                return grads
            # ZeRO's GradScaler unscales the partitions inside its step, and at stage 0 with gradient_clipping the
            # engine unscales before it clips, inside its step too: the reduced gradients are read scaled
            scale = float(scaler.get_scale())
            return {n: None if g is None else g / scale for n, g in grads.items()}
        scale = self._engine_scale()  # a power of two: dividing is exact
        return {n: None if g is None else g.float() / scale for n, g in grads.items()}

    def master_params(self) -> dict[str, torch.Tensor]:
        if self.stage:
            from deepspeed.utils import safe_get_full_fp32_param

            named = self.wrapped.module.named_parameters()
            masters = {n: safe_get_full_fp32_param(p) if p.requires_grad else None for n, p in named}
            whole = self.full_params() if any(t is None for t in masters.values()) else {}  # frozen: not partitioned in fp32
            return {n: whole[n] if t is None else t.detach().reshape(self._shape(p)).clone()
                    for (n, t), p in zip(masters.items(), self.wrapped.module.parameters())}
        named = super().master_params()
        if not self._engine_recipe:
            return named
        opt = self.wrapped.model.optimizer
        master = {id(lp): hp for lows, highs in zip(opt.fp16_groups, opt.fp32_groups) for lp, hp in zip(lows, highs)}
        return {n: master.get(id(p), p) for n, p in named.items()}

    def _inner_optimizer(self) -> torch.optim.Optimizer | None:
        inner = getattr(self.wrapped.model.optimizer, "optimizer", None)
        return inner if isinstance(inner, torch.optim.Optimizer) else None

    def optimizer_view(self):
        if not self.stage:
            return super().optimizer_view()
        # ZeRO's torch optimizer steps flat partitions, not the parameters: its hyper-parameters are read here, its
        # state by parameter through optimizer_state() (a collective, so not here: rank 0 alone asks for this).
        return self._inner_optimizer(), {}

    def optimizer_state(self) -> dict[str, dict] | None:
        if not self.stage:
            return super().optimizer_state()
        from deepspeed.utils import safe_get_full_optimizer_state

        inner = self._inner_optimizer()
        if inner is None:
            return None
        entries = [e for e in inner.state.values() if e]
        if not entries:
            return {}  # a fresh optimizer's
        optimizer = getattr(getattr(self.wrapped, "model", None), "optimizer", None)  # the ZeRO optimizer
        if self.stage in (1, 2) and hasattr(optimizer, "_lazy_init_hp_params_optimizer_state"):
            # ZeRO-1/2 link each parameter to its group's optimizer state once, in the first step right after the first
            # group's own step (stage_1_and_2.py `_optimizer_step`, DeepSpeed 0.19.8): the groups after it are linked
            # to a state they do not hold yet and are never linked again ("exp_avg not found in optimizer state
            # fragment"). Linked again here, every group's state held by now.
            optimizer._hp_optimizer_states_linked = False
            optimizer._lazy_init_hp_params_optimizer_state()
        # Sorted: every rank must ask for the keys in one order (each read is an all-reduce). A universal load fills
        # the state from a set of keys, so its order differs between processes (string hashing), and in the state's
        # own order one rank's exp_avg was summed with another's exp_avg_sq.
        keys = sorted(k for k, v in entries[0].items() if torch.is_tensor(v) and v.dim() > 0)
        scalars = {k: (v.detach().to("cpu", copy=True) if torch.is_tensor(v) else v)
                   for k, v in entries[0].items() if k not in keys}  # Adam's step: one count per flat partition
        state = {}
        for n, p in self.wrapped.module.named_parameters():
            if not p.requires_grad:
                continue
            full = {k: safe_get_full_optimizer_state(p, k) for k in keys}
            state[n] = {**{k: v.detach().reshape(self._shape(p)).to("cpu", copy=True) for k, v in full.items()
                           if v is not None}, **scalars}
        return state

    def model_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        if not self.stage:
            return super().model_state_tensors()
        opt = self.wrapped.model.optimizer
        params = [getattr(p, "ds_tensor", p) for p in self.wrapped.module.parameters()]  # ZeRO-3: this rank's part
        inner = self._inner_optimizer()
        state = [v for e in (inner.state.values() if inner is not None else []) for v in e.values() if torch.is_tensor(v)]
        masters = list(getattr(opt, "single_partition_of_fp32_groups", None) or getattr(opt, "fp32_partitioned_groups_flat", []))
        grads = [t for t in (getattr(opt, "averaged_gradients", {}) or {}).values() for t in (t if isinstance(t, list) else [t])
                 if torch.is_tensor(t)]
        grads += [p.grad for p in self.wrapped.module.parameters() if p.grad is not None]
        grads += [t.grad for t in masters if t.grad is not None]
        return {"params": params, "grads": grads, "optimizer": state, "master_params": masters,
                "comm_buffers": self._bucket_buffers(opt)}

    @staticmethod
    def _bucket_buffers(opt) -> list[torch.Tensor]:
        """ZeRO's gradient buckets (stages 1-2: IPGBucket.buffer, a list of flat tensors; stage 3: IPGBucketZ3.buffer,
        one tensor or None until the first reduce)."""
        out = []
        for bucket in (getattr(opt, "ipg_buckets", None) or {}).values():
            buffer = getattr(bucket, "buffer", None)
            out += [t for t in (buffer if isinstance(buffer, list) else [buffer]) if torch.is_tensor(t)]
        return out
