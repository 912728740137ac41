"""The DeepSpeed checkpoints `convert` reads and writes, offline on one process.

Owns: reading a ZeRO 1, 2 or 3 checkpoint (`engine.save_checkpoint`'s partitions, one file per rank) into a
`Portable`, through DeepSpeed's own `ds_to_universal`, which joins the partitions parameter by parameter; reading a
universal checkpoint; and writing a `Portable` as a universal checkpoint, which DeepSpeed's engine loads at any world
size and ZeRO stage with `checkpoint.load_universal`.

A universal checkpoint as the engine reads it (deepspeed/runtime/base_optimizer.py and zero/stage3.py, 0.19.8):
  TAG/zero/NAME/fp32.pt, exp_avg.pt, ...   each parameter's fp32 weight and optimizer state ({"param": tensor}),
                                             and ZeRO-1/2's step.pt;
  TAG/zero/optimizer_state.pt              the loss scaler and the groups' hyper-parameters (ZeRO-1/2: group by
                                             group; ZeRO-3: the first group's for all, its step count under
                                             "optimizer_state_dict");
  TAG/mp_rank_00_model_states.pt           what ZeRO-1/2's loader opens (the step counters, the scheduler), and
  TAG/zero_pp_rank_0_mp_rank_00_model_states.pt   what ZeRO-3's opens: `ds_to_universal` copies only the files of
                                             the stage that saved, so neither stage loads the other's; both are
                                             written here, which carries ZeRO-3 to ZeRO-1/2 and back;
  latest_universal                         the tag.
The engine's universal load restores neither the module's buffers nor a parameter the optimizer does not step; a state
with either is refused unless the loss is allowed (`write_universal`'s `lossy`).
"""

from __future__ import annotations

import contextlib
import io
import re
import tempfile
from collections import OrderedDict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from dpcompare.commands.convert.portable import Portable, Refused, same_bits

OPTIM = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
ZERO12_MODEL = "mp_rank_00_model_states.pt"
ZERO3_MODEL = "zero_pp_rank_{}_mp_rank_00_model_states.pt"
COUNTERS = ("global_steps", "global_samples", "skipped_steps")
OPTIMIZER_GLOBALS = ("dynamic_loss_scale", "overflow", "clip_grad")
"""What ZeRO's optimizer_state.pt keeps beside the loss scaler (carried in Portable.counters)."""


def tag_dir(path: Path, tag: str | None) -> Path:
    """The folder of one checkpoint: `path`/`tag`, else the tag `path`/latest (or latest_universal) names, else
    `path` itself where it holds the files."""
    if tag is not None:
        return path / tag
    for latest in ("latest", "latest_universal"):
        if (path / latest).is_file():
            return path / (path / latest).read_text().strip()
    return path


def is_deepspeed(d: Path) -> bool:
    return d.is_dir() and any(OPTIM.search(f.name) for f in d.iterdir())


def is_universal(d: Path) -> bool:
    return (d / "zero" / "optimizer_state.pt").is_file()


def is_zero0(d: Path) -> bool:
    return (d / ZERO12_MODEL).is_file() and not is_deepspeed(d) and not is_universal(d)


