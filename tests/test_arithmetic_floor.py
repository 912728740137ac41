"""experiments/arithmetic_floor.py: the checks' arithmetic floor at a batch is printed from its own readings (two
float64 forwards and backwards and one float32, over the float32 step), and bad input is one line with exit status 2."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from conftest import REPO_ROOT

SCRIPT = REPO_ROOT / "experiments" / "arithmetic_floor.py"


@pytest.mark.slow  # an experiment's tool, not the product
def test_the_floor_is_the_float64_and_float32_passes_over_the_step():
    done = subprocess.run([sys.executable, str(SCRIPT), "--batch", "1", "--seq-len", "8", "--repeats", "1"],
                          capture_output=True, text=True, timeout=300, cwd=REPO_ROOT,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-2000:]
    median = re.search(r"median: step (\d+) ms, float32 forward\+backward (\d+) ms, float64 forward\+backward (\d+) ms",
                       done.stdout)
    floor = re.search(r"/ step = ([0-9.]+) steps per checked step", done.stdout)
    over = re.search(r"over 4 checked steps.*= ([0-9.]+) steps per checked step", done.stdout)
    assert median and floor and over, done.stdout
    step, fb32, fb64 = (float(g) for g in median.groups())
    # the printed medians are rounded to the millisecond: the floor is theirs within that rounding
    assert float(floor.group(1)) == pytest.approx((2 * fb64 + fb32) / step, abs=0.02 + 3 * 0.5 / step), done.stdout
    # the first checked step's float64 pass is the oracle's, taken: 7 float64 and 4 float32 passes over 4 steps
    assert float(over.group(1)) == pytest.approx((7 * fb64 + 4 * fb32) / (4 * step), abs=0.02 + 11 * 0.5 / (4 * step))
    assert fb64 > 0 and fb32 > 0


def test_bad_input_is_one_line_and_exit_2():
    done = subprocess.run([sys.executable, str(SCRIPT), "--repeats", "0"], capture_output=True, text=True,
                          timeout=60, cwd=REPO_ROOT)
    assert done.returncode == 2 and "--repeats" in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
