"""The package installs from its wheel, outside the checkout: every package under dpcompare/ (found, not listed)
and adapters/ as dpcompare.adapters are in it, and every subcommand starts from it. The wheel is built from the sdist,
as `python -m build` does.

Both are built without isolation (setuptools is in the environment); the wheel is installed with `pip --target` into a
temporary directory, which goes first on PYTHONPATH; the environment's torch and the other dependencies are reused.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from dpcompare import cli

REPO = Path(__file__).resolve().parents[1]


def _packages_in_the_tree() -> set[str]:
    found = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "dpcompare").rglob("__init__.py")}
    return found | {"dpcompare.adapters"} if (REPO / "adapters" / "__init__.py").exists() else found


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path]:
    """The wheel built as `python -m build` builds it: an sdist first (setuptools' PEP 517 backend), the wheel from
    the sdist unpacked elsewhere (so nothing left in the checkout's build/ can ship), installed with --target."""
    out = tmp_path_factory.mktemp("dist")
    code = f"from setuptools import build_meta; print(build_meta.build_sdist({str(out)!r}))"
    made = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=240)
    assert made.returncode == 0, made.stderr[-3000:]
    with tarfile.open(out / made.stdout.strip().splitlines()[-1]) as tar:
        tar.extractall(out / "unpacked", filter="data")
    (source,) = (out / "unpacked").iterdir()
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(source)], check=True, capture_output=True, text=True, timeout=240)
    (wheel,) = out.glob("dpcompare-*.whl")
    target = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, text=True, timeout=240)
    return wheel, target


def _shipped(wheel: Path) -> tuple[set[str], list[str]]:
    names = zipfile.ZipFile(wheel).namelist()
    return {name.rsplit("/", 1)[0].replace("/", ".") for name in names if name.endswith("/__init__.py")}, names


def test_the_wheel_holds_every_package_of_the_tree(installed) -> None:
    wheel, _ = installed
    shipped, names = _shipped(wheel)
    assert shipped == _packages_in_the_tree(), (sorted(_packages_in_the_tree() - shipped), sorted(shipped))
    assert "dpcompare/schema/result.schema.json" in names and "dpcompare/py.typed" in names


def test_the_wheel_holds_every_module_of_the_tree_and_nothing_else(installed) -> None:
    """Module for module: what git tracks under dpcompare/ and adapters/ (as dpcompare/adapters/)."""
    wheel, _ = installed
    tracked = subprocess.run(["git", "ls-files", "dpcompare", "adapters"], cwd=REPO, capture_output=True, text=True,
                             timeout=60)
    if tracked.returncode != 0:
        pytest.skip("not a git checkout: " + tracked.stderr.strip())
    in_tree = {("dpcompare/" + f) if f.startswith("adapters/") else f for f in tracked.stdout.split() if f.endswith(".py")}
    in_wheel = {n for n in _shipped(wheel)[1] if n.endswith(".py")}
    assert in_wheel == in_tree, (sorted(in_tree - in_wheel), sorted(in_wheel - in_tree))


def test_the_tree_check_can_fail_on_a_package_left_out(installed) -> None:
    wheel, _ = installed
    shipped = {n.rsplit("/", 1)[0].replace("/", ".") for n in zipfile.ZipFile(wheel).namelist()
               if n.endswith("/__init__.py") and not n.startswith("dpcompare/commands/project/")}
    assert shipped != _packages_in_the_tree()


@pytest.mark.slow  # the wheel's modules are checked in the default tier; starting each subcommand is breadth
def test_every_subcommand_starts_from_the_installed_wheel(installed, tmp_path) -> None:
    _, target = installed
    env = dict(os.environ, PYTHONPATH=str(target), OMP_NUM_THREADS="1")
    where = subprocess.run([sys.executable, "-c", "import dpcompare; print(dpcompare.__file__)"], cwd=tmp_path,
                           env=env, capture_output=True, text=True, timeout=120)
    assert where.stdout.strip().startswith(str(target)), where.stdout + where.stderr
    for command in cli.SUBCOMMANDS:
        proc = subprocess.run([sys.executable, "-m", "dpcompare", command, "--help"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and "usage: dpcompare" in proc.stdout, (command, proc.stderr[-2000:])
    run = subprocess.run([sys.executable, "-m", "dpcompare", "--backend", "reference", "--steps", "1",
                          "--measure-steps", "0", "--out", str(tmp_path / "results")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "reference ws=1 mlp [python]: equivalent" in run.stdout, run.stdout + run.stderr
