"""Run flags, each declared once: a RunConfig field carries its flag as metadata (`run_flag`: its help, its checks,
whether compare forwards it and with which default and help, whether an adapter sees it in `Settings`), and every
place that speaks a run's command line is derived from it: the run's parser and compare's forwarded flags
(`add_arguments`), a config's values from what a parser read (`values`, `given`), the argv that launches a run
(`to_args`) and validation (`check`). The flag's name, type and default are the field's own.

Owns: the Flag metadata and what is derived from it. Imports nothing from dpcompare (run.config declares its fields
with it), no backend and no torch.
"""

from __future__ import annotations

import argparse
import functools
import math
import types
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any, Callable, Collection, Literal, Sequence, Union, get_args, get_origin, get_type_hints

FLAG = "dpcompare.flag"
"""The key of a field's Flag in its metadata."""
SAME = object()
"""Forwarded.default when compare's default is the run's."""


class CommandLineError(ValueError):
    """A setting refused for what the command line says alone: every rank of a launch refuses it the same way, so
    rank 0 says it and the other ranks leave without a word (however late rank 0 gets there)."""


@dataclass(frozen=True, slots=True)
class Rule:
    """One check of a flag's value: `ok(value, config)` holds, else the run refuses the value with `fix` (text, or
    text made from the config). A value of None (an optional flag left out) is not checked."""

    ok: Callable[[Any, Any], bool]
    fix: str | Callable[[Any], str]

    def problem(self, value: Any, cfg: Any) -> str | None:
        if self.ok(value, cfg):
            return None
        return self.fix(cfg) if callable(self.fix) else self.fix


def at_least(bound: float, fix: str) -> Rule:
    return Rule(lambda v, _: v >= bound, fix)


def above(bound: float, fix: str) -> Rule:
    return Rule(lambda v, _: v > bound, fix)


FINITE = Rule(lambda v, _: math.isfinite(v), "use a finite number")
"""Checked first for every float flag."""


def coverage_ok(text: str, _: Any) -> bool:
    if text in ("auto", "full"):
        return True
    try:
        return 0 < float(text) <= 1
    except ValueError:
        return False


def power_of_two(scale: float, _: Any) -> bool:
    return math.isfinite(scale) and scale >= 1 and math.frexp(scale)[0] == 0.5


@dataclass(frozen=True, slots=True)
class Forwarded:
    """compare offers the flag and passes its value to every run, with its own help (and default, where compare's
    runs start from another one)."""

    help: str
    default: Any = SAME


@dataclass(frozen=True, slots=True)
class Flag:
    """A run flag's declaration, beside what its field already says (the name, the type, the default)."""

    help: str | Callable[[], str]
    """The run's --help line (a callable where it lists what is registered when the parser is built)."""
    checks: tuple[Rule, ...] = ()
    """RunConfig.validate refuses the first value a rule refuses, in field order."""
    compare: Forwarded | None = None
    """compare offers it and forwards it to every run (None: compare does not)."""
    settings: bool = False
    """An adapter sees it: a field of `dpcompare.Settings` of the same name (run.backend.settings_for)."""
    name: str = ""
    """The option's name where it is not the field's (`opt` for options); a bool whose default is True is
    `--no-NAME`."""
    metavar: str | None = None
    hidden: bool = False
    """Left out of --help (compare's own plumbing)."""
    always: bool = False
    """Every argv that launches a run names it, even at its default (the backend)."""


def run_flag(default: Any = MISSING, *, default_factory: Any = MISSING, **flag: Any) -> Any:
    """A RunConfig field and its flag: `steps: int = run_flag(4, help=..., checks=(...))`."""
    return field(default=default, default_factory=default_factory, metadata={FLAG: Flag(**flag)})


def flag_of(f: Field) -> Flag:
    return f.metadata[FLAG]


def option(f: Field) -> str:
    """The option string of a field's flag: `--global-batch`, `--no-instrument`, `--opt`."""
    flag = flag_of(f)
    name = flag.name or f.name.replace("_", "-")
    return f"--no-{name}" if _default(f) is True else f"--{name}"


def dashed(name: str) -> str:
    """A field's name as its errors spell it: `--timeout-s`."""
    return "--" + name.replace("_", "-")


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def base_type(cls: type, name: str) -> Any:
    """The field's type without `| None`: int, float, str, bool, dict, or a Literal."""
    kind = _hints(cls)[name]
    if get_origin(kind) in (Union, types.UnionType):
        (kind,) = [a for a in get_args(kind) if a is not type(None)]
    return kind


def _default(f: Field) -> Any:
    return f.default_factory() if f.default_factory is not MISSING else f.default


