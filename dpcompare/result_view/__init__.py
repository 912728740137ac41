"""The one typed reader of a run's result: frozen views over the JSON object dpcompare.run.result_writer writes and
dpcompare/schema/result.schema.json describes.

Owns: the keys readers name (each declared once here, as the attribute that reads it: `Metrics.step_ms_p50` reads
`metrics.step_ms_p50`), what a missing, null or mistyped value reads as (a `Figure`: the value, or None with why),
refusing a file that is no result of this schema version in one line (`ResultError`), and the facts a run records
once, read back as recorded: its named variant, its knobs, its gradient floor, its power. Readers (the run's line,
compare, report, project, the pytest plugin) take every figure from here; none opens the dict by its keys.

A view holds the result's own dict (`raw`), unchanged: a reader may still hand the whole result on (the pytest
plugin's fixtures return it). Imports nothing of dpcompare but its version: the report reads results without torch.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from dpcompare._version import SCHEMA_VERSION
from dpcompare.result_view.equivalence import Check, Divergence, Equivalence, Note, Tolerance
from dpcompare.result_view.figures import Field, Figure, ResultError, is_number, mapping
from dpcompare.result_view.metrics import MEASURED_NOTHING, NO_METRICS, Metrics

__all__ = ["MEASURED_NOTHING", "NO_METRICS", "STATE_COMPONENTS", "Check", "Config", "Divergence", "Equivalence", "Field", "Figure",
           "Metrics", "Note", "ResultError", "RunResult", "Tolerance", "is_number", "knob_text", "state_ties"]


STATE_COMPONENTS = {
    "forward": "parameters in the forward",
    "masters": "weights the optimizer steps",
    "grads": "gradients held",
    "wire": "reduced in",
    "optimizer": "optimizer state",
    "loss_scale": "loss scale",
}
"""The components of a result's `state`, in the order they are printed, with their column titles."""


def state_ties(runs: Sequence[tuple[str, RunResult]]) -> list[tuple[str, list[str], str]]:
    """The state components that differ between runs at a world size, tied to the notes of those runs that say why (a
    note's `concerns`): (the run's label, the titles of the differing components the note explains, the note's text),
    each note once, in the runs' order."""
    out = []
    for label, run in runs:
        cells = run.state_cells
        peers = [r.state_cells for _, r in runs if r.world_size == run.world_size and r.state_cells]
        differ = [c for c in STATE_COMPONENTS if cells and any(p.get(c, "-") != cells.get(c, "-") for p in peers)]
        for note in run.equivalence.notes:
            if explained := [STATE_COMPONENTS[c] for c in differ if c in note.concerns]:
                out.append((label, explained, note.text))
    return out


# -- the run -------------------------------------------------------------------------------------------------
KNOBS_BEFORE_RECORDED = {"compression": "none", "grad_accum": 1, "bucket_mb": None}
"""Results written before `knobs` was recorded: the run flags compare --sweep varied, at their defaults of then.
Their backend options stand as the named variant they record (`variant=zero2`), if any."""


