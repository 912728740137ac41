"""The smallest backend that gets a real verdict, run end to end: docs/extending.md's minimal backend.

`MinimalBackend` below is the code of docs/extending.md#a-minimal-backend, verbatim (checked: the page's block, its
module docstring aside, is this module's text): an `Adapter` that overrides 9 methods (the training protocol's
must-haves and three measurement facts) and keeps every default of the check reads, the measurement reads and the
checkpoint I/O. It runs under real torchrun at 2 ranks, loaded as a user's is
(`--backend tests.test_minimal_backend:MinimalBackend`, the repository root on PYTHONPATH), and comes out
`equivalent` with the gradient, update and trajectory checks passing; its negative twin, `SummingBackend` (the
gradients summed over the ranks, never divided), comes out `different` at step 0's gradient.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from dpcompare import Adapter, Capabilities, CommCounter, CommCounts, CounterWindow, convert_global_batchnorm


class MinimalBackend(Adapter):
    name = "minimal"
    capabilities = Capabilities(
        multi_process=True,  # one process per replica
        launchers=frozenset({"torchrun"}),  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
        native_launcher="torchrun",
        launch_hint="torchrun --nproc_per_node=N -m dpcompare --backend my_backend:MinimalBackend",
    )
    interval = None  # set while a measurement window times communication

    # The training protocol: what a backend of several processes must implement.
    def setup(self, timeout_s: float) -> None:
        dist.init_process_group("gloo", rank=self.env.rank, world_size=self.env.world_size,
                                timeout=timedelta(seconds=timeout_s))

    def reduce(self) -> None:
        # Each rank's .grad holds its shard's gradient: their sum over the ranks, divided by the number of ranks, is
        # the mean, the gradient of the global-batch loss.
        grads = [p.grad for p in self.wrapped.module.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        with self.interval() if self.interval else contextlib.nullcontext():
            dist.all_reduce(flat)
        flat /= self.env.world_size
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    def all_gather_object(self, obj: object) -> list[object]:
        out = [None] * self.env.world_size
        dist.all_gather_object(out, obj)
        return out

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.clone()
        dist.all_reduce(out)
        return out

    def sync_batchnorm(self, module: nn.Module) -> nn.Module:  # --sync-bn: statistics over the global batch
        return convert_global_batchnorm(module, self.allreduce_sum_autograd())

    def allreduce_sum_autograd(self):
        import warnings

        from torch.distributed.nn.functional import all_reduce  # differentiable: its backward all-reduces too

        warnings.filterwarnings("ignore", message=r"torch\.distributed\.nn\.functional\.all_reduce is deprecated")
        return all_reduce

    # What measurement reads: one message, one flat copy, timed by the window's clock.
    def message_bytes(self, grad_bytes: int) -> tuple[int | None, str | None]:
        return grad_bytes, None

    def comm_buffer_bytes(self, grad_bytes: int) -> int | None:
        return grad_bytes

    def comm_counter(self) -> CommCounter:
        return _WindowTimer(self)


class _WindowTimer(CommCounter):
    """Times each all_reduce with the measurement window's own clock."""

    def __init__(self, backend: MinimalBackend) -> None:
        self.backend = backend

    def begin(self, window: CounterWindow) -> None:
        self.backend.interval = window.interval

    def end(self) -> CommCounts:
        self.backend.interval = None
        return CommCounts(method="all_reduce of the flat gradient, timed by the window's clock", timed_intervals=True)


# -- the negative twin: the classic bug of a hand-written reduce ------------------------------------------------
class SummingBackend(MinimalBackend):
    """The minimal backend whose reduce forgets to divide: `.grad` is N times the global-batch gradient."""

    name = "summing-minimal"

    def reduce(self) -> None:
        super().reduce()
        for p in self.wrapped.module.parameters():
            if p.grad is not None:
                p.grad.mul_(self.env.world_size)


# -- the tests -------------------------------------------------------------------------------------------------
import re  # noqa: E402  (after the backend: the module above is the docs' file, as a user writes it)
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from dpcompare.contract.check_reads import CheckReads  # noqa: E402
from dpcompare.contract.checkpoint_io import CheckpointIO  # noqa: E402
from dpcompare.contract.measurement_reads import MeasurementReads  # noqa: E402
from dpcompare.contract.training_protocol import TrainingProtocol  # noqa: E402

