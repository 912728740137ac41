"""dpcompare: one model, one data stream, four data-parallel backends, one float64 oracle.

The public API is what this module exports (`__all__`): everything a custom workload (`--model
package.module:function`) or a custom backend (`--backend package.module:Class`) needs. Those names are the
stable surface: they keep working across releases whatever module they live in (docs/extending.md). Anything
reached through a submodule (`dpcompare.run...`, `dpcompare.verify...`) is internal and may move.

The names load on first use (PEP 562), so `import dpcompare` and the commands that need no torch (report,
regress, --help, --version) do not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from dpcompare._version import SCHEMA_VERSION, __version__

_EXPORTS = {
    # a custom workload
    "Workload": "dpcompare.contract.workload",
    "shard": "dpcompare.contract.workload",
    "block_modules": "dpcompare.contract.workload",
    # a workload's batches from a torch Dataset, in DistributedSampler's order
    "from_dataset": "dpcompare.data",
    # --activation-checkpointing: each block recomputes its forward in backward
    "checkpoint_blocks": "dpcompare.contract.activation_checkpointing",
    # a custom backend: the adapter contract
    "Adapter": "dpcompare.contract.adapter",
    "Capabilities": "dpcompare.contract.capabilities",
    "Option": "dpcompare.contract.capabilities",
    "Settings": "dpcompare.contract.capabilities",
    "Note": "dpcompare.contract.capabilities",
    "Wrapped": "dpcompare.contract.training_protocol",
    "ModelFacts": "dpcompare.contract.training_protocol",
    "CommCounter": "dpcompare.contract.comm_counter",
    "CommCounts": "dpcompare.contract.comm_counter",
    "CounterWindow": "dpcompare.contract.comm_counter",
    "LaunchEnv": "dpcompare.contract.launch_env",
    "ensure_rendezvous": "dpcompare.contract.launch_env",
    # mixed precision: the recipes' dtypes and the loss-scaler state an adapter reports
    "AMP_DTYPES": "dpcompare.contract.amp",
    "AMP_NAMES": "dpcompare.contract.amp",
    "ScalerState": "dpcompare.contract.amp",
    # the process-group helper a torch.distributed backend mixes in (process group, global BatchNorm, gather)
    "ProcessGroupMixin": "dpcompare.contract.process_group",
    "DIST_BACKEND": "dpcompare.contract.process_group",
    # BatchNorm over the global batch through a backend's own all-reduce (what Horovod's adapter does)
    "GlobalBatchNorm": "dpcompare.contract.syncbn",
    "convert_global_batchnorm": "dpcompare.contract.syncbn",
    "has_batchnorm": "dpcompare.contract.syncbn",
    # a run from Python
    "RunConfig": "dpcompare.run.config",
}

__all__ = ["__version__", "SCHEMA_VERSION", *_EXPORTS]

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from dpcompare.contract.adapter import Adapter
    from dpcompare.contract.training_protocol import ModelFacts, Wrapped
    from dpcompare.contract.capabilities import Capabilities, Note, Option, Settings
    from dpcompare.contract.comm_counter import CommCounter, CommCounts, CounterWindow
    from dpcompare.contract.amp import AMP_DTYPES, AMP_NAMES, ScalerState
    from dpcompare.contract.launch_env import LaunchEnv, ensure_rendezvous
    from dpcompare.contract.process_group import DIST_BACKEND, ProcessGroupMixin
    from dpcompare.contract.syncbn import GlobalBatchNorm, convert_global_batchnorm, has_batchnorm
    from dpcompare.contract.activation_checkpointing import checkpoint_blocks
    from dpcompare.contract.workload import Workload, block_modules, shard
    from dpcompare.data import from_dataset
    from dpcompare.run.config import RunConfig


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dpcompare' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
