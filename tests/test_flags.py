"""Run flags, each declared once (dpcompare.run.flags): checked against the parsers and the argv built from them.

Every RunConfig field carries one flag declaration and no option is declared twice; the run's parser holds those
flags and nothing hand-written beside them; the fields an adapter sees are exactly `Settings`' fields. compare offers
every flag declared forwardable, from the same declaration, and the value given reaches every run. Any config, typed,
survives `to_args` -> argv -> `from_args` (hypothesis, over configs generated from the declarations), and so does
every `--opt` value an adapter declares. compare's spec is frozen and planning changes nothing in it. Each check is
shown failing on a planted second declaration.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable, Literal, get_args, get_origin

import pytest
from hypothesis import HealthCheck, Phase, find, given, settings
from hypothesis import strategies as st

from dpcompare import Settings, cli
from dpcompare.commands import compare
from dpcompare.commands.compare import plan, questions
from dpcompare.commands.compare import spec as compare_spec
from dpcompare.run import flags, registry
from dpcompare.run.config import RunConfig
from dpcompare.run.flags import run_flag

LAUNCHER_NOISE = {"-h", "--version", "--local_rank"}
"""The run parser's options that are no run setting: help, version, and what the deepspeed launcher appends."""
COMPARE_OWN_MEANING = {"collectives", "out", "timeout_s"}
"""compare's own flags that share a run flag's name and mean something else for compare (its microbenchmark, its
folder, its per-launch limit): never forwarded."""


# -- declared once --------------------------------------------------------------------------------------------
def declaration_problems(cls: type, parser: argparse.ArgumentParser, settings_cls: type = Settings) -> list[str]:
    """What breaks "each run flag is declared once": a field without a flag, an option two fields claim, an
    optional field whose default is not None (to_args could not say it), a run flag the parser holds that no field
    declares (or holds twice), and a field an adapter sees that `Settings` lacks (or the reverse)."""
    problems = []
    claimed: dict[str, str] = {}
    for f in fields(cls):
        if flags.FLAG not in f.metadata:
            problems.append(f"{f.name}: no flag declared")
            continue
        opt = flags.option(f)
        if opt in claimed:
            problems.append(f"{opt} declared by {claimed[opt]} and {f.name}")
        claimed[opt] = f.name
        if "None" in str(f.type) and f.default is not None:
            problems.append(f"{f.name}: optional with default {f.default!r}")
    by_field: dict[str, int] = {}
    for action in parser._actions:
        name = getattr(action, "run_field", None)
        if name is not None:
            by_field[name] = by_field.get(name, 0) + 1
        elif not set(action.option_strings) & LAUNCHER_NOISE:
            problems.append(f"{'/'.join(action.option_strings)} (dest {action.dest}) is declared by hand")
    problems += [f"{name}: {n} parser flags" for name, n in by_field.items() if n != 1]
    problems += [f"{f.name}: not in the parser" for f in fields(cls) if flags.FLAG in f.metadata
                 and f.name not in by_field]
    seen = {f.name for f in fields(cls) if flags.FLAG in f.metadata and flags.flag_of(f).settings}
    declared = {f.name for f in fields(settings_cls)}
    problems += [f"{name}: marked settings=True, not a Settings field" for name in sorted(seen - declared)]
    problems += [f"Settings.{name}: no run flag marked settings=True" for name in sorted(declared - seen)]
    return problems


def test_every_run_flag_is_declared_once():
    assert declaration_problems(RunConfig, cli.parser_for("run")) == []
    # What settings_for hands an adapter comes from the declaration: one Settings field per settings=True flag.
    assert set(RunConfig().settings_values()) == {f.name for f in fields(Settings)}


@dataclass(kw_only=True)
class _Planted:
    steps: int = run_flag(4, help="verification steps")
    verify_steps: int = run_flag(4, help="verification steps, again", name="steps")  # a second --steps
    seed: int = 1234  # a field with no flag
    bucket_mb: float | None = run_flag(None, help="bucket", settings=True)


