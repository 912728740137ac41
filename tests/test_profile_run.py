"""experiments/profile_run.py: a run profiled in-process writes its profile (a rank otherwise leaves by os._exit)."""

from __future__ import annotations

import pstats
import subprocess
import sys

import pytest

from conftest import REPO_ROOT

SCRIPT = REPO_ROOT / "experiments" / "profile_run.py"


@pytest.mark.slow  # an experiment's tool, not the product
def test_the_profile_is_written_with_the_checks_in_it_and_the_run_result_beside(tmp_path):
    out = tmp_path / "run.prof"
    done = subprocess.run([sys.executable, str(SCRIPT), str(out), "--top", "5", "--only", "dpcompare/verify", "--",
                           "--backend", "reference", "--model", "mlp", "--steps", "1", "--measure-steps", "1",
                           "--out", str(tmp_path / "runs")], capture_output=True, text=True, timeout=180,
                          cwd=tmp_path, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-2000:]
    functions = {f"{path}:{name}" for path, _, name in pstats.Stats(str(out)).stats}
    assert any("dpcompare/verify/phase/verifier.py" in f for f in functions), sorted(functions)[:20]
    assert len(list((tmp_path / "runs").glob("*.json"))) == 1  # the run itself wrote its result


def test_without_the_runs_arguments_it_says_how_in_one_line(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "x.prof")], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "after '--'" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "x.prof").exists()
