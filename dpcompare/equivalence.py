"""Equivalence: is the backend's reduced gradient the gradient of the global-batch loss?

Owns: the float64 oracle, the noise floor, per-parameter error metrics, the tolerance policy, fingerprints
for replica consistency, the diagnosis of a failure, and the verdict. Imports no adapter: it receives
tensors, state dicts and gathered fingerprints.

Definitions (all per parameter p, `o` the float64 oracle gradient, `g` the gradient under test):
  max_abs_err   max |g - o|
  max_rel_err   max |g - o| / (|o| + u * max|o|)       (u: unit roundoff of the run dtype; the u-term keeps
                                                         elements whose oracle is ~0 from dominating)
  rel_fro_err   ||g - o||_F / max(||o||_F, ||O||_F / sqrt(T))   (O: the whole model's oracle gradient, T: its
                number of parameter tensors; a parameter whose gradient is analytically ~0, such as a conv bias
                feeding BatchNorm, is measured against its share of the model's gradient instead of against
                its own rounding noise)
  noise floor   rel_fro_err of the plain single-process gradient computed in the run dtype on the same
                parameters and global batch: what that dtype costs on this model before any parallelism
  noise_ratio   rel_fro_err / floor_p, where floor_p = max(floor of p, floor of the whole model, depth * u)

Tolerance policy (the only place it is written): a parameter passes when
  rel_fro_err <= TOLERANCE_FACTOR * (floor_p + world_size * u_wire)
(u_wire = u, or the unit roundoff of the compressed dtype when gradients travel compressed: fp16 2^-11,
bf16 2^-8 — every gradient is rounded to it once and the sum accumulates in it.)
The floor term covers the rounding of the forward/backward in the run dtype (each rank computes its shard
in that dtype, with a different summation order than the single process: the same order of error). The
world_size * u term bounds the extra rounding of averaging N gradients (a ring or tree sum of N terms plus
one division: at most N-1 additions of relative error u each, and pre- vs post-division differing by an
ulp when N is not a power of two). TOLERANCE_FACTOR is 10: measured noise ratios of correct backends on the
built-in workloads stay below 3 (README, "Tolerance"), and every planted fault measured lands above 10^4.
"""

from __future__ import annotations

import copy
import hashlib
import math
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable

import torch
from torch import nn

TOLERANCE_FACTOR = 10.0
UNIT_ROUNDOFF = {"float64": 2.0**-53, "float32": 2.0**-24, "bfloat16": 2.0**-8, "float16": 2.0**-11}
WIRE_DTYPE = {"none": None, "fp16": "float16", "bf16": "bfloat16"}
DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}

Grads = dict[str, torch.Tensor]


# -- fingerprints ----------------------------------------------------------------------------------
def tensor_digest(t: torch.Tensor) -> str:
    return hashlib.blake2b(t.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy().tobytes(), digest_size=8).hexdigest()


def param_digests(module: nn.Module) -> list[str]:
    return [tensor_digest(p) for _, p in module.named_parameters()]


def grad_digests(module: nn.Module) -> list[str]:
    return [tensor_digest(p.grad) if p.grad is not None else "none" for _, p in module.named_parameters()]


def first_mismatch(per_rank: list[list[str]], names: list[str]) -> tuple[int, str] | None:
    """(rank, parameter) of the first entry where a rank disagrees with rank 0, or None when identical."""
    for rank, digests in enumerate(per_rank[1:], start=1):
        for name, mine, ref in zip(names, digests, per_rank[0]):
            if mine != ref:
                return rank, name
    return None


# -- metrics ---------------------------------------------------------------------------------------
@dataclass(slots=True)
class ParamError:
    parameter: str
    max_abs_err: float
    max_rel_err: float
    rel_fro_err: float
    floor_rel_fro_err: float
    noise_ratio: float
    tolerance_rel_fro: float
    ok: bool


def rel_fro(g: torch.Tensor, o: torch.Tensor, min_denom: float = 0.0) -> float:
    denom = max(float(torch.linalg.vector_norm(o)), min_denom)
    diff = float(torch.linalg.vector_norm(g - o))
    if denom == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / denom


def flat(grads: Grads, names: Iterable[str]) -> torch.Tensor:
    return torch.cat([grads[n].reshape(-1) for n in names])


def depth_of(module: nn.Module) -> int:
    """Layers with parameters: the length of the longest chain rounding errors can compound along."""
    return sum(1 for m in module.modules() if any(True for _ in m.parameters(recurse=False)))


