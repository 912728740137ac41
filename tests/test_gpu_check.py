"""experiments/gpu_check.sh and its judge, experiments/gpu_judge.py, without a GPU.

The judge is tested on real results: two cheap CPU runs (the reference backend at world size 1: an ordinary AdamW run
with its costs measured, and a forced fp16 overflow), copied into a step's directory as they were written, and on
doctored copies of them. Every expectation is shown both holding and falling short: the verdict (an equivalent run
passes `--verdict equivalent` and fails `--verdict different`; a copy made `different` or `unverifiable` fails with
its reason quoted), `--skips` (passes on the overflow, fails on the ordinary run, on a run with no skip, on a skip the
oracle did not predict), `--memory` (passes on the measured census beside the ZeRO formula, fails without either
figure, inside / outside its tolerance on doctored figures), `--count` and an empty directory. Bad usage is one line
and exit 2, never a traceback.

The script: `bash -n`; a static reading of its text (every step that launches dpcompare has judge flags that the
judge's own parser accepts, the overflow steps --skips, the sharding steps --memory; ws2_args is set before the first
part; each part its own port range); its `step` function, cut from the script and run with planted results (a
`different` run is reported as falling short, exit 1, and named at the end); and without a GPU it exits 2 at once.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import subprocess
import tempfile
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from conftest import REPO_ROOT

if str(REPO_ROOT) not in sys.path:  # `pytest` run from elsewhere: experiments/ is not an installed package
    sys.path.insert(0, str(REPO_ROOT))

from experiments import gpu_judge  # noqa: E402

SCRIPT = REPO_ROOT / "experiments" / "gpu_check.sh"
JUDGE = REPO_ROOT / "experiments" / "gpu_judge.py"
DPCOMPARE_LAUNCHERS = ("run1", "torchrun_n", "horovod_n", "filled", "compare_into")
"""The script's helpers that launch `python -m dpcompare run`; every step running one of them must be judged."""

ORDINARY_ARGS = ["--optimizer", "adamw", "--steps", "2", "--measure-steps", "2", "--warmup-steps", "1"]
OVERFLOW_ARGS = ["--amp", "fp16", "--loss-scale", "16777216", "--steps", "8", "--measure-steps", "0"]


# -- recorded results ------------------------------------------------------------------------------------------------
@pytest.fixture
def ordinary(shared_launch: Callable[..., Any]) -> dict[str, Any]:
    """A real equivalent run with its model-state census and ZeRO formula (reference, AdamW, measured)."""
    finished, result = shared_launch("reference", 1, "mlp", ORDINARY_ARGS, "python")
    assert result is not None, finished.output[-3000:]
    assert result["equivalence"]["verdict"] == "equivalent"
    return copy.deepcopy(result)


@pytest.fixture
def overflow(shared_launch: Callable[..., Any]) -> dict[str, Any]:
    """A real fp16 run whose initial loss scale 2^24 overflows: the scaler skips checked steps."""
    finished, result = shared_launch("reference", 1, "mlp", OVERFLOW_ARGS, "python")
    assert result is not None, finished.output[-3000:]
    return copy.deepcopy(result)


def step_dir(tmp_path: Path, name: str, *results: dict[str, Any]) -> Path:
    """A step's results directory holding `results`, as the runs write them (one JSON file each)."""
    d = tmp_path / "runs" / name
    d.mkdir(parents=True)
    for i, result in enumerate(results):
        (d / f"result-{i}.json").write_text(json.dumps(result, indent=1))
    return d


def judge(capsys: pytest.CaptureFixture[str], *argv: Any) -> tuple[int, list[str]]:
    """(exit status, stdout lines) of the judge's main."""
    rc = gpu_judge.main([str(a) for a in argv])
    return rc, capsys.readouterr().out.splitlines()


# -- the verdict ---------------------------------------------------------------------------------------------------
def test_an_equivalent_run_passes_equivalent_and_fails_different(tmp_path, capsys, ordinary):
    d = step_dir(tmp_path, "nccl-ws1", ordinary)
    rc, lines = judge(capsys, d, "--verdict", "equivalent")
    assert (rc, lines) == (0, ["nccl-ws1: ok: 1 result(s), equivalent (verdict held)"])
    rc, lines = judge(capsys, d, "--verdict", "different")
    assert rc == 1 and len(lines) == 1, lines
    assert lines[0].startswith("nccl-ws1: reference ws=1 mlp (result-0.json): ")
    assert lines[0].endswith("verdict equivalent, expected different")


