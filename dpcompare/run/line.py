"""The run's line: the one line rank 0 prints once its result is written, read back from the result through its
typed reader (dpcompare.result_view) and phrased with the verdict's words (dpcompare.verdict_words).

Owns: what the line says beside the checks' phrases and in which order: what the run chose and did not do, the
wire's rounding, the step time, what --compile did, the first divergence or why the run is unverifiable, the
checkpointed blocks, the replicas, the mixed-precision recipe and its loss scaler, and what the backend computes
that a single process would not. Imports no command.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from dpcompare import verdict_words as words
from dpcompare.contract import activation_checkpointing
from dpcompare.result_view import Equivalence, RunResult
from dpcompare.verify import checks
from dpcompare.verify.oracle import float64_paths


def _semantic_facts(e: Equivalence) -> list[str]:
    """What the backend computes that a single process would not, in a phrase each (the notes say it in full)."""
    facts = []
    bn = e.section("batchnorm")
    if bn.get("semantics") == "per_replica":
        distance = (f"{bn['floors']:.3g}x floor from the global batch" if bn.get("floors") is not None
                    else "distance from the global batch not measured")
        facts.append(f"per-replica BatchNorm over {bn['local_batch']} samples: {distance} (--sync-bn makes it one "
                     "computation)")
    split = e.section("split")
    cause = (split.get("cause") or {}).get("name")
    if split.get("semantics") == "per_replica" and cause == "normalisation":
        away = (f"{split['distance_rel_fro']:.3g} (relative) from the global batch's gradient"
                if split.get("distance_rel_fro") is not None else "the global batch not measured")
        facts.append(f"the loss is normalised per rank: compared with the ranks' own normalisation, {away} "
                     "(--loss-normalisation global divides by the step's count)")
    elif split.get("semantics") == "per_replica" and cause != "rounding":
        why = {"statistic": "a statistic of each forward's own samples", "samples_interact": "the loss couples a "
               "forward's samples", "control_flow": "control flow on the local batch",
               "model_interaction": "the model mixes a forward's samples"}.get(cause, "no tested cause")
        away = (f"{split['distance_rel_fro']:.3g} (relative) from the global batch's gradient"
                if split.get("distance_rel_fro") is not None else "the global batch not measured")
        facts.append(f"the forward depends on how the batch is split ({why}): judged as the ranks' forwards, {away}")
    elif split.get("semantics") == "loss_not_mean":
        facts.append(f"the loss is not a mean over its samples: the ranks' split computes {split['scale']:.4g}x the "
                     "global batch's gradient")
    if e.has_note("initial_weights_built_apart"):
        facts.append("the ranks built different initial weights; the backend gave every rank rank 0's")
    differ = [b for b in e.buffers if not b.get("ranks_agree", True)]
    if differ:
        follows = sorted({s for b in differ for s in b.get("nearest", b.get("semantics")) or []}) or ["no known semantics"]
        facts.append(f"{len(differ)} buffer(s) differ across ranks ({', '.join(follows)})")
    return facts


def _precision_facts(e: Equivalence) -> list[str]:
    """The mixed-precision recipe and what its loss scaler skipped, in a phrase each."""
    p = e.section("precision")
    tf32 = p.get("tf32") or {}
    on = [k for k in ("matmul_allow_tf32", "cudnn_allow_tf32") if tf32.get(k)]
    facts = ([f"checked with TF32 off and deterministic cuDNN, measured with the settings as set "
              f"({', '.join(on)})"] if on and str(tf32.get("checked_with", "")).startswith("TF32 off") else [])
    if p.get("amp", "none") == "none":
        return facts
    facts.append(f"--amp {p['amp']} {p['recipe']} recipe")  # a 16-bit wire is said with the tolerance, above
    if p.get("loss_scaler"):
        skipped = p.get("skipped_steps") or []
        total = p.get("skipped_total")
        unchecked = f" ({total} in all, unchecked steps counted)" if total is not None and total > len(skipped) else ""
        facts.append(f"loss scale {_power_of_two(p['initial_scale'])} at the start, " +
                     (f"step(s) {', '.join(map(str, skipped))} skipped on overflow{unchecked}" if skipped else
                      f"no checked step skipped{unchecked}" if unchecked else "no step skipped"))
        if skipped and not e.checked_steps:
            facts.append("every checked step overflowed and was skipped, so no gradient was compared: run more --steps "
                         "or start from a smaller --loss-scale")
    return facts


def _compile_phrase(c: Mapping[str, Any]) -> str:
    """--compile: compile time, graphs, breaks and recompilations, and the measured steps they cost."""
    def n(x: int | None, word: str) -> str:
        return f"? {word}s" if x is None else f"{x} {word}{'' if x == 1 else 's'}"

    seconds = "?" if c.get("compile_s") is None else f"{c['compile_s']:.1f}"
    text = (f"compiled in {seconds} s apart from the step time: {n(c.get('graphs'), 'graph')} ("
            f"{n(c.get('compiled_graphs'), 'compiled piece')}), {n(c.get('graph_breaks'), 'graph break')}, "
            f"{n(c.get('recompiles'), 'recompilation')}")
    if c.get("graphs") == 0:
        text += " (NOTHING COMPILED: the model ran eagerly)"
    if c.get("measured_steps_excluded"):
        text += f", {c['measured_steps_excluded']} measured step(s) that compiled left out"
    return text


def _power_of_two(x: float) -> str:
    exponent = math.log2(x) if x > 0 else math.nan
    return f"2^{exponent:.0f}" if math.isfinite(exponent) and exponent == round(exponent) else f"{x:g}"


def _about_the_run(r: RunResult) -> list[str]:
    """What the run chose, and what it did not do."""
    about = []
    if r.config.global_batch_chosen:
        about.append(f"global batch {r.global_batch} chosen for {r.world_size} rank(s) (--global-batch sets it)")
    if not r.config.measures:
        about.append("costs not measured (--measure-steps 0): add --measure-steps 20 to measure them")
    return about


def _checks(r: RunResult) -> str:
    """The checks' phrases, the oracle's coverage and the wire's rounding."""
    e = r.equivalence
    own = {c.name: c.words for c in checks.CHECKS if hasattr(c, "words")}  # a check of one's own's (Check.words)
    parts = words.check_phrases(e, r.config.dtype, r.config.amp, own)
    cov = e.section("oracle_coverage")
    if cov:
        parts.append(f"ORACLE COVERAGE {cov['fraction']:.0%} of the parameters ({len(cov['units_checked'])} of "
                     f"{len(cov['units_checked']) + len(cov['units_unchecked'])} units; --check-coverage)")
    detail = "; ".join(parts) or "no figures"
    tolerance = e.tolerance
    if tolerance.compression != "none":
        detail += (f" ({tolerance.compression} on the wire, its rounding "
                   + ("measured in the data-parallel floor)" if tolerance.wire_measured
                      else "bounded: tolerance widened to match)"))
    return detail


