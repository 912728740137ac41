"""--compile: a compiled run is judged against the uncompiled float64 oracle like any run, its compile is reported apart
from its step time, and what cannot compile is refused in one line.

Checks, against what each must be:
  - compiled DDP on 2 ranks (torchrun, mlp, the defaults) is `equivalent`, with compile seconds, graphs (at least one:
    a forward that compiled nothing would say so), graph breaks with their reasons and recompilations in the result and
    its line; its negative twin (tests/faulty_compile.py: the compiled inner module called around DDP, whose gradients
    are never all-reduced, pytorch/pytorch#109774) is `different` at step 0 in the gradient check;
  - the compile path: `compile_forward` compiles an nn.Sequential, which nn.Module.compile() leaves uncompiled
    (pytorch/pytorch#150915, the negative twin);
  - the compile log: what compiles inside `aside()` is not the run's, a step that recompiles is seen and one that does
    not is not; the measured figures drop the steps that compiled, with their ablation pairs;
  - refusals, one line and exit 2 in-process: a backend that declares no compiled path (dp), a host without a C++
    compiler, DDP buckets smaller than DDPOptimizer's first one;
  - compare passes --compile to every run and lists the backends that cannot compile as unavailable.
The slow tier compiles every other backend and model at the defaults (reference, fsdp, deepspeed, horovod; cnn,
gpt-tiny with --no-dropout; AdamW), and holds a compiled forward with dropout `unverifiable`.
"""

from __future__ import annotations

import argparse
import types

import pytest
import torch
from torch import nn

from dpcompare.contract.compiling import compile_forward
from dpcompare.run import compilation
from dpcompare.run.measurement import MeasurementPhase
from dpcompare.run.trainer import summary_line
from tests.test_failures import in_process  # noqa: F401 - the fixture

WORLD_SIZE = 2
LAUNCH_TIMEOUT_S = 400  # two ranks compiling on two cores, then rank 0's compiled reference copy


def _counting_backend():
    from torch._dynamo.testing import CompileCounter

    return CompileCounter()


# -- the compile path ---------------------------------------------------------------------------------------------
def test_compile_forward_compiles_a_sequential_which_module_compile_leaves_eager():
    torch._dynamo.reset()
    x = torch.randn(2, 4)
    ours, theirs = _counting_backend(), _counting_backend()
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    compile_forward(model, backend=ours)
    model(x)
    plain = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    plain.compile(backend=theirs)
    plain(x)
    assert ours.frame_count == 1
    assert theirs.frame_count == 0  # pytorch/pytorch#150915: if this starts compiling, compile_forward can go
    assert [n for n, _ in model.named_parameters()] == ["0.weight", "0.bias"]  # the names the checks read


# -- the compile log ----------------------------------------------------------------------------------------------
def test_the_log_counts_the_runs_compiles_and_not_the_checks():
    torch._dynamo.reset()
    log = compilation.CompileLog()
    log.start()
    run = torch.compile(lambda t: t.sin() + 1, backend="eager")
    check = torch.compile(lambda t: t.cos() * 2, backend="eager")
    run(torch.randn(3))
    with log.aside():
        check(torch.randn(3))
    report = log.to_dict()
    assert report["graphs"] == 1 and report["recompiles"] == 0 and report["graph_breaks"] == 0
    assert report["compile_s"] is not None and report["compile_s"] > 0


def test_a_recompiling_step_is_seen_and_a_cached_one_is_not():
    torch._dynamo.reset()
    log = compilation.CompileLog()
    log.start()
    f = torch.compile(lambda t: t * 2, backend="eager", dynamic=False)
    f(torch.randn(3))
    log.mark()
    f(torch.randn(3))
    assert not log.step_compiled()
    log.mark()
    f(torch.randn(5))  # a new shape: a guard fails, the frame recompiles
    assert log.step_compiled()
    assert log.to_dict()["recompiles"] >= 1


def test_a_graph_break_is_counted_with_its_reason():
    torch._dynamo.reset()
    log = compilation.CompileLog()
    log.start()

    def broken(t):
        t = t + 1
        torch._dynamo.graph_break()
        return t * 2

    torch.compile(broken, backend="eager")(torch.randn(3))
    report = log.to_dict()
    assert report["graph_breaks"] >= 1 and report["graphs"] == 2
    assert report["graph_break_reasons"] and all(r["reason"] and r["count"] >= 1 for r in report["graph_break_reasons"])