def test_a_run_made_different_fails_with_its_first_divergence(tmp_path, capsys, ordinary):
    doctored = copy.deepcopy(ordinary)
    doctored["equivalence"]["verdict"] = "different"
    doctored["equivalence"]["first_divergence"] = {
        "step": 0, "parameter": "fc1.weight", "check": "gradient", "reason": "rel fro err 3e-3, 4000x its floor"}
    d = step_dir(tmp_path, "ddp-ws2", doctored)
    rc, lines = judge(capsys, d)  # the default: equivalent
    assert rc == 1 and len(lines) == 1, lines
    assert lines[0] == ("ddp-ws2: reference ws=1 mlp (result-0.json): verdict different, expected equivalent (first "
                        "divergence at step 0, gradient, fc1.weight: rel fro err 3e-3, 4000x its floor)")
    rc, lines = judge(capsys, d, "--verdict", "equivalent,different")
    assert (rc, lines) == (0, ["ddp-ws2: ok: 1 result(s), different (verdict held)"])


def test_unverifiable_passes_only_where_the_step_allows_it(tmp_path, capsys, ordinary):
    doctored = copy.deepcopy(ordinary)
    doctored["equivalence"].update(verdict="unverifiable", unverifiable_reason="drop's CUDA mask\nwas not captured")
    d = step_dir(tmp_path, "gpt2-small-dropout-ws1", doctored)
    rc, lines = judge(capsys, d)
    assert rc == 1 and lines == ["gpt2-small-dropout-ws1: reference ws=1 mlp (result-0.json): verdict unverifiable, "
                                 "expected equivalent (drop's CUDA mask was not captured)"]
    rc, _ = judge(capsys, d, "--verdict", "equivalent,unverifiable")
    assert rc == 0


def test_one_line_per_result_that_falls_short(tmp_path, capsys, ordinary):
    doctored = copy.deepcopy(ordinary)
    doctored["equivalence"]["verdict"] = "unchecked"
    d = step_dir(tmp_path, "two-runs", ordinary, doctored)
    rc, lines = judge(capsys, d, "--count", "2")
    assert rc == 1 and lines == ["two-runs: reference ws=1 mlp (result-1.json): verdict unchecked, expected equivalent"]


# -- --skips -------------------------------------------------------------------------------------------------------
def test_skips_pass_on_a_forced_overflow(tmp_path, capsys, overflow):
    records = overflow["equivalence"]["precision"]["steps"]
    assert any(r["skipped"] for r in records), records  # the run did skip: what the positive case stands on
    rc, lines = judge(capsys, step_dir(tmp_path, "amp-fp16-overflow-ddp-ws1", overflow), "--skips")
    assert (rc, lines) == (0, ["amp-fp16-overflow-ddp-ws1: ok: 1 result(s), equivalent (verdict, skips held)"])


def test_skips_fail_on_an_ordinary_run(tmp_path, capsys, ordinary):
    rc, lines = judge(capsys, step_dir(tmp_path, "plain", ordinary), "--skips")
    assert rc == 1 and len(lines) == 1, lines
    assert "--skips: no checked step recorded a loss scale (equivalence.precision.steps is empty; --amp none" in lines[0]


def test_skips_fail_where_no_checked_step_was_skipped(tmp_path, capsys, overflow):
    doctored = copy.deepcopy(overflow)
    for r in doctored["equivalence"]["precision"]["steps"]:
        r.update(skipped=False, predicted_overflow=False)
    rc, lines = judge(capsys, step_dir(tmp_path, "no-skip", doctored), "--skips")
    assert rc == 1 and len(lines) == 1, lines
    assert re.search(r"--skips: none of the 8 checked step\(s\) was skipped \(loss scale 16777216.0 to .*\): the "
                     r"overflow path was not exercised$", lines[0]), lines[0]


def test_skips_fail_on_a_skip_the_oracle_did_not_predict(tmp_path, capsys, overflow):
    doctored = copy.deepcopy(overflow)
    first = doctored["equivalence"]["precision"]["steps"][0]
    assert first["skipped"]
    first["predicted_overflow"] = False
    rc, lines = judge(capsys, step_dir(tmp_path, "unpredicted", doctored), "--skips")
    assert rc == 1 and len(lines) == 1, lines
    assert lines[0].endswith("--skips: checked step(s) 0 (skipped, overflow not predicted): skipped other than where "
                             "the oracle predicts an overflow")


def test_skips_fail_when_the_verdict_is_not_equivalent(tmp_path, capsys, overflow):
    doctored = copy.deepcopy(overflow)
    doctored["equivalence"]["verdict"] = "different"
    rc, lines = judge(capsys, step_dir(tmp_path, "skipped-but-different", doctored), "--skips")
    assert rc == 1 and len(lines) == 1 and lines[0].endswith("verdict different, expected equivalent"), lines


# -- --memory ------------------------------------------------------------------------------------------------------
def test_memory_passes_on_the_measured_census_beside_the_formula(tmp_path, capsys, ordinary):
    metrics = ordinary["metrics"]
    assert metrics["model_state_formula_mib"] and metrics["model_state_mib_per_rank"], metrics.get("reasons")
    rc, lines = judge(capsys, step_dir(tmp_path, "sharding-fsdp-ws1", ordinary), "--memory")
    assert (rc, lines) == (0, ["sharding-fsdp-ws1: ok: 1 result(s), equivalent (verdict, memory held)"])


