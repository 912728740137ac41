"""The tiers (tests/conftest.py): a breadth test listed in tests/deep_tier.txt runs in the deep tier, not in CI's
breadth tier, and a list that names a test no longer there is refused."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from conftest import REPO_ROOT, deep_listed, pytest_collection_modifyitems

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
    with pytest.raises(pytest.UsageError, match="deep_tier.txt lists tests that do not exist"):
        pytest_collection_modifyitems(config, [])
    config.args = ["tests/test_robust.py"]  # a partial collection cannot tell: no error
    pytest_collection_modifyitems(config, [])