def summary_line(payload: Mapping[str, Any]) -> str:
    """The run's line, from the result it wrote."""
    r = RunResult(payload)
    e, m = r.equivalence, r.metrics
    head = f"{r.name} ws={r.world_size} {r.model} [{r.launcher}]: {e.verdict}"
    about_the_run = _about_the_run(r)
    if e.verdict == "unchecked":
        detail = "; ".join(about_the_run)
        return f"{head}{f' ({detail})' if detail else ''} -> {r.result_path}"
    detail = _checks(r)
    if m.step_ms_p50.value is not None:
        detail += f"; step p50 {m.step_ms_p50.value:.1f} ms, {m.samples_per_s.text('.3g', '?')} samples/s"
    if r.compile:
        detail += "; " + _compile_phrase(r.compile)
    if e.first_divergence is not None:
        detail += f"; first divergence at {words.divergence(e.first_divergence)}"
    if e.unverifiable_reason:
        detail += f"; unverifiable: {e.unverifiable_reason}"
    detail += activation_checkpointing.summary_phrase(r.activation_checkpointing, m.peak_mem_mib.value,
                                           m.peak_above_start_mib.value)
    detail += "; replicas identical" if e.replicas_identical else "; REPLICAS DIFFER"
    detail += "".join(f"; {fact}" for fact in _precision_facts(e) + _semantic_facts(e)
                      + float64_paths.phrases(e.section("oracle_precision") or None))
    return f"{head} ({'; '.join([detail, *about_the_run])}) -> {r.result_path}"