@pytest.mark.parametrize("field", ["model_state_formula_mib", "model_state_mib_per_rank"])
def test_memory_fails_without_a_figure_naming_the_field(tmp_path, capsys, ordinary, field):
    ordinary["metrics"][field] = None
    ordinary["metrics"]["reasons"][field] = "no formula for this run"
    rc, lines = judge(capsys, step_dir(tmp_path, "sharding-zero2-ws1", ordinary), "--memory")
    assert rc == 1 and len(lines) == 1, lines
    assert lines[0].endswith(f"--memory: metrics.{field} is missing (no formula for this run)")


def test_memory_fails_on_a_run_that_measured_nothing(tmp_path, capsys, overflow):
    metrics = overflow["metrics"]  # --measure-steps 0: only the verification's own cost is recorded
    assert metrics["measured_steps"] == 0 and "peak_mem_mib" not in metrics and metrics["verify_peak_mib"] > 0
    rc, lines = judge(capsys, step_dir(tmp_path, "unmeasured", overflow), "--memory")
    assert rc == 1 and lines and all("--memory: metrics." in line and "is missing" in line for line in lines), lines


def _scaled(result: dict[str, Any], rank: int, component: str, factor: float) -> dict[str, Any]:
    """`result` with a second rank (a copy of rank 0's census) and `component` of rank `rank` times `factor`."""
    doctored = copy.deepcopy(result)
    per_rank = doctored["metrics"]["model_state_mib_per_rank"]
    per_rank.append(copy.deepcopy(per_rank[0]))
    per_rank[rank][component] = doctored["metrics"]["model_state_formula_mib"][component] * factor
    return doctored


@pytest.mark.parametrize("component", ["params", "optimizer"])
def test_memory_holds_inside_its_tolerance(tmp_path, capsys, ordinary, component):
    rc, lines = judge(capsys, step_dir(tmp_path, "inside", _scaled(ordinary, 1, component, 1.05)), "--memory")
    assert rc == 0, lines


@pytest.mark.parametrize("component", ["params", "optimizer"])
def test_memory_falls_short_outside_its_tolerance(tmp_path, capsys, ordinary, component):
    d = step_dir(tmp_path, "sharding-zero3-ws2", _scaled(ordinary, 1, component, 2.0))  # not sharded: twice the formula
    rc, lines = judge(capsys, d, "--memory")
    formula = ordinary["metrics"]["model_state_formula_mib"][component]
    assert rc == 1 and len(lines) == 1, lines
    assert re.search(rf"--memory: rank 1 {component} measured {2 * formula:.4g} MiB, formula {formula:.4g} MiB "
                     rf"\(\+100%, tolerance 10%; ZeRO-0 \(replicated", lines[0]), lines[0]
    rc, _ = judge(capsys, d, "--memory", "--memory-tolerance", "0.9")  # the tolerance is the flag's
    assert rc == 1
    rc, _ = judge(capsys, step_dir(tmp_path, "loose", _scaled(ordinary, 1, component, 1.5)), "--memory",
                  "--memory-tolerance", "0.6")
    assert rc == 0


# -- what is in the directory --------------------------------------------------------------------------------------
# -- the judge's GPU expectations: each passes on what it is there for and fails without it ----------------------
def test_power_holds_what_the_run_resolves_and_fails_above_it(tmp_path, capsys, ordinary):
    assert judge(capsys, step_dir(tmp_path, "p", ordinary), "--power", "0.1")[0] == 0
    weak = copy.deepcopy(ordinary)
    weak["equivalence"]["min_detectable_rel"] = 0.66
    rc, lines = judge(capsys, step_dir(tmp_path, "w", weak), "--power", "0.1")
    assert rc == 1 and "catches a change of 0.66, more than 0.1" in lines[0], lines


def test_cause_names_the_twin_and_fails_on_another(tmp_path, capsys, ordinary):
    twin = copy.deepcopy(ordinary)
    twin["equivalence"].update(verdict="different", first_divergence={"step": 0, "cause": "lr_scaled", "reason": "x"})
    d = step_dir(tmp_path, "t", twin)
    assert judge(capsys, d, "--verdict", "different", "--cause", "lr_scaled")[0] == 0
    rc, lines = judge(capsys, d, "--verdict", "different", "--cause", "local_clip")
    assert rc == 1 and "cause is 'lr_scaled', expected 'local_clip'" in lines[0], lines


