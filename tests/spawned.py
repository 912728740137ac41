"""Real processes for protocol tests: a worker run on every rank of a gloo group over a file rendezvous."""

from __future__ import annotations

import os
import tempfile
from typing import Callable

import torch
import torch.multiprocessing as mp


def spawned(worker: Callable, world: int, helpers: tuple[int, ...] = ()) -> tuple[dict, dict[int, dict]]:
    """`worker(rank, world, init, out)` on `world` processes, joined: what rank 0 saved at `out`, and what each rank of
    `helpers` saved at `out.<rank>`."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.pt")
        mp.spawn(worker, args=(world, f"file://{os.path.join(tmp, 'rendezvous')}", out), nprocs=world, join=True)
        return torch.load(out), {rank: torch.load(f"{out}.{rank}") for rank in helpers}
