"""The result read through one typed reader (dpcompare.result_view), its facts recorded once, the verdict phrased once.

Checks, each against a planted violation that must be caught:
- no module of the library opens a run result by its keys (a section such as `metrics`, or a metric's name): they
  read it through the views, whose Fields each declare one key once (a second declaration in a view is caught);
- a run records its knobs (what it changes from its backend's baseline) from its adapter's own OPTIONS and
  VARIANTS when it is written, and the report reads them back: a changed declaration changes what a run records;
- the gradient's floor is recorded by the verdict and the run's line prints the recorded one, never a recomputation;
- the verdict's first divergence is phrased by dpcompare.verdict_words for the run's line, compare's table and
  questions, report.md and the pytest plugin alike: changing the phrase there changes it everywhere;
- a file that is no result of this schema version is refused in one line naming the version;
- one reference run (a process, seconds) writes a result that passes the schema and reads back as written.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import dpcompare
from dpcompare import verdict_words as words
from dpcompare.result_view import Check, Equivalence, Field, Metrics, ResultError, RunResult
from dpcompare.run import line, registry, result_writer
from dpcompare.run.config import RunConfig
from dpcompare.verify.judgement.tolerance import allowed_floor

LIBRARY = Path(dpcompare.__file__).parent
READER = LIBRARY / "result_view"
SECTIONS = ("equivalence", "metrics", "checks", "capabilities", "knobs")
"""A run result's sections: a module that opens one by its key reads the result around its reader."""
SHARED_KEYS = {"busbw_gbps", "algbw_gbps", "step_ms", "comm_exposed_ms", "comm_total_ms", "peak_mem_mib",
               "peak_above_start_mib", "scaling"}
"""Metric names that are keys of other files too (collectives.json's sizes, projection.json's predictions, compare's
figures, the ranks' records before the result is written): their modules read those files, not a result."""


def _metric_names() -> set[str]:
    return {f.name for f in vars(Metrics).values() if isinstance(f, Field)} - SHARED_KEYS


def key_reads(text: str) -> list[str]:
    """The result keys a module's source opens by name: a section (`run["metrics"]`, `run.get("equivalence")`), or a
    metric (`m["step_ms_p50"]`, `m.get("step_ms_p50")`, `metric(run, "step_ms_p50")`)."""
    names = "|".join(sorted({*SECTIONS, *_metric_names()}))
    return re.findall(rf"""(?:\[|\.get\(|metric\(\w+,\s*)\s*["']({names})["']""", text)


def test_no_module_of_the_library_opens_a_result_by_its_keys() -> None:
    found = {str(path.relative_to(LIBRARY)): reads for path in sorted(LIBRARY.rglob("*.py"))
             if READER not in path.parents and (reads := key_reads(path.read_text()))}
    assert found == {}, f"read these through dpcompare.result_view: {found}"


def test_a_module_that_opens_a_result_by_its_keys_is_caught() -> None:
    """The twin: a reader module with one line reading around the reader."""
    module = (LIBRARY / "commands" / "report" / "markdown_sweep.py").read_text()
    assert key_reads(module) == []
    planted = module + '\n\ndef step(run):\n    return (run.get("metrics") or {})["step_ms_p50"]\n'
    assert key_reads(planted) == ["metrics", "step_ms_p50"]
    assert key_reads('x = metric(run, "compute_ms_p50")') == ["compute_ms_p50"]


def declared_twice(source: str) -> list[str]:
    """`Class.name` for each name a class body of `source` assigns more than once (the second silently wins)."""
    twice = []
    for cls in (n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef)):
        seen: set[str] = set()
        for statement in cls.body:
            targets = statement.targets if isinstance(statement, ast.Assign) else (
                [statement.target] if isinstance(statement, ast.AnnAssign) else [])
            for name in (t.id for t in targets if isinstance(t, ast.Name)):
                if name in seen:
                    twice.append(f"{cls.name}.{name}")
                seen.add(name)
    return twice


