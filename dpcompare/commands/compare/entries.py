"""compare's --backends entries: a registered backend (`ddp`), a registered backend and one of the variants its adapter
declares (`deepspeed:zero2`, its `VARIANTS`: run with their `--opt` values), or a user's adapter class
(`package.module:Class`, optionally `package.module:Class:variant`). The rule that keeps the two apart: a `:` names a
variant only after a registered backend name, or after a full `package.module:Class`.

Owns: reading --backends into entries, each checked against what its adapter declares, and what compare asks of an
adapter class (its capabilities, launcher, variants, precision recipes). Imports no backend runtime.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

from dpcompare.contract import Adapter, Capabilities
from dpcompare.run import registry


@functools.cache
def adapter_class(backend: str) -> type[Adapter]:
    """The backend's adapter class (importing it imports torch, never the backend's runtime)."""
    return registry.load(backend, registry.BACKENDS, "backend")


def capabilities(backend: str) -> Capabilities:
    """What the backend's adapter declares."""
    return adapter_class(backend).capabilities


def declared_launcher(backend: str) -> str:
    """The launcher the backend's adapter declares, or '-' when its adapter cannot be loaded (not registered)."""
    try:
        return capabilities(backend).native_launcher
    except (ValueError, ImportError):
        return "-"


@functools.cache
def amp_recipe_choices(backend: str) -> tuple[str, ...]:
    """The precision recipes besides its default that a backend declares (its `amp_recipe` option), or ()."""
    cls = registry.load(backend, registry.BACKENDS, "backend")
    option = next((o for o in cls.OPTIONS if o.name == "amp_recipe"), None)
    return tuple(c for c in option.choices if c != option.default) if option is not None else ()


@dataclass(frozen=True, slots=True)
class Entry:
    """One item of --backends: a backend, and the named variant of it its adapter declares (VARIANTS), if any."""

    backend: str
    variant: str = ""
    options: tuple[tuple[str, Any], ...] = ()
    """The variant's `--opt` values, typed, in the order the adapter declares them."""

    @property
    def name(self) -> str:
        return f"{self.backend}:{self.variant}" if self.variant else self.backend


def split_entry(item: str) -> tuple[str, str | None]:
    """(backend, variant name or None) of one --backends item. A `:` after a registered backend's name names a
    variant (`deepspeed:zero2`); `package.module:Class` is a user's adapter, and a third part after it a variant
    (`mypkg.adapters:Mine:fast`); `deepspeed:` names an empty variant, refused by resolve_entry."""
    head, sep, rest = item.partition(":")
    if sep and head in registry.BACKENDS:
        return head, rest
    if item.count(":") >= 2:
        backend, _, variant = item.rpartition(":")
        return backend, variant
    return item, None


def backend_variants(backend: str) -> dict[str, dict[str, Any]]:
    """The named variants the backend's adapter declares (its VARIANTS), importing no backend runtime."""
    cls = registry.load(backend, registry.BACKENDS, "backend")
    return {str(name): dict(options) for name, options in (getattr(cls, "VARIANTS", None) or {}).items()}


def resolve_entry(item: str, backend: str, variant: str) -> Entry:
    """The entry of `backend:variant`, its options typed and checked against what the adapter declares, or a
    ValueError naming the variants the backend has."""
    declared = backend_variants(backend)
    if variant not in declared:
        have = (f"choose one of {', '.join(f'{backend}:{v}' for v in declared)}" if declared
                else f"{backend} declares no variants (its adapter's VARIANTS is empty)")
        shown = "an empty variant" if not variant else f"no variant {variant!r}"
        raise ValueError(f"--backends {item!r}: {backend} has {shown}; {have}")
    options = {o.name: o for o in registry.load(backend, registry.BACKENDS, "backend").OPTIONS}
    typed = []
    for key, value in declared[variant].items():
        if key not in options:
            raise ValueError(f"--backends {item!r}: the variant sets {key}, an option {backend} does not declare "
                             f"(it declares {', '.join(options) or 'none'})")
        typed.append((key, options[key].parse(value)))
    order = list(options)
    return Entry(backend, variant, tuple(sorted(typed, key=lambda kv: order.index(kv[0]))))


def parse_backends(text: str, *, lenient: bool = False) -> tuple[list[Entry], list[dict[str, str]]]:
    """The entries of --backends, in order, and {'backend', 'reason', 'launcher'} for each left out. An unknown
    name (no `:`, not registered) is refused, listing the registered ones; `lenient` (a --suite preset's own
    list) leaves it out as unavailable instead, so a preset runs on a dpcompare without that backend."""
    entries: list[Entry] = []
    unknown: list[str] = []
    missing: list[dict[str, str]] = []
    for item in comma_separated(text, "--backends"):
        backend, variant = split_entry(item)
        if ":" not in backend and backend not in registry.BACKENDS:
            if lenient:
                missing.append({"backend": backend, "launcher": "-", "reason": (
                    f"not a registered backend of this dpcompare (it has {', '.join(registry.BACKENDS)})")})
            else:
                unknown.append(item)
            continue
        entry = Entry(backend) if variant is None else resolve_entry(item, backend, variant)
        if entry in entries:
            raise ValueError(f"--backends: {item} is given twice; name each backend or variant once")
        entries.append(entry)
    if unknown:
        raise ValueError(f"--backends: unknown {', '.join(unknown)}; choose from {', '.join(registry.BACKENDS)} "
                         "(BACKEND:VARIANT for a variant its adapter declares, or package.module:Class)")
    return entries, missing


def comma_separated(text: str, option: str, kind: Callable = str) -> list:
    try:
        return [kind(v.strip()) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{option}={text!r} is invalid: use a comma-separated list") from None
