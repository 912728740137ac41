"""The backend options that make a run a variant of its backend's baseline, each with the value that is the
baseline, as the registered adapters declare them: an option a declared variant sets (the adapter's `VARIANTS`:
deepspeed's zero_stage, fsdp's reshard_after_forward) or the precision recipe compare --amp runs beside the default
one (`amp_recipe`: deepspeed's engine), its baseline value the default of its `Option` in the adapter's `OPTIONS`.
In the order of dpcompare.run.registry.BACKENDS, then of each adapter's OPTIONS; where two adapters declare one
option, the first one's default counts.

The declarations are read from the adapters' source files, not from their classes: importing an adapter module
imports torch, and the report reads past results on a machine without torch or without the backends
(`import dpcompare.commands.report` loads neither, and building a report loads no adapter module). The files ship
with dpcompare (dpcompare.adapters) whether or not a backend's runtime is installed (registry.availability), so a
deepspeed:zero2 result stays a variant where deepspeed is missing. Each file is found through the import system's
finders without importing the adapter (find_spec of its package, which imports only the packages above it) and
parsed with `ast`. What is read is the class body's own literal declarations: `Option(name, type, default, ...)`
calls in OPTIONS with a literal name and default (other entries, such as DIST_BACKEND, are no variant's), and the
keys of the option mappings in VARIANTS (a dict of dicts, or a dict comprehension making them). A declaration that
is not literal where it is needed is a ValueError naming the file; tests/test_report.py checks what is read here
against the classes themselves.
"""

from __future__ import annotations

import ast
import functools
import importlib.machinery
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from dpcompare.run import registry

AMP_RECIPE = "amp_recipe"
"""The option naming a backend's mixed-precision recipes; compare --amp runs each one besides its default."""


@dataclass(frozen=True, slots=True)
class Declarations:
    """What one adapter class declares, as far as variants need it."""

    defaults: dict[str, Any]
    """Option name -> its declared default, for each literal Option(...) in OPTIONS, in their order."""
    variant_keys: frozenset[str]
    """The options its VARIANTS set."""


def source_of(module_name: str) -> Path:
    """The file of `module_name`, found without importing it (only the packages above it are imported)."""
    parent, _, _ = module_name.rpartition(".")
    try:
        if parent:
            package = importlib.util.find_spec(parent)
            locations = None if package is None else package.submodule_search_locations
            spec = None if locations is None else importlib.machinery.PathFinder.find_spec(module_name, locations)
        else:
            spec = importlib.util.find_spec(module_name)
    except (ImportError, ValueError) as exc:
        raise ValueError(f"cannot find the adapter module {module_name!r} ({exc})") from None
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        raise ValueError(f"cannot find the source of the adapter module {module_name!r}")
    return Path(spec.origin)


def _literal(node: ast.expr, where: str) -> Any:
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError):
        raise ValueError(f"{where}: {ast.unparse(node)} is not a literal") from None


def _options(value: ast.expr, where: str) -> dict[str, Any]:
    if not isinstance(value, (ast.Tuple, ast.List)):
        raise ValueError(f"{where}: OPTIONS is not a tuple or list of Option(...)")
    defaults = {}
    for item in value.elts:
        if not (isinstance(item, ast.Call) and isinstance(item.func, ast.Name) and item.func.id == "Option"):
            continue  # an Option defined elsewhere (DIST_BACKEND): no variant sets it
        args = {**dict(zip(("name", "type", "default"), item.args)), **{k.arg: k.value for k in item.keywords}}
        if "name" not in args or "default" not in args:
            raise ValueError(f"{where}: {ast.unparse(item)} gives no name or no default")
        defaults[_literal(args["name"], where)] = _literal(args["default"], where)
    return defaults


def _variant_keys(value: ast.expr, where: str) -> frozenset[str]:
    if isinstance(value, ast.Dict):
        settings = value.values
    elif isinstance(value, ast.DictComp):
        settings = [value.value]
    else:
        raise ValueError(f"{where}: VARIANTS is not a dict (or a dict comprehension) of option dicts")
    keys = set()
    for options in settings:
        if not isinstance(options, ast.Dict) or any(k is None for k in options.keys):
            raise ValueError(f"{where}: the variant {ast.unparse(options)} is not a dict of options")
        keys |= {_literal(k, where) for k in options.keys}
    return frozenset(keys)


def read_declarations(source: str, class_name: str, where: str) -> Declarations:
    """The OPTIONS and VARIANTS of class `class_name` in the module source `source` (read at `where`)."""
    cls = next((n for n in ast.parse(source, where).body if isinstance(n, ast.ClassDef) and n.name == class_name), None)
    if cls is None:
        raise ValueError(f"{where} defines no class {class_name}")
    defaults, keys = {}, frozenset()
    for statement in cls.body:
        if isinstance(statement, ast.Assign) and len(statement.targets) == 1:
            target, value = statement.targets[0], statement.value
        elif isinstance(statement, ast.AnnAssign) and statement.value is not None:
            target, value = statement.target, statement.value
        else:
            continue
        name = target.id if isinstance(target, ast.Name) else None
        if name == "OPTIONS":
            defaults = _options(value, f"{where}: {class_name}")
        elif name == "VARIANTS":
            keys = _variant_keys(value, f"{where}: {class_name}")
    return Declarations(defaults, keys)


def declarations(spec: str) -> Declarations:
    """What the adapter class at `package.module:Class` declares, read from its source."""
    module_name, _, class_name = spec.partition(":")
    path = source_of(module_name)
    try:
        source = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the adapter {spec} at {path} ({exc})") from None
    return read_declarations(source, class_name, str(path))


@functools.cache
def _variant_options(backends: tuple[tuple[str, str], ...]) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for name, spec in backends:
        declared = declarations(spec)
        missing = declared.variant_keys - declared.defaults.keys()
        if missing:
            raise ValueError(f"backend {name} ({spec}): its VARIANTS set {', '.join(sorted(missing))}, for which its "
                             "OPTIONS hold no Option(...) with a literal default")
        for key, default in declared.defaults.items():
            if key == AMP_RECIPE or key in declared.variant_keys:
                options.setdefault(key, default)
    return options


def variant_options(backends: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Option name -> the value that is the baseline, for every option that makes a run a variant, as the adapters
    of `backends` (name -> package.module:Class; default: the registered ones) declare them. Read once per table."""
    table = registry.BACKENDS if backends is None else backends
    return dict(_variant_options(tuple(table.items())))
