"""Model FLOPs and the device's peak: what MFU (model FLOPs utilisation) is made of.

Owns: `model_flops` (a forward and backward of one local batch counted once by torch.utils.flop_counter.FlopCounterMode,
on a copy of the untouched template whose tensors live on the meta device: shapes only, no arithmetic, no memory),
`measured_peak` (a short matmul microbenchmark in the run's compute dtype on the run's device, as bench-collectives
measures the link), `datasheet_peak` (the vendor's dense figure for a known device and dtype), and `facts`, all
of them for one run, and `record_mfu` (rank 0 turns them into metrics.mfu).

Model FLOPs are the model's own: what activation checkpointing recomputes, what the oracle checks and what a backend
adds (ZeRO's partition copies, the collectives) are not counted, as MFU is defined (PaLM, appendix B). Float8 is not
offered: a float8 run computes its matmuls in float8 but its other operations in bf16 or float32, so no one peak
stands for the step, and MFU against the float8 peak (twice the bf16 one) would halve the figure for the same work.
"""

from __future__ import annotations

import copy
import time
from typing import Any, Callable

import torch
from torch import nn

from dpcompare.contract import batches
from dpcompare.measure.samples import Metrics

DATASHEET_TFLOPS: dict[str, dict[str, float]] = {
    # dense (without 2:4 sparsity), from each vendor datasheet; fp32 is the non-tensor-core rate
    "H100 SXM": {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4},
    "H100 PCIe": {"fp32": 51.0, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0},
    "H200 SXM": {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4},
    "H200 NVL": {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5},
    "A100": {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0},
    "L40S": {"fp32": 91.6, "tf32": 183.0, "bf16": 362.1, "fp16": 362.1},
}
"""TFLOP/s by device and compute dtype."""

MATMUL_SIDE = {"cuda": 8192, "cpu": 512}
"""The square matmul's side in the microbenchmark: large enough to reach the device's matmul peak."""
MICROBENCH_S = {"cuda": 0.1, "cpu": 0.02}
"""Seconds of each timed window of matmuls (after a warm-up), best of three."""


def datasheet_device(name: str) -> str | None:
    """The DATASHEET_TFLOPS key for a CUDA device name (torch.cuda.get_device_name), or None where unknown."""
    upper = name.upper()
    if "H200" in upper:
        return "H200 NVL" if "NVL" in upper else "H200 SXM"
    if "H100" in upper:
        return "H100 PCIe" if "PCIE" in upper else "H100 SXM"
    if "A100" in upper:
        return "A100"
    if "L40S" in upper:
        return "L40S"
    return None


def compute_dtype(amp: str, device: torch.device) -> str:
    """The dtype the step's matmuls run in: the autocast dtype, else float32, or TF32 where CUDA's matmuls allow it."""
    if amp in ("bf16", "fp16"):
        return amp
    if device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "fp32"


def datasheet_peak(device: torch.device, dtype: str) -> tuple[float | None, str | None]:
    """(TFLOP/s, None) from the datasheet, or (None, why there is none)."""
    if device.type != "cuda":
        return None, f"no datasheet figure for a {device.type} device (known: {', '.join(DATASHEET_TFLOPS)})"
    name = torch.cuda.get_device_name(device)
    key = datasheet_device(name)
    if key is None:
        return None, f"{name} is not among the known devices ({', '.join(DATASHEET_TFLOPS)})"
    return DATASHEET_TFLOPS[key][dtype], None


