"""Compiling a module's forward in place with torch.compile, so that whatever calls the module (a DDP wrapper, an
engine, FSDP's hooks) calls the compiled forward: the one way --compile compiles, for the adapters (through
`Adapter.compile_module`) and for the verifier's compiled reference copy. Imports no adapter.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def compile_forward(module: nn.Module, **options: Any) -> None:
    """Compile `module`'s forward in place (torch.compile `options`), its hooks left outside the compiled code: the
    instance's `forward` becomes a compiled function of this module that calls the original. Not nn.Module.compile():
    it compiles `Module._call_impl`, a frame in torch's own files that Dynamo skips when the module's forward is torch's
    too (nn.Sequential, nn.Linear), so nothing at all is compiled and nothing says so (pytorch/pytorch#150915); a frame
    here is traced, and the forward it calls inlined, whoever defined it."""
    forward = module.forward

    def compiled_forward(*args: Any, **kwargs: Any) -> Any:
        return forward(*args, **kwargs)

    module.forward = torch.compile(compiled_forward, **options)
