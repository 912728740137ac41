"""`compare --suite NAME`: presets, each a set of compare flags that answers one question in one command.

A preset fills only the flags the command line did not give: `--suite sharding --world-sizes 2` runs the preset at
world size 2. The parser records which flags were given (record_given) so a flag given with its default value still
wins over the preset; compare's spec (dpcompare.commands.compare.spec) reads the preset once, and nothing sets it
on the namespace.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Mapping

GIVEN = "given_flags"
"""The namespace attribute holding the dests of the flags given on the command line (absent: none given)."""


@dataclass(frozen=True, slots=True)
class Suite:
    summary: str
    """What the preset runs and why, for --help."""
    values: Mapping[str, Any]
    """compare's flags by dest, as argparse would have stored them."""
    checkpoint: bool = False
    """Its runs are the checkpoint matrix's cells (dpcompare.commands.checkpoint): a save and a load each."""
    questions: bool = False
    """Its runs are the rows of dpcompare.commands.compare.questions, each posing one question with flags of its own
    (the workload too), instead of every backend at every world size on one workload."""


SUITES: dict[str, Suite] = {
    "sharding": Suite(
        summary="what sharding buys: ddp, deepspeed ZeRO stages 0-3 (deepspeed:zero0..zero3) and fsdp at world sizes "
                "1 and 2 under AdamW, whose two moments per parameter make the optimizer state half the model state, "
                "on mlp-wide (0.8 M parameters) at global batch 256, where the model state outweighs the "
                "activations; 2 checked steps, 1 warm-up, 5 timed steps (a few minutes on two CPU cores). A backend "
                "this dpcompare does not register or have installed is listed as unavailable",
        values={"backends": "ddp,deepspeed:zero0,deepspeed:zero1,deepspeed:zero2,deepspeed:zero3,fsdp",
                "world_sizes": "1,2", "model": "mlp-wide", "optimizer": "adamw", "global_batch": 256, "steps": 2,
                "warmup_steps": 1, "measure_steps": 5},
    ),
    "questions": Suite(
        summary="the questions users ask in the backends' trackers, each answered by runs judged against the oracle "
                "with the figure that settles it: gradient clipping under every backend (the norm each reports), "
                "HSDP at 4 ranks against plain FSDP (what each sends, by kind), torch.compile and activation "
                "checkpointing with dropout (their cost set against the run without them); 4 checked steps, "
                "1 warm-up, 5 timed steps, no microbenchmark (a few minutes on two CPU cores). The workload is each "
                "question's own: --model and --global-batch do not apply",
        values={"steps": 4, "warmup_steps": 1, "measure_steps": 5, "collectives": "none"},
        questions=True,
    ),
    "checkpoint": Suite(
        summary="moving a run between backends: every pair of --backends (default ddp, fsdp, deepspeed:zero1..zero3, "
                "horovod) at --world-sizes (default 1,2,4) saves 4 steps in the first's format and continues 4 under "
                "the second through the libraries' own conversions or dpcompare convert, judged against one "
                "uninterrupted float64 run; mlp-dropout, AdamW, global batch 32 unless given "
                "(324 cells, each side saved once: about 1 h 45 min on two CPU cores as `python -m dpcompare checkpoint "
                "--matrix all --jobs 2`, whose `--resume` finishes an invocation cut short; "
                "`python -m dpcompare checkpoint` runs a covering subset)",
        values={}, checkpoint=True,
    ),
}


def help_text() -> str:
    return ("a preset of the flags below; flags given beside it win. " + "; ".join(
        f"{name}: {suite.summary}" for name, suite in SUITES.items()))


def given(ns: argparse.Namespace) -> frozenset[str]:
    return getattr(ns, GIVEN, frozenset())


def preset(name: str | None, given: frozenset[str]) -> dict[str, Any]:
    """The preset's value of every flag the command line did not give (no --suite: none)."""
    if not name:
        return {}
    if name not in SUITES:
        raise ValueError(f"--suite {name!r} is unknown: choose one of {', '.join(SUITES)}")
    return {dest: value for dest, value in SUITES[name].values.items() if dest not in given}


def poses_questions(name: str | None) -> bool:
    """The runs are the questions' rows (--suite questions)."""
    return bool(name) and name in SUITES and SUITES[name].questions


def lists_backends(name: str | None, given: frozenset[str]) -> bool:
    """The backends come from a --suite preset, not from --backends: one this dpcompare lacks is left out, not
    refused."""
    return bool(name) and "backends" not in given and "backends" in SUITES[name].values


def _recording(base: type[argparse.Action]) -> type[argparse.Action]:
    class Given(base):  # type: ignore[valid-type,misc]
        def __call__(self, parser, namespace, values, option_string=None):  # noqa: ANN001
            super().__call__(parser, namespace, values, option_string)
            setattr(namespace, GIVEN, given(namespace) | {self.dest})

    Given.__name__ = Given.__qualname__ = f"Given{base.__name__}"
    return Given


def record_given(parser: argparse.ArgumentParser) -> None:
    """Make every flag added to `parser` afterwards record its dest in the namespace's GIVEN set when given."""
    for name in (None, "store", "store_true", "store_false", "append"):
        parser.register("action", name, _recording(parser._registry_get("action", name)))