def measured_peak(device: torch.device, dtype: str) -> float:
    """TFLOP/s of a square matmul in `dtype` on `device`: the best of three windows of MICROBENCH_S."""
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype, torch.float32)
    n = MATMUL_SIDE.get(device.type, MATMUL_SIDE["cpu"])
    a = torch.randn(n, n, device=device, dtype=torch_dtype)
    b = torch.randn(n, n, device=device, dtype=torch_dtype)
    out = torch.empty(n, n, device=device, dtype=torch_dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def window(seconds: float) -> float:
        count, start = 0, time.perf_counter()
        while True:
            torch.mm(a, b, out=out)
            count += 1
            if count % 4 == 0:
                sync()
                elapsed = time.perf_counter() - start
                if elapsed >= seconds:
                    return 2.0 * n**3 * count / elapsed / 1e12

    seconds = MICROBENCH_S.get(device.type, MICROBENCH_S["cpu"])
    window(seconds)  # warm-up: kernels chosen, clocks up
    return max(window(seconds) for _ in range(3))


def meta_copy(template: nn.Module) -> nn.Module:
    """A copy of `template` whose parameters and buffers are on the meta device (no data copied)."""
    memo: dict[int, Any] = {}
    for p in template.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in template.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(template, memo)


def model_flops(template: nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor], x: Any, y: Any) -> int:
    """FLOPs of one forward and backward of `template` on the batch (x, y: tensors or any structure of them), counted
    on a meta copy."""
    from torch.utils.flop_counter import FlopCounterMode

    model = meta_copy(template)
    model.train()
    counter = FlopCounterMode(display=False)
    with counter:
        loss = loss_fn(batches.call(model, batches.to(x, "meta")), batches.to(y, "meta"))
        loss.backward()
    return int(counter.get_total_flops())


def facts(template: nn.Module | None, loss_fn: Callable[[Any, Any], torch.Tensor] | None, x: Any, y: Any, amp: str,
          device: torch.device) -> dict[str, Any]:
    """{dtype, flops (per sample, forward and backward, on the local batch x, y), measured, datasheet (the device's
    peak in TFLOP/s), why: {name: reason} for each one missing}."""
    dtype = compute_dtype(amp, device)
    found: dict[str, Any] = {"dtype": dtype, "flops": None, "why": {}}
    if template is None:
        found["why"]["flops"] = "no template given"
    else:
        try:
            found["flops"] = model_flops(template, loss_fn, x, y) / max(batches.rows(x), 1)
        except Exception as exc:  # a model that cannot run on meta tensors: MFU unmeasured, said why
            found["why"]["flops"] = (f"FlopCounterMode on a meta copy of the model raised {type(exc).__name__}: "
                                     f"{str(exc)[:200]}")
    found["measured"] = measured_peak(device, dtype)
    found["datasheet"], why = datasheet_peak(device, dtype)
    if why:
        found["why"]["datasheet"] = why
    return found


# -- the run's MFU figures --------------------------------------------------------------------------------
def mfu(flops_per_sample: float | None, samples_per_s_per_rank: float | None,
        peak_tflops: float | None) -> float | None:
    """Achieved model FLOP/s per rank over the peak, or None where a figure is missing."""
    if not flops_per_sample or not samples_per_s_per_rank or not peak_tflops:
        return None
    return flops_per_sample * samples_per_s_per_rank / (peak_tflops * 1e12)


def record_mfu(m: Metrics, found: dict[str, Any] | None, samples_per_s_per_rank: float | None, why_not: str) -> None:
    """The MFU figures (dpcompare.measure.flops.facts: `found`; None: not measured, `why_not`)."""
    found = found or {"why": {}}
    why = found["why"]
    m.set("compute_dtype", found.get("dtype"), why_not)
    m.set("model_flops_per_sample", found.get("flops"), why.get("flops", why_not))
    m.set("peak_tflops_measured", found.get("measured"), why_not)
    m.set("peak_tflops_datasheet", found.get("datasheet"), why.get("datasheet", why_not))
    no_rate = "no step time (no measured steps)" if samples_per_s_per_rank is None else None
    m.set("mfu", mfu(found.get("flops"), samples_per_s_per_rank, found.get("measured")),
          why.get("flops") or no_rate or why_not)
    m.set("mfu_datasheet", mfu(found.get("flops"), samples_per_s_per_rank, found.get("datasheet")),
          why.get("datasheet") or why.get("flops") or no_rate or why_not)
