"""Deprecated: dpcompare.launch moved to dpcompare.run.launch (internal) in 0.1.0. Import LaunchEnv from
`dpcompare`, the public API (docs/extending.md). Until 0.3.0 this module forwards every name there, with a
DeprecationWarning, so code written against the old path keeps running."""

from __future__ import annotations

import importlib
import warnings
from typing import Any


def __getattr__(name: str) -> Any:
    warnings.warn(f"dpcompare.launch.{name}: dpcompare.launch is deprecated and goes in 0.3.0; import LaunchEnv from "
                  "dpcompare (the public API)", DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module("dpcompare.run.launch"), name)
