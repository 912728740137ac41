"""The tiers (tests/conftest.py): a breadth test listed in tests/deep_tier.txt runs in the deep tier, not in CI's
breadth tier; a default-tier test listed in tests/slow_tier.txt runs in the breadth tier, not in the default one; and a
list that names a test no longer there is refused."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from conftest import REPO_ROOT, deep_listed, pytest_collection_modifyitems, slow_listed

MOVED = "tests/test_robust.py::test_fifty_consecutive_runs_all_exit_under_torchrun"


def _collected(*args: str) -> set[str]:
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=120).stdout
    return {line.strip() for line in out.splitlines() if "::" in line}


@pytest.mark.slow  # two collections (16 s); CI's breadth tier runs it
def test_a_listed_breadth_test_runs_in_the_deep_tier_and_not_in_the_breadth_tier():
    assert MOVED in deep_listed()
    slow, deep = _collected("-m", "slow", "tests/test_robust.py"), _collected("-m", "deep", "tests/test_robust.py")
    assert MOVED not in slow and MOVED in deep
    assert slow and not slow & deep  # the file keeps breadth tests in CI's tier, none in both


def test_a_list_naming_a_test_that_is_not_there_is_refused():
    config = SimpleNamespace(args=["tests"], getoption=lambda name: "slow")
    with pytest.raises(pytest.UsageError, match="slow_tier.txt lists tests that do not exist"):
        pytest_collection_modifyitems(config, [])
    config.args = ["tests/test_robust.py"]  # a partial collection cannot tell: no error
    pytest_collection_modifyitems(config, [])


DEMOTED = "tests/test_minimal_backend.py::test_the_summing_twin_is_different_at_step_0"


@pytest.mark.slow  # two collections (9 s); CI's breadth tier runs it
def test_a_listed_default_test_runs_in_the_breadth_tier_and_not_in_the_default_tier():
    assert DEMOTED in slow_listed()
    default, slow = _collected("tests/test_minimal_backend.py"), _collected("-m", "slow", "tests/test_minimal_backend.py")
    assert DEMOTED not in default and DEMOTED in slow
    assert default  # the file keeps its other tests in the default tier