def test_the_measured_figures_leave_out_the_steps_that_compiled_and_their_pairs():
    phase = types.SimpleNamespace(cfg=types.SimpleNamespace(measure_steps=4))
    steps, synced, unsynced, loop = MeasurementPhase._without(phase, [1], [10.0, 900.0, 12.0, 11.0],
                                                              [9.0, 800.0, 10.0, 9.5], [5.0, 700.0, 6.0, 5.5],
                                                              (10 + 900 + 12 + 11) / 4, 4)
    assert steps == [10.0, 12.0, 11.0] and synced == [9.0, 10.0, 9.5] and unsynced == [5.0, 6.0, 5.5]
    assert loop == pytest.approx(11.0)
    untouched = MeasurementPhase._without(phase, [], [10.0], [9.0], [5.0], 10.0, 1)
    assert untouched == ([10.0], [9.0], [5.0], 10.0)


def test_the_line_says_when_nothing_compiled():
    payload = {"backend": "ddp", "world_size": 2, "model": "mlp", "launcher": "torchrun", "result_path": "r.json",
               "equivalence": {"verdict": "unchecked"}, "compile": {}}
    base = {"compile_s": 1.5, "graphs": 0, "compiled_graphs": 0, "graph_breaks": 0, "recompiles": 0}
    assert "NOTHING COMPILED" in summary_line({**payload, "equivalence": _checked(), "compile": base})
    line = summary_line({**payload, "equivalence": _checked(), "compile": {**base, "graphs": 2, "compiled_graphs": 3,
                                                                           "measured_steps_excluded": 1}})
    assert "NOTHING" not in line and "2 graphs (3 compiled pieces)" in line and "1 measured step(s)" in line


def _checked() -> dict:
    return {"verdict": "equivalent", "noise_ratio": 0.5, "checked_steps": [], "checks": {}, "tolerance": {},
            "max_rel_fro_err": 1e-7, "noise_floor_rel_fro": 1e-7, "first_divergence": None, "replicas_identical": True}


# -- refusals -----------------------------------------------------------------------------------------------------
def _one_line(status: int, err: str, written: list, *words: str) -> None:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert status == 2, err
    assert len(lines) == 1 and lines[0].startswith("dpcompare: error: "), err
    assert "Traceback" not in err and not written
    for word in words:
        assert word in lines[0], lines[0]


def test_a_backend_without_a_compiled_path_refuses_compile_in_one_line(in_process):  # noqa: F811
    status, _, err, written = in_process("dp", "mlp", ["--compile"])
    _one_line(status, err, written, "--compile is not available for --backend dp", "leave --compile out")


def test_a_host_without_a_cxx_compiler_refuses_compile_in_one_line(in_process):  # noqa: F811
    from torch._inductor import config, cpp_builder

    cpp_builder.cpp_compiler_search.cache_clear()
    try:
        with config.patch({"cpp.cxx": ("/nonexistent/g++",)}):  # what torch searches: $CXX, then g++
            status, _, err, written = in_process("reference", "mlp", ["--compile"])
    finally:
        cpp_builder.cpp_compiler_search.cache_clear()
    _one_line(status, err, written, "--compile needs a C++ compiler", "apt-get install g++", "CXX=")


def test_ddp_buckets_below_the_first_one_refuse_compile_in_one_line(in_process):  # noqa: F811
    status, _, err, written = in_process("ddp", "mlp", ["--compile", "--bucket-mb", "0.5"])
    _one_line(status, err, written, "--bucket-mb=0.5 is invalid with --compile", "DDPOptimizer")


def test_compare_passes_compile_and_lists_what_cannot_compile(tmp_path):
    from dpcompare import cli
    from dpcompare.commands.compare import plan, spec

    ns = cli.parser_for("compare").parse_args(["--backends", "reference,dp,ddp", "--world-sizes", "1,2", "--compile",
                                               "--measure-steps", "0"])
    assert isinstance(ns, argparse.Namespace)
    planned = plan.plan(spec.parse(ns), tmp_path)
    assert planned.jobs and all("--compile" in job.command for job in planned.jobs)
    assert {u["backend"] for u in planned.unavailable} == {"dp"}
    assert "--compile" in planned.unavailable[0]["reason"]