def test_the_declared_once_check_fails_on_a_planted_second_declaration():
    # A second field claiming --steps, a field with no flag, a Settings field no flag feeds.
    planted = declaration_problems(_Planted, argparse.ArgumentParser(), Settings)
    assert "--steps declared by steps and verify_steps" in planted and "seed: no flag declared" in planted
    # The run's parser with one flag declared again by hand (as cli.py and compare declared them before).
    parser = cli.parser_for("run")
    parser.add_argument("--warmup", dest="warmup_steps", type=int, default=3)
    assert declaration_problems(RunConfig, parser) == ["--warmup (dest warmup_steps) is declared by hand"]
    # A flag an adapter is said to see that Settings does not have.
    extra = dataclasses.make_dataclass("Extra", [("sync_bn", bool, run_flag(False, help="bn", settings=True))],
                                       bases=(RunConfig,), kw_only=True)
    planted = declaration_problems(extra, argparse.ArgumentParser())
    assert "sync_bn: marked settings=True, not a Settings field" in planted


# -- compare offers every forwardable flag --------------------------------------------------------------------
def forwarding_problems(parser: argparse.ArgumentParser) -> list[str]:
    """What breaks "compare offers every forwardable flag from its declaration": a forwarded field without its
    generated flag, and a run flag compare declares by hand (a second declaration, with its own type and default)."""
    run_options = {flags.option(f): f.name for f in fields(RunConfig)}
    generated = [a.run_field for a in parser._actions if hasattr(a, "run_field")]
    problems = [f"{name}: not offered" for name in flags.forwarded(RunConfig) if generated.count(name) != 1]
    for action in parser._actions:
        if hasattr(action, "run_field"):
            continue
        names = {run_options.get(o) for o in action.option_strings} | {action.dest}
        hand = names & set(run_options.values()) - COMPARE_OWN_MEANING
        problems += [f"{name}: declared by hand in compare" for name in sorted(hand)]
    return problems


def _compare_parser(conflict_handler: str = "error") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(conflict_handler=conflict_handler)
    compare.add_arguments(parser)
    return parser


def _sample(f: dataclasses.Field, default: Any) -> Any:
    """A value of the field other than compare's default that the run accepts."""
    kind = flags.base_type(RunConfig, f.name)
    if kind is bool:
        return not default
    if get_origin(kind) is Literal:
        return next(c for c in get_args(kind) if c != default)
    if kind is str:
        return {"model": "cnn", "check_coverage": "0.5", "optimizer": "adamw",  # a new forwarded text flag: add a value
                "scheduler": "tests.optim_workloads:warmup_cosine"}[f.name]  # it takes
    return (default or 0) + (3 if kind is int else 0.5)


def test_compare_offers_every_forwardable_flag_and_every_run_gets_its_value(tmp_path, monkeypatch):
    parser = _compare_parser()
    assert forwarding_problems(parser) == []
    monkeypatch.setattr(registry, "availability", lambda b: (True, ""))
    for name in flags.forwarded(RunConfig):
        f = next(f for f in fields(RunConfig) if f.name == name)
        default = parser.get_default(name)
        value = _sample(f, default)
        words = [flags.option(f)] if isinstance(value, bool) else [flags.option(f), flags.option_text(value)]
        if name == "seq_len":
            words += ["--model", "hf:somewhere"]  # the run takes --seq-len for an hf: model only
        spec = compare_spec.parse(parser.parse_args([*words, "--backends", "reference", "--collectives", "none"]))
        (job,) = plan.plan(spec, tmp_path).jobs
        run = RunConfig.from_args(job.command[job.command.index("--backend"):])
        assert getattr(run, name) == value, (name, job.command)


def test_the_forwarding_check_fails_on_a_flag_compare_declares_again_by_hand():
    parser = _compare_parser("resolve")
    parser.add_argument("--steps", type=int, default=2, help="verification steps")  # replaces the generated one
    assert forwarding_problems(parser) == ["steps: not offered", "steps: declared by hand in compare"]


# -- from_args(to_args(cfg)) == cfg -----------------------------------------------------------------------------
def _values(kind: Any) -> st.SearchStrategy:
    if kind is bool:
        return st.booleans()
    if get_origin(kind) is Literal:
        return st.sampled_from(get_args(kind))
    if kind is int:
        return st.integers(min_value=-2**40, max_value=2**40)
    if kind is float:
        return st.floats(allow_nan=False)
    if kind is dict:  # --opt KEY=VALUE, as the command line holds them: text
        return st.dictionaries(st.text(min_size=1).filter(lambda k: "=" not in k), st.text(), max_size=4)
    return st.text()