def whole(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None


def number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def _argument(cls: type, f: Field, for_compare: bool) -> dict[str, Any]:
    """add_argument's keywords for the field's flag."""
    flag, kind = flag_of(f), base_type(cls, f.name)
    default = _default(f)
    help_text = flag.help() if callable(flag.help) else flag.help
    if for_compare and flag.compare is not None:
        help_text = flag.compare.help
        default = default if flag.compare.default is SAME else flag.compare.default
    kw: dict[str, Any] = {"dest": f.name, "default": default,
                          "help": argparse.SUPPRESS if flag.hidden else help_text}
    if kind is bool:
        kw["action"] = "store_false" if default is True else "store_true"
    elif kind is dict:
        kw.update(action="append", default=[])
    elif get_origin(kind) is Literal:
        kw["choices"] = get_args(kind)
    elif kind in (int, float):
        kw["type"] = whole if kind is int else number
    if flag.metavar:
        kw["metavar"] = flag.metavar
    return kw


def add_arguments(parser: argparse.ArgumentParser, cls: type, *, for_compare: bool = False,
                  defaults: bool = True) -> None:
    """Add the flag of every field of `cls` to `parser` (for_compare: only those compare forwards, with compare's
    help and defaults). defaults=False: a flag not given is absent from the namespace (what `given` reads). Each
    action remembers its field (`action.run_field`)."""
    for f in fields(cls):
        if for_compare and flag_of(f).compare is None:
            continue
        kw = _argument(cls, f, for_compare)
        if not defaults:
            kw["default"] = argparse.SUPPRESS
        action = parser.add_argument(option(f), **kw)
        action.run_field = f.name


def values(cls: type, ns: argparse.Namespace) -> dict[str, Any]:
    """The config's keyword arguments from a namespace a parser of `add_arguments` filled (fields it lacks left
    out); `--opt KEY=VALUE` items become the options dict, refused (CommandLineError) without a `=`."""
    found: dict[str, Any] = {}
    for f in fields(cls):
        if not hasattr(ns, f.name):
            continue
        value = getattr(ns, f.name)
        found[f.name] = _options(value) if base_type(cls, f.name) is dict else value
    return found


def _options(items: list[str]) -> dict[str, str]:
    options = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise CommandLineError(f"--opt {item!r} is invalid: use KEY=VALUE, e.g. --opt gradient_as_bucket_view=true")
        options[key] = value
    return options


class _Refusing(argparse.ArgumentParser):
    """A parser whose errors are ValueErrors (what the caller turns into its one line), never an exit."""

    def error(self, message: str) -> None:  # noqa: D102
        raise ValueError(message)


def parse(cls: type, argv: Sequence[str], *, defaults: bool = True) -> dict[str, Any]:
    """The config's keyword arguments that `argv` (run flags only) says; defaults=False: only those it gives."""
    parser = _Refusing(prog="dpcompare run", add_help=False)
    add_arguments(parser, cls, defaults=defaults)
    return values(cls, parser.parse_args(list(argv)))


def option_text(value: Any) -> str:
    """A value as its flag takes it: true/false for a bool (as `Option.parse` reads it), repr for a float (which
    float() reads back exactly), else str."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, float) else str(value)


def _words(opt: str, text: str) -> list[str]:
    # A value that starts with '-' would read as an option of its own: keep it in one word with its flag.
    return [f"{opt}={text}"] if text.startswith("-") else [opt, text]


def to_args(cfg: Any, *, leave_out: Collection[str] = ()) -> list[str]:
    """The run flags that make `cfg` when parsed: every field whose value is not its default (and the ones every
    launch names), in field order, `--opt KEY=VALUE` for each option; the fields named in `leave_out` are the
    caller's."""
    default = type(cfg)()
    args: list[str] = []
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if f.name in leave_out or (value == getattr(default, f.name) and not flag_of(f).always):
            continue
        opt = option(f)
        if value is None:
            raise ValueError(f"{dashed(f.name)}: None cannot be given on the command line (its default is "
                             f"{getattr(default, f.name)!r})")
        if isinstance(value, bool):
            args.append(opt)
        elif isinstance(value, dict):
            args += [w for key, v in value.items() for w in _words(opt, f"{key}={option_text(v)}")]
        else:
            args += _words(opt, option_text(value))
    return args


def check(cfg: Any) -> None:
    """Refuse the first value a field's checks refuse (float flags must be finite first), as one line naming the
    flag, the value and the fix."""
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if value is None:
            continue
        rules = flag_of(f).checks
        if base_type(type(cfg), f.name) is float:
            rules = (FINITE, *rules)
        for rule in rules:
            fix = rule.problem(value, cfg)
            if fix is not None:
                raise ValueError(f"{dashed(f.name)}={value!r} is invalid: {fix}")


def forwarded(cls: type) -> tuple[str, ...]:
    """The fields compare offers and forwards to every run."""
    return tuple(f.name for f in fields(cls) if flag_of(f).compare is not None)


def settings_fields(cls: type) -> tuple[str, ...]:
    """The fields an adapter sees in its Settings."""
    return tuple(f.name for f in fields(cls) if flag_of(f).settings)
