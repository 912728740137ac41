"""Checkpoints across backends and world sizes: the routes, the check of what was loaded against what was
saved (each part, with a negative for each), and real save -> load runs whose continuation is judged against one
uninterrupted float64 run, with the six planted faults of a load each `different` with its cause named."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from conftest import Launcher, child_env, run_command
from dpcompare.commands.checkpoint.cells import CONVERT, DEFAULT, TOOLS, matrix, parse_cell
from dpcompare.verify.starting_state import loaded_state
from dpcompare.verify.randomness import random_modules
from dpcompare.verify.judgement.verdict import Verdict

RUN = ["--optimizer", "adamw", "--steps", "4", "--global-batch", "32", "--measure-steps", "0"]


# -- routes -------------------------------------------------------------------------------------------------------------
def test_each_route_is_the_libraries_own_where_it_carries_the_state_else_dpcompare_convert():
    assert parse_cell("ddp:2>fsdp:4").tool is None  # FSDP reads DDP's torch file
    assert parse_cell("ddp:2>fsdp:4:dcp").tool.endswith("torch_save_to_dcp")
    assert parse_cell("fsdp:2>horovod:1").tool.endswith("dcp_to_torch_save")
    assert parse_cell("zero2:2>zero2:2").tool is None and parse_cell("zero2:2>zero2:2").load.fmt == "deepspeed"
    assert parse_cell("zero2:2>zero1:4").tool.endswith("ds_to_universal")
    assert parse_cell("zero3:2>zero3:4").tool.endswith("ds_to_universal")
    out, into, across = parse_cell("zero2:2>fsdp:2"), parse_cell("ddp:2>zero1:2"), parse_cell("zero3:2>zero2:2")
    assert out.tool == into.tool == across.tool == CONVERT
    assert (out.load.fmt, into.load.fmt, across.load.fmt) == ("dcp", "universal", "universal")
    assert parse_cell("zero1:1>horovod:2").load.fmt == "torch"
    routes = {c.tool for c in matrix("all")}  # every pair has one: no cell is refused by its route
    assert CONVERT in routes and routes <= set(TOOLS.values()) | {None}
    with pytest.raises(ValueError, match="BACKEND:WORLD_SIZE"):
        parse_cell("ddp:2>megatron:2")
    with pytest.raises(ValueError, match="writes and reads torch"):
        parse_cell("ddp:2>horovod:2:dcp")


def test_a_state_convert_will_not_carry_makes_the_cell_refused_with_its_one_line(tmp_path):
    from dpcompare.commands.checkpoint import tools

    with pytest.raises(tools.Refused) as refused:
        tools.run(CONVERT, tmp_path / "nothing", tmp_path / "converted", tmp_path / "convert.log", 120, "universal")
    assert str(refused.value).endswith("no such file or directory") and "\n" not in str(refused.value)
    assert not (tmp_path / "converted").exists()


def test_the_flag_offers_the_formats_the_contract_saves():
    from dpcompare.contract.checkpoint_io import FORMATS
    from dpcompare.run import config

    assert config.FORMATS == FORMATS


def test_the_default_matrix_covers_every_backend_world_size_and_conversion():
    cells = [parse_cell(c) for c in DEFAULT]
    ran = cells
    assert {c.save.name for c in ran} | {c.load.name for c in ran} == {"ddp", "fsdp", "horovod", "zero1", "zero2", "zero3"}
    assert {c.save.world_size for c in ran} == {c.load.world_size for c in ran} == {1, 2, 4}
    assert {c.tool for c in ran} == set(TOOLS.values()) | {None}
    assert len(matrix("all")) == 6 * 3 * 6 * 3


# -- the check of what was loaded --------------------------------------------------------------------------------------
def _saved():
    torch.manual_seed(0)
    params = {"a": torch.randn(8, 4), "b": torch.randn(6)}
    state = {n: {"step": torch.tensor(4.0), "exp_avg": torch.randn_like(t), "exp_avg_sq": torch.rand_like(t)}
             for n, t in params.items()}
    rng = [random_modules.capture(torch.device("cpu")), random_modules.RngState(b"other")]
    loop = {"step": 4, "world_size": 2, "rng": rng, "backend": "ddp", "format": "torch"}
    return {"params": params, "masters": {}, "optimizer": state, "scale": 1024.0}, loop


def _judge(saved, loop, **live):
    kw = dict(params={n: t.clone() for n, t in saved["params"].items()}, masters={},
              state={n: {k: v.clone() for k, v in e.items()} for n, e in saved["optimizer"].items()},
              scale=saved["scale"], rngs=list(loop["rng"]), start=loop["step"])
    kw.update(live)
    verdict = Verdict()
    record = loaded_state.judge_loaded(verdict, saved, loop, **kw)
    return verdict, record


def test_a_load_that_holds_every_saved_part_passes_and_names_each_part():
    saved, loop = _saved()
    verdict, record = _judge(saved, loop)
    assert verdict.first_divergence is None and record["causes"] == []
    assert set(record["parts"]) == {"parameters", "masters", "optimizer", "loss_scale", "data_position", "generators"}


@pytest.mark.parametrize("change, cause", [
    ("rotated", "checkpoint_shard_order"), ("perturbed", "checkpoint_parameters"), ("dropped", "checkpoint_optimizer"),
    ("moments", "checkpoint_optimizer"), ("step", "checkpoint_step_count"), ("scale", "checkpoint_loss_scale"),
    ("data", "checkpoint_data"), ("rng", "checkpoint_generator")])
def test_each_part_that_differs_from_the_saved_is_a_divergence_with_its_cause(change, cause):
    saved, loop = _saved()
    params = {n: t.clone() for n, t in saved["params"].items()}
    state = {n: {k: v.clone() for k, v in e.items()} for n, e in saved["optimizer"].items()}
    live: dict = {}
    if change == "rotated":  # rank 1's half where rank 0's was
        flat = torch.cat([t.reshape(-1) for t in params.values()])
        flat = torch.roll(flat, flat.numel() // 2)
        live["params"] = {"a": flat[:32].reshape(8, 4), "b": flat[32:]}
    elif change == "perturbed":
        params["b"] = params["b"] * (1 + 1e-6)
        live["params"] = params
    elif change == "dropped":
        live["state"] = {n: {} for n in state}
    elif change == "moments":
        state["a"]["exp_avg"] = state["a"]["exp_avg"] + 1e-7
        live["state"] = state
    elif change == "step":
        for e in state.values():
            e["step"] = torch.tensor(0.0)
        live["state"] = state
    elif change == "scale":
        live["scale"] = 65536.0
    elif change == "data":
        live["start"] = 0
    elif change == "rng":
        live["rngs"] = [loop["rng"][0], random_modules.RngState(b"seed")]
    verdict, record = _judge(saved, loop, **live)
    assert verdict.first_divergence is not None and verdict.first_divergence.check == "checkpoint"
    assert verdict.first_divergence.cause == cause and record["causes"][0] == cause
    assert verdict.status() == "different"


def test_generators_saved_by_another_world_size_are_said_not_carried_rather_than_compared():
    saved, loop = _saved()
    verdict, record = _judge(saved, loop, rngs=[random_modules.RngState(b"x")] * 4)
    assert verdict.first_divergence is None and record["parts"]["generators"].startswith("not carried")


# -- real runs -----------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved_ddp(tmp_path_factory) -> tuple[Launcher, Path]:
    """ddp, one rank, mlp-dropout under AdamW: 4 steps saved in DDP's torch format."""
    launch = Launcher(tmp_path_factory.mktemp("ckpt"))
    where = launch.tmp_path / "saved"
    proc, result = launch("ddp", 1, "mlp-dropout", [*RUN, "--save-checkpoint", str(where)], "python")
    assert result is not None, proc.output[-3000:]
    assert result["equivalence"]["verdict"] == "equivalent"
    assert result["equivalence"]["checkpoint"]["saved"]["step"] == 4
    return launch, where


