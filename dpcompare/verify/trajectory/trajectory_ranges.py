"""The reference trajectory held in ranges over the ranks: each rank keeps and steps its own range of the parameters.

Owns: `Ranges` (on every rank, over the verifier's own process group, dpcompare.verify.memory.divider.Peers): which rank
holds which elements of each trainable parameter (dpcompare.verify.ranks.range_plan: one contiguous range of the elements a rank,
a parameter that crosses ranges held in pieces, each holder stepping its own piece as a tensor of its own),
and the collectives the reference trajectory (dpcompare.verify.trajectory.reference_trajectory) needs to train its float64 and run-precision
copies as one process would, with each rank holding only its own range between steps:
  - `gather`: before a step's forwards, every rank's copy is made whole: each trainable parameter from its holders, the
    buffers and every other parameter (not trained: a frozen or non-float one, the ones the oracle coverage leaves
    out) from rank 0, whose forwards' semantics they follow (as the backend's replicas follow rank 0's buffers);
  - `to_owners`: the ranks' summed gradients of their own forwards go to each parameter's owner, who adds them in the
    order the ranks first appear in the step's forwards (rank 0's order when one process ran them all), in the copy's
    own dtype, as autograd would have accumulated them on one process (dpcompare.verify.memory.divider's order);
  - `release`: after the step, a rank frees the storage of the trainable parameters it does not hold whole (a piece
    lives in a tensor of its own between steps).
Each rank's optimizer steps only its own range: the optimizers the run can use (SGD, AdamW) act element by element,
so a range steps exactly as it would within the whole. The figures the trajectory is judged by are computed by each
owner for its range and merged by rank 0 in the parameters' order: the same sums, in the same order, as one process's.

`TrajectoryRequest` is what rank 0 sends the other ranks (on the verifier's group, in the Helper's loop) for each of
the trajectory's steps and judgements. Imports no adapter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping

import torch
import torch.distributed as dist
from torch import nn

from dpcompare.verify.ranks import range_cuts
from dpcompare.verify.replay.optimizer_rebuild import over
from dpcompare.verify.ranks.verifier_group import Peers, owners, to_owners


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
    """The ranks in the step's forwards (the recipe's loss multiplier, dpcompare.verify.oracle.gradient_oracle.accumulate_raw)."""
    loss_scale: float = 1.0
    at: int = 0
    """"step": the run's step (a schedule's hyper-parameters are that step's)."""
    dtypes: tuple[torch.dtype, ...] = ()
    """"judge": the dtypes of rank 0's parameters after the step it sends each owner, in the trainable order."""
    slot: str = "trajectory"
    """Never None: the Helper's loop serves until a request whose slot is None."""


