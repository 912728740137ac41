"""The layers docs/ARCHITECTURE.md draws are import-linter contracts (pyproject.toml [tool.importlinter]): the
tree keeps them, and each contract fails on a planted import that breaks it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")
CONTRACTS = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def _lint(root: Path, *contracts: str) -> subprocess.CompletedProcess:
    if not LINT.exists():
        pytest.fail(f"{LINT} is missing: import-linter is a test dependency (pip install '.[test]')")
    # cwd first on sys.path: the tree under `root` is the one analysed, not the installed package.
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([str(LINT), "--no-cache", *(a for c in contracts for a in ("--contract", c))], cwd=root, env=env, capture_output=True, text=True, timeout=120)


def test_the_tree_keeps_every_import_contract():
    proc = _lint(REPO)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert f"Contracts: {len(CONTRACTS)} kept, 0 broken." in out, out[-2000:]


def test_the_adapters_are_forbidden_every_internal_package():
    """The adapters' contract names every module of dpcompare but the package itself: a new subpackage cannot
    slip past it."""
    (contract,) = [c for c in CONTRACTS if c["type"] == "forbidden" and c["source_modules"] == ["adapters"]]
    children = {f"dpcompare.{p.stem}" for p in (REPO / "dpcompare").iterdir()
                if (p.suffix == ".py" and p.stem not in ("__init__", "__main__")) or (p / "__init__.py").exists()}
    assert children <= set(contract["forbidden_modules"]), children - set(contract["forbidden_modules"])


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of the sources and the contracts, to plant imports in."""
    for name in ("dpcompare", "adapters"):
        shutil.copytree(REPO / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


PLANTS = {
    # the verify layer reaching up into the run layer
    "layers": ("dpcompare/verify/judgement/tolerance.py", "from dpcompare.run import config as _planted\n"),
    # a lazy import inside a function counts too: the contract reaching into verify
    "layers-lazy": ("dpcompare/contract/optim_state.py", "def _planted():\n    from dpcompare.verify.phase import verifier\n"),
    # an adapter on an internal module instead of the public API
    "adapters": ("adapters/dp.py", "from dpcompare.contract.adapter import Adapter as _Planted\n"),
    # inside verify: the judgement (the bottom) reaching up to the verifier (the top), and two siblings
    "verify": ("dpcompare/verify/judgement/verdict.py", "def _planted():\n    from dpcompare.verify.phase import verifier\n"),
    "verify-siblings": ("dpcompare/verify/diagnosis/explanation.py",
                        "def _planted():\n    from dpcompare.verify.trajectory import reference_trajectory\n"),
    # two run modules importing each other (a cycle inside one layer)
    "acyclic": ("dpcompare/run/optim.py", "def _planted():\n    from dpcompare.run import trainer\n"),
}


@pytest.mark.parametrize("name", list(PLANTS))
def test_a_planted_import_breaks_its_contract(tree, name):
    path, line = PLANTS[name]
    with open(tree / path, "a") as f:
        f.write("\n" + line)
    contract = name.split("-")[0]
    proc = _lint(tree, contract)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "Contracts: 0 kept, 1 broken." in out, out[-3000:]
    assert Path(path).stem in out, out[-3000:]