def test_tf32_off_fails_on_a_cpu_run_and_holds_on_cuda_settings(tmp_path, capsys, ordinary):
    rc, lines = judge(capsys, step_dir(tmp_path, "cpu", ordinary), "--tf32-off")
    assert rc == 1 and "not on CUDA" in lines[0], lines
    cuda = copy.deepcopy(ordinary)
    cuda["equivalence"]["precision"]["tf32"].update(checked_with="TF32 off in the checked steps")
    assert judge(capsys, step_dir(tmp_path, "cuda", cuda), "--tf32-off")[0] == 0
    cuda["equivalence"]["precision"]["tf32"]["checked_cudnn_allow_tf32"] = True
    rc, lines = judge(capsys, step_dir(tmp_path, "on", cuda), "--tf32-off")
    assert rc == 1 and "checked_cudnn_allow_tf32 is True" in lines[0], lines


def test_compiled_needs_a_graph(tmp_path, capsys, ordinary):
    rc, lines = judge(capsys, step_dir(tmp_path, "eager", ordinary), "--compiled")
    assert rc == 1 and "nothing was compiled" in lines[0], lines
    compiled = copy.deepcopy(ordinary)
    compiled["compile"] = {"graphs": 2}
    assert judge(capsys, step_dir(tmp_path, "c", compiled), "--compiled")[0] == 0


def test_partial_coverage_needs_a_part_planned_from_cuda_free_memory(tmp_path, capsys, ordinary):
    rc, lines = judge(capsys, step_dir(tmp_path, "full", ordinary), "--partial-coverage")
    assert rc == 1 and "checked the whole model" in lines[0], lines
    part = copy.deepcopy(ordinary)
    part["equivalence"]["oracle_coverage"] = {"fraction": 0.4, "reason": "13.9 GiB free (CUDA free memory "
                                              "(torch.cuda.mem_get_info))"}
    assert judge(capsys, step_dir(tmp_path, "part", part), "--partial-coverage")[0] == 0
    part["equivalence"]["oracle_coverage"]["reason"] = "13.9 GiB free (MemAvailable)"
    rc, lines = judge(capsys, step_dir(tmp_path, "host", part), "--partial-coverage")
    assert rc == 1 and "not planned from CUDA's free memory" in lines[0], lines


def test_saving_needs_the_recomputing_run_lower(tmp_path, capsys, ordinary):
    without, recomputing = copy.deepcopy(ordinary), copy.deepcopy(ordinary)
    without["activation_checkpointing"], recomputing["activation_checkpointing"] = None, {"blocks": 12}
    without["metrics"]["peak_above_start_mib"], recomputing["metrics"]["peak_above_start_mib"] = 9000.0, 3000.0
    rc, lines = judge(capsys, step_dir(tmp_path, "s", without, recomputing), "--saving")
    assert rc == 0 and "9000 MiB without, 3000 MiB recomputing" in lines[0], lines
    recomputing["metrics"]["peak_above_start_mib"] = 9500.0
    rc, lines = judge(capsys, step_dir(tmp_path, "n", without, recomputing), "--saving")
    assert rc == 1 and "no saving" in lines[0], lines
    rc, lines = judge(capsys, step_dir(tmp_path, "one", without), "--saving")
    assert rc == 1 and "expected exactly 2" in lines[0], lines


def test_cost_states_the_figures_and_fails_without_them(tmp_path, capsys, ordinary):
    rc, lines = judge(capsys, step_dir(tmp_path, "c", ordinary), "--cost")
    assert rc == 0 and "x the step" in lines[0] and "B/param above the start" in lines[0], lines
    assert "by part (ms/step): " in lines[0] and "oracle " in lines[0], lines  # the real run recorded its parts
    bare = copy.deepcopy(ordinary)
    del bare["metrics"]["verify_ms_per_step"]
    rc, lines = judge(capsys, step_dir(tmp_path, "b", bare), "--cost")
    assert rc == 1 and "metrics.verify_ms_per_step is missing" in lines[0], lines


def _cell_record(label: str, load_verdict: str = "equivalent", part: str = "as saved") -> dict[str, Any]:
    """One cell as `dpcompare checkpoint` writes it (Outcome.to_dict, runs through _run_summary)."""
    run = {"verdict": "equivalent", "checkpoint": None, "first_divergence": None, "cause": None, "steps": [0, 1]}
    load = dict(run, verdict=load_verdict, steps=[2, 3],
                checkpoint={"loaded": {"parts": {"parameters": "as saved", "optimizer": part}}})
    if load_verdict != "equivalent":
        load.update(cause="checkpoint_optimizer", first_divergence="exp_avg differs")
    return {"cell": label, "status": "ran", "refusal": None, "error": None, "wall_s": 12.0, "save_run": run,
            "load_run": load}