def test_every_key_of_a_view_is_declared_once() -> None:
    sources = {path.name: path.read_text() for path in READER.glob("*.py")}
    assert {name: twice for name, source in sources.items() if (twice := declared_twice(source))} == {}
    # The twin: a second declaration of a figure, planted in the metrics' view.
    planted = sources["metrics.py"].replace("    step_ms_p90 = Field()\n",
                                            "    step_ms_p90 = Field()\n    step_ms_p50 = Field(list)\n")
    assert declared_twice(planted) == ["Metrics.step_ms_p50"]
    # Each Field reads the key it is named after, at its path.
    assert (Metrics.step_ms_p50.name, Metrics.step_ms_p50.path) == ("step_ms_p50", "metrics.step_ms_p50")
    assert Equivalence.min_detectable_rel.path == "equivalence.min_detectable_rel"


def written_keys(source: str) -> set[str]:
    """The keys a writer's source names: `m.set("name", ...)` (the metrics), dict keys `"name": ...` and item
    assignments `d["name"] = ...`."""
    patterns = (r"""m\.set\(\s*["'](\w+)["']""", r"""["'](\w+)["']\s*:""", r"""\[\s*["'](\w+)["']\s*\]\s*=""")
    return {key for pattern in patterns for key in re.findall(pattern, source)}


def _fields(*views: type) -> set[str]:
    return {f.name for view in views for f in vars(view).values() if isinstance(f, Field)}


def test_every_key_the_reader_declares_is_one_its_writer_writes() -> None:
    """A Field names a key its writer writes (the modules of measure/ the metrics, each its concern's, and
    measure.run_metrics the run's facts; verify.verdict the verdict's figures): a misspelt declaration would read as
    missing in every result."""
    metrics = set().union(*(written_keys(path.read_text()) for path in (LIBRARY / "measure").glob("*.py")))
    writers = [LIBRARY / "verify" / "judgement" / "verdict.py", *(LIBRARY / "verify" / "checks").glob("*.py")]
    verdict = set().union(*(written_keys(path.read_text()) for path in writers))  # the verdict's, each check's entry
    assert _fields(Metrics) - metrics == set()
    assert _fields(Equivalence, Check) - verdict == set()
    # The twin: a declaration misspelt.
    planted = type("Planted", (), {"step_ms_p5O": Field()})
    assert _fields(Metrics, planted) - metrics == {"step_ms_p5O"}


# -- what a figure reads as ---------------------------------------------------------------------------------------
def test_a_missing_figure_reads_with_its_reason_never_as_a_number() -> None:
    m = RunResult({"metrics": {"step_ms_p50": 3.0, "busbw_gbps": None, "samples_per_s": "fast", "stragglers": 1,
                               "reasons": {"busbw_gbps": "one process: no communication"}}}).metrics
    assert m.step_ms_p50.value == 3.0 and m.step_ms_p50.reason is None
    assert (m.busbw_gbps.value, m.busbw_gbps.reason) == (None, "one process: no communication")
    assert m.samples_per_s.reason == "metrics.samples_per_s is 'fast', not a number"
    assert m.stragglers.reason == "metrics.stragglers is 1, not a list"
    assert m.tokens_per_s.reason == "metrics.tokens_per_s is absent and no reason was recorded"
    assert RunResult({"metrics": None}).metrics.step_ms_p50.reason.startswith("the run measured nothing")
    assert RunResult({}).metrics.step_ms_p50.reason.startswith("this result has no metrics")
    check = RunResult({"equivalence": {"checks": {"update": {"status": "pass", "norm_ratio": True}}}}).equivalence.update
    assert check.norm_ratio.value is None and check.status == "pass"  # a bool is no figure


@pytest.mark.parametrize(("payload", "said"), [
    ({"schema_version": 0, "backend": "ddp", "world_size": 2}, "schema_version 0; this dpcompare reads 1"),
    ({"schema_version": 1, "backend": 3, "world_size": 2}, "backend 3 is not a string"),
    ({"schema_version": 1, "backend": "ddp", "world_size": True}, "world_size True is not a positive whole number"),
    ([1, 2], "not a JSON object"),
])
def test_what_is_no_result_of_this_schema_version_is_refused_in_one_line(tmp_path: Path, payload, said) -> None:
    path = tmp_path / "r.json"
    path.write_text(json.dumps(payload))
    with pytest.raises(ResultError) as refused:
        RunResult.read(path)
    assert str(refused.value) == f"{path}: {said}" and "\n" not in str(refused.value)
    assert isinstance(refused.value, ValueError)  # the command line's one-line error, exit status 2


