"""The loaded-state check: is the state a run loaded from a checkpoint the state the saving run held?

Owns: `judge_loaded`, on rank 0 of a run started from a checkpoint (--load-checkpoint), before its first step. What the
saving run read through the adapter contract after its last step (every parameter's full value, the optimizer state by
parameter name, the loss scale) and what its loop kept (the data position, every rank's generator) against what this
run holds once its backend has loaded the checkpoint and its loop has restored its own state, read the same way. Every
part is compared bitwise, whatever the backends: the formats are lossless for the values they carry, so any difference
is a fault of the save, the conversion or the load. Each part that differs is a divergence with its cause named:
  checkpoint_parameters    a parameter's values differ (checkpoint_shard_order: the saved values, at other places);
  checkpoint_optimizer     the optimizer state is missing (dropped on load: fresh moments) or differs;
  checkpoint_step_count    the optimizer's step counts differ (AdamW's bias correction restarts);
  checkpoint_loss_scale    the loss scale differs (reset to its initial value);
  checkpoint_data          the data position differs (batches replayed or skipped);
  checkpoint_generator     a rank's generator state differs (its dropout masks repeat).
The trajectory check then judges the continuation against the saved run's reference trajectory, resumed
(dpcompare.verify.trajectory.reference_trajectory), so the verdict spans every step of both runs. Imports no adapter.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from dpcompare.verify.judgement.verdict import Divergence, Verdict


def judge_loaded(verdict: Verdict, saved: dict[str, Any], loop: dict[str, Any], *, params: dict[str, torch.Tensor],
                 masters: dict[str, torch.Tensor], state: dict[str, dict[str, Any]] | None, scale: float | None,
                 rngs: list[Any], start: int) -> dict:
    """Record in `verdict` every part of the loaded state that is not the saved one; returns the check's record (the
    result's `checkpoint` section)."""
    step = loop["step"]
    parts: dict[str, str] = {}
    found: list[Divergence] = []

    def fail(part: str, cause: str, name: str, text: str, names: list[str] | None = None) -> None:
        parts[part] = "differs"
        found.append(Divergence(start, name, math.nan, 0.0, math.nan, f"after loading the checkpoint saved after step "
                                f"{step - 1}: {text}", check="checkpoint", cause=cause, parameters=names or [name]))

    for part, what, kept, live in (("parameters", "parameters", saved["params"], params),
                                   ("masters", "master weights (the values the optimizer steps)",
                                    saved.get("masters") or {}, masters)):
        differ = [n for n, t in kept.items() if n not in live or not _equal(t, live[n])]
        parts[part] = f"bitwise equal ({len(kept)})" if kept else "the parameters"
        if differ:
            moved = _moved(kept, live, differ)
            fail(part, "checkpoint_shard_order" if moved >= 0.9 else "checkpoint_parameters", differ[0],
                 f"{len(differ)} of {len(kept)} {what} hold other values than were saved ({differ[0]} first)"
                 + (f"; {moved:.0%} of the values that differ are saved values at other places: the shards were "
                    "loaded in the wrong rank order, or into another layout" if moved >= 0.9 else ""), differ)
    _judge_optimizer(saved.get("optimizer"), state, parts, fail)
    parts["loss_scale"] = "not scaled" if saved.get("scale") is None else f"equal ({saved['scale']:g})"
    if saved.get("scale") is not None and scale != saved["scale"]:
        fail("loss_scale", "checkpoint_loss_scale", "loss scale", f"the loss scale is {scale:g}, the saved "
             f"{saved['scale']:g}: the loss scaler was not restored (it restarts from its initial scale)")
    parts["data_position"] = f"equal (step {step})"
    if start != step:
        fail("data_position", "checkpoint_data", "data position", f"this run starts at step {start}, the saved run "
             f"would have taken step {step} next: the batches of steps {min(start, step)}-{max(start, step) - 1} are "
             f"{'replayed' if start < step else 'skipped'}")
    if loop["world_size"] != len(rngs):
        parts["generators"] = (f"not carried: saved by {loop['world_size']} ranks, loaded by {len(rngs)} (each rank's "
                               "generator starts from its seed)")
    else:
        parts["generators"] = f"equal ({len(rngs)} ranks)"
        apart = [r for r, (a, b) in enumerate(zip(loop["rng"], rngs)) if a != b]
        if apart:
            fail("generators", "checkpoint_generator", f"rank {apart[0]} generator",
                 f"rank {', '.join(map(str, apart))}'s generator is not the saved one: its random draws (dropout "
                 "masks) repeat those it drew from its seed, not the continuation of the saved run's",
                 [f"rank {r}" for r in apart])
    for divergence in found:
        verdict.diverge(divergence)
    return {"saved_by": {"backend": loop["backend"], "world_size": loop["world_size"], "format": loop["format"]},
            "step": step, "parts": parts, "causes": [d.cause for d in found]}


def _judge_optimizer(saved: dict | None, state: dict | None, parts: dict[str, str], fail) -> None:
    if saved is None or state is None:
        parts["optimizer"] = "not read" if saved is None else "not read by this backend"
        return
    missing = [n for n, entry in saved.items() if entry and not state.get(n)]
    if missing:
        fail("optimizer", "checkpoint_optimizer", missing[0], f"the optimizer holds no state for {len(missing)} of "
             f"{len(saved)} parameters ({missing[0]} first): it was dropped on load, and the next step starts from "
             "fresh moments", missing)
        return
    steps = [n for n, entry in saved.items() if "step" in entry and _value(entry["step"]) != _value(state[n]["step"])]
    if steps:
        n = steps[0]
        fail("optimizer", "checkpoint_step_count", n, f"the optimizer's step count is {_value(state[n]['step']):g}, the "
             f"saved {_value(saved[n]['step']):g} ({n} first): it was reset, so AdamW's bias correction restarts",
             steps)
        return
    differ = [n for n, entry in saved.items() for k, v in entry.items()
              if k != "step" and torch.is_tensor(v) and (k not in state[n] or not _equal(v, state[n][k]))]
    parts["optimizer"] = f"bitwise equal ({len(saved)} parameters)"
    if differ:
        fail("optimizer", "checkpoint_optimizer", differ[0], f"the optimizer state of {len(set(differ))} parameters "
             f"differs from the saved ({differ[0]} first)", sorted(set(differ)))


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.detach().to("cpu"), b.detach().to("cpu")
    if a.shape != b.shape:
        return False
    if a.dtype != b.dtype:
        return bool(torch.equal(a.double(), b.double()))
    return bool(torch.equal(a, b))


def _value(v: Any) -> float:
    return float(v.item() if torch.is_tensor(v) else v)


def _moved(saved: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor], differ: list[str]) -> float:
    """Of the elements that differ, the share whose loaded value is among the saved values (anywhere in the model)."""
    values = np.unique(np.concatenate([t.detach().to("cpu").double().reshape(-1).numpy() for t in saved.values()]))
    hits = total = 0
    for n in differ:
        if n not in loaded or loaded[n].shape != saved[n].shape:
            continue
        a = saved[n].detach().to("cpu").double().reshape(-1).numpy()
        b = loaded[n].detach().to("cpu").double().reshape(-1).numpy()
        apart = b[a != b]
        total += apart.size
        hits += int(np.isin(apart, values).sum())
    return hits / total if total else 0.0