class Ranges:
    """This rank's range of `model`'s trainable parameters and the collectives over them (see the module docstring).
    `model` is any copy of the template with its trainable parameters as the run's (the same names on every rank)."""

    def __init__(self, peers: Peers, model: nn.Module, whole: Iterable[str] = ()) -> None:
        """`whole`: the parameters never cut (the optimizer steps them as whole tensors)."""
        self.peers = peers
        self.plan = owners(model, peers.world_size, whole)
        """Which rank holds which elements of each trainable parameter between steps and steps them
        (dpcompare.verify.ranks.range_plan): a parameter held whole by one rank, or cut, each holder stepping its piece."""
        self.rank = peers.rank

    def mine(self, name: str) -> bool:
        """Whether this rank holds and steps `name` whole (a parameter that is not trained is every rank's)."""
        if name not in self.plan.sizes:
            return True
        return self.plan.sole(name) == self.rank

    def cut(self, name: str) -> bool:
        """Whether `name` is held in pieces by several ranks (each steps its own piece, `pieces_of`)."""
        return name in self.plan.sizes and self.plan.is_cut(name)

    def pieces_of(self, model: nn.Module) -> dict[str, nn.Parameter]:
        """This rank's piece of each parameter of `model` cut over the ranks, as a tensor of its own (copied from the
        parameter's values now): what the copy's optimizer steps in its place, and `gather` copies back into it."""
        return {n: nn.Parameter(self.plan.take(n, self.rank, p.detach()).clone()) for n, p in model.named_parameters()
                if self.cut(n) and self.plan.holds(n, self.rank)}

    def targets(self, model: nn.Module, pieces: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, the tensor this rank steps of it) for each trainable parameter of `model` in its range: the
        parameter it holds whole, or its piece of one cut over the ranks (`pieces`, from `pieces_of`)."""
        for n, p in model.named_parameters():
            if p.requires_grad and (n in pieces or self.mine(n)):
                yield n, pieces.get(n, p)

    def ask(self, request: TrajectoryRequest) -> None:
        """Rank 0: every other rank runs `request` beside this one."""
        self.peers.broadcast(request)

    # -- the copy whole, and in ranges again ---------------------------------------------------------------------
    def gather(self, model: nn.Module, pieces: Mapping[str, torch.Tensor] | None = None) -> None:
        """Make `model` whole on every rank: each trainable parameter from its owner (a cut one from each holder's
        piece, this rank's in `pieces`), the rest from rank 0."""
        with torch.no_grad():
            for n, p in model.named_parameters():
                if self.cut(n):
                    _allocate(p)
                    flat = p.data.view(-1)
                    for piece in self.plan.holders(n):
                        part = flat[piece.start:piece.stop]
                        if piece.rank == self.rank:
                            part.copy_(pieces[n].detach().reshape(-1))
                        self._broadcast(part, piece.rank)
                    continue
                src = self.plan.sole(n) if n in self.plan.sizes else 0
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
        plan, me = self.plan, self.rank
        for n in names:
            if me == 0:
                range_cuts.send(plan, n, values[n], self.peers.group)
                if plan.holds(n, 0):
                    out[n] = plan.take(n, 0, values[n])
            elif plan.holds(n, me):
                out[n] = torch.empty(plan.shape(n, me, shapes[n]), dtype=dtypes[n])
                dist.recv(out[n], src=0, group=self.peers.group)
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
        (dpcompare.verify.ranks.verifier_group.to_owners): this rank's own range's sums."""
        return to_owners(self.peers, self.plan, model, raw, order)

    def global_norm(self, own: dict[str, torch.Tensor], order: list[str]) -> torch.Tensor | None:
        """The norm of every range's per-tensor norms (`own`: this rank's, by parameter; a cut parameter's from its
        pieces' norms), stacked in `order` as one process stacks them; None where no parameter has a gradient."""
        norms = {n: range_cuts.norm_of(ts) for n, ts in range_cuts.by_parameter(self.everyone(own)).items()}
        ordered = [norms[n] for n in order if n in norms]
        return torch.linalg.vector_norm(torch.stack(ordered)) if ordered else None

    def figures_at_rank0(self, mine: dict[str, tuple]) -> dict[str, tuple] | None:
        """Every range's drift figures (`mine`: this rank's), merged on rank 0 by parameter (a cut parameter's from
        its pieces'); None on the other ranks."""
        parts = self.at_rank0(mine)
        return None if parts is None else {n: range_cuts.merge_drift(fs) for n, fs in range_cuts.by_parameter(parts).items()}

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


class Idle:
    """The optimizer of a rank whose range holds no parameter (more ranks than elements, or parameters the plan may not
    cut: dpcompare.verify.ranks.range_plan): it steps nothing and holds no state, and the rank takes part in everything else as a
    rank that holds parameters does."""

    def __init__(self) -> None:
        self.state: dict = {}
        self.param_groups: list[dict] = []

    def step(self) -> None:
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None

    def state_dict(self) -> dict:
        return {"state": {}, "param_groups": []}

    def load_state_dict(self, state: dict) -> None:
        if state.get("state") or state.get("param_groups"):
            raise ValueError("a rank that holds no parameter was given an optimizer state to load")


def optimizer(factory: Any, named: list[tuple[str, torch.Tensor]]) -> Any:
    """The run's optimizer over `named` tensors (name, tensor), grouped as the run's (dpcompare.verify.replay.optimizer_rebuild
    `over`), or an Idle one where this rank's range holds none (the optimizers refuse an empty list)."""
    return over(factory, named) if named else Idle()