def test_a_continuation_is_judged_over_all_the_steps_against_one_uninterrupted_run(saved_ddp):
    launch, where = saved_ddp
    proc, result = launch("ddp", 1, "mlp-dropout", [*RUN, "--load-checkpoint", str(where)], "python")
    assert result is not None, proc.output[-3000:]
    eq = result["equivalence"]
    assert eq["verdict"] == "equivalent", eq["first_divergence"]
    assert [e["step"] for e in eq["drift"]] == [4, 5, 6, 7] and eq["checked_steps"] == [4, 5, 6, 7]
    loaded = eq["checkpoint"]["loaded"]
    assert loaded["causes"] == [] and loaded["parts"]["optimizer"].startswith("bitwise equal")
    assert loaded["saved_by"] == {"backend": "ddp", "world_size": 1, "format": "torch"}


@pytest.mark.parametrize("fault, cause", [("ckpt-optimizer", "checkpoint_optimizer"),
                                          ("ckpt-step", "checkpoint_step_count"),
                                          pytest.param("ckpt-data", "checkpoint_data", marks=pytest.mark.slow)])
def test_a_planted_fault_of_the_load_is_different_with_its_cause_and_the_trajectory_sees_the_state_faults(
        saved_ddp, fault, cause):
    launch, where = saved_ddp
    proc, result = launch("ddp", 1, "mlp-dropout", [*RUN, "--load-checkpoint", str(where), "--inject-fault", fault],
                          "python")
    assert result is not None, proc.output[-3000:]
    eq = result["equivalence"]
    assert eq["verdict"] == "different" and eq["first_divergence"]["cause"] == cause
    worst = max(e["noise_ratio"] for e in eq["drift"] if e["noise_ratio"] is not None)
    if fault == "ckpt-data":  # the oracle follows the batches the run reads: only the loaded state's check sees it
        assert worst <= 1.0
    else:  # the oracle's trajectory, resumed from the saved run's, leaves the faulty run behind by itself
        assert worst > 100.0


