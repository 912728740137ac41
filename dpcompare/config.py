"""Deprecated: dpcompare.config moved to dpcompare.run.config (internal) in 0.1.0. Import RunConfig from
`dpcompare`, the public API (docs/extending.md). Until 0.3.0 this module forwards every name there, with a
DeprecationWarning, so code written against the old path keeps running."""

from __future__ import annotations

import importlib
import warnings
from typing import Any


def __getattr__(name: str) -> Any:
    warnings.warn(f"dpcompare.config.{name}: dpcompare.config is deprecated and goes in 0.3.0; import RunConfig from "
                  "dpcompare (the public API)", DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module("dpcompare.run.config"), name)
