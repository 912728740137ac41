"""A deliberately broken --compile, for tests/test_compile.py.

`InnerCompiledDDP` compiles the module DDP wraps and has the trainer call that compiled module itself, around DDP
instead of through it (pytorch/pytorch#109774: compiled DDP whose gradients are not synchronised). DDP's forward never
runs, so its reducer is never told a backward is coming (`prepare_for_backward`): its autograd hooks return without
queuing an all-reduce, and each rank steps its own shard's gradient. Loaded the way a user's adapter is:
`--backend tests.faulty_compile:InnerCompiledDDP --compile`.

Not a test module (no `test_` prefix): pytest does not collect it.
"""

from __future__ import annotations

import torch

from dpcompare.adapters.ddp import DDPAdapter


class InnerCompiledDDP(DDPAdapter):
    """DDP whose compiled inner module is called directly: the gradients stay local to each rank."""

    name = "inner-compiled-ddp"

    def compile(self) -> None:
        self.wrapped.model = torch.compile(self.wrapped.module)