# -- facts recorded once ------------------------------------------------------------------------------------------
def _options(cls: type, **given: Any) -> dict[str, Any]:
    return {o.name: o.parse(given[o.name]) if o.name in given else o.default for o in cls.OPTIONS}


def test_a_run_records_the_knobs_it_changes_from_its_adapters_own_declarations() -> None:
    deepspeed = registry.load("deepspeed", registry.BACKENDS, "backend")  # its class, not DeepSpeed's runtime
    fsdp = registry.load("fsdp", registry.BACKENDS, "backend")
    ddp = registry.load("ddp", registry.BACKENDS, "backend")
    cfg = RunConfig()
    assert result_writer.knobs(cfg, deepspeed, _options(deepspeed, zero_stage="2")) == {"zero_stage": 2}
    assert result_writer.knobs(cfg, deepspeed, _options(deepspeed, zero_stage="0")) == {}  # stage 0 is its default
    assert result_writer.knobs(cfg, deepspeed, _options(deepspeed, zero_stage="3", amp_recipe="engine")) == {
        "amp_recipe": "engine", "zero_stage": 3}  # in the order of its OPTIONS
    assert result_writer.knobs(cfg, fsdp, _options(fsdp, reshard_after_forward="false")) == {"reshard_after_forward": False}
    # An option no named variant sets leaves the run its backend's baseline.
    assert result_writer.knobs(cfg, deepspeed, _options(deepspeed, gradient_clipping="1.0")) == {}
    assert result_writer.knobs(RunConfig(grad_accum=4, bucket_mb=0.01), ddp, _options(ddp)) == {"grad_accum": 4,
                                                                                          "bucket_mb": 0.01}
    assert RunResult({"knobs": result_writer.knobs(cfg, fsdp, _options(fsdp, reshard_after_forward="false"))}).knob_label \
        == "reshard_after_forward=false"


def test_a_changed_declaration_changes_the_knobs_a_run_records() -> None:
    """The twin: the same adapter with its default, or its named variants, changed."""
    deepspeed = registry.load("deepspeed", registry.BACKENDS, "backend")
    fsdp = registry.load("fsdp", registry.BACKENDS, "backend")
    stage_one = type("StageOne", (deepspeed,), {"OPTIONS": tuple(
        dataclasses.replace(o, default=1) if o.name == "zero_stage" else o for o in deepspeed.OPTIONS)})
    cfg = RunConfig()
    assert result_writer.knobs(cfg, stage_one, _options(stage_one, zero_stage="1")) == {}
    assert result_writer.knobs(cfg, stage_one, _options(stage_one, zero_stage="0")) == {"zero_stage": 0}
    unnamed = type("Unnamed", (fsdp,), {"VARIANTS": {}})
    assert result_writer.knobs(cfg, unnamed, _options(unnamed, reshard_after_forward="false")) == {}


def _tolerance() -> dict[str, Any]:
    return {"rule": "...", "factor": 10.0, "unit_roundoff": 2.0**-24, "unit_roundoff_wire": 2.0**-24, "world_size": 2,
            "depth": 3, "compression": "none", "wire_rounding": "bounded"}


def _payload(**gradient: Any) -> dict[str, Any]:
    return {"backend": "ddp", "world_size": 2, "model": "mlp", "launcher": "torchrun", "result_path": "r.json",
            "config": {"dtype": "float32"},
            "equivalence": {"verdict": "equivalent", "checked_steps": [0], "noise_ratio": 1.5, "max_rel_fro_err": 2e-7,
                            "noise_floor_rel_fro": 2e-7, "first_divergence": None, "replicas_identical": True,
                            "tolerance": _tolerance(), "checks": {"gradient": {"status": "pass", **gradient}}}}


def test_the_runs_line_prints_the_floor_the_verdict_recorded() -> None:
    recorded = allowed_floor(4e-8, depth=3, unit_roundoff=2.0**-24, world_size=2, u_sum=2.0**-24)
    assert f"its data-parallel floor {recorded:.2e}," in line.summary_line(_payload(dp_floor_rel_fro=4e-8,
                                                                                     floor_rel_fro=recorded))
    # The twin: a recorded floor that the tolerance would not give is printed as recorded, not recomputed.
    assert "its data-parallel floor 1.23e-05," in line.summary_line(_payload(dp_floor_rel_fro=4e-8,
                                                                             floor_rel_fro=1.23e-5))


