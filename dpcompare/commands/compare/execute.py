"""Running what was planned: the bench-collectives microbenchmark first, then each job as a subprocess of
its launcher (dpcompare.run.launchers.run_process: own session, output in the job's log, the whole process
tree killed on timeout), and each job's outcome: its result JSON, found by tag, and its status.
"""

from __future__ import annotations

import sys
from pathlib import Path

from dpcompare.commands.compare.plan import Job, capabilities
from dpcompare.commands.compare.spec import CompareSpec
from dpcompare.result_view import ResultError, RunResult
from dpcompare.run.launchers import run_process


def run_microbenchmark(spec: CompareSpec, run_dir: Path, jobs: list[Job], timeout_s: float) -> str | None:
    """`compare --collectives auto`: a short all-reduce sweep over the transports the runs use, at the
    world sizes above 1, so each run can quote the link's busbw at its own message size. Returns an
    error line, or None."""
    sizes = sorted({j.world_size for j in jobs if j.world_size > 1})
    if spec.collectives != "auto" or not sizes or spec.run.measure_steps == 0:
        return None
    transports = sorted({capabilities(j.backend).collective_transport for j in jobs if j.world_size > 1})
    log = run_dir / "logs" / "bench-collectives.log"
    out = run_dir / "collectives.json"
    cmd = [sys.executable, "-m", "dpcompare", "bench-collectives", "--transports", ",".join(transports),
           "--world-sizes", ",".join(map(str, sizes)), "--max-bytes", "16MiB", "--out", str(out)]
    finished = run_process(cmd, timeout_s=timeout_s, log=log)
    if finished.returncode != 0 or not out.exists():
        return f"bench-collectives failed (log: {log}); runs report no microbenchmark busbw"
    return None


def drop_collectives(jobs: list[Job]) -> None:
    """Take --collectives FILE out of every job's command: runs must not point at a file that is not there."""
    for job in jobs:
        if "--collectives" in job.command:
            i = job.command.index("--collectives")
            del job.command[i:i + 2]


def execute(job: Job, timeout_s: float) -> None:
    """Run the job under its launcher and record its wall time, result and status. Once the launcher has
    returned (or compare is interrupted), the job's fence is closed: a rank that outlived the process-tree
    kill writes nothing into this run folder afterwards."""
    try:
        finished = run_process(job.command, timeout_s=timeout_s, log=job.log)
    finally:
        job.fence.parent.mkdir(parents=True, exist_ok=True)
        job.fence.touch()
    job.wall_s = finished.wall_s
    job.result, job.result_path = _find_result(job)
    if finished.timed_out:
        job.status, job.error = "timeout", f"no result within {timeout_s:g} s (log: {job.log})"
    elif finished.returncode != 0 or job.result is None:
        lines = [ln for ln in job.log.read_text().splitlines() if "error" in ln.lower()]
        job.status = "failed"
        job.error = (lines[-1].strip() if lines else f"exit status {finished.returncode}") + f" (log: {job.log})"
    else:
        job.status = job.result.equivalence.verdict or "failed"


def _find_result(job: Job) -> tuple[RunResult | None, Path | None]:
    """The result the job's run wrote (tagged with the job's label; the last one if several), or None."""
    found: tuple[RunResult | None, Path | None] = (None, None)
    for path in sorted((job.log.parent.parent / "runs").glob("*.json")):
        try:
            candidate = RunResult.read(path)
        except ResultError:
            continue  # not a result of this dpcompare: not this job's
        if candidate.tag == job.label:
            found = (candidate, path)
    return found
