"""Convert a checkpoint between DeepSpeed ZeRO 1-3, torch.distributed.checkpoint (DCP) and torch, keeping the whole
training state, offline on one process: parameters, the fp32 master weights, the optimizer state matched to each
parameter by name (AdamW's moments and step counts, SGD's momentum, under every parameter group), the loss scaler, and
the step counters and scheduler where the source has them.

SRC is read as it was saved by the libraries themselves:
  deepspeed  a ZeRO 1, 2 or 3 checkpoint from engine.save_checkpoint at any world size (the folder it was saved to,
             its tag read from `latest` unless --tag names it), joined by DeepSpeed's own ds_to_universal;
  universal  a DeepSpeed universal checkpoint;
  dcp        a torch.distributed.checkpoint directory (dcp.save of get_state_dict's state);
  torch      one file (or a directory holding state.pt) of {"model": ..., "optim"/"optimizer": ...} keyed by name.
--to deepspeed writes a universal checkpoint, which DeepSpeed's engine loads at any world size and ZeRO stage with
{"checkpoint": {"load_universal": true}} and engine.load_checkpoint(DST, tag=TAG).

What the target cannot hold is refused in one line, or with --allow-lossy dropped and said. The written state is
compared bitwise with the state read, and the line says so; --check reads DST back from disk and compares that too.
Exit status: 0 converted, 2 bad input (nothing written, DST untouched), 1 the written state is not the state read.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

from dpcompare.commands.convert import deepspeed_formats as ds
from dpcompare.commands.convert import torch_formats as tf
from dpcompare.commands.convert.portable import Portable, Refused, differences

FORMATS = ("deepspeed", "universal", "dcp", "torch")
TARGETS = ("deepspeed", "dcp", "torch")
PLANTS = ("drop-exp-avg-sq", "swap-moments")
"""Twin converters, for the tests that prove the checks catch them: the second moment written as zeros; each
parameter's moments written to another parameter of its shape (matched by shape and order, not by name)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", metavar="SRC", help="the checkpoint to read")
    p.add_argument("target", metavar="DST", help="an empty or new directory to write the converted checkpoint to")
    p.add_argument("--to", required=True, choices=TARGETS, help="the format to write (deepspeed: a universal checkpoint)")
    p.add_argument("--from", dest="source_format", choices=FORMATS, default=None,
                   help="the format SRC is in (default: found from its files)")
    p.add_argument("--tag", default=None, help="DeepSpeed's checkpoint tag: SRC's to read (default: its `latest`), "
                                               "DST's to write (default: SRC's, else global_step<N>)")
    p.add_argument("--zero-stage", type=int, choices=(1, 2, 3), default=None,
                   help="--to deepspeed: the ZeRO stage that will load it, so that what its loader would not restore "
                        "is refused (default: any stage; what ZeRO-3 would not restore is said)")
    p.add_argument("--allow-lossy", action="store_true",
                   help="write what the target can hold and say what was dropped, instead of refusing")
    p.add_argument("--check", action="store_true", help="read DST back from disk and compare it with SRC, bitwise")
    p.add_argument("--plant", choices=PLANTS, default=None, help=argparse.SUPPRESS)


def detect(path: Path, tag: str | None) -> str:
    """SRC's format from its files (Refused: none)."""
    if not path.exists():
        raise Refused(f"{path}: no such file or directory")
    if path.is_file():
        return "torch"
    if tf.is_dcp(path):
        return "dcp"
    if tf.is_torch(path):
        return "torch"
    d = ds.tag_dir(path, tag)
    if ds.is_universal(d):
        return "universal"
    if d.is_dir() and (ds.is_deepspeed(d) or ds.is_zero0(d)):
        return "deepspeed"
    raise Refused(f"{path}: not a checkpoint convert reads (no DCP .metadata, no {tf.TORCH_FILE}, no DeepSpeed "
                  "*_optim_states.pt or universal zero/ folder); name the folder it was saved to")


def read(path: Path, fmt: str, tag: str | None) -> Portable:
    if fmt == "deepspeed":
        return ds.read_deepspeed(path, tag)
    if fmt == "universal":
        return ds.read_universal(path, tag)
    if fmt == "dcp":
        return tf.read_dcp(path)
    return tf.read_torch(path)


def write(p: Portable, directory: Path, fmt: str, tag: str) -> None:
    if fmt == "deepspeed":
        ds.write_universal(p, directory, tag, dp_world_size=1)
    elif fmt == "dcp":
        tf.write_dcp(p, directory)
    else:
        tf.write_torch(p, directory)


def read_back(directory: Path, fmt: str, tag: str) -> Portable:
    return read(directory, "universal" if fmt == "deepspeed" else fmt, tag if fmt == "deepspeed" else None)


def plant(p: Portable, kind: str) -> None:
    """A twin converter's fault, applied to the state before it is written."""
    import torch

    if kind == "drop-exp-avg-sq":
        for state in p.optimizer.values():
            if "exp_avg_sq" in state:
                state["exp_avg_sq"] = torch.zeros_like(state["exp_avg_sq"])
        return
    by_shape: dict[tuple, list[str]] = {}
    for name in p.optimizer:
        by_shape.setdefault(tuple(p.params[name].shape), []).append(name)
    moved = {}
    for names in by_shape.values():
        for a, b in zip(names, names[1:] + names[:1]):
            moved[b] = p.optimizer[a]
    p.optimizer.update(moved)