@pytest.mark.slow  # breadth: the default tier keeps this capability's other test
def test_a_continuation_with_other_settings_or_no_checkpoint_is_refused_in_one_line(saved_ddp):
    launch, where = saved_ddp
    sgd = ["--optimizer", "sgd", *RUN[2:]]
    proc, result = launch("ddp", 1, "mlp-dropout", [*sgd, "--load-checkpoint", str(where)], "python")
    assert proc.returncode == 2 and result is None
    assert "--optimizer adamw (this run: sgd)" in proc.stderr and "Traceback" not in proc.stderr
    proc, _ = launch("ddp", 1, "mlp-dropout", [*RUN, "--load-checkpoint", str(launch.tmp_path)], "python")
    assert proc.returncode == 2 and "no complete dpcompare checkpoint" in proc.stderr and "Traceback" not in proc.stderr


def _command(tmp_path: Path, cells: str, *extra: str, timeout_s: float = 900) -> dict:
    out = tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "dpcompare", "checkpoint", "--cells", cells, "--steps", "2", "--out", str(out), *extra]
    done = run_command(cmd, cwd=tmp_path, env=child_env(tmp_path), timeout_s=timeout_s)
    assert done.returncode == 0, done.output[-4000:]
    return {c["cell"]: c for c in json.loads(next(out.glob("*/checkpoint.json")).read_text())["cells"]}


@pytest.mark.slow
def test_the_command_moves_zero3_out_of_deepspeed_and_to_zero2(tmp_path):
    """Two moves no library's tool carried, each through dpcompare convert: ZeRO-3 into a torch file for DDP at
    another world size, and ZeRO-3 to ZeRO-2; each continuation `equivalent`, every loaded part as saved. (ZeRO-3
    keeps one step count a group: handed to every parameter as one tensor, torch's AdamW counted it once a parameter
    at every step, which only the continuation showed.) Into ZeRO-2 and ZeRO-3 from FSDP2's DCP:
    tests/test_convert.py's transformers round trips."""
    cells = _command(tmp_path, "zero3:2>ddp:1,zero3:2>zero2:1", timeout_s=1500)
    for cell in cells.values():
        load = cell["load_run"]
        assert cell["status"] == "ran" and cell["tool"] == CONVERT and load["verdict"] == "equivalent", cell
        assert load["checkpoint"]["loaded"]["causes"] == [] and load["steps"] == [2, 3]
        parts = load["checkpoint"]["loaded"]["parts"]
        assert parts["optimizer"].startswith("bitwise equal") and parts["parameters"].startswith("bitwise equal")


