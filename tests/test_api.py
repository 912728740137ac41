"""The surface a newcomer and a plugin author touch: the public API, the version, the top-level help, and the
defaults a run takes at any world size.

Checks `from dpcompare import ...` against `dpcompare.__all__` (every name there resolves, nothing else is
invented, and importing the package alone loads no torch); the version against the installed metadata and
`--version`; the top-level `--help` against the subcommands; every option's help against its default; and the
global batch a run picks without `--global-batch` against its world size and `--grad-accum`, with the run's line
saying what it chose and when costs were not measured. Negative twins: an unknown name is an AttributeError, an
explicit global batch the world size does not divide is still refused.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import subprocess
import sys

import pytest

import dpcompare
from dpcompare import cli
from dpcompare.run.config import RUN_GLOBAL_BATCH_TARGET, RunConfig, default_global_batch
from dpcompare.run.trainer import summary_line

PUBLIC = {"Workload", "shard", "block_modules", "from_dataset", "checkpoint_blocks", "Adapter", "Capabilities", "Option", "Settings", "Note", "Wrapped", "ModelFacts",
          "CommCounter", "CommCounts", "CounterWindow", "ScalerState", "LaunchEnv", "ProcessGroupMixin", "DIST_BACKEND", "RunConfig",
          "ensure_rendezvous", "AMP_DTYPES", "AMP_NAMES", "GlobalBatchNorm", "convert_global_batchnorm", "has_batchnorm",
          "__version__", "SCHEMA_VERSION"}


def test_the_public_names_are_exported_and_resolve():
    assert set(dpcompare.__all__) == PUBLIC
    for name in dpcompare.__all__:
        assert getattr(dpcompare, name) is not None, name
    from dpcompare import Adapter, Option, Workload  # the issue's own line
    from dpcompare.contract import Adapter as contract_adapter

    assert Adapter is contract_adapter and Workload.__name__ == "Workload" and Option.__name__ == "Option"


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'Trainer'"):
        dpcompare.Trainer  # noqa: B018
    with pytest.raises(ImportError):
        from dpcompare import Trainer  # noqa: F401


def test_importing_the_package_loads_no_torch():
    code = "import sys, dpcompare; assert 'torch' not in sys.modules; dpcompare.Workload; assert 'torch' in sys.modules"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_the_version_has_one_source():
    assert importlib.metadata.version("dpcompare") == dpcompare.__version__


def test_version_and_top_level_help(capsys):
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"dpcompare {dpcompare.__version__}"
    assert cli.main(["--help"]) == 0
    text = capsys.readouterr().out
    for command in cli.SUBCOMMANDS:
        assert f"\n  {command} " in text, command
    assert cli.main([]) == 0 and capsys.readouterr().out == text


@pytest.mark.parametrize("command", cli.SUBCOMMANDS)
def test_every_option_shows_its_default(command):
    parser = cli.parser_for(command)
    text = parser.format_help()
    for action in parser._actions:
        if (not action.option_strings or action.help == argparse.SUPPRESS or action.default in (None, [], False)
                or isinstance(action, (argparse._HelpAction, argparse._VersionAction, argparse._StoreConstAction))):
            continue  # -h, --version, on/off switches and options without a default
        shown = parser._get_formatter()._get_help_string(action) or ""
        assert "default" in shown, f"{command} {action.option_strings[0]}: {shown!r}"
    if command == "run":
        assert "(default: 10)" in " ".join(text.split())  # --measure-steps


@pytest.mark.parametrize(("world_size", "grad_accum", "expected"), [
    (1, 1, 24), (2, 1, 24), (3, 1, 24), (5, 1, 25), (8, 1, 24), (16, 1, 32), (16, 4, 64), (64, 1, 64), (2, 5, 30)])
def test_without_a_global_batch_the_run_picks_one_its_world_size_divides(world_size, grad_accum, expected):
    assert default_global_batch(world_size * grad_accum) == expected
    cfg = RunConfig(grad_accum=grad_accum)
    cfg.validate()
    global_batch, local_batch = cfg.batch_sizes(world_size)
    assert (global_batch, local_batch) == (expected, expected // world_size)
    assert local_batch % grad_accum == 0 and global_batch >= RUN_GLOBAL_BATCH_TARGET


def test_a_global_batch_given_is_taken_as_given_or_refused():
    with pytest.raises(ValueError, match="--global-batch=24 is not divisible by world size 16"):
        RunConfig(global_batch=24).batch_sizes(16)
    assert RunConfig(global_batch=48).batch_sizes(16) == (48, 3)


def _payload(global_batch_given: int | None, measure_steps: int) -> dict:
    e = {"verdict": "equivalent", "checked_steps": [0], "max_rel_fro_err": 2e-7, "noise_ratio": 1.0,
         "noise_floor_rel_fro": 2e-7, "checks": {}, "tolerance": {}, "first_divergence": None,
         "unverifiable_reason": None, "replicas_identical": True}
    metrics = {"step_ms_p50": 2.0, "samples_per_s": 16000.0} if measure_steps else None
    return {"backend": "ddp", "world_size": 16, "model": "mlp", "launcher": "torchrun", "global_batch": 32,
            "equivalence": e, "metrics": metrics, "result_path": "r.json",
            "config": {"global_batch": global_batch_given, "scaling": "strong", "measure_steps": measure_steps}}


def test_the_runs_line_says_what_it_chose_and_what_it_did_not_measure():
    line = summary_line(_payload(None, 10))
    assert "global batch 32 chosen for 16 rank(s)" in line and "step p50 2.0 ms" in line
    assert "not measured" not in line
    line = summary_line(_payload(32, 0))
    assert "chosen" not in line
    assert "costs not measured (--measure-steps 0): add --measure-steps 20" in line


@pytest.mark.parametrize("old", ["dpcompare.workloads", "dpcompare.process_group", "dpcompare.config",
                                 "dpcompare.launch", "dpcompare.contract.adapter.LaunchEnv"])
def test_the_paths_deprecated_in_0_2_are_gone(old):
    """0.3 retired the forwarders of 0.1's module paths (CHANGELOG): the names are imported from dpcompare."""
    with pytest.raises(ImportError):
        importlib.import_module(old)
    assert dpcompare.LaunchEnv.__name__ == "LaunchEnv" and dpcompare.Workload.__name__ == "Workload"