EXTENDING = Path(__file__).resolve().parents[1] / "docs" / "extending.md"
BACKEND = "tests.test_minimal_backend:MinimalBackend"
"""Loaded as a user's backend is: `module:Class`, the repository root on the ranks' PYTHONPATH."""
RUN = ["--steps", "4", "--measure-steps", "0"]
MOST_METHODS = 12
"""What "minimal" means: at most this many methods overridden."""
MEASUREMENT_OVERRIDES = frozenset({"message_bytes", "comm_buffer_bytes", "comm_counter"})
"""The measurement reads docs/extending.md says the minimal backend overrides; no check read, no checkpoint I/O."""


def members(cls: type) -> frozenset[str]:
    """The public members a part of the contract defines."""
    return frozenset(n for n in vars(cls) if not n.startswith("_"))


def overridden(cls: type) -> frozenset[str]:
    """The methods (functions, classmethods, properties) `cls` defines itself, data aside."""
    return frozenset(n for n, v in vars(cls).items() if not n.startswith("_")
                     and (callable(v) or isinstance(v, (classmethod, staticmethod, property))))


def test_the_minimal_backend_is_the_docs_one():
    """The Python block before docs/extending.md's `--backend my_backend:MinimalBackend` command is this module's text
    (after its `from __future__` line), so the page shows the backend this test runs."""
    from test_docs import example

    code, words = example(EXTENDING, "--backend")
    assert words[words.index("--backend") + 1] == "my_backend:MinimalBackend", words
    body = code.split("from __future__ import annotations\n", 1)[1]
    assert body in Path(__file__).read_text(), "docs/extending.md's minimal backend and this module's differ"


def test_the_minimal_backend_overrides_few_methods_and_keeps_the_read_parts_defaults():
    own = overridden(MinimalBackend)
    assert len(own) <= MOST_METHODS, sorted(own)
    contract = members(TrainingProtocol) | members(CheckReads) | members(MeasurementReads) | members(CheckpointIO)
    assert own <= contract, f"not members of the contract (a misspelt override overrides nothing): {sorted(own - contract)}"
    assert not own & members(CheckReads), sorted(own & members(CheckReads))
    assert not own & members(CheckpointIO), sorted(own & members(CheckpointIO))
    assert own & members(MeasurementReads) == MEASUREMENT_OVERRIDES
    for name in MEASUREMENT_OVERRIDES:
        assert re.search(rf"`{name}\b", EXTENDING.read_text()), f"docs/extending.md does not say it overrides {name}"


def test_the_parts_share_no_member():
    """Each member is one part's alone: the order of Adapter's bases decides no member's resolution."""
    parts = [members(p) for p in (TrainingProtocol, CheckReads, MeasurementReads, CheckpointIO)]
    for i, a in enumerate(parts):
        for b in parts[i + 1:]:
            assert not a & b, sorted(a & b)


@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_the_minimal_backend_is_equivalent_under_torchrun(launch):
    proc, result = launch(BACKEND, 2, "mlp", RUN, "torchrun")
    assert proc.returncode == 0, proc.output[-4000:]
    e = result["equivalence"]
    assert e["verdict"] == "equivalent", e
    for check in ("gradient", "update", "trajectory"):
        assert e["checks"][check]["status"] == "pass", (check, e["checks"])
    assert result["world_size"] == 2 and ": equivalent" in proc.stdout, proc.stdout[-2000:]


@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_the_summing_twin_is_different_at_step_0(launch):
    proc, result = launch("tests.test_minimal_backend:SummingBackend", 2, "mlp", RUN, "torchrun")
    assert proc.returncode == 0, proc.output[-4000:]
    e = result["equivalence"]
    assert e["verdict"] == "different", e
    assert (e["first_divergence"]["check"], e["first_divergence"]["step"]) == ("gradient", 0), e["first_divergence"]
    assert e["checks"]["gradient"]["status"] == "fail", e["checks"]