def compare_grads(
    grads: Grads, oracle: Grads, floor: Grads, *, dtype: str, world_size: int, depth: int, compression: str = "none"
) -> list[ParamError]:
    u = UNIT_ROUNDOFF[dtype]
    wire = WIRE_DTYPE[compression]
    u_sum = max(u, UNIT_ROUNDOFF[wire]) if wire else u  # the reduction rounds in the wire dtype
    names = list(oracle)
    whole = flat(oracle, names)
    global_floor = rel_fro(flat(floor, names), whole)
    share = float(torch.linalg.vector_norm(whole)) / math.sqrt(max(len(names), 1))
    out = []
    for name in names:
        g, o = grads[name], oracle[name]
        diff = (g - o).abs()
        scale = float(o.abs().max()) if o.numel() else 0.0
        max_rel = float((diff / (o.abs() + u * scale + 1e-300)).max()) if o.numel() else 0.0
        err = rel_fro(g, o, share)
        own_floor = rel_fro(floor[name], o, share)
        floor_p = max(own_floor, global_floor, depth * u)
        tol = TOLERANCE_FACTOR * (floor_p + world_size * u_sum)
        out.append(
            ParamError(name, float(diff.max()) if o.numel() else 0.0, max_rel, err,
                       own_floor, err / floor_p, tol, err <= tol)
        )
    return out


# -- the oracle ------------------------------------------------------------------------------------
class Oracle:
    """Recomputes gradients of the global-batch loss on rank 0 from the run's current parameters.

    It holds two plain copies of the workload's model (no wrapper, no global BatchNorm): one in float64
    (the oracle) and one in the run dtype (the noise floor). Each check loads the run's state dict into
    them, so no error carries over from earlier steps.
    """

    def __init__(self, template: nn.Module, loss_fn: Callable, dtype: str, device: torch.device) -> None:
        self.loss_fn = loss_fn
        self.device = device
        self.model64 = copy.deepcopy(template).to(device=device, dtype=torch.float64)
        self.model_run = copy.deepcopy(template).to(device=device, dtype=DTYPES[dtype])
        self.names = [n for n, _ in template.named_parameters()]

    def _grad(self, model: nn.Module, state: dict, x: torch.Tensor, y: torch.Tensor, dtype: torch.dtype) -> Grads:
        model.load_state_dict(state)
        model.train()
        model.zero_grad(set_to_none=True)
        x = x.to(self.device)
        if x.is_floating_point():
            x = x.to(dtype)
        self.loss_fn(model(x), y.to(self.device)).backward()
        return {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().double().cpu()
                for n, p in model.named_parameters()}

    def oracle(self, state: dict, x: torch.Tensor, y: torch.Tensor) -> Grads:
        return self._grad(self.model64, state, x, y, torch.float64)

    def floor(self, state: dict, x: torch.Tensor, y: torch.Tensor) -> Grads:
        return self._grad(self.model_run, state, x, y, next(self.model_run.parameters()).dtype)


# -- diagnosis -------------------------------------------------------------------------------------
@dataclass(slots=True)
class Divergence:
    step: int
    parameter: str
    rel_fro_err: float
    tolerance_rel_fro: float
    noise_ratio: float
    reason: str


