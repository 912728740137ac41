"""The state table: what each backend holds for the model's state, read from its live objects after the first step
(dpcompare.run.state_table), recorded in the result's `state` and laid side by side by compare."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpcompare.commands.compare import compare_output as render
from dpcompare.commands.compare.plan import Job
from dpcompare.result_view import STATE_COMPONENTS, RunResult
from dpcompare.run import state_table

QUICK = ["--steps", "2", "--measure-steps", "0", "--optimizer", "adamw"]


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def test_the_forward_is_read_as_the_module_holds_it_after_the_backends_own_pre_forward_hooks():
    """A backend that swaps a module's parameters in before its forward (FSDP gathers them; here a 16-bit copy) is
    read as the forward used them, not as they were built; the recorder holds no tensor and leaves no hook."""
    model = _mlp()
    first = model[0]
    kept = first.weight

    def gather(module, args):  # registered first, as a backend wraps before dpcompare reads
        module._parameters["weight"] = nn.Parameter(kept.detach().to(torch.bfloat16))

    first.register_forward_pre_hook(gather)
    recorder = state_table.ForwardDtypes(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randn(3, 4))
    seen = recorder.close()
    assert seen["dtypes"] == {"bfloat16": 32, "float32": 8 + 16 + 2}
    assert seen["autocast"] == ["bfloat16"] and seen["tensors"] == 4
    assert all(not m._forward_pre_hooks or m is first for m in model.modules())
    assert len(first._forward_pre_hooks) == 1  # the backend's own stays
    # the negative: read without the swap, the same module is float32 throughout
    plain = _mlp()
    recorder = state_table.ForwardDtypes(plain)
    plain(torch.randn(3, 4))
    assert recorder.close()["dtypes"] == {"float32": 32 + 8 + 16 + 2}


def test_a_reference_run_records_what_its_optimizer_and_gradients_hold(launch):
    proc, result = launch("reference", 1, "mlp", QUICK, launcher="python")
    assert proc.returncode == 0, proc.stderr[-2000:]
    mine = result["state"]["per_rank"][0]
    elements = result["model_info"]["parameters"]
    assert mine["forward"]["dtypes"] == {"float32": elements} and mine["forward"]["autocast"] == []
    assert mine["masters"]["dtypes"] == {"float32": elements}
    assert mine["grads"]["dtypes"] == {"float32": elements}
    assert set(mine["optimizer"]) == {"exp_avg", "exp_avg_sq"}
    assert all(e["dtypes"] == {"float32": elements} for e in mine["optimizer"].values())
    assert mine["wire"] is None and mine["loss_scale"] is None
    cells = RunResult(result).state_cells
    assert cells["masters"] == "float32, cpu" and cells["wire"] == "float32 (as held)"


@pytest.mark.slow  # breadth: the default tier keeps this capability's other test
@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_under_bf16_deepspeeds_engine_keeps_fp32_masters_apart_and_reduces_in_bf16_where_ddp_autocasts(launch):
    """--amp bf16 over two ranks: DDP runs its float32 parameters under autocast and reduces float32 gradients; ZeRO-2
    under DeepSpeed's own bf16 engine runs bfloat16 parameters, reduces and holds bfloat16 gradients, and steps its
    float32 masters, each rank its half (read from the engine: its partitions and its communication_data_type)."""
    ddp_proc, ddp = launch("ddp", 2, "mlp", [*QUICK, "--amp", "bf16"])
    ds_proc, ds = launch("deepspeed", 2, "mlp", [*QUICK, "--amp", "bf16", "--opt", "zero_stage=2",
                                                 "--opt", "amp_recipe=engine"])
    assert ddp_proc.returncode == 0 and ds_proc.returncode == 0, (ddp_proc.stderr[-2000:], ds_proc.stderr[-2000:])
    elements = ddp["model_info"]["parameters"]
    ddp0, ds0 = ddp["state"]["per_rank"][0], ds["state"]["per_rank"][0]
    assert ddp0["forward"]["dtypes"] == {"float32": elements} and ddp0["forward"]["autocast"] == ["bfloat16"]
    assert ddp0["forward"]["tensors"] == ds0["forward"]["tensors"] == ddp0["masters"]["tensors"]
    assert ddp0["grads"]["dtypes"] == {"float32": elements} and ddp0["wire"] is None
    assert ds0["forward"]["dtypes"] == {"bfloat16": elements} and ds0["forward"]["autocast"] == []
    assert ds0["wire"] == "bfloat16"
    halves = [sum(r["masters"]["dtypes"].values()) for r in ds["state"]["per_rank"]]
    assert sum(halves) >= elements and max(halves) < elements  # each rank its partition of the fp32 masters
    assert all(set(r["masters"]["dtypes"]) == {"float32"} for r in ds["state"]["per_rank"])
    assert set(ds0["grads"]["dtypes"]) == {"bfloat16"}
    cells = {"ddp": RunResult(ddp).state_cells, "zero2": RunResult(ds).state_cells}
    assert cells["zero2"]["masters"] == "float32, cpu, sharded" and cells["ddp"]["masters"] == "float32, cpu"
    assert cells["ddp"]["forward"] == "float32 (autocast bfloat16), cpu"


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_under_bf16_fsdp_and_zero3_shard_fp32_masters_and_zero3_alone_reduces_in_bf16(launch):
    """--amp bf16 over two ranks, the autocast recipe: FSDP2 and ZeRO-3 each hold a part of the float32 masters and of
    the float32 gradients on each rank; ZeRO-3 sends them in bfloat16 (its communication_data_type), FSDP as held. Each
    difference from the other is tied to the note that explains it."""
    fsdp_proc, fsdp = launch("fsdp", 2, "mlp", [*QUICK, "--amp", "bf16"])
    z3_proc, z3 = launch("deepspeed", 2, "mlp", [*QUICK, "--amp", "bf16", "--opt", "zero_stage=3"])
    assert fsdp_proc.returncode == 0 and z3_proc.returncode == 0, (fsdp_proc.stderr[-2000:], z3_proc.stderr[-2000:])
    elements = fsdp["model_info"]["parameters"]
    for result in (fsdp, z3):
        ranks = result["state"]["per_rank"]
        parts = [sum(r["masters"]["dtypes"].values()) for r in ranks]
        assert sum(parts) >= elements and max(parts) < elements  # each rank its part of the masters
        assert all(set(r["masters"]["dtypes"]) == {"float32"} and set(r["grads"]["dtypes"]) == {"float32"}
                   for r in ranks)
        assert ranks[0]["forward"]["autocast"] == ["bfloat16"]
    assert fsdp["state"]["per_rank"][0]["wire"] is None and z3["state"]["per_rank"][0]["wire"] == "bfloat16"
    from dpcompare.result_view import state_ties

    ties = state_ties([("fsdp", RunResult(fsdp)), ("zero3", RunResult(z3))])
    assert any(label == "zero3" and "reduced in" in titles and "bfloat16" in text for label, titles, text in ties)
    assert not any("reduced in" in titles for label, titles, _ in ties if label == "fsdp")  # FSDP's note is its sharding


def test_compare_marks_the_cells_where_backends_differ(tmp_path):
    """compare's table puts runs side by side and marks a cell that differs from another run's at its world size."""
    from rich.console import Console

    sharding = {"code": "fsdp.sharding", "text": "fsdp: each rank holds 1/2 of every parameter",
                "concerns": ["masters", "grads", "optimizer"]}

    def job(label: str, masters: str, notes: list | None = None) -> Job:
        cells = {c: "float32, cpu" for c in STATE_COMPONENTS}
        cells["masters"] = masters
        j = Job(label, 2, [], label, tmp_path / label, tmp_path / f"{label}.log")
        j.result = RunResult({"world_size": 2, "state": {"per_rank": [], "cells": cells},
                              "equivalence": {"notes": notes or []}})
        return j

    def shown(jobs: list[Job]) -> str:
        console = Console(record=True, width=200)
        render.render_state(console, jobs)
        return console.export_text()

    def marks(text: str) -> int:
        return sum(line.count(" *") for line in text.splitlines() if line.startswith("│"))

    text = shown([job("ddp", "float32, cpu"), job("fsdp", "float32, cpu, sharded", [sharding])])
    assert marks(text) == 2  # both runs' masters
    # the difference is tied to the note that explains it, for the component it concerns alone
    assert "* fsdp (weights the optimizer steps): fsdp: each rank holds 1/2" in text and "gradients held" not in text.split(
        "└")[-1]
    same = shown([job("ddp", "float32, cpu"), job("dp", "float32, cpu", [sharding])])
    assert marks(same) == 0 and "each rank holds" not in same  # no difference, no tie


def test_the_report_lays_the_runs_state_side_by_side_with_differences_in_bold():
    from dpcompare.commands.report.markdown_verdict import state_section

    def run(backend: str, grads: str, world_size: int = 2) -> RunResult:
        cells = {c: "float32, cpu" for c in STATE_COMPONENTS}
        cells["grads"] = grads
        return RunResult({"backend": backend, "world_size": world_size, "state": {"per_rank": [], "cells": cells}})

    fsdp = run("fsdp", "float32, cpu, sharded")
    fsdp.raw["equivalence"] = {"notes": [{"code": "fsdp.sharding", "text": "fsdp: sharded", "concerns": ["grads"]}]}
    lines = state_section([run("ddp", "float32, cpu"), fsdp, run("dp", "bf16", 1)])
    text = "\n".join(lines)
    assert "- fsdp (gradients held): fsdp: sharded" in text
    assert "| ddp | 2 | float32, cpu | float32, cpu | **float32, cpu** |" in text
    assert "**float32, cpu, sharded**" in text and "| dp | 1 | float32, cpu | float32, cpu | bf16 |" in text
    assert state_section([RunResult({"backend": "ddp", "world_size": 2})]) == []  # written before it was read


def test_a_backend_that_cannot_give_a_component_is_read_without_it_and_the_run_goes_on():
    """An adapter whose reads raise (a custom backend) leaves those components empty, says why, and raises nothing;
    a wire that carries only some parameters' gradients says how many."""
    from types import SimpleNamespace

    model = _mlp()
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()

    def broken():
        raise RuntimeError("no census here")

    adapter = SimpleNamespace(wrapped=SimpleNamespace(optimizer=SimpleNamespace(optimizer=optimizer)),
                              model_state_tensors=broken, gradient_wire=lambda: "bf16",
                              gradient_wire_parameters=lambda: frozenset({"0.weight", "0.bias"}),
                              scaler_state=broken)
    recorder = state_table.ForwardDtypes(model)
    model(torch.randn(2, 4))
    mine = state_table.read(adapter, recorder.close(), grads=None)
    assert set(mine["unread"]) == {"held", "loss_scale"} and "no census here" in mine["unread"]["held"]
    assert mine["masters"]["dtypes"] == {"float32": 32 + 8 + 16 + 2}  # what the torch optimizer behind it steps
    assert set(mine["optimizer"]) == {"exp_avg", "exp_avg_sq"} and mine["loss_scale"] is None
    cells = state_table.section([mine])["cells"]
    assert cells["wire"] == "bfloat16 (2 of 4 parameters' gradients; the rest none, as held)"


def test_each_local_part_is_counted_once_even_where_python_reuses_a_freed_objects_id():
    """A DTensor's to_local() is a new object each call; one freed before the next is made can share its id."""

    class Part:
        def __init__(self, n: int) -> None:
            self.n = n

        def to_local(self) -> torch.Tensor:
            return torch.zeros(self.n)

    class Shard(torch.Tensor):
        pass

    parts = [torch.zeros(5).as_subclass(Shard) for _ in range(3)]
    for p, n in zip(parts, (4, 5, 6)):
        p.to_local = Part(n).to_local  # type: ignore[attr-defined]
    assert state_table.summary(parts)["dtypes"] == {"float32": 15}
    assert state_table.summary([parts[0], parts[0]])["dtypes"] == {"float32": 4}  # the same tensor twice: once