def knob_text(value: Any) -> str:
    """A knob's value as the command line takes it: true/false, 0.01 and 25 (not 25.0), else as is."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return f"{value:g}" if isinstance(value, float) else str(value)


@dataclass(frozen=True, slots=True)
class Config:
    """The RunConfig the run ran with, as recorded."""

    raw: Mapping[str, Any]

    @property
    def dtype(self) -> str:
        return str(self.raw.get("dtype", "float32"))

    @property
    def amp(self) -> str:
        return str(self.raw.get("amp", "none"))

    @property
    def global_batch_chosen(self) -> bool:
        """Strong scaling without --global-batch: the run chose its batch."""
        return self.raw.get("scaling", "strong") == "strong" and "global_batch" in self.raw \
            and self.raw["global_batch"] is None

    @property
    def measures(self) -> bool:
        """False under --measure-steps 0."""
        return self.raw.get("measure_steps") != 0

    @property
    def inject_slowdown(self) -> float:
        return float(self.raw.get("inject_slowdown", 0.0) or 0.0)


@dataclass(frozen=True, slots=True)
class RunResult:
    """One run's result. `RunResult.parse` refuses what is no result of this schema version; the constructor takes any
    dict (a run's own payload before it is written, a test's partial one) and reads what is there."""

    raw: Mapping[str, Any]
    source: str | None = None
    """The file it was read from (None: not read from a file)."""

    @staticmethod
    def problem(payload: Any) -> str | None:
        """Why `payload` is no run result this dpcompare reads, or None."""
        if not isinstance(payload, Mapping):
            return "not a JSON object"
        if payload.get("schema_version") != SCHEMA_VERSION:
            return f"schema_version {payload.get('schema_version')!r}; this dpcompare reads {SCHEMA_VERSION}"
        if not isinstance(payload.get("backend"), str):
            return f"backend {payload.get('backend')!r} is not a string"
        ws = payload.get("world_size")
        if not isinstance(ws, int) or isinstance(ws, bool) or ws < 1:
            return f"world_size {ws!r} is not a positive whole number"
        if payload.get("metrics") is not None and not isinstance(payload["metrics"], Mapping):
            return "metrics is not an object"
        return None

    @classmethod
    def parse(cls, payload: Any, source: str | None = None) -> RunResult:
        problem = cls.problem(payload)
        if problem is not None:
            raise ResultError(f"{source or 'the result'}: {problem}")
        return cls(payload, source)

    @classmethod
    def read(cls, path: str | Path) -> RunResult:
        """The result in the file at `path`, or ResultError saying in one line why it is none."""
        try:
            payload = json.loads(Path(path).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ResultError(f"{path}: not readable JSON ({exc})") from None
        return cls.parse(payload, str(path))

    # -- who ran -----------------------------------------------------------------------------------------
    @property
    def backend(self) -> str:
        return str(self.raw.get("backend"))

    @property
    def variant(self) -> str:
        """The named variant of its backend the run's options make (Adapter.VARIANTS: `zero2`), '' for none."""
        return str(self.raw.get("variant") or "")

    @property
    def name(self) -> str:
        """`deepspeed:zero2`, or the backend's name."""
        return f"{self.backend}:{self.variant}" if self.variant else self.backend

    @property
    def world_size(self) -> int:
        return int(self.raw.get("world_size") or 0)

    @property
    def label(self) -> str:
        return f"{self.backend}/{self.world_size}"

    @property
    def launcher(self) -> str | None:
        return self.raw.get("launcher")

    @property
    def model(self) -> str | None:
        return self.raw.get("model")

    @property
    def device(self) -> str | None:
        return self.raw.get("device")

    @property
    def tag(self) -> str | None:
        tag = self.raw.get("tag")
        return tag if isinstance(tag, str) else None

    @property
    def created_unix(self) -> float:
        """When it was written (-inf for a result without the time: the oldest)."""
        value = self.raw.get("created_unix")
        return float(value) if is_number(value) else -math.inf

    @property
    def result_path(self) -> str | None:
        return self.raw.get("result_path")

    # -- what it ran -------------------------------------------------------------------------------------------
    @property
    def global_batch(self) -> int | None:
        return self.raw.get("global_batch")

    @property
    def local_batch(self) -> float | None:
        """Samples per rank per step: recorded, else the global batch over the world size."""
        lb, gb = self.raw.get("local_batch"), self.raw.get("global_batch")
        if is_number(lb) and lb > 0:
            return lb
        return float(gb) / self.world_size if is_number(gb) and gb > 0 and self.world_size else None

    @property
    def scaling(self) -> str | None:
        """strong or weak (the metrics' record in older results), None where neither says."""
        return self.raw.get("scaling") or mapping(self.raw.get("metrics")).get("scaling")

    @property
    def config(self) -> Config:
        return Config(mapping(self.raw.get("config")))

    @property
    def env(self) -> Mapping[str, Any]:
        return mapping(self.raw.get("env"))

    @property
    def scaling_baseline(self) -> bool:
        """Its backend declares itself the denominator of scaling efficiency (capabilities.scaling_baseline; a
        result written before capabilities were recorded declares nothing)."""
        return mapping(self.raw.get("capabilities")).get("scaling_baseline") is True

    @property
    def native_launcher(self) -> str | None:
        """The launcher its backend's adapter declares (capabilities.native_launcher)."""
        return mapping(self.raw.get("capabilities")).get("native_launcher")

    @property
    def knobs(self) -> Mapping[str, Any]:
        """What the run changes from its backend's baseline computation, as recorded when it was written (the run
        flags compare --sweep varies, and the backend options its named variants set or its precision recipe);
        {} for a baseline run. Results written before it was recorded: their sweep flags, and their named variant."""
        if isinstance(self.raw.get("knobs"), Mapping):
            return self.raw["knobs"]
        config = self.config.raw
        knobs = {k: config[k] for k, default in KNOBS_BEFORE_RECORDED.items() if config.get(k, default) != default}
        return {**({"variant": self.variant} if self.variant else {}), **knobs}

    @property
    def knob_label(self) -> str:
        """'' for a baseline run, else `zero_stage=2 bucket_mb=25`: the knobs in the order recorded."""
        return " ".join(f"{k}={knob_text(v)}" for k, v in self.knobs.items())

    # -- what it found -----------------------------------------------------------------------------------------
    @property
    def equivalence(self) -> Equivalence:
        return Equivalence(mapping(self.raw.get("equivalence")))

    @property
    def metrics(self) -> Metrics:
        metrics = self.raw.get("metrics")
        return Metrics(mapping(metrics), measured=isinstance(metrics, Mapping), written="metrics" in self.raw)

    @property
    def compile(self) -> Mapping[str, Any] | None:
        """--compile: what torch.compile did (None: not compiled)."""
        return self.raw.get("compile") or None

    @property
    def activation_checkpointing(self) -> Mapping[str, Any] | None:
        """The blocks recomputed in backward (None: none)."""
        return self.raw.get("activation_checkpointing") or None

    @property
    def state_cells(self) -> Mapping[str, str]:
        """What the run held for the model's state, one phrase per component of STATE_COMPONENTS (dpcompare.run.
        state_table); {} where it was not read (results written before it was recorded)."""
        state = self.raw.get("state")
        return mapping(state.get("cells")) if isinstance(state, Mapping) else {}

    def at(self, path: str) -> Any:
        """The value at a dotted path (`metrics.step_ms_p50`), None where any part is missing: for a figure kept as
        recorded beside its text (compare --suite questions)."""
        value: Any = self.raw
        for key in path.split("."):
            if not isinstance(value, Mapping):
                return None
            value = value.get(key)
        return value
