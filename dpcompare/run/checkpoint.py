"""--save-checkpoint and --load-checkpoint: a run's state saved in its backend's own format after its verification
steps, and a run that starts from such a checkpoint, at any world size, under any backend that reads the format.

Owns: what dpcompare writes beside the backend's checkpoint, and the loop's side of a load.
  - LOOP (every rank reads it): the loop's own state, as a training script keeps it beside the model's: the data
    position (the next step), every rank's generator state, the torch.amp.GradScaler's state, and the settings the
    continuation must share (model, optimizer, batch, precision).
  - SAVED (rank 0 reads it): the state as the saving run read it through the adapter contract (every parameter's full
    value, the optimizer state by parameter name, the loss scaler) and the float64 oracle's reference trajectory, so
    that the continuation is judged against one uninterrupted run over every step (dpcompare.verify.starting_state.loaded_state).
A load: the backend loads its checkpoint (Adapter.load_checkpoint), then the loop restores its own state. The planted
faults (--inject-fault ckpt-*) break one part of that on purpose: the checks must name it.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from dpcompare.contract import Adapter
from dpcompare.run.config import CommandLineError, RunConfig, check_writable_dir
from dpcompare.verify.randomness import random_modules

LOOP = "dpcompare-loop.pt"
SAVED = "dpcompare-saved.pt"
SHARED = ("model", "optimizer", "lr", "momentum", "weight_decay", "dtype", "amp", "grad_accum", "seed",
          "clip_grad_norm", "no_dropout")
"""The settings a continuation must share with the run that saved (the global batch besides)."""
SHARD_FILES = {"dcp": ("__{}_0.distcp",),
               "deepspeed": ("zero_pp_rank_{}_mp_rank_00_optim_states.pt", "zero_pp_rank_{}_mp_rank_00_model_states.pt")}
"""Per-rank files of the sharded formats (under the checkpoint or its tag), swapped by --inject-fault ckpt-shards."""
TAG = "dpcompare"
"""The tag DeepSpeed's checkpoints are saved under."""


@dataclass
class Loaded:
    """What a run loaded, for its verification: the loop's record, where it starts, and what it could not restore."""

    loop: dict[str, Any]
    start: int
    directory: Path
    notes: list[str] = field(default_factory=list)

    def saved(self) -> dict[str, Any]:
        """Rank 0: the state the saving run read, and its oracle's trajectory."""
        return torch.load(self.directory / SAVED, map_location="cpu", weights_only=False)


def check_paths(cfg: RunConfig, adapter_cls: type[Adapter]) -> None:
    """Before any work, on rank 0: the formats asked for are the backend's, --save-checkpoint can be written and
    --load-checkpoint holds a complete checkpoint (ValueError naming the flag)."""
    for flag, given in (("save-checkpoint", cfg.save_checkpoint), ("load-checkpoint", cfg.load_checkpoint)):
        if given is not None:
            format_of(cfg, adapter_cls, flag)
    if cfg.save_checkpoint is not None:
        check_writable_dir("save_checkpoint", Path(cfg.save_checkpoint))
    if cfg.load_checkpoint is not None and not (Path(cfg.load_checkpoint) / LOOP).is_file():
        raise ValueError(f"--load-checkpoint {cfg.load_checkpoint}: no complete dpcompare checkpoint there (no {LOOP}); "
                         "save one with --save-checkpoint, or name the directory it was saved to")


def format_of(cfg: RunConfig, adapter: Adapter | type[Adapter], flag: str) -> str:
    formats = adapter.checkpoint_formats()
    if not formats:
        raise CommandLineError(f"--{flag}: --backend {cfg.backend} saves and loads no checkpoint; drop --{flag}")
    fmt = cfg.checkpoint_format or formats[0]
    if fmt not in formats:
        raise CommandLineError(f"--checkpoint-format {fmt}: --backend {cfg.backend} writes and reads "
                               f"{', '.join(formats)}; convert the checkpoint (python -m dpcompare checkpoint) or "
                               "name one of those")
    return fmt