def configs() -> st.SearchStrategy[RunConfig]:
    """Any RunConfig its declarations allow, each field at its default or any value of its type (not validated: the
    round trip must hold for what the run then refuses too)."""
    parts = {}
    default = RunConfig()
    for f in fields(RunConfig):
        # Its default too: the value to_args leaves out, which the parser must then supply.
        parts[f.name] = st.one_of(st.just(getattr(default, f.name)), _values(flags.base_type(RunConfig, f.name)))
        if f.default is None:
            parts[f.name] = st.one_of(st.none(), parts[f.name])
    return st.builds(lambda **kw: RunConfig(**kw), **parts)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs())
def test_any_config_survives_to_args_and_back(cfg):
    assert RunConfig.from_args(cfg.to_args()) == cfg


def _adapter_options() -> list[tuple[str, Any]]:
    return [(f"{name}.{o.name}", o) for name in registry.BACKENDS
            for o in registry.load(name, registry.BACKENDS, "backend").OPTIONS]


@pytest.mark.parametrize(("where", "option"), _adapter_options(), ids=lambda x: x if isinstance(x, str) else "")
def test_every_declared_opt_value_survives_typed_to_argv_to_parsed(where, option):
    values = st.sampled_from(option.choices) if option.choices else _values(option.type)

    @settings(max_examples=40, deadline=None)
    @given(values)
    def survives(value):
        cfg = RunConfig(options={option.name: value})
        assert option.parse(RunConfig.from_args(cfg.to_args()).options[option.name]) == value

    survives()


def _read_with(parser: argparse.ArgumentParser) -> Callable[[list[str]], RunConfig]:
    return lambda argv: RunConfig(**flags.values(RunConfig, parser.parse_args(argv)))


def test_the_round_trip_fails_on_a_planted_second_declaration():
    # --steps declared a second time by hand, with compare's old default: an argv that leaves --steps out (the run's
    # default) now means 2 steps, and hypothesis finds a config that does not come back.
    planted = argparse.ArgumentParser(conflict_handler="resolve")
    flags.add_arguments(planted, RunConfig)
    planted.add_argument("--steps", type=int, default=2)
    lost = find(configs(), lambda c: _read_with(planted)(c.to_args()) != c,
                settings=settings(deadline=None, phases=[Phase.generate]))  # any counterexample: no need to shrink it
    assert _read_with(planted)(lost.to_args()).steps != lost.steps


# -- compare parses once, into a frozen spec --------------------------------------------------------------------
def _unchanged_by(planner: Callable[[compare_spec.CompareSpec, Path], Any], argv: list[str], tmp_path: Path) -> bool:
    ns = _compare_parser().parse_args(argv)
    before_ns = dict(vars(ns))
    spec = compare_spec.parse(ns)
    assert vars(ns) == before_ns  # the preset is read, never set on the namespace
    before = copy.deepcopy(spec)
    planner(spec, tmp_path)
    return spec == before


def test_compare_parses_once_into_a_frozen_spec_that_planning_leaves_alone(tmp_path, monkeypatch):
    monkeypatch.setattr(registry, "availability", lambda b: (True, ""))
    spec = compare_spec.parse(_compare_parser().parse_args(["--suite", "sharding"]))
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.global_batch = 24  # type: ignore[misc]
    for argv in (["--suite", "sharding", "--sweep"], ["--backends", "ddp", "--scaling", "weak"]):
        assert _unchanged_by(plan.plan, [*argv, "--collectives", "none"], tmp_path), argv
    assert _unchanged_by(questions.plan, ["--suite", "questions"], tmp_path)

    # Twin: a planner that writes back into the template (as plan.py rewrote ns.global_batch) is caught.
    def rewriting(spec: compare_spec.CompareSpec, run_dir: Path) -> None:
        spec.run.global_batch = 4096

    assert not _unchanged_by(rewriting, ["--backends", "ddp"], tmp_path)