def _drop(p: Portable) -> None:
    """--allow-lossy into DeepSpeed: leave out what its universal load would not restore (the line says what)."""
    stepped = {n for g in p.groups for n in g["params"]}
    p.buffers = {}
    p.params = {n: t for n, t in p.params.items() if n in stepped}


def convert(src: Path, dst: Path, to: str, *, source_format: str | None = None, tag: str | None = None,
            zero_stage: int | None = None, allow_lossy: bool = False, check: bool = False,
            planted: str | None = None) -> tuple[Portable, list[str], list[str], list[str]]:
    """Read `src`, write it to `dst` as `to`; returns (the state read, what was dropped, what ZeRO-3 would not load
    where no stage was named, the differences found: empty where the written state is the state read). Refused:
    nothing written, `dst` untouched."""
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise Refused(f"{dst}: not empty; name a new or empty directory (convert never writes over a checkpoint)")
    found = detect(src, tag)
    fmt = source_format or found
    if source_format is not None and found != source_format and not (found == "universal" and source_format == "deepspeed"):
        raise Refused(f"{src}: --from {source_format}, but its files are a {found} checkpoint's; drop --from, or "
                      f"name a {source_format} checkpoint")
    p = read(src, fmt, tag)
    if planted is not None:  # a twin whose reader is wrong: its own comparison agrees with itself
        plant(p, planted)
    lost = ds.loss_on_universal(p, zero_stage) if to == "deepspeed" else []
    if lost and not allow_lossy:
        raise Refused(f"{src} -> {to}: the target cannot hold {lost[0]}"
                      + (f" (and {len(lost) - 1} more)" if len(lost) > 1 else "")
                      + "; convert to another format, or drop it with --allow-lossy")
    if lost:
        _drop(p)
    later = ([f"by ZeRO-3: {x}" for x in ds.loss_on_universal(p, 3)]
             if to == "deepspeed" and zero_stage is None else [])
    derived = [ds.engine_counters(p)] if to == "deepspeed" else []
    out_tag = tag or _tag_of(src, fmt, p)
    dst.parent.mkdir(parents=True, exist_ok=True)
    part = Path(tempfile.mkdtemp(prefix=f".{dst.name}.part-", dir=dst.parent))
    try:
        write(p, part, to, out_tag)
        apart = differences(p, read_back(part, to, out_tag) if check else as_written(p, to))
        if dst.exists():
            dst.rmdir()
        os.replace(part, dst)
    except BaseException:
        shutil.rmtree(part, ignore_errors=True)
        raise
    return p, lost, later + [f"derived: {x}" for x in derived if x], apart


def _tag_of(src: Path, fmt: str, p: Portable) -> str:
    """DST's tag: SRC's where it is DeepSpeed's, else global_step<N> (the step counter, else the optimizer's)."""
    if fmt in ("deepspeed", "universal") and src.is_dir() and ds.tag_dir(src, None) != src:
        return ds.tag_dir(src, None).name
    steps = [s["step"] for s in p.optimizer.values() if "step" in s]
    return f"global_step{int(p.counters.get('global_steps', steps[0] if steps else 0))}"


def as_written(p: Portable, to: str) -> Portable:
    """`p` as the target format's structure holds it, read back in memory (torch and DCP: the state dict written;
    DeepSpeed: the tensors written)."""
    if to in ("torch", "dcp"):
        return tf.from_state(tf.to_state(p), p.source)
    return p


def main(ns: argparse.Namespace) -> int:
    src, dst = Path(ns.source), Path(ns.target)
    try:
        p, lost, later, apart = convert(src, dst, ns.to, source_format=ns.source_format, tag=ns.tag, zero_stage=ns.zero_stage,
                                 allow_lossy=ns.allow_lossy, check=ns.check, planted=ns.plant)
    except Refused as exc:
        print(f"dpcompare convert: error: {exc}", file=sys.stderr)
        return 2
    moments = sum(1 for s in p.optimizer.values() for k in s if k != "step")
    what = (f"{len(p.params)} parameters, {len(p.masters)} fp32 masters apart, {moments} optimizer tensors in "
            f"{len(p.groups)} groups, {len(p.buffers)} buffers"
            + (", the loss scaler" if p.scaler is not None else "")
            + (f", counters {', '.join(sorted(p.counters))}" if p.counters else "")
            + (", the scheduler" if p.scheduler is not None else ""))
    where = "read back from disk" if ns.check else "as written"
    print(f"dpcompare convert: {p.source} -> {ns.to} {dst}: {what}")
    for x in lost:
        print(f"dpcompare convert: not carried (--allow-lossy): {x}")
    for x in later:
        print(f"dpcompare convert: {x}" if x.startswith("derived") else f"dpcompare convert: not loaded {x}")
    if apart:
        print(f"dpcompare convert: the state {where} differs from the state read in {len(apart)} places "
              f"({apart[0]} first)", file=sys.stderr)
        return 1
    print(f"dpcompare convert: the state {where} is bitwise the state read")
    return 0