@pytest.mark.slow
@pytest.mark.parametrize("backend, world_size, model, extra, fault, cause", [
    ("deepspeed", 2, "mlp", ["--opt", "zero_stage=2"], "ckpt-shards", "checkpoint_shard_order"),
    ("ddp", 2, "mlp-dropout", [], "ckpt-rng:1", "checkpoint_generator"),
    ("ddp", 1, "mlp", ["--amp", "fp16", "--loss-scale", "16777216"], "ckpt-scale", "checkpoint_loss_scale")])
def test_the_sharded_generator_and_scaler_faults_of_a_load_are_caught_with_their_cause(
        tmp_path, backend, world_size, model, extra, fault, cause):
    launch = Launcher(tmp_path)
    where = tmp_path / "saved"
    proc, result = launch(backend, world_size, model, [*RUN, *extra, "--save-checkpoint", str(where)])
    assert result is not None, proc.output[-3000:]
    proc, result = launch(backend, world_size, model, [*RUN, *extra, "--load-checkpoint", str(where)])
    assert result is not None and result["equivalence"]["checkpoint"]["loaded"]["causes"] == [], proc.output[-3000:]
    proc, result = launch(backend, world_size, model, [*RUN, *extra, "--load-checkpoint", str(where),
                                                       "--inject-fault", fault])
    assert result is not None, proc.output[-3000:]
    assert result["equivalence"]["verdict"] == "different"
    assert result["equivalence"]["first_divergence"]["cause"] == cause


@pytest.mark.slow
def test_a_universal_checkpoint_loaded_onto_more_ranks_reads_its_optimizer_state_as_saved(tmp_path):
    """ZeRO-1 at one rank, loaded through ds_to_universal into ZeRO-2 at two: the loaded state bitwise as saved. The
    whole path on real ranks; whether it misread depended on each process's string hashing, so the key order's own
    guard is test_zero_optimizer_state_is_read_in_one_key_order_on_every_rank."""
    cells = _command(tmp_path, "zero1:1>zero2:2", timeout_s=900)
    cell = cells["zero1:1>zero2:2"]
    assert cell["status"] == "ran" and cell["load_run"]["verdict"] == "equivalent", cell
    parts = cell["load_run"]["checkpoint"]["loaded"]["parts"]
    assert parts and not [k for k, v in parts.items() if str(v).startswith("differs")], parts


@pytest.mark.slow
def test_cells_from_one_side_share_its_save_and_a_resumed_invocation_runs_only_what_did_not_run(tmp_path):
    """Two cells from ddp:1 run at once, one loading its torch file and one converted to DCP: one save run between them. An
    invocation cut short after its first cell, resumed, runs the second cell alone, with the save it already has;
    a resume with other settings is one line, exit 2, the record untouched."""
    cells = "ddp:1>ddp:1,ddp:1>fsdp:1:dcp"
    ran = _command(tmp_path, cells, "--jobs", "2")  # both at once: the second waits for the first's save
    assert [c["status"] for c in ran.values()] == ["ran", "ran"]
    assert all(c["load_run"]["verdict"] == "equivalent" and c["load_run"]["steps"] == [2, 3] for c in ran.values())
    (out,) = (tmp_path / "ckpt").iterdir()
    assert [p.name for p in (out / "sides").iterdir()] == ["ddp1-torch"]
    assert len(list(out.glob("**/save.log"))) == 1 and len(list(out.glob("conversions/*/converted"))) == 1
    assert ran["ddp:1>ddp:1"]["save_run"] == ran["ddp:1>fsdp:1"]["save_run"]

    record = json.loads((out / "checkpoint.json").read_text())  # as if stopped during the second cell
    record["cells"][1] = {**record["cells"][1], "status": "planned", "load_run": None, "save_run": None}
    (out / "checkpoint.json").write_text(json.dumps(record))
    save_log, first_load = out / "sides/ddp1-torch/logs/save.log", next((out / "cells/ddp1-to-ddp1/load").glob("*.json"))
    stamps = save_log.stat().st_mtime_ns, first_load.stat().st_mtime_ns
    cmd = [sys.executable, "-m", "dpcompare", "checkpoint", "--cells", cells, "--steps", "2", "--resume", str(out)]
    done = run_command(cmd, cwd=tmp_path, env=child_env(tmp_path), timeout_s=600)
    assert done.returncode == 0 and "1 of 2 cells ran before" in done.output, done.output[-3000:]
    resumed = {c["cell"]: c for c in json.loads((out / "checkpoint.json").read_text())["cells"]}
    assert resumed["ddp:1>ddp:1"] == ran["ddp:1>ddp:1"]
    assert resumed["ddp:1>fsdp:1"]["status"] == "ran" and resumed["ddp:1>fsdp:1"]["load_run"]["verdict"] == "equivalent"
    assert (save_log.stat().st_mtime_ns, first_load.stat().st_mtime_ns) == stamps  # neither ran again

    before = (out / "checkpoint.json").read_bytes()
    done = run_command([*cmd[:-4], "--steps", "3", "--resume", str(out)], cwd=tmp_path, env=child_env(tmp_path),
                       timeout_s=120)
    assert done.returncode == 2 and "it ran with --steps 2, not 3" in done.output and "Traceback" not in done.output
    assert (out / "checkpoint.json").read_bytes() == before


