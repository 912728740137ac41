"""The conversions between checkpoint formats, each run as a subprocess with its output in the cell's log: DCP's
format_utils (dcp_to_torch_save, torch_save_to_dcp) and DeepSpeed's ds_to_universal where they carry the whole
state, and dpcompare convert (dpcompare.commands.convert) where none does."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

from dpcompare.commands.checkpoint.cells import CONVERT
from dpcompare.contract.checkpoint_io import TORCH_FILE
from dpcompare.run.launchers import run_process

TAG = "dpcompare"
"""The tag dpcompare's DeepSpeed checkpoints are saved under (dpcompare.run.checkpoint.TAG)."""


class Refused(RuntimeError):
    """The converter refused the state in one line (exit status 2): the cell cannot run without losing state."""


def command(tool: str, source: Path, target: Path, fmt: str = "") -> list[str]:
    """The command line that converts `source` into `target` (in `fmt`, the load's format) with `tool` (cells.TOOLS)."""
    if tool == CONVERT:
        return [sys.executable, "-m", "dpcompare", "convert", str(source), str(target),
                "--to", "deepspeed" if fmt == "universal" else fmt, "--tag", TAG, "--check"]
    if tool.endswith("dcp_to_torch_save"):
        code = ("from torch.distributed.checkpoint.format_utils import dcp_to_torch_save as f; import sys; "
                "f(sys.argv[1], sys.argv[2])")
        return [sys.executable, "-c", code, str(source), str(target / TORCH_FILE)]
    if tool.endswith("torch_save_to_dcp"):
        code = ("from torch.distributed.checkpoint.format_utils import torch_save_to_dcp as f; import sys; "
                "f(sys.argv[1], sys.argv[2])")
        return [sys.executable, "-c", code, str(source / TORCH_FILE), str(target)]
    if tool.endswith("ds_to_universal"):
        return [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(source / TAG),
                "--output_folder", str(target / TAG), "--num_extract_workers", "1", "--num_merge_workers", "1",
                # a model of no DeepSpeed's own (a plain nn.Module) records no universal_checkpoint_info at ZeRO-1/2
                "--inject_missing_state"]
    raise ValueError(f"no conversion {tool!r}")


def run(tool: str, source: Path, target: Path, log: Path, timeout_s: float, fmt: str = "",
        cancel: threading.Event | None = None) -> None:
    """Convert, or RuntimeError naming the tool and its log (Refused: dpcompare convert's one line)."""
    if tool != CONVERT:  # convert writes a new directory of its own, whole or not at all
        target.mkdir(parents=True, exist_ok=True)
    finished = run_process(command(tool, source, target, fmt), timeout_s=timeout_s, log=log, cancel=cancel)
    if tool == CONVERT and finished.returncode == 2:
        lines = [ln for ln in log.read_text().splitlines() if ln.startswith("dpcompare convert: error:")]
        raise Refused(lines[-1].removeprefix("dpcompare convert: error: ") if lines else f"refused (log: {log})")
    if finished.returncode != 0:
        raise RuntimeError(f"{tool} failed (exit status {finished.returncode}; log: {log})")