def check_complete(d: Path) -> tuple[int, int]:
    """(the ZeRO stage, the ranks that saved) of the checkpoint in `d`, or Refused naming the first file missing."""
    ranks: dict[int, Path] = {}
    for f in sorted(d.iterdir()):
        m = OPTIM.search(f.name)
        if m:
            if int(m.group(2)) != 0:
                raise Refused(f"{d}: saved with tensor parallelism ({f.name}); convert reads data-parallel ZeRO "
                              "checkpoints (model-parallel rank 0 alone)")
            ranks[int(m.group(1))] = f
    try:
        head = torch.load(next(iter(ranks.values())), map_location="cpu", weights_only=False)["optimizer_state_dict"]
    except Exception as exc:  # noqa: BLE001 - a truncated or foreign file is one line
        raise Refused(f"{d}: its ZeRO optimizer file cannot be read ({type(exc).__name__}); save the checkpoint "
                      "again") from None
    stage = int(head.get("zero_stage", 1))
    count = head["partition_count"]
    count = int(max(count) if isinstance(count, (list, tuple)) else count)
    missing = [r for r in range(count) if r not in ranks]
    if missing:
        name = next(iter(ranks.values())).name
        name = re.sub(r"zero_pp_rank_\d+", f"zero_pp_rank_{missing[0]}", name)
        raise Refused(f"{d}: a partial ZeRO-{stage} checkpoint: {len(ranks)} of the {count} ranks' optimizer files "
                      f"are there, {name} is not; copy every rank's files, or save it again")
    models = [ZERO3_MODEL.format(r) for r in range(count)] if stage == 3 else [ZERO12_MODEL]
    absent = [m for m in models if not (d / m).is_file()]
    if absent:
        raise Refused(f"{d}: a partial ZeRO-{stage} checkpoint: {absent[0]} is missing; copy every rank's files, or "
                      "save it again")
    return stage, count


def read_deepspeed(path: Path, tag: str | None) -> Portable:
    """A ZeRO 1-3 checkpoint under `path` (its tag folder, or the folder `latest` names), joined by ds_to_universal."""
    d = tag_dir(path, tag)
    if is_zero0(d):
        raise Refused(f"{d}: a DeepSpeed checkpoint without ZeRO (stage 0), whose optimizer state is the torch "
                      "optimizer's own, keyed by position; convert reads ZeRO 1-3 checkpoints")
    if not is_deepspeed(d):
        raise Refused(f"{d}: no ZeRO optimizer files (*_optim_states.pt) there: not a DeepSpeed checkpoint (name its "
                      "tag with --tag, or the folder engine.save_checkpoint wrote)")
    stage, count = check_complete(d)
    with tempfile.TemporaryDirectory(prefix="dpcompare-convert-") as tmp:
        _ds_to_universal(d, Path(tmp))
        model_file = d / (ZERO3_MODEL.format(0) if stage == 3 else ZERO12_MODEL)
        p = _read_universal(Path(tmp), model_file, stage)
    p.source = f"DeepSpeed ZeRO-{stage} checkpoint of {count} ranks ({d})"
    return p


def read_universal(path: Path, tag: str | None) -> Portable:
    d = tag_dir(path, tag)
    if not is_universal(d):
        raise Refused(f"{d}: no zero/optimizer_state.pt there: not a DeepSpeed universal checkpoint")
    models = [d / ZERO12_MODEL, *sorted(d.glob("zero_pp_rank_*_mp_rank_00_model_states.pt"))]
    model_file = next((m for m in models if m.is_file()), None)
    if model_file is None:
        raise Refused(f"{d}: a universal checkpoint without its model-states file ({ZERO12_MODEL}); convert it again")
    p = _read_universal(d, model_file, 3 if model_file.name != ZERO12_MODEL else 2)
    p.source = f"DeepSpeed universal checkpoint ({d})"
    return p


def _ds_to_universal(d: Path, out: Path) -> None:
    from deepspeed.checkpoint import ds_to_universal

    args = SimpleNamespace(input_folder=str(d), output_folder=str(out), num_extract_workers=1, num_merge_workers=1,
                           keep_temp_folder=False, strict=True,
                           # a model of no DeepSpeed's own records no universal_checkpoint_info at ZeRO-1/2
                           inject_missing_state=True)
    said = io.StringIO()
    try:
        with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
            ds_to_universal.main(args)
    except Exception as exc:  # noqa: BLE001 - DeepSpeed's own reason, in one line
        raise Refused(f"{d}: DeepSpeed's ds_to_universal could not join its partitions ({type(exc).__name__}: "
                      f"{(str(exc).strip().splitlines() or [''])[0][:200]})") from None


def _state(obj: Any) -> Any:
    return obj["param"] if isinstance(obj, dict) else obj