def test_a_save_or_conversion_is_made_once_for_every_cell_that_needs_it_its_refusal_too(tmp_path):
    import threading

    from dpcompare.commands.checkpoint import tools
    from dpcompare.commands.checkpoint.checkpoint_command import Shared

    shared, calls = Shared(tmp_path), []

    def make():
        calls.append(threading.current_thread().name)
        raise tools.Refused("ZeRO-3 does not load SGD's momentum")

    threads = [threading.Thread(target=lambda: pytest.raises(tools.Refused, shared.once, "key", make)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert shared.once("other", lambda: 7) == 7 and shared.once("other", lambda: 8) == 7


def test_a_cancelled_launch_is_killed_at_once(tmp_path):
    import threading
    import time

    from dpcompare.run.launchers import run_process

    cancel = threading.Event()
    threading.Timer(0.5, cancel.set).start()
    start = time.monotonic()
    finished = run_process([sys.executable, "-c", "import time; time.sleep(60)"], timeout_s=120,
                           log=tmp_path / "log", cancel=cancel)
    assert finished.returncode is None and time.monotonic() - start < 10


def test_a_resume_of_no_earlier_invocation_or_of_other_cells_is_one_line_and_exit_2(tmp_path, capsys):
    from dpcompare import cli

    assert cli.main(["checkpoint", "--cells", "ddp:1>ddp:1", "--resume", str(tmp_path)]) == 2
    assert "no checkpoint.json of an earlier invocation there" in capsys.readouterr().err
    (tmp_path / "checkpoint.json").write_text(json.dumps(
        {"cells": [{"cell": "fsdp:2>ddp:1", "status": "ran"}], "steps": 4, "model": "mlp-dropout",
         "optimizer": "adamw", "global_batch": 32, "run_arg": []}))
    assert cli.main(["checkpoint", "--cells", "ddp:1>ddp:1", "--resume", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "holds cells this invocation does not run (fsdp:2>ddp:1)" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "cells").exists() and not (tmp_path / "sides").exists()


@pytest.mark.deep  # about 5 minutes, outside CI's time (docs/results/2026-11-28-checkpoints-cpu.md records it)
def test_the_default_matrix_is_equivalent_in_every_cell_it_runs(tmp_path):
    cells = _command(tmp_path, ",".join(DEFAULT), timeout_s=2400)
    for name, cell in cells.items():
        assert cell["status"] == "ran" and cell["load_run"]["verdict"] == "equivalent", (name, cell)
        assert cell["save_run"]["verdict"] == "equivalent", (name, cell)
        assert math.isfinite(cell["load_run"]["trajectory"]["noise_ratio"])


@pytest.mark.slow  # breadth: the default tier keeps this capability's other test
def test_compare_suite_checkpoint_runs_every_pair_of_its_backends_and_world_sizes(tmp_path):
    from dpcompare.cli import parser_for
    from dpcompare.commands.checkpoint.checkpoint_command import from_compare
    from dpcompare.commands.compare import suites

    ns = parser_for("compare").parse_args(["--suite", "checkpoint", "--backends", "fsdp,deepspeed:zero2",
                                           "--world-sizes", "1,4", "--steps", "3"])
    moved = from_compare(ns, suites.given(ns))
    cells = moved.cells.split(",")
    assert len(cells) == 16 and "zero2:4>fsdp:1" in cells and moved.steps == 3 and moved.model == "mlp-dropout"
    default = from_compare(parser_for("compare").parse_args(["--suite", "checkpoint"]), frozenset())
    assert len(default.cells.split(",")) == 324 and default.steps == 4
    out = tmp_path / "suite"
    done = run_command([sys.executable, "-m", "dpcompare", "compare", "--suite", "checkpoint", "--backends", "ddp",
                        "--world-sizes", "1", "--steps", "2", "--out", str(out)], cwd=tmp_path,
                       env=child_env(tmp_path), timeout_s=300)
    assert done.returncode == 0, done.output[-3000:]
    (cell,) = json.loads(next(out.glob("*/checkpoint.json")).read_text())["cells"]
    assert cell["cell"] == "ddp:1>ddp:1" and cell["load_run"]["verdict"] == "equivalent"
    assert cell["load_run"]["steps"] == [2, 3]


@pytest.mark.parametrize("order", [("step", "exp_avg", "exp_avg_sq"), ("step", "exp_avg_sq", "exp_avg")])
def test_zero_optimizer_state_is_read_in_one_key_order_on_every_rank(monkeypatch, order):
    """Each read of a ZeRO parameter's optimizer state is an all-reduce over the ranks, so every rank must ask for
    the keys in one order. A universal load fills the state from a set of keys, whose order differs between processes:
    read in the state's own order, one rank's exp_avg was summed with another's exp_avg_sq (zero1:2>zero2:2 read
    `checkpoint_optimizer` where its trajectory held). Both insertion orders must give the same calls."""
    pytest.importorskip("deepspeed")
    import deepspeed.utils
    from dpcompare.adapters.deepspeed_state import ZeroStateReader

    calls: list[tuple[str, str]] = []
    monkeypatch.setattr(deepspeed.utils, "safe_get_full_optimizer_state",
                        lambda p, key: calls.append((p.name_for_test, key)) or torch.zeros(p.shape))
    model = torch.nn.Linear(2, 2)
    for name, p in model.named_parameters():
        p.name_for_test = name
    flat = torch.zeros(6)
    inner = torch.optim.AdamW([flat])
    values = {"step": torch.tensor(1.0), "exp_avg": torch.zeros(6), "exp_avg_sq": torch.zeros(6)}
    inner.state[flat] = {k: values[k] for k in order}

    class Reader(ZeroStateReader):
        stage = 1
        wrapped = type("W", (), {"module": model})()

        def _inner_optimizer(self):
            return inner

    state = Reader().optimizer_state()
    assert calls == [(n, k) for n in ("weight", "bias") for k in ("exp_avg", "exp_avg_sq")], calls
    assert set(state["weight"]) == {"exp_avg", "exp_avg_sq", "step"}


def test_the_cells_follow_the_adapters_formats(monkeypatch):
    """A cell's formats and routes come from the adapters (Adapter.checkpoint_formats), not from a table beside them:
    FSDP saves DCP unless told otherwise, and a backend that learns to read DCP needs no conversion into it."""
    from dpcompare.adapters.fsdp import FSDPAdapter  # as the registry loads them
    from dpcompare.adapters.horovod import HorovodAdapter
    from dpcompare.commands.checkpoint import cells

    assert cells.native("fsdp") == FSDPAdapter.checkpoint_formats()[0] == "dcp"
    assert parse_cell("fsdp:2>horovod:1").tool.endswith("dcp_to_torch_save")
    cells.reads.cache_clear()
    monkeypatch.setattr(HorovodAdapter, "checkpoint_formats", classmethod(lambda cls: ("torch", "dcp")))
    try:
        assert parse_cell("fsdp:2>horovod:1").tool is None and parse_cell("fsdp:2>horovod:1").load.fmt == "dcp"
    finally:
        cells.reads.cache_clear()
