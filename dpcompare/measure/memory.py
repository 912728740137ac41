"""Model-state memory two ways: the census of what a rank really holds, and the ZeRO paper's formula for it.

Owns: `census_bytes` (bytes per component of the tensors an adapter lists in `model_state_tensors()`, each byte of
a storage counted once), `census_mib` (the same in MiB with the analytic comm-buffer fallback), `zero_formula_mib`
(Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", section 3 and
figure 1, generalised to the run's optimizer and precision) and `param_counts` (Psi from a module whose parameters
may be sharded); the run's memory figures rank 0 writes from every rank's (`record_memory`: peak memory over the
measured window, the model state measured and by the formula). Pure functions of tensors and numbers: no
collective, no adapter.

  model state   each rank's census of the tensors its adapter lists (model_state_tensors) after the reduce of the
                last measured step, each storage byte once; model_state_mib is the largest rank's, beside the
                ZeRO paper's formula for the run's model, precision, optimizer and stage
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

import torch

from dpcompare.measure.samples import Metrics, RankSample

MIB = 1024.0 * 1024.0
COMPONENTS = ("params", "grads", "optimizer", "master_params", "comm_buffers")
"""In the order a byte is claimed: a tensor (or a byte of a storage) listed in two components counts in the first."""

SHARD_STAGES = {"none": 0, "optimizer": 1, "gradients": 2, "parameters": 3}
"""Capabilities.shards -> the ZeRO stage whose partitioning it is (FSDP's full sharding is stage 3's)."""


# -- the census -------------------------------------------------------------------------------------------------
def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The part of `t` this rank holds: a DTensor's local shard, else the tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def held_parts(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The strided tensors that hold `t`'s elements: a sparse tensor's indices and values (a sparse gradient of
    nn.Embedding(sparse=True), SGD's momentum of one), else `t` itself (a DTensor's local shard)."""
    t = local_tensor(t)
    if t.layout == torch.sparse_coo:
        return t._indices(), t._values()
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return t.crow_indices(), t.col_indices(), t.values()
    if t.layout in (torch.sparse_csc, torch.sparse_bsc):
        return t.ccol_indices(), t.row_indices(), t.values()
    return (t,)


def byte_range(t: torch.Tensor) -> tuple[Any, int, int] | None:
    """(the storage's identity, first byte, one past the last byte) the tensor's elements span in its storage, or
    None for a tensor without elements. A strided view spans from its first to its last element."""
    t = local_tensor(t)
    if t.numel() == 0 or t.device.type == "meta":  # a meta tensor holds no memory
        return None
    size = t.element_size()
    span = 1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))
    key = (t.device.type, t.device.index, t.untyped_storage().data_ptr())
    start = t.storage_offset() * size
    return key, start, start + span * size


