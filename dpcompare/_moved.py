"""Forwarding for module paths that moved: the deprecated module's `__getattr__` (PEP 562) warns and hands over
the name from its new home, so code written against the old path keeps running until the version named."""

from __future__ import annotations

import importlib
import warnings
from typing import Any, Callable


def forward(old: str, new: str, names: str, until: str = "0.3.0") -> Callable[[str], Any]:
    """The `__getattr__` of deprecated module `old`: every name comes from module `new`, with a DeprecationWarning
    that says to import `names` from dpcompare (the public API)."""

    def __getattr__(name: str) -> Any:
        warnings.warn(f"{old}.{name}: {old} is deprecated and goes in {until}; import {names} from dpcompare "
                      "(the public API)", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(new), name)

    return __getattr__