def test_cells_hold_every_cell_equivalent_as_saved_and_fall_short_otherwise(tmp_path, capsys):
    def record(name: str, *cells: dict[str, Any]) -> Path:
        d = tmp_path / name
        (d / "20261128-000000").mkdir(parents=True)
        (d / "20261128-000000" / "checkpoint.json").write_text(json.dumps({"cells": list(cells)}))
        return d
    good = record("good", _cell_record("ddp:1>fsdp:1"), _cell_record("zero1:1>zero2:1"))
    rc, lines = judge(capsys, good, "--cells", "2")
    assert rc == 0 and "2 cell(s) saved and loaded equivalent" in lines[0], lines
    rc, lines = judge(capsys, good, "--cells", "3")
    assert rc == 1 and "2 cell(s)" in lines[0] and "expected exactly 3" in lines[0], lines
    bad = record("bad", _cell_record("a", load_verdict="different"), _cell_record("b", part="differs: 3 values"),
                 dict(_cell_record("c"), status="failed", error="load under zero2:1 failed: exit status 1"))
    rc, lines = judge(capsys, bad, "--cells", "3")
    assert rc == 1 and len(lines) == 3, lines
    assert "a: the load run is different" in lines[0] and "checkpoint_optimizer" in lines[0], lines
    assert "b: loaded other than saved: optimizer" in lines[1], lines
    assert "c: failed: load under zero2:1 failed" in lines[2], lines
    rc, lines = judge(capsys, record("none"), "--cells", "1")
    assert rc == 1 and "0 cell(s)" in lines[0], lines


def test_an_empty_directory_falls_short(tmp_path, capsys):
    d = step_dir(tmp_path, "dp-1dev")
    rc, lines = judge(capsys, d)
    assert (rc, lines) == (1, [f"dp-1dev: no result file found in {d}"])
    (d / "ds_config.json").write_text('{"train_batch_size": 8}')  # readable JSON that is not a result
    rc, lines = judge(capsys, d)
    assert (rc, lines) == (1, [f"dp-1dev: no result file found in {d} (1 other JSON file(s), not run results)"])


def test_count_zero_is_a_refused_run_that_wrote_nothing(tmp_path, capsys, ordinary):
    rc, lines = judge(capsys, step_dir(tmp_path, "nccl-refused"), "--count", "0")
    assert (rc, lines) == (0, ["nccl-refused: ok: 0 result(s), as expected"])
    d = step_dir(tmp_path, "wrote-one", ordinary)
    rc, lines = judge(capsys, d, "--count", "0")
    assert (rc, lines) == (1, [f"wrote-one: 1 result(s) in {d}, expected exactly 0"])
    rc, lines = judge(capsys, d, "--count", "2")
    assert (rc, lines) == (1, [f"wrote-one: 1 result(s) in {d}, expected exactly 2"])


def test_a_result_that_is_not_json_falls_short(tmp_path, capsys, ordinary):
    d = step_dir(tmp_path, "truncated", ordinary)
    (d / "cut.json").write_text('{"backend": "ddp", "equiv')
    rc, lines = judge(capsys, d)
    assert rc == 1 and len(lines) == 1 and lines[0].startswith("truncated: cut.json: not readable JSON"), lines


@pytest.mark.parametrize("argv, says", [
    ([], "the following arguments are required: dir"),
    (["{missing}"], "is not a directory"),
    (["{dir}", "--verdict", "same"], "argument --verdict: 'same': expected a comma list of equivalent"),
    (["{dir}", "--count", "-1"], "argument --count: '-1': expected a whole number"),
    (["{dir}", "--memory-tolerance", "10"], "argument --memory-tolerance: '10': expected a relative tolerance"),
    (["{dir}", "--skips", "--verdict", "equivalent,unverifiable"], "--skips judges an equivalent run"),
    (["{dir}", "--sikps"], "unrecognized arguments: --sikps"),
])
def test_bad_usage_is_one_line_and_exit_2(tmp_path, capsys, argv, says):
    (tmp_path / "d").mkdir()
    argv = [a.format(dir=tmp_path / "d", missing=tmp_path / "missing") for a in argv]
    rc = gpu_judge.main(argv)
    captured = capsys.readouterr()
    assert rc == 2 and captured.out == "", captured
    assert len(captured.err.splitlines()) == 1 and says in captured.err, captured.err