def save(cfg: RunConfig, adapter: Adapter, device: torch.device, step: int, trajectory: Any) -> None:
    """Every rank, after step `step - 1`: the backend's checkpoint, then what the loop keeps and what the run holds."""
    directory = Path(cfg.save_checkpoint)
    fmt = format_of(cfg, adapter, "save-checkpoint")
    adapter.all_gather_object(None)  # every rank has left its step
    adapter.save_checkpoint(str(directory), fmt)
    full = adapter.full_params()
    params = {n: t.detach().to("cpu").clone() for n, t in full.items()}
    masters = {n: t.detach().to("cpu").clone() for n, t in adapter.master_params().items() if t is not full.get(n)}
    state = adapter.optimizer_state()
    rngs = adapter.all_gather_object(random_modules.capture(device))
    if adapter.env.rank == 0:
        scaling = getattr(adapter, "_scaling", None)  # the torch.amp.GradScaler the run used, if any
        loop = {"step": step, "format": fmt, "backend": cfg.backend, "world_size": adapter.env.world_size,
                "checked": trajectory is not None,
                "global_batch": cfg.batch_sizes(adapter.env.world_size)[0], "rng": rngs,
                "grad_scaler": (scaling.scaler.state_dict(), scaling.skipped) if scaling is not None else None,
                "settings": {k: getattr(cfg, k) for k in SHARED}}
        scaler = adapter.scaler_state()
        saved = {"params": params, "masters": masters, "optimizer": state, "scale": scaler.scale if scaler is not None else None,
                 "oracle": trajectory.state() if trajectory is not None else None}
        for name, obj in ((SAVED, saved), (LOOP, loop)):  # the loop's record last: it marks the save complete
            _save_atomic(obj, directory / name)
    adapter.all_gather_object(None)


def load(cfg: RunConfig, adapter: Adapter, device: torch.device, global_batch: int) -> Loaded:
    """Every rank, after wrapping: the backend loads the checkpoint, then the loop restores its own state."""
    directory = Path(cfg.load_checkpoint)
    try:
        loop = torch.load(directory / LOOP, map_location="cpu", weights_only=False)
    except (OSError, RuntimeError, EOFError) as exc:
        raise CommandLineError(f"--load-checkpoint {directory}: no complete dpcompare checkpoint there ({LOOP}: "
                               f"{type(exc).__name__}); save one with --save-checkpoint") from None
    _check_shared(cfg, loop, global_batch)
    if cfg.check_every and not loop.get("checked", True):
        raise CommandLineError(f"--load-checkpoint {directory}: the run that saved it checked no step (--check-every 0), "
                               "so it carries no reference trajectory to continue: add --check-every 0 here too, or "
                               "save it from a checked run")
    fmt = format_of(cfg, adapter, "load-checkpoint")
    fault, fault_rank = _fault(cfg)
    with _shards_swapped(directory, fmt, adapter) if fault == "ckpt-shards" else contextlib.nullcontext():
        try:
            adapter.load_checkpoint(str(directory), fmt)
        except BaseException as exc:  # noqa: BLE001 - the library refused what it was given: said in one line
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):  # DCP's CheckpointException is a BaseException
                raise
            cause = next(iter(getattr(exc, "failures", {}).values()), exc)  # DCP's: each rank's own exception
            first = f"{type(cause).__name__}: " + (str(cause).strip().splitlines() or [""])[0][:300]
            raise ValueError(f"--load-checkpoint {directory}: --backend {cfg.backend} could not load it as {fmt} "
                             f"({first}); load it with the backend and format that saved it, "
                             "or convert it (python -m dpcompare checkpoint)") from None
    optimizer, _ = adapter.optimizer_view()
    if fault in ("ckpt-optimizer", "ckpt-step") and optimizer is not None:
        _plant_optimizer(optimizer, fault)
    notes = []
    scaling = adapter.grad_scaling if loop["grad_scaler"] is not None else None
    if scaling is not None and fault != "ckpt-scale":
        scaling.scaler.load_state_dict(loop["grad_scaler"][0])
        scaling.skipped = loop["grad_scaler"][1]
    rank, world_size = adapter.env.rank, adapter.env.world_size
    if loop["world_size"] == world_size:
        if not (fault == "ckpt-rng" and fault_rank == rank):
            restore_generator(loop["rng"][rank], device)
    else:
        notes.append(f"the checkpoint was saved by {loop['world_size']} ranks and this run has {world_size}: each "
                     "rank's generator starts from its own seed, not a saved rank's")
    start = 0 if fault == "ckpt-data" else loop["step"]
    return Loaded(loop, start, directory, notes)


