"""The reference trajectory held in ranges over the ranks: each rank keeps and steps its own range of the parameters.

Owns: `Ranges` (on every rank, over the verifier's own process group, dpcompare.verify.divided.Peers): which rank
owns which trainable parameter (dpcompare.verify.peers.owners: contiguous ranges of about as many elements each),
and the collectives the reference trajectory (dpcompare.verify.trajectory) needs to train its float64 and run-precision
copies as one process would, with each rank holding only its own range between steps:
  - `gather`: before a step's forwards, every rank's copy is made whole: each trainable parameter from its owner, the
    buffers and every other parameter (not trained: a frozen or non-float one, the ones the oracle coverage leaves
    out) from rank 0, whose forwards' semantics they follow (as the backend's replicas follow rank 0's buffers);
  - `to_owners`: the ranks' summed gradients of their own forwards go to each parameter's owner, who adds them in the
    order the ranks first appear in the step's forwards (rank 0's order when one process ran them all), in the copy's
    own dtype, as autograd would have accumulated them on one process (dpcompare.verify.divided's order);
  - `release`: after the step, a rank frees the storage of the trainable parameters it does not own.
Each rank's optimizer steps only its own range: the optimizers the run can use (SGD, AdamW) act element by element,
so a range steps exactly as it would within the whole. The figures the trajectory is judged by are computed by each
owner for its range and merged by rank 0 in the parameters' order: the same sums, in the same order, as one process's.

`TrajectoryRequest` is what rank 0 sends the other ranks (on the verifier's group, in the Helper's loop) for each of
the trajectory's steps and judgements. Imports no adapter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dpcompare.verify.peers import Peers, owners, to_owners


@dataclass(frozen=True, slots=True)
class TrajectoryRequest:
    """One of the reference trajectory's operations, run by every rank at once: "step" (its forwards at `positions`
    with `weights`, summed in `order`; None: rank 0 runs every forward itself) or "judge" (each rank's figures for its
    range, against the run's parameters after the step)."""

    op: str
    positions: tuple[int, ...] | None = None
    weights: tuple[float, ...] = ()
    order: tuple[int, ...] = (0,)
    ranks: int = 1
    """The ranks in the step's forwards (the recipe's loss multiplier, dpcompare.verify.equivalence.accumulate_raw)."""
    loss_scale: float = 1.0
    dtypes: tuple[torch.dtype, ...] = ()
    """"judge": the dtypes of rank 0's parameters after the step it sends each owner, in the trainable order."""
    slot: str = "trajectory"
    """Never None: the Helper's loop serves until a request whose slot is None."""


class Ranges:
    """This rank's range of `model`'s trainable parameters and the collectives over them (see the module docstring).
    `model` is any copy of the template with its trainable parameters as the run's (the same names on every rank)."""

    def __init__(self, peers: Peers, model: nn.Module) -> None:
        self.peers = peers
        trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        self.plan = owners(model, peers.world_size, whole=trainable)
        """Which rank holds each trainable parameter between steps and steps it (never cut here: each copy's optimizer
        steps whole parameters)."""
        self.owner = {n: self.plan.sole(n) for n in trainable}
        """Trainable parameter name -> the rank that holds it between steps and steps it."""
        self.rank = peers.rank

    def mine(self, name: str) -> bool:
        """Whether this rank holds and steps `name` (a parameter that is not trained is every rank's)."""
        return self.owner.get(name, self.rank) == self.rank

    def ask(self, request: TrajectoryRequest) -> None:
        """Rank 0: every other rank runs `request` beside this one."""
        self.peers.broadcast(request)

    # -- the copy whole, and in ranges again ---------------------------------------------------------------------
    def gather(self, model: nn.Module) -> None:
        """Make `model` whole on every rank: each trainable parameter from its owner, the rest from rank 0."""
        with torch.no_grad():
            for n, p in model.named_parameters():
                src = self.owner.get(n, 0)
                if src != self.rank:
                    _allocate(p)
                self._broadcast(p, src)
            for _, b in model.named_buffers():
                self._broadcast(b, 0)

    def from_rank0(self, model: nn.Module) -> None:
        """Every parameter and buffer of `model` set to rank 0's (a copy each rank built from its own template: the
        ranks may have built different initial weights, which the backend may or may not make rank 0's)."""
        with torch.no_grad():
            for _, t in (*model.named_parameters(), *model.named_buffers()):
                self._broadcast(t, 0)

    def to_owners_from_rank0(self, names: list[str], values: dict[str, torch.Tensor] | None,
                             dtypes: dict[str, torch.dtype], shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
        """Rank 0's `values` of `names`, each sent to its owner: this rank's own range of them (rank 0: its own)."""
        out: dict[str, torch.Tensor] = {}
        for n in names:
            owner = self.owner[n]
            if self.rank == 0:
                if owner == 0:
                    out[n] = values[n]
                else:
                    dist.send(values[n].detach().to("cpu").contiguous(), dst=owner, group=self.peers.group)
            elif owner == self.rank:
                t = torch.empty(shapes[n], dtype=dtypes[n])
                dist.recv(t, src=0, group=self.peers.group)
                out[n] = t
        return out

    def release(self, model: nn.Module) -> None:
        """Free the storage of the trainable parameters of `model` this rank does not own (gathered again before use)."""
        for n, p in model.named_parameters():
            if not self.mine(n):
                storage = p.untyped_storage()
                if storage.nbytes():
                    storage.resize_(0)

    def _broadcast(self, t: torch.Tensor, src: int) -> None:
        if t.device.type == "cpu" and t.is_contiguous():
            dist.broadcast(t.data, src=src, group=self.peers.group)
            return
        staged = t.detach().to("cpu").contiguous() if self.rank == src else torch.empty(t.shape, dtype=t.dtype)
        dist.broadcast(staged, src=src, group=self.peers.group)
        if self.rank != src:
            t.data.copy_(staged.to(t.device))

    # -- gradients and figures -----------------------------------------------------------------------------------
    def to_owners(self, model: nn.Module, raw: dict[str, torch.Tensor], order: tuple[int, ...]) -> dict[str, torch.Tensor]:
        """Each trainable parameter's sum over the ranks in `order` of their `raw` gradients, at its owner
        (dpcompare.verify.peers.to_owners): this rank's own range's sums."""
        return to_owners(self.peers, self.plan, model, raw, order)

    def everyone(self, obj: Any) -> list[Any]:
        """`obj` from every rank, on every rank, in rank order."""
        out: list[Any] = [None] * self.peers.world_size
        dist.all_gather_object(out, obj, group=self.peers.group)
        return out

    def at_rank0(self, obj: Any) -> list[Any] | None:
        """`obj` from every rank, on rank 0 (None on the others)."""
        return self.peers.gather(obj)


def _allocate(p: torch.Tensor) -> None:
    storage = p.untyped_storage()
    need = (p.storage_offset() + p.numel()) * p.element_size()
    if storage.nbytes() < need:
        storage.resize_(need)