def test_the_script_form_exits_2_without_a_traceback(tmp_path):
    done = subprocess.run([sys.executable, str(JUDGE), str(tmp_path / "missing")], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("gpu_judge: ") and len(done.stderr.splitlines()) == 1, done.stderr


# -- the script ----------------------------------------------------------------------------------------------------
def script_lines(text: str) -> list[str]:
    """A script's lines with continuations joined and comments dropped."""
    return [line for line in text.replace("\\\n", " ").splitlines() if not line.lstrip().startswith("#")]


def step_calls(text: str) -> list[tuple[str, list[str], list[str]]]:
    """(name, judge flags, command) of every `step` call in a script's text (a loop's call once), "${eq[@]}"
    expanded."""
    lines = script_lines(text)
    eq = next(shlex.split(line.split("=", 1)[1].strip("()")) for line in lines if line.startswith("eq=("))
    calls = []
    for line in filter(re.compile(r"(?:^|&&|;|\bthen)\s*step\s").search, lines):
        tokens = shlex.split(line)
        for i, token in enumerate(tokens):
            if token == "step" and (i == 0 or tokens[i - 1] in ("&&", "then", "||", ";")):
                rest = [t for a in tokens[i + 3:] for t in (eq if a == "${eq[@]}" else [a])]
                flags: list[str] = []
                if rest and rest[0].startswith("--") and rest[0] != "--":
                    flags, rest = rest[:rest.index("--")], rest[rest.index("--") + 1:]
                calls.append((tokens[i + 1], flags, rest))
    return calls


def launches(text: str) -> list[tuple[str, list[str]]]:
    """(name, judge flags) of every step that launches dpcompare."""
    return [(name, flags) for name, flags, command in step_calls(text) if command and command[0] in DPCOMPARE_LAUNCHERS]


def ws2_args_before_every_part(text: str) -> bool:
    """Is ws2_args assigned only before the first part opens (`if part functional ...`)?"""
    lines = script_lines(text)
    first_part = next(i for i, line in enumerate(lines) if re.match(r"\s*if part ", line))
    assigned = [i for i, line in enumerate(lines) if re.match(r"\s*ws2_args=", line)]
    return bool(assigned) and max(assigned) < first_part


def test_the_script_parses():
    done = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr


def expected_judging(name: str, ns) -> bool:
    """Is step NAME judged on what it is there to show?"""
    if "twin" in name:
        return ns.verdict == ("different",) and (ns.cause is not None or "scale-left-in" in name)
    if "-zero0-" in name:  # DeepSpeed 0.19.8's fp16 engine at ZeRO 0 (deepspeedai/DeepSpeed#8393): never equivalent
        return ns.verdict == ("different",) and (ns.cause == "overflow_not_seen" or "scale1024" in name)
    if name.startswith("power-"):
        return ns.verdict == ("equivalent",) and ns.power == 0.1 and ns.tf32_off
    if "nccl-refused" in name:
        return ns.count == 0
    extra = {"checkpointing-saving": "saving", "compile": "compiled", "cost-": "cost", "coverage-": "partial_coverage"}
    wanted = next((flag for key, flag in extra.items() if key in name), None)
    flags = ("skips", "memory", "power", "cause", "tf32_off", "compiled", "partial_coverage", "saving", "cost")
    given = {f for f in flags if getattr(ns, f) not in (None, False)}
    return ns.verdict == ("equivalent",) and given == ({wanted} if wanted else set())


def test_every_step_that_runs_dpcompare_is_judged(tmp_path):
    text = SCRIPT.read_text()
    launched = launches(text)
    assert len(launched) >= 24, launched  # the whole step list was read (a loop's call counted once)
    assert not [name for name, flags in launched if not flags]
    for name, flags in launched:  # the flags are the judge's own, and the ones the step is there for
        ns = gpu_judge.parse_args([str(tmp_path), *flags])
        assert expected_judging(name, ns), (name, flags)
    # `dpcompare run` is launched only by the helpers above, each into the step's own directory
    runs = [line for line in script_lines(text) if "dpcompare run" in line]
    assert len(runs) == 3 and all('--out "$run_dir"' in line for line in runs), runs


def test_ws2_args_is_set_before_any_part_and_each_part_has_its_own_ports():
    text = SCRIPT.read_text()
    assert ws2_args_before_every_part(text)
    table = re.search(r"declare -A base_port=\((.*?)\)\n", text, re.S).group(1)
    ports = {name: int(port) for name, port in re.findall(r"\[([\w-]+)\]=(\d+)", table)}
    parts = re.search(r'^all_parts="([^"]+)"', text, re.M).group(1).split()
    parts += re.search(r'^optional_parts="([^"]+)"', text, re.M).group(1).split()
    assert set(ports) == set(parts), (ports, parts)
    bases = sorted(ports.values())
    assert all(b - a >= 50 for a, b in zip(bases, bases[1:])), ports
    opened = set(re.findall(r'\bif part "([\w$-]+)"', text))
    assert opened == {"power-$prec", "twins-$prec", "engine-$model-ws$ws", "shared", "branches", "checkpointing",
                      "questions", "questions-shared", "horovod", "overhead", "cost", "coverage", "moves", "profile"}, opened


def test_every_part_runs_once_in_a_lane_or_after_them_and_an_unknown_part_is_refused(tmp_path):
    """GPU_CHECK_LIST=1: the parts the script would run, read from the script itself (a part whose name the lanes or
    part() fail to match would be left out without a word)."""
    parts = re.search(r'^all_parts="([^"]+)"', SCRIPT.read_text(), re.M).group(1).split()
    done = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out")], env={**os.environ, "GPU_CHECK_LIST": "1"},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    listed = [name for line in done.stdout.splitlines() for name in line.split(":", 1)[1].split()]
    assert sorted(listed) == sorted(parts), done.stdout
    assert [line.split(": ")[1] for line in done.stdout.splitlines() if line.startswith("after")] == \
        ["cost", "coverage", "overhead"]
    bad = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out")], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "GPU_CHECK_LIST": "1", "GPU_CHECK_PARTS": "shared engine-ws2"})
    assert bad.returncode == 2 and "names 'engine-ws2', which is no part" in bad.stderr, bad.stderr


def test_the_static_checks_catch_an_unjudged_step_and_a_late_ws2_args():
    text = SCRIPT.read_text()
    unjudged = text.replace('step branch-compile-ddp 0 "${eq[@]}" --compiled -- torchrun_n',
                            "step branch-compile-ddp 0 torchrun_n", 1)
    assert unjudged != text
    assert [name for name, flags in launches(unjudged) if not flags] == ["branch-compile-ddp"]
    misjudged = text.replace("--verdict different --cause lr_scaled", "--verdict equivalent", 1)
    assert misjudged != text
    tmp = Path(tempfile.mkdtemp())
    assert [n for n, f in launches(misjudged) if not expected_judging(n, gpu_judge.parse_args([str(tmp), *f]))] \
        == ["twin-$prec-lr-times-n"]
    late = text.replace('  if part "power-$prec"; then\n', '  if part "power-$prec"; then\nws2_args=()\n', 1)
    assert late != text and not ws2_args_before_every_part(late)


def test_the_step_function_reports_a_shortfall_and_names_the_step(tmp_path, ordinary):
    text = SCRIPT.read_text()
    function = re.search(r"^step\(\) \{\n.*?^\}\n", text, re.S | re.M)
    assert function, "no step() in the script"
    different = copy.deepcopy(ordinary)
    different["equivalence"]["verdict"] = "different"
    planted = {}
    for name, result in (("good", ordinary), ("bad", different)):
        planted[name] = tmp_path / f"{name}.json"
        planted[name].write_text(json.dumps(result))
    out = tmp_path / "out"
    harness = f"""set -uo pipefail
out={shlex.quote(str(out))} root={shlex.quote(str(REPO_ROOT))} py={shlex.quote(sys.executable)}
steps_tsv="$out/steps.tsv" failed=0 short=() group=g
now() {{ date +%s; }}; end=$(( $(now) + 600 ))
mkdir -p "$out/logs"; : >"$steps_tsv"
{function.group(0)}
plant() {{ cp "$1" "$run_dir/"; }}
step equivalent-run 0 --verdict equivalent -- plant {shlex.quote(str(planted['good']))}
step plain-check 0 true
failed_before=$failed
step different-run 0 --verdict equivalent -- plant {shlex.quote(str(planted['bad']))}
step crashed-run 0 --verdict equivalent -- false
end=$(now)
step too-late 0 true
echo "before=$failed_before failed=$failed"
printf 'short: %s\\n' "${{short[@]}}"
"""
    done = subprocess.run(["bash", "-c", harness], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    assert "before=0 failed=1" in done.stdout, done.stdout
    rows = {r.split("\t")[0]: r.split("\t") for r in (out / "steps.tsv").read_text().splitlines()}
    assert rows["equivalent-run"][3] == "ok; 1 result(s), equivalent (verdict held)"
    assert rows["plain-check"][3] == "ok"
    assert rows["different-run"][3] == "FELL SHORT: reference ws=1 mlp (bad.json): verdict different, expected equivalent"
    assert (rows["crashed-run"][1], rows["crashed-run"][3]) == ("1", "FELL SHORT: expected exit 0, got 1")
    assert (out / "runs" / "g" / "different-run" / "bad.json").exists()  # each step its own directory
    shorts = [line for line in done.stdout.splitlines() if line.startswith("short: ")]
    assert [s.split(":")[1].strip() for s in shorts] == ["different-run", "crashed-run", "too-late"], shorts
    assert rows["too-late"][3] == "FELL SHORT: not run: past the deadline"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here: the script would run the whole check")
def test_without_a_gpu_the_script_exits_2_at_once(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DPCOMPARE_PY": sys.executable}
    done = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out")], capture_output=True, text=True, timeout=120,
                          env=env)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "sees no CUDA device" in done.stderr and not (tmp_path / "out" / "steps.tsv").exists()


def test_the_summary_names_each_runs_step_and_lists_a_copied_result_once(tmp_path, ordinary):
    """experiments/gpu_summary.py: one row per result, named by the step that wrote it; the copy the script puts beside
    another step's run (the checkpointing pair's) is not a second row."""
    import shutil
    import time

    from experiments import gpu_summary

    wrote = step_dir(tmp_path / "runs" / "checkpointing", "branch-checkpointing-without", ordinary)
    (original,) = wrote.glob("*.json")
    time.sleep(0.01)
    pair = tmp_path / "runs" / "checkpointing-pair" / "branch-checkpointing-saving"
    pair.mkdir(parents=True)
    shutil.copy(original, pair / original.name)
    rows = [r for r in gpu_summary.run_rows(tmp_path)[2:]]
    assert len(rows) == 1 and rows[0].startswith("| branch-checkpointing-without | mlp | reference | 1 |"), rows
    other = {**ordinary, "backend": "ddp"}
    (pair / "other.json").write_text(json.dumps(other))
    rows = gpu_summary.run_rows(tmp_path)[2:]
    assert [r.split(" | ")[0].lstrip("| ") for r in rows] == ["branch-checkpointing-saving",
                                                                "branch-checkpointing-without"], rows


def test_the_overhead_ratio_passes_within_its_bound_and_fails_beyond_it(tmp_path, capsys, ordinary):
    """experiments/gpu_overhead.py: dpcompare's step p50 (or loop per step) against plain_ddp's, side by side."""
    from experiments import gpu_overhead

    step = ordinary["metrics"]["step_ms_p50"]
    d = step_dir(tmp_path, "dpc", ordinary)
    near, far = tmp_path / "near.json", tmp_path / "far.json"
    near.write_text(json.dumps({"step_ms_p50": step / 1.05, "loop_ms_per_step": 1.0}))
    far.write_text(json.dumps({"step_ms_p50": step / 1.5, "loop_ms_per_step": 1.0}))
    assert gpu_overhead.main([str(near), str(d)]) == 0
    assert "ratio 1.050" in capsys.readouterr().out
    assert gpu_overhead.main([str(far), str(d)]) == 1
    assert "ratio 1.500, more than 1.1" in capsys.readouterr().out
    bare = step_dir(tmp_path, "bare", {**ordinary, "metrics": {"step_ms_p50": None}})
    assert gpu_overhead.main([str(near), str(bare)]) == 1  # a figure missing: said, never a pass
    assert "a figure is missing" in capsys.readouterr().out
    # --loop: judged on the loop's wall clock per step, the step p50's ratio stated beside, not judged
    loop = ordinary["metrics"]["loop_ms_per_step"]
    slow_p50 = tmp_path / "slow_p50.json"
    slow_p50.write_text(json.dumps({"step_ms_p50": step / 1.5, "loop_ms_per_step": loop / 1.04}))
    assert gpu_overhead.main(["--loop", str(slow_p50), str(d)]) == 0
    said = capsys.readouterr().out
    assert "loop per step" in said and "ratio 1.040" in said and "not judged: step p50" in said and "= 1.500" in said
    slow_loop = tmp_path / "slow_loop.json"
    slow_loop.write_text(json.dumps({"step_ms_p50": step, "loop_ms_per_step": loop / 1.3}))
    assert gpu_overhead.main(["--loop", str(slow_loop), str(d)]) == 1
    assert "ratio 1.300, more than 1.1" in capsys.readouterr().out


# -- --profiled ------------------------------------------------------------------------------------------------------
def test_profiled_passes_on_a_cuda_trace_with_mfu_and_fails_on_a_cpu_one(tmp_path, capsys, ordinary):
    trace = tmp_path / "rank0.json"
    events = [{"ph": "X", "name": "dpcompare.step 3", "ts": 0, "dur": 10, "tid": 1, "cat": "user_annotation"}]
    trace.write_text(json.dumps({"traceEvents": events}))
    cpu = copy.deepcopy(ordinary)  # a CPU run: no kernel in its trace, no datasheet peak
    cpu["metrics"].update(profile={"steps": 1, "traces": [str(trace)], "phases": []}, comm_exposed_trace_ms=0.0,
                          mfu=0.3, mfu_datasheet=None)
    rc, lines = judge(capsys, step_dir(tmp_path, "cpu", cpu), "--profiled")
    assert rc == 1 and any("no CUDA kernel" in line for line in lines) and any("mfu_datasheet" in line for line in lines)
    (tmp_path / "k.json").write_text(json.dumps({"traceEvents": [*events, {"ph": "X", "name": "sm90_gemm", "ts": 1,
                                                                           "dur": 5, "tid": 7, "cat": "kernel"}]}))
    cuda = copy.deepcopy(cpu)
    cuda["metrics"].update(profile={"steps": 1, "traces": [str(tmp_path / "k.json")], "phases": []}, mfu_datasheet=0.2)
    rc, lines = judge(capsys, step_dir(tmp_path, "cuda", cuda), "--profiled")
    assert rc == 0 and "1 kernels traced" in lines[0] and "profiled held" in lines[0], lines