def restore_generator(state: random_modules.RngState, device: torch.device) -> None:
    torch.set_rng_state(torch.from_numpy(np.frombuffer(state.cpu, dtype=np.uint8).copy()))
    if state.cuda is not None and device.type == "cuda":
        torch.cuda.set_rng_state(torch.from_numpy(np.frombuffer(state.cuda, dtype=np.uint8).copy()), device)


def _check_shared(cfg: RunConfig, loop: dict[str, Any], global_batch: int) -> None:
    apart = [f"--{k.replace('_', '-')} {loop['settings'][k]} (this run: {getattr(cfg, k)})" for k in SHARED
             if loop["settings"].get(k) != getattr(cfg, k)]
    if loop["global_batch"] != global_batch:
        apart.append(f"a global batch of {loop['global_batch']} (this run: {global_batch})")
    if apart:
        raise CommandLineError(f"--load-checkpoint {cfg.load_checkpoint}: it was saved by a run with {'; '.join(apart)}: "
                               "a continuation must train the same model on the same data the same way; use its settings")


def _fault(cfg: RunConfig) -> tuple[str | None, int | None]:
    if not cfg.inject_fault or not cfg.inject_fault.startswith("ckpt-"):
        return None, None
    kind, _, rank = cfg.inject_fault.partition(":")
    return kind, int(rank) if rank else None


def _plant_optimizer(optimizer: torch.optim.Optimizer, fault: str) -> None:
    """ckpt-optimizer: the optimizer state dropped (fresh moments at the next step); ckpt-step: its step counts reset."""
    if fault == "ckpt-optimizer":
        optimizer.state.clear()
        return
    for entry in optimizer.state.values():
        if "step" in entry:
            entry["step"] = entry["step"].zero_() if torch.is_tensor(entry["step"]) else 0


@contextlib.contextmanager
def _shards_swapped(directory: Path, fmt: str, adapter: Adapter) -> Iterator[None]:
    """ckpt-shards: ranks 0 and 1's files of a sharded checkpoint swapped while it loads (rank 0 swaps, and swaps back)."""
    root = directory / TAG if fmt == "deepspeed" else directory
    pairs = [(root / f.format(0), root / f.format(1)) for f in SHARD_FILES.get(fmt, ())]
    pairs = [(a, b) for a, b in pairs if a.exists() and b.exists()]
    if not pairs:
        raise CommandLineError(f"--inject-fault ckpt-shards: this {fmt} checkpoint has no per-rank files of ranks 0 "
                               "and 1 to swap; save a sharded checkpoint with 2 or more ranks")
    if adapter.env.rank == 0:
        _swap(pairs)
    adapter.all_gather_object(None)
    try:
        yield
    finally:
        adapter.all_gather_object(None)
        if adapter.env.rank == 0:
            _swap(pairs)


def _swap(pairs: list[tuple[Path, Path]]) -> None:
    for a, b in pairs:
        held = a.with_name(a.name + ".swap")
        os.replace(a, held)
        os.replace(b, a)
        os.replace(held, b)


def _save_atomic(obj: Any, path: Path) -> None:
    part = path.with_name(f".{path.name}.part")
    torch.save(obj, part)
    os.replace(part, path)