def _read_universal(d: Path, model_file: Path, stage: int) -> Portable:
    ms = torch.load(model_file, map_location="cpu", weights_only=False)
    osd = torch.load(d / "zero" / "optimizer_state.pt", map_location="cpu", weights_only=False)
    shapes: list[OrderedDict] = ms["param_shapes"]
    if isinstance(shapes, dict):
        shapes = [shapes]
    hyper = osd["param_groups"]
    if len(hyper) != len(shapes):
        if len(hyper) != 1:
            raise Refused(f"{d}: {len(hyper)} parameter groups but {len(shapes)} groups of parameter shapes; convert "
                          "reads checkpoints whose groups are the optimizer's")
        shapes = [OrderedDict((n, s) for g in shapes for n, s in g.items())]
    module = ms.get("module") or {}
    buffers = {n: module[n].clone() for n in ms.get("buffer_names") or [] if n in module}
    stage3_steps = (osd.get("optimizer_state_dict") or {}).get("state", {})
    params, masters, optimizer, groups = {}, {}, {}, []
    for g, named in enumerate(shapes):
        for name, shape in named.items():
            folder = d / "zero" / name
            fp32 = _state(torch.load(folder / "fp32.pt", map_location="cpu", weights_only=False))
            fp32 = fp32.detach().reshape(shape).clone()
            low = module.get(name)
            params[name] = (low.detach().reshape(shape).clone() if low is not None and low.numel() == fp32.numel()
                            else fp32.to(low.dtype if low is not None else fp32.dtype))
            masters[name] = fp32
            state: dict[str, Any] = {}
            for f in sorted(folder.glob("*.pt")):
                if f.stem == "fp32":
                    continue
                value = _state(torch.load(f, map_location="cpu", weights_only=False))
                state[f.stem] = value if f.stem == "step" else value.detach().reshape(shape).clone()
            if "step" not in state and g in stage3_steps and "step" in stage3_steps[g]:
                state["step"] = stage3_steps[g]["step"]  # ZeRO-3 keeps one count a group
            if torch.is_tensor(state.get("step")):
                # each parameter its own: torch's optimizers count in place, and one tensor shared by a group's
                # parameters would be counted once for each of them at every step
                state["step"] = state["step"].clone()
            optimizer[name] = state
        groups.append({**{k: v for k, v in hyper[min(g, len(hyper) - 1)].items() if k != "params"},
                       "params": list(named)})
    frozen = ms.get("frozen_param_shapes") or {}
    for name, shape in frozen.items():
        if name in module and module[name].numel() == torch.Size(shape).numel():
            params[name] = module[name].detach().reshape(shape).clone()
        else:
            raise Refused(f"{model_file.parent}: the frozen parameter {name} is partitioned (ZeRO-3) and convert "
                          "joins only the parameters the optimizer steps; unfreeze it, or save at ZeRO-1/2")
    for name in list(masters):
        if same_bits(masters[name], params[name]):
            del masters[name]  # the model's own weights are the fp32 ones: one copy
    counters = {k: ms[k] for k in COUNTERS if k in ms}
    counters.update({k: osd[k] for k in OPTIMIZER_GLOBALS if k in osd})
    p = Portable(params=params, masters=masters, buffers=buffers, optimizer=optimizer, groups=groups,
                 scaler=osd.get("loss_scaler"), counters=counters, scheduler=ms.get("lr_scheduler"))
    p.check_names()
    return p


def loss_on_universal(p: Portable, stage: int | None) -> list[str]:
    """What a universal checkpoint of `p` would not carry into DeepSpeed's engine (`stage`: the ZeRO stage that will
    load it, None: any)."""
    lost = []
    if p.buffers:
        lost.append(f"the module's {len(p.buffers)} buffers ({next(iter(p.buffers))} first): the engine's universal "
                    "load restores the parameters and the optimizer, not the module's buffers")
    stepped = {n for g in p.groups for n in g["params"]}
    unstepped = [n for n in p.params if n not in stepped]
    if unstepped:
        lost.append(f"{len(unstepped)} parameters no optimizer group steps ({unstepped[0]} first)")
    if stage == 3:
        keys = {k for s in p.optimizer.values() for k in s if k != "step"}
        if keys - {"exp_avg", "exp_avg_sq"}:
            lost.append(f"the optimizer state {', '.join(sorted(keys - {'exp_avg', 'exp_avg_sq'}))}: ZeRO-3's universal "
                        "loader reads Adam's exp_avg and exp_avg_sq alone")
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in p.groups]
        if any(h != hyper[0] for h in hyper[1:]):
            lost.append(f"the hyper-parameters of {len(hyper) - 1} groups after the first: ZeRO-3's universal loader "
                        "gives every group the first group's")
    return lost