def diagnose(
    *,
    grads: Grads,
    oracle_grads: Grads,
    oracle: Oracle,
    state: dict,
    global_batch: tuple[torch.Tensor, torch.Tensor],
    shards: list[tuple[torch.Tensor, torch.Tensor]],
    shard_digests: list[str],
    expected_digests: list[str],
    tolerance: float,
    has_batchnorm: bool,
    sync_bn: bool,
) -> str:
    """Explain why the reduced gradient is not the global-batch gradient, by testing hypotheses against
    what the gradient would be under each known fault. Returns a sentence naming the cause and the fix."""
    names = oracle.names
    g = flat(grads, names)
    o = flat(oracle_grads, names)
    n = len(shards)

    seen: dict[str, int] = {}
    for rank, digest in enumerate(shard_digests):
        if digest in seen:
            return (f"ranks {seen[digest]} and {rank} read the same shard (duplicated data): each rank must read a "
                    "disjoint 1/N of the global batch (DistributedSampler-style sharding)")
        seen[digest] = rank
    if sorted(shard_digests) != sorted(expected_digests):
        return ("the ranks' shards are not the shards of the global batch: the data stream differs between ranks "
                "(seed, sampler or shuffling)")
    if n > 1 and rel_fro(g, n * o) <= tolerance:
        return (f"the reduced gradient is {n}x the oracle: gradients were summed, not averaged; divide by the world "
                "size (op=Average / a mean comm hook)")
    local = [flat(oracle.oracle(state, x, y), names) for x, y in shards]
    for rank, l in enumerate(local):
        if n > 1 and rel_fro(g, l) <= tolerance:
            return (f"the reduced gradient equals rank {rank}'s local gradient: gradients were not synchronised on "
                    "this step (sync switched off, or the reduction skipped)")
    if n > 1 and has_batchnorm and not sync_bn:
        mean_local = torch.stack(local).mean(dim=0)
        if rel_fro(g, mean_local) <= tolerance:
            return (f"BatchNorm normalised each rank's shard with that shard's own statistics (local batch "
                    f"{shards[0][0].shape[0]}), so the mean of the rank gradients is not the global-batch gradient; "
                    "rerun with --sync-bn for global-batch statistics")
    return "the reduced gradient matches none of the known fault patterns (sum, skipped sync, duplicated data, per-rank BatchNorm)"


# -- verdict ---------------------------------------------------------------------------------------
@dataclass(slots=True)
class StepCheck:
    step: int
    params: list[ParamError]
    replicas_identical: bool
    grads_identical_across_ranks: bool
    mismatch: str | None = None

    @property
    def max_rel_err(self) -> float:
        return max((p.max_rel_err for p in self.params), default=0.0)

    @property
    def max_rel_fro_err(self) -> float:
        return max((p.rel_fro_err for p in self.params), default=0.0)

    @property
    def noise_ratio(self) -> float:
        return max((p.noise_ratio for p in self.params), default=0.0)

    @property
    def floor(self) -> float:
        return max((p.floor_rel_fro_err for p in self.params), default=0.0)


@dataclass(slots=True)
class Verdict:
    checks: list[StepCheck] = field(default_factory=list)
    first_divergence: Divergence | None = None
    replicas_identical: bool = True
    initial_weights_identical: bool = True
    drift: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self, tolerance_policy: dict) -> dict:
        checked = bool(self.checks)
        ok = self.first_divergence is None and self.replicas_identical and self.initial_weights_identical
        if not checked and ok:
            verdict = "unchecked"
        else:
            verdict = "equivalent" if ok else "different"
        worst = max(self.checks, key=lambda c: c.noise_ratio, default=None)
        return {
            "verdict": verdict,
            "checked_steps": [c.step for c in self.checks],
            "max_rel_err": max((c.max_rel_err for c in self.checks), default=None),
            "max_rel_fro_err": max((c.max_rel_fro_err for c in self.checks), default=None),
            "noise_floor_rel_fro": max((c.floor for c in self.checks), default=None),
            "noise_ratio": worst.noise_ratio if worst else None,
            "first_divergence": asdict(self.first_divergence) if self.first_divergence else None,
            "replicas_identical": self.replicas_identical,
            "initial_weights_identical": self.initial_weights_identical,
            "tolerance": tolerance_policy,
            "drift": self.drift,
            "notes": self.notes,
            "per_step": [
                {
                    "step": c.step,
                    "max_rel_err": c.max_rel_err,
                    "max_rel_fro_err": c.max_rel_fro_err,
                    "noise_floor_rel_fro": c.floor,
                    "noise_ratio": c.noise_ratio,
                    "replicas_identical": c.replicas_identical,
                    "grads_identical_across_ranks": c.grads_identical_across_ranks,
                    "params": [asdict(p) for p in c.params],
                }
                for c in self.checks
            ],
        }


def tolerance_policy(dtype: str, world_size: int, depth: int, compression: str = "none") -> dict:
    wire = WIRE_DTYPE[compression]
    return {
        "rule": "rel_fro_err <= factor * (max(floor_param, floor_model, depth*u) + world_size*u_wire)",
        "compression": compression,
        "unit_roundoff_wire": UNIT_ROUNDOFF[wire] if wire else UNIT_ROUNDOFF[dtype],
        "factor": TOLERANCE_FACTOR,
        "unit_roundoff": UNIT_ROUNDOFF[dtype],
        "dtype": dtype,
        "world_size": world_size,
        "depth": depth,
    }
