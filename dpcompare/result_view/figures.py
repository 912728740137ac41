"""The building blocks of the result's views: a recorded figure or why it is missing (Figure), a figure declared
once as the attribute that reads it (Field), and the one-line refusal of what is no result (ResultError)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Generic, Mapping, TypeVar

T = TypeVar("T")
NUMBER = (int, float)


class ResultError(ValueError):
    """A JSON object that is no run result this dpcompare reads, said in one line."""


def is_number(value: Any) -> bool:
    """A finite int or float (not a bool): what a figure must be to be shown as one."""
    return isinstance(value, NUMBER) and not isinstance(value, bool) and math.isfinite(value)


def mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


@dataclass(frozen=True, slots=True)
class Figure(Generic[T]):
    """A recorded figure, or None and why it is missing."""

    value: T | None
    reason: str | None = None

    def text(self, spec: str, missing: str = "-") -> str:
        return missing if self.value is None else format(self.value, spec)


class Field(Generic[T]):
    """One recorded figure of a view, declared once: its key is the attribute's name. `kind`: the JSON type it must
    have (numbers by default: finite, not a bool); a value of another type reads as missing, with why."""

    def __init__(self, kind: type | tuple[type, ...] = NUMBER) -> None:
        self.kind = kind
        self.name = ""
        self.path = ""
        """Its dotted path in the result (`metrics.step_ms_p50`) where its view sits at one place; else its name."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name
        prefix = owner.__dict__.get("path")
        self.path = f"{prefix}.{name}" if isinstance(prefix, str) else name

    def __get__(self, view: Any, owner: type) -> Any:
        return self if view is None else view.figure(self)

    def accepts(self, value: Any) -> bool:
        return is_number(value) if self.kind is NUMBER else isinstance(value, self.kind)

    def wrong(self, path: str, value: Any) -> str:
        kind = "number" if self.kind is NUMBER else getattr(self.kind, "__name__", str(self.kind))
        return f"{path}.{self.name} is {value!r}, not a {kind}"


def _unrecorded(path: str, name: str, value: Any) -> str:
    return f"{path}.{name} is {'null' if value is None else repr(value)} and no reason was recorded"


class View:
    """A section of the result: reads its Fields from `raw`, names them by `path`."""

    __slots__ = ()
    raw: Mapping[str, Any]
    path: str

    def figure(self, field: Field) -> Figure:
        value = self.raw.get(field.name)
        if value is not None and field.accepts(value):
            return Figure(value)
        return Figure(None, field.wrong(self.path, value) if value is not None
                      else _unrecorded(self.path, field.name, value))
