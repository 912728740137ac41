"""The oracle coverage: how much of the model the float64 oracle checks, chosen so that its memory fits before
anything is built (--check-coverage). Not the coverage of a check (dpcompare.verify.judgement.tolerance: the parameters a
check judges alone, the noisy ones left out).

Owns: the verifier's memory model (`need_bytes`: the model copies every check needs, whatever it covers, plus what
each checked parameter adds: its float64 gradients, the reference optimizer states, the update check's copies), the
memory a device has free for it (`available_bytes`), and the choice of the parameters checked (`plan`): all of them
where they fit; else, under `--check-coverage auto` or a fraction, whole blocks (the units FSDP shards, the model's
`_no_split_modules`) in a stated order — the first block, the last, the parameters outside the blocks (embeddings,
head, final norm), then the blocks halfway between those taken — as many as fit; else a refusal in one line with
the figures. The parameters left out are still in every forward (at the run's own values), only their gradients
and updates are not compared; the oracle coverage is recorded in the verdict and said with it. Imports no adapter.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dpcompare.contract.workload import block_modules

GIB = 1024.0**3

COPY_BYTES_PER_PARAM = 38.0
"""What rank 0 holds per parameter of the model whatever the oracle coverage (float32 run): the reference
trajectory's float64 and run-dtype copies, the oracle's copies while they compute (they hold nothing between), and the
run's own gradients and optimizer state first allocated in the verification phase. Measured (verify_above_start_mib,
an 11 M-parameter Llama-style model on CPU at 6.3 % and full coverage, 2026-11-27; docs/results/
2026-11-27-verification-memory-cpu.md): 25 B/param with SGD, 33 with AdamW at one rank; rank 0 holds up to 10 more at
2 and 4 ranks (the divided sums, the ranks' evidence), which this constant covers. Measured again with the float64
trajectory held as offsets (2026-11-29): 31 and 39 at 6.3 % coverage, the small model's fixed part included."""
CHECKED_BYTES_PER_PARAM = {"sgd": 26.0, "adamw": 40.0}
"""What each checked parameter adds: the oracle's float64 gradient, the reduced gradient, the step's parameters and
the references held in their own dtype (dpcompare.verify.judgement.held_values.Compact), the backend's optimizer state as read and the
expected one, the reference trajectories' optimizer states (AdamW's twice SGD's; the float64 trajectory's held as
offsets between steps, dpcompare.verify.trajectory.trajectory_offsets). Measured on the same model at 6.3 % and full coverage (2026-11-29,
docs/results/2026-11-29-trajectory-offsets-cpu.md): 32.8 -> 58.1 B/param with SGD, 41.9 -> 79.4 with AdamW: 27 and
40 per checked parameter. With COPY_BYTES_PER_PARAM rank 0 is planned at 64 (SGD) and 78 (AdamW) B/param at one rank,
10 over the slopes measured across the 11-39 M models (53.8 and 67.4)."""
DIVIDED_BYTES_PER_PARAM = {"sgd": 28.0, "adamw": 34.0}
"""Of what each checked parameter adds on rank 0, the share the ranks divide where they share the oracle
(dpcompare.verify.memory.divider, dpcompare.verify.trajectory.trajectory_ranges): at N ranks rank 0 holds 1/N of it (the reference trajectory's
copies and optimizer states, the oracle's sums and the reduced gradient, each held in ranges by their owners).
Fitted to rank 0's bytes per parameter above start at 1, 2 and 4 ranks (benchmarks/test_verification_cost.py, 11-39 M
Llama-style models, docs/results/2026-11-29-trajectory-offsets-cpu.md): slopes 53.8 -> 37.1 -> 32.0 with SGD, 67.4 ->
45.0 -> 42.5 with AdamW; with the constants above rank 0 is planned at 64 -> 50 -> 43 (SGD) and 78 -> 61 -> 52.5
(AdamW) B/param, at least 10 over each."""
HELPER_BYTES_PER_PARAM = {"sgd": (30.0, 41.0), "adamw": (33.0, 55.0)}
"""A rank other than 0 where the ranks share the oracle's forwards, per parameter of the model, a + b / N at N ranks:
its float64 and run-precision copies while they compute (12) and its copies of the reference trajectory made whole
for its step, its own training state (gradients, optimizer state, DDP's buckets) (a); its ranges of the trajectory's
optimizer states and parameters, of the oracle's sums, of the reduced gradient and of the update check's optimizer
states (b / N). Fitted to the largest other rank's bytes per parameter above start at 2 and 4 ranks, the update
check's states held in ranges (benchmarks/test_verification_cost.py, 11-39 M Llama-style models,
docs/results/2026-11-29-update-state-ranges-cpu.md: slopes 45.5 and 35.3 with SGD, 55.6 and 41.8 with AdamW), 5 over
each: 50.5 and 40.3 (SGD), 60.5 and 46.8 (AdamW) planned."""
FIXED_BYTES = 256 * 1024**2
"""The checks' fixed part (the float64 activations of a small batch, allocator slack)."""
MARGIN = 0.85
"""Of the memory free when the verifier is planned, the share it may plan to use (the run's steps keep allocating)."""


class OracleCoverageRefused(ValueError):
    """The oracle cannot check even one block within the memory free: one line with the figures and what to do."""


@dataclass(slots=True)
class OracleCoverage:
    """The parameters the float64 oracle checks (--check-coverage); `unchecked` empty means all of them."""

    parameters: int
    checked_parameters: int
    unchecked: frozenset[str] = frozenset()
    units_checked: list[str] = field(default_factory=list)
    units_unchecked: list[str] = field(default_factory=list)
    need_bytes: float = 0.0
    full_need_bytes: float = 0.0
    available_bytes: float | None = None
    reason: str = ""

    @property
    def fraction(self) -> float:
        return self.checked_parameters / self.parameters if self.parameters else 1.0

    @property
    def full(self) -> bool:
        return not self.unchecked

    def to_dict(self) -> dict[str, Any]:
        return {"fraction": self.fraction, "parameters": self.parameters, "checked_parameters": self.checked_parameters,
                "units_checked": self.units_checked, "units_unchecked": self.units_unchecked,
                "need_gib": self.need_bytes / GIB, "full_need_gib": self.full_need_bytes / GIB,
                "available_gib": None if self.available_bytes is None else self.available_bytes / GIB,
                "reason": self.reason}


def need_bytes(parameters: int, checked: int, optimizer: str, dtype_bytes: int = 4, copied: int | None = None,
               ranks: int = 1) -> float:
    """The verifier's memory on rank 0 for a model of `parameters`, `checked` of them compared (see the constants),
    where `ranks` share the oracle. `copied`: the elements every copy of the model holds (frozen parameters, integer
    ones and buffers included; the copies keep an integer at its own 8 bytes or less), where more than `parameters`."""
    scale = dtype_bytes / 4 if dtype_bytes > 4 else 1.0  # a float64 run holds its run-dtype copies at 8 bytes
    per_checked = CHECKED_BYTES_PER_PARAM.get(optimizer, max(CHECKED_BYTES_PER_PARAM.values()))
    per_checked -= DIVIDED_BYTES_PER_PARAM.get(optimizer, min(DIVIDED_BYTES_PER_PARAM.values())) * (1 - 1 / ranks)
    copies = max(parameters, copied or 0)
    return FIXED_BYTES + COPY_BYTES_PER_PARAM * scale * copies + per_checked * checked


def helper_bytes(copied: int, dtype_bytes: int = 4, optimizer: str = "adamw", ranks: int = 2) -> float:
    """What a rank that shares the oracle's forwards holds for them, at `ranks` ranks: its copies of a model of
    `copied` elements, and its ranges."""
    scale = dtype_bytes / 4 if dtype_bytes > 4 else 1.0
    a, b = HELPER_BYTES_PER_PARAM.get(optimizer, max(HELPER_BYTES_PER_PARAM.values()))
    return FIXED_BYTES + (a + b / max(ranks, 2)) * scale * copied


def copied_elements(template: nn.Module) -> int:
    """The elements every copy of the model holds: parameters (trainable or not) and buffers."""
    return sum(t.numel() for t in (*template.parameters(), *template.buffers()))


def available_bytes(device: torch.device) -> tuple[float | None, str]:
    """(bytes free for the verifier, where the figure comes from). CUDA: the device's free memory; CPU: the host's
    MemAvailable, or the cgroup's limit less its usage where that is smaller; DPCOMPARE_VERIFY_MEMORY_GIB, where set,
    stands for either (a smaller budget than the machine's, or a test's). None where it cannot be read."""
    override = os.environ.get("DPCOMPARE_VERIFY_MEMORY_GIB")
    if override:
        return float(override) * GIB, "DPCOMPARE_VERIFY_MEMORY_GIB"
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return float(free), "CUDA free memory (torch.cuda.mem_get_info)"
    found: list[tuple[float, str]] = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append((int(line.split()[1]) * 1024.0, "MemAvailable"))
    except OSError:
        pass
    for limit_path, usage_path in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit = open(limit_path).read().strip()
            usage = float(open(usage_path).read().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and float(limit) < 2**60:
            found.append((float(limit) - usage, "the cgroup's memory limit less its usage"))
        break
    if not found:
        return None, "no MemAvailable in /proc/meminfo"
    return min(found)


def units(template: nn.Module) -> list[tuple[str, list[str]]]:
    """The units the oracle coverage takes whole, in the order it takes them: (name, trainable parameter names).
    The first block, the last, what lies outside the blocks, then the blocks halfway between those taken."""
    named = [(n, p) for n, p in template.named_parameters() if p.requires_grad]
    blocks = block_modules(template)
    owner: dict[str, str] = {}
    for block, module in blocks:
        for n, _ in module.named_parameters():
            owner.setdefault(f"{block}.{n}", block)
    by_unit: dict[str, list[str]] = {}
    for n, _ in named:
        by_unit.setdefault(owner.get(n, "(outside the blocks)"), []).append(n)
    order = [b for b, _ in blocks if b in by_unit]
    picked: list[int] = []
    if order:
        picked = [0] + ([len(order) - 1] if len(order) > 1 else [])
        gaps = [(0, len(order) - 1)]
        while gaps:  # breadth first: the middle of every gap between blocks taken
            lo, hi = gaps.pop(0)
            if hi - lo < 2:
                continue
            mid = (lo + hi) // 2
            picked.append(mid)
            gaps += [(lo, mid), (mid, hi)]
    ordered = [order[i] for i in picked]
    result = [(u, by_unit[u]) for u in ordered[:2]]
    if "(outside the blocks)" in by_unit:
        result.append(("(outside the blocks)", by_unit["(outside the blocks)"]))
    result += [(u, by_unit[u]) for u in ordered[2:]]
    return result


def plan(template: nn.Module, *, request: str, optimizer: str, dtype_bytes: int, device: torch.device,
         refuse_partial: str | None = None, reserved: float = 0.0, free: tuple[float | None, str] | None = None,
         ranks: int = 1) -> OracleCoverage:
    """The parameters the oracle checks. `request`: 'full' (all, refused in one line where they do not fit), 'auto'
    (all where they fit, else as many whole units as fit) or a fraction in (0, 1] (whole units up to that share of the
    parameters, each taken only while it fits). `refuse_partial`: why this run cannot be checked on a subset (the
    global gradient norm under --clip-grad-norm needs every gradient), said where a subset would be needed."""
    trainable = [(n, p.numel()) for n, p in template.named_parameters() if p.requires_grad]
    total = sum(c for _, c in trainable)
    sizes = dict(trainable)
    copied = copied_elements(template)

    def need(checked: int) -> float:
        return need_bytes(total, checked, optimizer, dtype_bytes, copied, ranks)

    full_need = need(total)
    free, source = free if free is not None else available_bytes(device)
    budget = None if free is None else free * MARGIN - reserved
    where = f"{'the GPU' if device.type == 'cuda' else 'this host'}"

    beside = (f", beside {reserved / GIB:.1f} GiB for the other ranks' copies that share its forwards there"
              if reserved else "")

    def figures(need: float) -> str:
        return (f"needs about {need / GIB:.1f} GiB on rank 0{beside} and {where} has {free / GIB:.1f} GiB free "
                f"({source}; {MARGIN:.0%} of it planned)" if free is not None else f"needs about {need / GIB:.1f} GiB")

    fraction = None if request in ("auto", "full") else float(request)
    if fraction is None or fraction >= 1.0:
        if budget is None or full_need <= budget:
            return OracleCoverage(total, total, need_bytes=full_need, full_need_bytes=full_need, available_bytes=free)
        if request == "full" or (fraction is not None and fraction >= 1.0):
            raise OracleCoverageRefused(
                f"the float64 oracle cannot check every parameter of this model: it {figures(full_need)}; pass "
                "--check-coverage auto to check the blocks that fit (the coverage is stated), --check-every 0 to "
                "measure without checking, or run where more memory is free")
        fraction = 1.0
    if refuse_partial:
        raise OracleCoverageRefused(
            f"the float64 oracle cannot check every parameter ({figures(full_need)}) and a subset cannot be checked "
            f"here: {refuse_partial}; run where more memory is free, or --check-every 0 to measure without checking")
    taken: list[str] = []
    left: list[str] = []
    names: set[str] = set()
    checked = 0
    for unit, members in units(template):
        size = sum(sizes[n] for n in members)
        fits = budget is None or need(checked + size) <= budget
        within = (checked + size) / total <= fraction + 1e-12 or not taken
        if fits and within:
            taken.append(unit)
            names.update(members)
            checked += size
        else:
            left.append(unit)
    if not taken:
        floor_need = need(min(sum(sizes[n] for n in m) for _, m in units(template)))
        raise OracleCoverageRefused(
            f"the float64 oracle cannot check even one block of this model: with one block it {figures(floor_need)} "
            f"(its copies of the whole model alone take {COPY_BYTES_PER_PARAM * max(total, copied) / GIB:.1f} GiB); "
            "--check-every 0 measures without checking, or run where more memory is free")
    unchecked = frozenset(n for n, _ in trainable if n not in names)
    why = ("requested" if fraction < 1.0 and (budget is None or full_need <= budget)
           else f"every parameter {figures(full_need)}")
    return OracleCoverage(total, checked, unchecked, taken, left, need(checked), full_need, free,
                          f"--check-coverage {request}: {why}")


def unchecked_frozen(template: nn.Module, unchecked: frozenset[str]) -> None:
    """Mark the parameters left out `requires_grad=False` in the verifier's template, so every copy of it computes no
    gradient, keeps no optimizer state and holds no check for them (their values still enter every forward)."""
    for n, p in template.named_parameters():
        if n in unchecked:
            p.requires_grad_(False)


__all__ = ["OracleCoverage", "OracleCoverageRefused", "available_bytes", "copied_elements", "helper_bytes", "need_bytes",
           "plan", "plan_ranks", "unchecked_frozen", "units"]


def plan_ranks(template: nn.Module, pools: list[tuple[Any, tuple[float | None, str]]], **kwargs: Any) -> OracleCoverage:
    """`plan` where every rank shares the oracle's forwards: `pools`, each rank's memory (what it shares it with: its
    host for CPU ranks, its device for CUDA ones; its bytes free and their source), in rank order. Rank 0's plan
    leaves room for the other ranks' copies in its own pool; a pool too small for its ranks' copies is refused in one
    line, naming the ranks."""
    copies = helper_bytes(copied_elements(template), kwargs.get("dtype_bytes", 4), kwargs.get("optimizer", "adamw"),
                          len(pools))
    mine = pools[0][0]
    for pool in dict.fromkeys(p for p, _ in pools[1:] if p != mine):
        ranks = [r for r, (p, _) in enumerate(pools) if p == pool and r]
        free, source = next(f for p, f in pools if p == pool)
        need = copies * len(ranks)
        if free is not None and need > free * MARGIN:
            raise OracleCoverageRefused(
                f"rank(s) {', '.join(map(str, ranks))} hold copies of the model to run their share of the oracle's "
                f"forwards: they need about {need / GIB:.1f} GiB and have {free / GIB:.1f} GiB free ({source}); "
                "--oracle-ranks rank0 runs every forward on rank 0 alone")
    helpers_here = copies * sum(1 for r, (p, _) in enumerate(pools) if r and p == mine)
    return plan(template, reserved=helpers_here, free=pools[0][1], ranks=len(pools), **kwargs)