def engine_counters(p: Portable) -> str | None:
    """Give a state from outside DeepSpeed the engine's step counters, from its optimizer's step count (every
    parameter's alike); returns what was derived (None: the source had them)."""
    if "global_steps" in p.counters:
        return None
    steps = {float(s["step"]) for s in p.optimizer.values() if "step" in s}
    if len(steps) > 1:
        raise Refused(f"the optimizer's parameters have taken different numbers of steps ({sorted(steps)[:3]}): "
                      "DeepSpeed's engine keeps one step counter")
    p.counters.update(global_steps=int(steps.pop()) if steps else 0, skipped_steps=0)
    return f"the engine's global_steps ({p.counters['global_steps']}) from the optimizer's step count"


def write_universal(p: Portable, directory: Path, tag: str, dp_world_size: int = 1) -> None:
    """`p` as a universal checkpoint in `directory`/`tag`, its tag in `directory`/latest_universal."""
    import deepspeed

    d = directory / tag
    zero = d / "zero"
    weights = p.weights
    for group in p.groups:
        for name in group["params"]:
            folder = zero / name
            folder.mkdir(parents=True, exist_ok=True)
            torch.save({"param": weights[name].detach().float().reshape(-1).clone(), "cat_dim": 0}, folder / "fp32.pt")
            for key, value in p.optimizer.get(name, {}).items():
                if key == "step":
                    torch.save(value, folder / "step.pt")
                elif torch.is_tensor(value):
                    torch.save({"param": value.detach().reshape(-1).clone(), "cat_dim": 0}, folder / f"{key}.pt")
                else:
                    raise Refused(f"the optimizer state {name}.{key} is {type(value).__name__}, not a tensor; "
                                  "DeepSpeed's universal checkpoint holds tensors alone")
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in p.groups]
    starts = [sum(len(g["params"]) for g in p.groups[:i]) for i in range(len(p.groups))]
    param_groups = [dict(h, params=list(range(s, s + len(g["params"])))) for h, s, g in zip(hyper, starts, p.groups)]
    steps = {i: {"step": p.optimizer[g["params"][0]]["step"]} for i, g in enumerate(p.groups)
             if g["params"] and "step" in p.optimizer.get(g["params"][0], {})}
    osd: dict[str, Any] = {"param_groups": param_groups, "ds_version": deepspeed.__version__,
                           "optimizer_state_dict": {"state": steps, "param_groups": param_groups}}
    if p.scaler is not None:
        osd["loss_scaler"] = p.scaler
    osd.update({k: p.counters[k] for k in OPTIMIZER_GLOBALS if k in p.counters})
    torch.save(osd, zero / "optimizer_state.pt")
    counters = {"global_steps": 0, "skipped_steps": 0, **{k: p.counters[k] for k in COUNTERS if k in p.counters}}
    ms = {"module": {**{n: t.detach().clone() for n, t in p.params.items()}, **p.buffers},
          "buffer_names": list(p.buffers), "optimizer": None,
          "param_shapes": [OrderedDict((n, p.params[n].shape) for n in g["params"]) for g in p.groups],
          "frozen_param_shapes": OrderedDict(), "shared_params": {}, "frozen_param_fragments": OrderedDict(),
          "lr_scheduler": p.scheduler, "data_sampler": None, "random_ltd": None, **counters,
          "dp_world_size": dp_world_size, "mp_world_size": 1, "ds_version": deepspeed.__version__}
    for name in (ZERO12_MODEL, ZERO3_MODEL.format(0)):
        torch.save(ms, d / name)
    (directory / "latest_universal").write_text(tag)
