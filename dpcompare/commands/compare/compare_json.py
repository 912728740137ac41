"""compare.json, the summary of one compare: the invocation, every run with its outcome (label, backend and named
variant, world size, the knob it changes, status, wall time, error, command, result path, verdict), the backends
unavailable, the sweep combinations skipped, and the cross-run figures (scaling, the gradient matrix,
unused-parameter gradients, skipped steps)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from dpcompare import json_files
from dpcompare.commands.compare import plan
from dpcompare.commands.compare.spec import CompareSpec


def payload(spec: CompareSpec, run_dir: Path, planned: plan.Plan, figures: dict[str, Any],
            questions: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """compare.json: the invocation, every run and its outcome, the cross-run figures, and under --suite questions
    each question's answer (dpcompare.commands.compare.questions.answers)."""
    collectives = run_dir / "collectives.json"
    return json_files.base_payload(
        kind="compare",
        created_unix=time.time(),
        suite=spec.suite, backends=spec.backends,
        model=spec.run.model, steps=spec.run.steps, measure_steps=spec.run.measure_steps,
        global_batch=spec.global_batch, scaling_mode=spec.run.scaling, amp=spec.run.amp,
        optimizer=spec.run.optimizer, clip_grad_norm=spec.run.clip_grad_norm,
        activation_checkpointing=spec.run.activation_checkpointing, compile=spec.run.compile,
        runs=[run_entry(j) for j in planned.jobs],
        unavailable=planned.unavailable,
        sweep_skipped=planned.sweep_skipped,
        scaling=figures["scaling"],
        matrix=figures["matrix"],
        unused_parameter_grads=figures["unused_parameter_grads"],
        skipped_steps=figures["skipped_steps"],
        collectives=str(collectives) if collectives.exists() else None,
        questions=questions,
        env=json_files.environment(),
    )


def run_entry(job: plan.Job) -> dict[str, Any]:
    return {"label": job.label, "backend": job.backend, "entry": job.entry,
            "backend_variant": job.backend_variant or None, "options": job.options,
            "world_size": job.world_size, "knob": job.knob, "question": job.question or None,
            "status": job.status, "wall_s": job.wall_s, "error": job.error, "command": job.command,
            "result_path": None if job.result_path is None else str(job.result_path),
            "verdict": job.result.equivalence.verdict if job.result is not None else None}
