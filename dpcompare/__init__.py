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

__version__ = "0.2.0"
"""The one place the version is set (pyproject.toml reads it from here)."""
SCHEMA_VERSION = 1
"""Version of the JSON result schema (dpcompare/schema/result.schema.json)."""

_EXPORTS = {
    # a custom workload
    "Workload": "dpcompare.run.workloads",
    "shard": "dpcompare.run.workloads",
    # a custom backend: the adapter contract
    "Adapter": "dpcompare.contract",
    "Capabilities": "dpcompare.contract",
    "Option": "dpcompare.contract",
    "Settings": "dpcompare.contract",
    "Note": "dpcompare.contract",
    "Wrapped": "dpcompare.contract",
    "ModelFacts": "dpcompare.contract",
    "CommCounter": "dpcompare.contract",
    "CommCounts": "dpcompare.contract",
    "CounterWindow": "dpcompare.contract",
    "ScalerState": "dpcompare.run.precision",
    "LaunchEnv": "dpcompare.run.launch",
    # the process-group helper a torch.distributed backend mixes in (process group, global BatchNorm, gather)
    "ProcessGroupMixin": "dpcompare.run.process_group",
    "DIST_BACKEND": "dpcompare.run.process_group",
    # a run from Python
    "RunConfig": "dpcompare.run.config",
}

__all__ = ["__version__", "SCHEMA_VERSION", *_EXPORTS]

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from dpcompare.contract import (Adapter, Capabilities, CommCounter, CommCounts, CounterWindow, ModelFacts, Note,
                                    Option, Settings, Wrapped)
    from dpcompare.run.precision import ScalerState
    from dpcompare.run.config import RunConfig
    from dpcompare.run.launch import LaunchEnv
    from dpcompare.run.process_group import DIST_BACKEND, ProcessGroupMixin
    from dpcompare.run.workloads import Workload, shard


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dpcompare' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
