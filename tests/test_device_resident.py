"""The checks compute where the model is: none of them takes a parameter-sized tensor to the host.

A run of the reference backend (one process, 4 checked steps, momentum SGD and AdamW, with and without clipping) is
made with every entry of the verifier (`Verifier.__init__`, `after_reduce`, `after_update`, `finish`) under
tests/host_moves.py's mode, which counts each call that takes a tensor of at least the smallest weight matrix's size to
the host, by the line that made it. The checks may bring figures to the host (a norm, a distance: one number), never
a parameter, a gradient or a state. The mode itself is shown to count such a call (a check that moves the
gradient to the host to compare it).
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import pytest
import torch

from dpcompare import cli
from dpcompare.run import registry, workloads
from dpcompare.verify.phase import verifier

from conftest import without_launcher_vars
from host_moves import HostMoves

ENTRIES = ("__init__", "after_reduce", "after_update", "finish")


def _least(model: str = "mlp") -> int:
    """The smallest weight matrix of the model the run trains: what counts as parameter-sized."""
    workload = registry.load(model, registry.MODELS, "model")(0)
    return min(p.numel() for p in workload.model.parameters() if p.dim() >= 2)


def _watched(monkeypatch, mode: HostMoves) -> None:
    for name in ENTRIES:
        original = getattr(verifier.Verifier, name)

        @functools.wraps(original)
        def entry(*args, _original=original, **kwargs):
            with mode:
                return _original(*args, **kwargs)

        monkeypatch.setattr(verifier.Verifier, name, entry)


def _run(tmp_path: Path, extra: list[str], model: str = "mlp") -> dict:
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(without_launcher_vars(saved))
    try:
        status = cli.main(["--backend", "reference", "--model", model, "--steps", "4", "--measure-steps", "0",
                           "--out", str(tmp_path), *extra])
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert status == 0
    return json.loads(next(tmp_path.glob("*.json")).read_text())


CELLS = {
    "sgd-momentum": ("mlp", ["--optimizer", "sgd"]),
    "adamw-clipped": ("mlp", ["--optimizer", "adamw", "--clip-grad-norm", "0.5"]),
    "dropout-accumulated": ("mlp-dropout", ["--optimizer", "adamw", "--grad-accum", "2"]),
    "batchnorm-bf16-autocast": ("cnn", ["--amp", "bf16"]),
    "lm-bf16-autocast": ("lm", ["--amp", "bf16", "--optimizer", "adamw"]),
    "lm-fp16-scaled": ("lm", ["--amp", "fp16", "--optimizer", "adamw"]),
}


@pytest.mark.parametrize("cell", list(CELLS))
def test_no_check_takes_a_parameter_sized_tensor_to_the_host(tmp_path: Path, monkeypatch, cell: str) -> None:
    model, extra = CELLS[cell]
    mode = HostMoves(_least(model))
    _watched(monkeypatch, mode)
    result = _run(tmp_path, extra, model)
    assert result["equivalence"]["verdict"] == "equivalent", result["equivalence"].get("first_divergence")
    assert len(result["equivalence"]["per_step"]) >= 3  # fp16's scaler may skip a step: it is not checked
    assert not mode.sites, "the checks took parameter-sized tensors to the host:\n" + "\n".join(
        f"  {n} x {site}" for site, n in mode.sites.most_common())


def test_a_check_that_takes_the_gradient_to_the_host_is_counted(tmp_path: Path, monkeypatch) -> None:
    from dpcompare.verify.checks import gradient_check

    judge = gradient_check.Gradient.judge

    def moving(self, ctx, step):  # what a check that compares on the host does
        if step.oracle is not None:
            for name in ctx.names:
                step.oracle.oracle[name].detach().to("cpu")
        return judge(self, ctx, step)

    monkeypatch.setattr(gradient_check.Gradient, "judge", moving)
    mode = HostMoves(_least())
    _watched(monkeypatch, mode)
    _run(tmp_path, ["--optimizer", "sgd"])
    weights = sum(1 for p in workloads.mlp(0).model.parameters() if p.numel() >= _least())
    assert sum(mode.sites.values()) == 4 * weights, mode.sites  # each weight's oracle gradient, at each checked step
