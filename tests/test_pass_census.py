"""experiments/pass_census.py: the checks' memory traffic, op by op, in passes over the model."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import pytest
import torch

from conftest import REPO_ROOT
from experiments import pass_census

SCRIPT = REPO_ROOT / "experiments" / "pass_census.py"


def _totals() -> dict:
    return {"moved": Counter(), "compute": Counter(), "sites": Counter(), "ops": Counter()}


def test_an_op_counts_what_it_reads_and_writes_and_a_view_nothing():
    a, b = torch.ones(1000, dtype=torch.float64), torch.ones(1000, dtype=torch.float32)
    totals = _totals()
    with pass_census.Passes("part", totals):
        c = a + b  # reads 8000 + 4000 bytes, writes 8000
        c.view(10, 100).t()  # a view moves nothing
        c[torch.tensor([1, 2, 3])]  # picks 3 float64s with 3 int64s
    assert totals["moved"]["part"] == 20000 + 2 * 3 * 8 + 3 * 8, totals["moved"]
    assert totals["ops"]["part"] == 2, totals["ops"]  # the add and the index; the view and the lift are not


def test_an_op_that_writes_its_arguments_in_place_counts_them_written_once_whatever_it_returns():
    a, b = torch.ones(1000, dtype=torch.float64), torch.ones(1000, dtype=torch.float64)
    p, g, m = (torch.ones(100, dtype=torch.float64) for _ in range(3))
    totals = _totals()
    with pass_census.Passes("add_", totals):
        a.add_(b)  # returns a: read a and b, write a
    with pass_census.Passes("foreach", totals):
        torch._foreach_add_([a], [b])  # returns nothing: the same bytes
    with pass_census.Passes("fused", totals):
        torch._fused_sgd_([p], [g], [m], weight_decay=0.0, momentum=0.9, lr=0.1, dampening=0.0, nesterov=False,
                          maximize=False, is_first_step=False)  # reads p, g, m; its schema writes all three
    assert totals["moved"]["add_"] == totals["moved"]["foreach"] == 3 * a.nbytes, totals["moved"]
    assert totals["moved"]["fused"] == 6 * p.nbytes, totals["moved"]


def test_a_matrix_product_is_counted_apart_from_the_passes():
    a = torch.ones(64, 64)
    totals = _totals()
    with pass_census.Passes("part", totals):
        a @ a
    assert totals["moved"]["part"] == 0 and totals["compute"]["part"] == 3 * a.nbytes


@pytest.mark.slow  # an experiment's tool, not the product
def test_a_run_under_the_census_prints_each_part_in_passes_and_writes_them(tmp_path):
    out = tmp_path / "census.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--backend", "reference", "--model", "mlp", "--steps", "2",
                           "--measure-steps", "1", "--out", str(tmp_path / "runs"), "--census-json", str(out)],
                          check=False, capture_output=True, text=True, timeout=180, cwd=REPO_ROOT,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO_ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(out.read_text())
    assert figures["checked_steps"] == 2 and figures["parameters"] > 0
    for part in ("oracle", "gradient", "update", "trajectory"):
        assert figures["passes"]["moved"][part] > 1, (part, figures["passes"])  # at least a read of its inputs
    assert "all parts" in done.stderr and "by site" in done.stderr