# -- the verdict's words, phrased once ----------------------------------------------------------------------------
DIVERGENCE = {"step": 1, "parameter": "fc1.weight", "reason": "the update is twice the reference's", "check": "update"}


def _presented(tmp_path: Path) -> dict[str, str]:
    """The first divergence as each presenter shows it."""
    from dpcompare.commands import pytest_plugin
    from dpcompare.commands.compare import compare_output as render, plan, questions
    from dpcompare.commands.report.markdown import Footnotes
    from dpcompare.commands.report.markdown_verdict import _verdict_row

    payload = _payload()
    payload["equivalence"].update(verdict="different", first_divergence=DIVERGENCE)
    run = RunResult(payload)
    job = plan.Job("ddp", 2, [], "q: ddp/2", tmp_path / "d.npz", tmp_path / "l.log", "control", status="different",
                   result=run, question="clipping")
    with pytest.raises(pytest.fail.Exception) as failed:
        pytest_plugin.record(SimpleNamespace(), payload)
    return {"line": line.summary_line(payload), "compare": render._note(job),
            "questions": questions._answer(questions.by_name()["clipping"], job, None)["first_divergence"],
            "report": _verdict_row(run, Footnotes())[-1].replace("`", ""), "pytest": str(failed.value)}


def test_the_first_divergence_is_phrased_by_the_verdicts_words_everywhere(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    phrase = "step 1 (update check), fc1.weight: the update is twice the reference's"
    shown = _presented(tmp_path)
    assert {name: phrase in text for name, text in shown.items()} == dict.fromkeys(shown, True), shown
    # The twin: the phrase changed in verdict_words changes it in every presenter.
    monkeypatch.setattr(words, "divergence", lambda d, parameter=str: f"PLANTED {parameter(d.parameter)}")
    shown = _presented(tmp_path)
    assert {name: "PLANTED fc1.weight" in text and phrase not in text for name, text in shown.items()} == \
        dict.fromkeys(shown, True), shown


def test_the_checks_figures_take_one_format_wherever_they_are_shown() -> None:
    e = Equivalence({"checked_steps": [0], "noise_ratio": 1.25, "max_rel_fro_err": 2.5e-8, "noise_floor_rel_fro": 2e-8,
                     "min_detectable_rel": 3.14e-6, "checks": {"update": {"status": "pass", "noise_ratio": 3.5,
                                                                          "norm_ratio": 1.001}}})
    phrases = "; ".join(words.check_phrases(e, "float32", "none"))
    assert "gradient: 1.25x" in phrases and "||update||/||reference|| 1.0010" in phrases
    assert "catches a change of 3.1e-06" in phrases
    assert isinstance(e.update, Check) and e.update.ran and not e.trajectory.ran


# -- the round trip through a real run -----------------------------------------------------------------------------
def test_a_run_writes_what_the_reader_reads_back(launch) -> None:
    finished, payload = launch("reference", 1, "mlp", ["--grad-accum", "2", "--measure-steps", "2"])
    assert finished.returncode == 0 and payload is not None, finished.stdout + finished.stderr
    (path,) = (launch.tmp_path / f"out-{launch.count}").glob("*.json")
    run = RunResult.read(path)
    assert run.knobs == {"grad_accum": 2} and run.knob_label == "grad_accum=2" and run.variant == ""
    tolerance, gradient = run.equivalence.tolerance.raw, run.equivalence.gradient
    assert gradient.floor_rel_fro.value == pytest.approx(allowed_floor(
        gradient.dp_floor_rel_fro.value, depth=tolerance["depth"], unit_roundoff=tolerance["unit_roundoff"],
        world_size=tolerance["world_size"], u_sum=tolerance["unit_roundoff"]))
    assert f"floor {gradient.floor_rel_fro.value:.2e}," in finished.stdout
    assert run.metrics.step_ms_p50.value is not None and run.equivalence.verdict == "equivalent"