# -- launches -----------------------------------------------------------------------------------------------------
def compiled_and_equivalent(proc, result: dict | None) -> dict:
    assert proc.returncode == 0, proc.output[-6000:]
    assert result is not None
    assert result["equivalence"]["verdict"] == "equivalent", result["equivalence"]
    c = result["compile"]
    assert c["graphs"] >= 1 and c["compiled_graphs"] >= 1, c  # something really compiled
    assert c["compile_s"] > 0 and c["recompiles"] is not None
    assert c["graph_breaks"] == sum(r["count"] for r in c["graph_break_reasons"])
    assert result["config"]["compile"] is True
    assert "compiled in" in proc.stdout and "apart from the step time" in proc.stdout
    return c


@pytest.mark.multiproc
@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
def test_compiled_ddp_is_equivalent_and_reports_its_compile(launch):
    proc, result = launch("ddp", WORLD_SIZE, "mlp", ["--compile"], timeout_s=LAUNCH_TIMEOUT_S)
    c = compiled_and_equivalent(proc, result)
    assert "measured_steps_excluded" in c and result["metrics"]["step_ms_p50"] is not None
    assert any(n["code"] == "compile" for n in result["equivalence"]["notes"])


@pytest.mark.slow  # breadth: the default tier keeps this capability's other test
@pytest.mark.multiproc
@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
def test_compiling_the_inner_module_around_ddp_is_different(launch):
    proc, result = launch("tests.faulty_compile:InnerCompiledDDP", WORLD_SIZE, "mlp",
                          ["--compile", "--steps", "2", "--measure-steps", "0"], timeout_s=LAUNCH_TIMEOUT_S)
    assert proc.returncode == 0, proc.output[-6000:]
    e = result["equivalence"]
    assert e["verdict"] == "different", e
    assert e["first_divergence"]["step"] == 0 and e["first_divergence"]["check"] == "gradient", e["first_divergence"]
    assert result["compile"]["graphs"] >= 1  # it did compile: the fault is the missing all-reduce, not eager code


SLOW, DEEP = pytest.mark.slow, pytest.mark.deep  # reference and ddp on cnn: `compare --suite questions` (slow) runs them


@pytest.mark.multiproc
@pytest.mark.timeout(2 * LAUNCH_TIMEOUT_S)
@pytest.mark.parametrize(("backend", "world_size", "model", "extra"), [
    pytest.param("reference", 1, "cnn", [], marks=DEEP),
    pytest.param("ddp", WORLD_SIZE, "cnn", [], marks=DEEP),
    pytest.param("ddp", WORLD_SIZE, "gpt-tiny", ["--no-dropout"], marks=DEEP),
    pytest.param("ddp", WORLD_SIZE, "mlp", ["--optimizer", "adamw"], marks=SLOW),
    pytest.param("fsdp", WORLD_SIZE, "mlp", [], marks=SLOW),
    pytest.param("fsdp", WORLD_SIZE, "gpt-tiny", ["--no-dropout", "--optimizer", "adamw"], marks=DEEP),
    pytest.param("deepspeed", WORLD_SIZE, "mlp", [], marks=SLOW),
    pytest.param("horovod", WORLD_SIZE, "mlp", [], marks=DEEP),
], indirect=["backend"])
def test_every_backend_compiled_is_equivalent(backend, world_size, model, extra, launch):
    proc, result = launch(backend, world_size, model, ["--compile", "--measure-steps", "3", *extra],
                          timeout_s=2 * LAUNCH_TIMEOUT_S - 60)
    compiled_and_equivalent(proc, result)


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
def test_a_compiled_forward_with_dropout_is_unverifiable(launch):
    proc, result = launch("reference", 1, "mlp-dropout", ["--compile", "--measure-steps", "0"],
                          timeout_s=LAUNCH_TIMEOUT_S)
    assert proc.returncode == 0, proc.output[-6000:]
    e = result["equivalence"]
    assert e["verdict"] == "unverifiable" and "--no-dropout" in e["unverifiable_reason"], e
