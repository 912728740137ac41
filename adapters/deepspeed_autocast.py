"""DeepSpeed's torch_autocast section under ZeRO: which parameters travel and are gathered in the autocast dtype.

Owns: the names of the parameters DeepSpeed marks for the autocast dtype (its lower_precision_safe_modules'
parameters, `get_comm_dtype`), ZeRO-3's gather of them as the forward saw it (`GatherWatch`), and the note that says
where that gather reaches beyond autocast. Imported by adapters.deepspeed only; imports deepspeed inside its functions.

ZeRO-3 all-gathers those parameters in the autocast dtype and casts them back to float32
(`partition_parameters.get_allgather_dtype`), so a forward can see them rounded in every op, not only in the ops
autocast narrows. Whether it does depends on how DeepSpeed fetched the parameter for that forward: a parameter below
`stage3_param_persistence_threshold` stays gathered between steps and is refreshed from the float32 partition after
each step, so only the forward after its first gather sees it rounded. Rather than restate that rule, the watch
records what each forward saw: a parameter whose gathered values are all exactly representable in the autocast dtype
was rounded (a float32 tensor of more than a few elements is not so by chance, and where it is, rounding it is a
no-op). Values that are neither rounded nor the optimizer's are left for the verdict to find (a stale gather).
"""

from __future__ import annotations

import torch
from torch import nn


def narrow_parameters(module: nn.Module) -> list[str]:
    """The parameters DeepSpeed's torch_autocast section marked for the autocast dtype, by name."""
    from deepspeed.runtime.torch_autocast import get_comm_dtype

    return [n for n, p in module.named_parameters() if get_comm_dtype(p) in (torch.float16, torch.bfloat16)]


class GatherWatch:
    """Forward pre-hooks (after DeepSpeed's own, which gather) on the modules holding `names`: after each forward,
    the set of those parameters it saw rounded to `dtype`."""

    def __init__(self, module: nn.Module, names: list[str], dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.seen: dict[str, bool] = {}
        wanted = {id(p): n for n, p in module.named_parameters() if n in set(names)}
        self.handles = []
        for mod in module.modules():
            held = [(wanted[id(p)], p) for p in mod.parameters(recurse=False) if id(p) in wanted]
            if held:
                self.handles.append(mod.register_forward_pre_hook(self._hook(held)))

    def _hook(self, held: list[tuple[str, nn.Parameter]]):
        def record(_module: nn.Module, _args) -> None:
            with torch.no_grad():
                for name, p in held:
                    data = p.data
                    self.seen[name] = data.numel() > 0 and bool(torch.equal(data, data.to(self.dtype).to(data.dtype)))
        return record

    def rounded(self) -> frozenset[str]:
        return frozenset(n for n, r in self.seen.items() if r)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def gathered_note(module: nn.Module, narrow: set[str], amp: str) -> str:
    """ZeRO-3's all-gather of the narrow parameters in the autocast dtype, and where it reaches beyond autocast: the
    narrow parameters that a module outside the lower-precision-safe list also uses (a weight tied to an Embedding),
    whose ops then see the rounded values where plain autocast would keep float32."""
    from deepspeed.runtime.torch_autocast import LOWER_PRECISION_SAFE_MODULES

    ids = {id(p) for n, p in module.named_parameters() if n in narrow}
    beyond = sorted({f"{m}.{n}".lstrip(".") for m, mod in module.named_modules()
                     if type(mod) not in LOWER_PRECISION_SAFE_MODULES
                     for n, p in mod.named_parameters(recurse=False) if id(p) in ids})
    where = (f", also where a module outside that list uses them ({', '.join(beyond)}), which plain autocast would "
             "compute in float32" if beyond else "")
    return (f"; ZeRO-3 all-gathers the same parameters in {amp}, so a forward sees them rounded to {amp}{where} "
            "wherever DeepSpeed gathered them for it (a parameter kept gathered between steps, below "
            "stage3_param_persistence_threshold, only after its first gather); the run-precision reference rounds "
            "the ones each checked step's forward saw rounded")
