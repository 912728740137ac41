"""Sparse gradients: the embedding tables that get one (`nn.Embedding(sparse=True)`, `nn.EmbeddingBag(sparse=True)`,
the tables of recommendation models), their dense reading, and the run's one-line refusal where a backend or torch
cannot take one.

A sparse gradient (a COO tensor: the rows a batch read, a row read twice listed twice) is reduced as such by DDP and
Horovod (gloo all-gathers the indices and values) and stepped as such by torch's SGD. The checks read it densified
(`dense`: coalesced, the repeated rows summed, into a strided tensor of the parameter's shape) — the same gradient,
laid out as the oracle's: the float64 oracle, the noise floor and the reference trajectory compute theirs on
verification copies whose tables are switched to `sparse=False` (`make_dense`), which compute the same sum of rows
into a dense gradient. Where a backend cannot take a sparse gradient (it shards or partitions flat dense buffers:
FSDP, ZeRO) or torch cannot (AdamW, weight decay in SGD, clip_grad_norm_), the run refuses the model before it trains,
in one line naming the parameter (`refusal`). Imports nothing above the contract.
"""

from __future__ import annotations

from typing import Any, Mapping, TypeVar

import torch
from torch import nn

TABLES = (nn.Embedding, nn.EmbeddingBag)
"""The torch modules whose `sparse=True` gives their weight a sparse gradient."""
FIX = "use ddp or horovod, or build the table with sparse=False"
"""What a refusal of the backend offers instead (the backends that reduce sparse gradients)."""

T = TypeVar("T")


def is_sparse(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.layout != torch.strided


def dense(t: T) -> T:
    """`t` as a strided tensor of its shape (a sparse one coalesced: repeated rows summed); anything else as it is."""
    return t.to_dense() if is_sparse(t) else t  # type: ignore[union-attr]


def densified(tensors: Mapping[str, T]) -> dict[str, T]:
    """`tensors` by name, each sparse one densified (None stays None)."""
    return {n: dense(t) for n, t in tensors.items()}


def densified_state(state: Mapping[str, Mapping[str, Any]] | None) -> dict[str, dict[str, Any]] | None:
    """An optimizer state by parameter name with its sparse tensors densified (SGD's momentum buffer of a sparse
    gradient is sparse: the momentum-scaled sum of the sparse gradients, every row it holds decayed alike)."""
    return None if state is None else {n: {k: dense(v) for k, v in s.items()} for n, s in state.items()}


def tables(model: nn.Module) -> dict[str, str]:
    """The trainable parameters the model's tables give a sparse gradient, by name -> the table as its constructor
    says it ("nn.EmbeddingBag(sparse=True)")."""
    found: dict[str, str] = {}
    for name, module in model.named_modules():
        # a table's alone: a parametrized layer's weight is computed when read (spectral_norm's moves its buffers)
        weight = getattr(module, "weight", None) if isinstance(module, TABLES) else None
        if isinstance(module, TABLES) and module.sparse and isinstance(weight, nn.Parameter) and weight.requires_grad:
            found.setdefault(f"{name}.weight" if name else "weight", f"nn.{type(module).__name__}(sparse=True)")
    return found


def make_dense(model: nn.Module) -> nn.Module:
    """`model` (a copy for checking) with its tables computing dense gradients (`sparse=False`), in place."""
    for module in model.modules():
        if isinstance(module, TABLES):
            module.sparse = False
    return model


def sparse_grads(model: nn.Module) -> tuple[str, ...]:
    """The parameters whose `.grad` is sparse after a backward (the probe's test, whatever made it sparse)."""
    return tuple(n for n, p in model.named_parameters() if is_sparse(p.grad))


def note(found: tuple[str, ...], known: Mapping[str, str]) -> str:
    """The verdict's sentence on a model whose tables get sparse gradients (`found`, all of them `known` tables)."""
    names = ", ".join(f"`{n}` ({known.get(n, 'sparse')})" for n in found)
    return (f"{names} get{'s' if len(found) == 1 else ''} a sparse gradient: the backend reduces it and the optimizer "
            "steps it sparse; the checks read it, and SGD's momentum of it, densified (coalesced: repeated rows "
            "summed) against the dense gradient of the oracle's copies, whose tables compute with sparse=False")


OPTIMIZER_NAMES = {"adamw": "AdamW"}
SIXTEEN_BITS = ("a 16-bit sparse gradient rounds each repeated row apart and sums the rows when coalesced, unlike the "
                "dense reference the checks hold it against")


def refusal(found: tuple[str, ...], known: Mapping[str, str], backend: str, backend_refusal: str | None, *,
            optimizer: str, weight_decay: float, clip_grad_norm: float | None, dtype: str,
            compression: str) -> str | None:
    """Why the run cannot take the sparse gradients the probe `found` (parameter names), in one line naming the first
    (None: it can). `known`: the model's tables (`tables`), whose sparse gradients the checks read densified;
    `backend_refusal`: why the backend cannot take one (`Adapter.sparse_gradient_refusal`), or None; then what torch
    cannot do with one (AdamW, SGD's weight decay, clip_grad_norm_) and what the checks cannot model (16 bits)."""
    if not found:
        return None
    name = found[0]
    if name not in known:
        return (f"`{name}` gets a sparse gradient from outside nn.Embedding/nn.EmbeddingBag(sparse=True), the tables "
                "whose sparse gradients the checks read densified; compute it dense to check this model")
    more = f" and {len(found) - 1} more" if len(found) > 1 else ""
    what = f"the sparse gradient of `{name}` ({known[name]}){more}"
    dense_fix = "or build the table with sparse=False"
    if backend_refusal:
        return f"{backend} cannot take {what}: {backend_refusal}; {FIX}"
    if optimizer != "sgd":
        return (f"--optimizer {optimizer} cannot step {what}: torch's {OPTIMIZER_NAMES.get(optimizer, optimizer)} "
                f"refuses sparse gradients; use --optimizer sgd (momentum SGD steps them), {dense_fix}")
    if weight_decay:
        return (f"--weight-decay {weight_decay:g} cannot apply to {what}: torch's SGD adds no weight decay to a sparse "
                f"gradient; drop --weight-decay, {dense_fix}")
    if clip_grad_norm is not None:
        return (f"--clip-grad-norm cannot clip {what}: torch's clip_grad_norm_ takes no norm of a sparse gradient; "
                f"drop --clip-grad-norm, {dense_fix}")
    if dtype not in ("float32", "float64"):
        return (f"--dtype {dtype}: the checks cannot judge {what} in 16 bits: {SIXTEEN_BITS}; use --dtype float32 "
                f"(--amp bf16 keeps float32 gradients), {dense_fix}")
    if compression != "none":
        return (f"--compression {compression}: the checks cannot judge {what} sent in 16 bits: {SIXTEEN_BITS}; drop "
                f"--compression, {dense_fix}")
    return None