def _subtract(start: int, end: int, claimed: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of [start, end) that no claimed interval covers."""
    free = [(start, end)]
    for a, b in claimed:
        free = [piece for lo, hi in free for piece in ((lo, min(hi, a)), (max(lo, b), hi)) if piece[0] < piece[1]]
        if not free:
            break
    return free


def census_bytes(components: Mapping[str, Sequence[torch.Tensor | None]]) -> dict[str, int]:
    """Bytes per component of the tensors listed, every byte of a storage counted once: views of one flat buffer
    count the bytes they cover together (not once per view, not the buffer's unlisted rest), a tensor listed in
    two components counts in the first of COMPONENTS (then any other key, in its order), a DTensor counts its
    local shard, a sparse tensor its indices and values. None entries and empty tensors count 0. Returns every key of
    COMPONENTS (0 when absent) plus the keys given."""
    order = [c for c in COMPONENTS] + [c for c in components if c not in COMPONENTS]
    claimed: dict[Any, list[tuple[int, int]]] = {}
    out: dict[str, int] = {}
    for name in order:
        total = 0
        for t in (part for listed in components.get(name) or () if listed is not None for part in held_parts(listed)):
            found = byte_range(t)
            if found is None:
                continue
            key, start, end = found
            pieces = _subtract(start, end, claimed.get(key, []))
            total += sum(b - a for a, b in pieces)
            claimed.setdefault(key, []).extend(pieces)
        out[name] = total
    return out


def census_mib(components: Mapping[str, Sequence[torch.Tensor | None]],
               analytic_comm_buffer_bytes: int | None) -> dict[str, Any]:
    """One rank's model state in MiB: {params, grads, optimizer, master_params, comm_buffers, total,
    comm_buffers_method}. Where the adapter listed no comm buffers (an empty list or none at all), comm_buffers is
    the adapter's analytic `comm_buffer_bytes` (None when it cannot say) and comm_buffers_method says so."""
    counted = census_bytes(components)
    listed = bool([t for t in components.get("comm_buffers") or () if t is not None])
    if listed:
        comm, method = counted["comm_buffers"], "measured (the adapter's comm_buffers tensors)"
    else:
        comm, method = analytic_comm_buffer_bytes, "analytic (the adapter's comm_buffer_bytes: it listed no comm buffers)"
    parts = {c: counted[c] / MIB for c in COMPONENTS if c != "comm_buffers"}
    parts["comm_buffers"] = None if comm is None else comm / MIB
    total = sum(counted[c] for c in COMPONENTS if c != "comm_buffers") + (comm or 0)
    return {**parts, "total": total / MIB, "comm_buffers_method": method}


# -- the ZeRO paper's formula -----------------------------------------------------------------------------------
def param_numel(p: torch.Tensor) -> int:
    """A parameter's full element count: a DTensor's global numel, DeepSpeed ZeRO-3's `ds_numel` (its `.data` is an
    empty placeholder between gathers), else numel()."""
    full = getattr(p, "ds_numel", None)
    return int(full) if full is not None else p.numel()


def param_counts(params: Iterable[torch.Tensor]) -> tuple[int, int]:
    """(Psi: every parameter's elements, the trainable ones' elements)."""
    total = trainable = 0
    for p in params:
        n = param_numel(p)
        total += n
        trainable += n if p.requires_grad else 0
    return total, trainable


def optimizer_state_factor(optimizer: str, momentum: float, state_bytes: int) -> tuple[int, str]:
    """Bytes of optimizer state per trainable parameter (masters apart) and its name in the formula: Adam(W) keeps
    two moments, SGD with momentum one buffer, plain SGD nothing. `state_bytes`: the bytes of one state element
    (the masters' 4 under a 16-bit engine, else the weights'). Step counters (a scalar per tensor) are left out."""
    name = optimizer.lower()
    if name in ("adam", "adamw"):
        return 2 * state_bytes, "Adam moments m, v"
    if name == "sgd":
        return (state_bytes, "SGD momentum buffer") if momentum else (0, "plain SGD: no state")
    raise ValueError(f"no optimizer-state factor for optimizer {optimizer!r}: expected adamw, adam or sgd")


def zero_formula_mib(*, psi: int, trainable: int, world_size: int, shards: str, weight_bytes: int, masters: bool,
                     optimizer: str, momentum: float = 0.0, replicas: int = 1) -> dict[str, Any]:
    """The ZeRO paper's model-state memory per rank for this model, precision and optimizer, in MiB:
    {params, grads, optimizer, master_params, total, stage, formula}.

    Psi parameters (`trainable` of them with gradients and optimizer state). Without fp32 masters (float32 runs,
    --amp autocast: the weights stay in the run dtype) params and grads take `weight_bytes` per element and the
    optimizer state is in the same dtype: fp32 Adam is 4 Psi + 4 Psi + 8 Psi. With a 16-bit engine (`masters`:
    16-bit weights, fp32 master copies) params and grads take 2 bytes and K = 4 (master) + the optimizer's state in
    fp32: mixed-precision Adam is 2 Psi + 2 Psi + 12 Psi (K = 12). Stage 1 (shards optimizer) divides the optimizer
    state and the masters by N, stage 2 (gradients) the gradients too, stage 3 (parameters) the parameters too.
    N is the sharding degree: the world size, or under HSDP (`replicas` > 1: capabilities.shard_replicas) the shard
    group's world_size / replicas ranks, each replica group holding the whole state once.
    Comm buffers, activations and fragmentation are not in the formula."""
    if shards not in SHARD_STAGES:
        raise ValueError(f"shards must be one of {', '.join(SHARD_STAGES)}, got {shards!r}")
    if world_size < 1 or psi < 0 or not 0 <= trainable <= psi:
        raise ValueError(f"need world_size >= 1 and 0 <= trainable <= psi, got {world_size}, {trainable}, {psi}")
    if replicas < 1 or world_size % replicas:
        raise ValueError(f"replicas must divide the world size, got {replicas} replicas of world size {world_size}")
    stage = SHARD_STAGES[shards]
    w = 2 if masters else weight_bytes
    state, state_name = optimizer_state_factor(optimizer, momentum, 4 if masters else weight_bytes)
    master = 4 if masters else 0
    n = world_size // replicas
    per = {"params": w * psi / (n if stage >= 3 else 1), "grads": w * trainable / (n if stage >= 2 else 1),
           "optimizer": state * trainable / (n if stage >= 1 else 1),
           "master_params": master * trainable / (n if stage >= 1 else 1)}
    k = state + master

    def term(bytes_per: int, what: str, divided: bool) -> str:
        return f"{bytes_per}{what}" + ("/N" if divided and n > 1 else "")

    psi_t = "Psi" if trainable == psi else "Psi_t"
    text = (f"ZeRO-{stage} ({'sharded: ' + shards if stage else 'replicated'}; Rajbhandari et al. 2020): "
            f"{term(w, 'Psi', stage >= 3)} params + {term(w, psi_t, stage >= 2)} grads + "
            f"{term(k, psi_t, stage >= 1)} optimizer (K={k}: "
            + (f"4 fp32 master + {state} {state_name}" if masters else state_name)
            + f"), Psi={psi}" + (f", Psi_t={trainable} trainable" if trainable != psi else "") + f", N={n}"
            + (f" (HSDP: the {world_size} ranks as {replicas} replica groups of {n})" if replicas > 1 else "") + ", "
            + ("16-bit weights with fp32 masters" if masters else f"{weight_bytes}-byte weights, no master copy")
            + f", {optimizer}")
    out: dict[str, Any] = {k2: v / MIB for k2, v in per.items()}
    out.update(total=sum(per.values()) / MIB, stage=stage, formula=text)
    return out


# -- the run's memory figures ------------------------------------------------------------------------------
def record_memory(m: Metrics, samples: list[RankSample], model_state: dict[str, float | None],
            formula: dict[str, Any] | None = None, formula_reason: str | None = None) -> None:
    """Peak memory over the window: the highest rank's, each rank's, the allocator's reserve, the most any rank rose
    above what it held when the window opened (peak_above_start_mib: the steps' own memory, activations included);
    the model state.

    model_state_mib is the census of the rank whose measured model state is largest (its whole breakdown, with
    `rank`: what the largest rank needs, as peak_mem_mib is the highest rank's; ZeRO's padded partitions make the
    ranks differ), model_state_mib_per_rank every rank's census in rank order, model_state_formula_mib the ZeRO
    paper's per-rank figure for the same model, precision and optimizer. Where a rank took no census the model state
    is the analytic one (parameters, their gradients, the optimizer's state on rank 0: not sharding-aware) and
    model_state_mib_per_rank is None."""
    peaks = [s.memory.get("peak_mem_mib") for s in samples]
    known = [x for x in peaks if x is not None]
    m.set("peak_mem_mib", max(known) if known else None, samples[0].memory_reason)
    m.set("peak_mem_mib_per_rank", peaks)
    reserved = [s.memory.get("peak_mem_reserved_mib") for s in samples if s.memory.get("peak_mem_reserved_mib") is not None]
    m.set("peak_mem_reserved_mib", max(reserved) if reserved else None, "CPU: no allocator reserve to report")
    m.set("mem_method", "cuda max_memory_allocated" if reserved else "resident high-water mark (VmHWM) over the window")
    above = [s.memory.get("peak_above_start_mib") for s in samples]
    known_above = [x for x in above if x is not None]
    m.set("peak_above_start_mib", max(known_above) if known_above else None,
          samples[0].memory_reason or "what the rank held when the window opened was not read")
    m.set("peak_above_start_mib_per_rank", above)
    censuses = [s.model_state for s in samples]
    if censuses and all(_is_census(c) for c in censuses):
        largest = max(range(len(censuses)), key=lambda r: (censuses[r]["total"], -r))
        m.set("model_state_mib", {**censuses[largest], "rank": largest,
                                  "method": "census of the tensors the adapter lists (model_state_tensors), the rank "
                                            "with the largest total"})
        m.set("model_state_mib_per_rank", censuses)
    else:
        missing = [r for r, c in enumerate(censuses) if not _is_census(c)]
        why = next((c["reason"] for c in censuses if isinstance(c, dict) and c.get("reason")), None)
        m.set("model_state_mib", {**model_state, "method": "analytic (rank 0's parameters, gradients and optimizer "
                                                           "state; no census)"} if model_state else model_state)
        m.set("model_state_mib_per_rank", None,
              f"no model-state census on rank(s) {', '.join(map(str, missing))}" + (f" ({why})" if why else "")
              + ": the model state is analytic")
    m.set("model_state_formula_mib", formula, formula_reason or "no formula for this run")


def _is_census(c: Any) -> bool:
    return isinstance(c, dict) and isinstance(c.get("total"), (int, float))
