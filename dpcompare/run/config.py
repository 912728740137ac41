"""Run configuration: one validated dataclass, built from the command line or from an experiment.

Owns: the fields of a run, each with its flag declared once as field metadata (dpcompare.run.flags: help, checks,
whether compare forwards it, whether an adapter sees it), their validation, and the default-global-batch rule.
Errors name the field, the value received and the fix. Imports no backend and no torch.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

from dpcompare.run import flags, registry
from dpcompare.run.faults import CHECKPOINT_FAULTS, fault_ok as _fault_ok  # noqa: F401 - the run's, named here
# CommandLineError is the flags' own; the rest of the run imports it from here, beside RunConfig.
from dpcompare.run.flags import CommandLineError, Forwarded, Rule, above, at_least, coverage_ok, power_of_two, run_flag  # noqa: F401,E501

Dtype = Literal["float32", "float64", "bfloat16"]
Compression = Literal["none", "fp16", "bf16"]
Amp = Literal["none", "bf16", "fp16"]
Scaling = Literal["strong", "weak"]
LossNormalisation = Literal["local", "global"]
TokenData = Literal["padded", "packed"]
OracleRanks = Literal["all", "rank0"]
DeviceChoice = Literal["auto", "cpu", "cuda"]


class SaidByAnotherRank(Exception):
    """This rank leaves without a word: another rank of the launch says why the run ends (its model raised, a setting
    the run refused), and what failed here (a collective that lost that rank) follows from it. wait_for_launcher: that
    rank has yet to say it, so this one waits, silent, for the launcher to end it rather than leave first (a launcher
    ends every rank once one has left)."""

    def __init__(self, wait_for_launcher: bool = False) -> None:
        super().__init__("another rank says why the run ends")
        self.wait_for_launcher = wait_for_launcher


RUN_GLOBAL_BATCH_TARGET = 24
"""The global batch a run aims at when --global-batch is not given (default_global_batch rounds it up to what its
world size x --grad-accum divides)."""
COMPARE_GLOBAL_BATCH_TARGET = 2048
"""The global batch compare aims at when --global-batch is not given (default_global_batch rounds it up to what
every world size divides): at 2048, compute dominates a step of mlp-wide at world size 2 on a CPU core."""


def default_global_batch(*units: int, target: int = RUN_GLOBAL_BATCH_TARGET) -> int:
    """The default-global-batch rule: the smallest multiple of every unit (ranks x micro-batches per step) that is at
    least `target`, so every shard and micro-batch is equal. A run: one unit, world_size x grad_accum (1-3 ranks: 24;
    16 ranks: 32; 5 ranks: 25); compare: each world size, at COMPARE_GLOBAL_BATCH_TARGET."""
    unit = math.lcm(*units)
    return unit * -(-target // unit)


MAX_TIMEOUT_S = 7 * 24 * 3600.0
"""--timeout-s above this is refused: watchdogs and socket timeouts take it as a C integer of milliseconds."""


def _env_number(name: str, default: float) -> Callable[[], float]:
    def read() -> float:
        text = os.environ.get(name)
        if not text:
            return default
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"{name}={text!r} is invalid: use a number, e.g. {name}=0.2") from None

    return read


FORMATS = ("torch", "dcp", "deepspeed", "universal")
"""--checkpoint-format's values: dpcompare.contract.checkpoint_io.FORMATS, named here so that parsing the flags never
imports the contract (and torch)."""
@dataclass(kw_only=True, slots=True)
class RunConfig:
    """A run's settings, one field per run flag. Adding a flag is adding a field here (plus a `Settings` field where
    an adapter sees it): the run's parser, compare's, the argv of every launch and validation follow from it."""

    backend: str = run_flag(
        "reference", always=True, help=lambda: f"{', '.join(registry.BACKENDS)}, or package.module:Class",
        checks=(Rule(lambda v, _: bool(v), "name a backend (reference, dp, ddp, horovod, deepspeed, fsdp) or "
                     "package.module:Class"),))
    """Registered backend name (reference, dp, ddp, horovod, deepspeed, fsdp: dpcompare.run.registry.BACKENDS) or
    `package.module:Class`."""
    model: str = run_flag(
        "mlp", help=lambda: f"{', '.join(registry.MODELS)}, package.module:function, or hf:NAME_OR_PATH (a Hugging "
                            "Face transformers config: a folder holding config.json, or a hub name whose config is "
                            "cached)",
        compare=Forwarded("workload, a name, package.module:function or hf:NAME_OR_PATH (a transformers config); "
                          "mlp-wide (0.8 M parameters) is compute-bound on a CPU core at the default global batch, so "
                          "the costs compare backends rather than Python overhead", default="mlp-wide"))
    """Built-in workload (dpcompare.run.registry.MODELS: the toys mlp, mlp-wide, mlp-dropout, mlp-unused, cnn, lm; the
    real models resnet18, resnet50, resnet18-cifar, resnet50-cifar, gpt-tiny, gpt-mini, gpt2-small, gpt2-medium) or
    `package.module:function` returning a Workload, or `hf:NAME_OR_PATH`: a Hugging Face transformers model built from
    its config with random weights (dpcompare.run.hf_models; needs the `hf` extra)."""
    seq_len: int | None = run_flag(
        None, help="hf: causal language models: tokens per sample (default: 128, at most the config's context)",
        checks=(above(0, "use a positive number of tokens per sample"),
                Rule(lambda v, c: c.model.startswith("hf:"), lambda c: "it sets the sample length of an hf: causal "
                     f"language model; --model {c.model} fixes its own: drop --seq-len")),
        compare=Forwarded("hf: causal language models: tokens per sample of every run (default: 128, at most the "
                          "config's context)"))
    """Tokens per sample of an `hf:` causal language model (default: 128, at most the config's context)."""
    token_data: TokenData = run_flag(
        "padded", help="a token model's data (the built-ins lm and gpt-*, hf: language models): padded (sequences of "
                       "varying length padded at the end, targets -100 there; masked LMs mask 15%% of each sample at "
                       "random, 80/10/10) or packed (every sample full length)",
        compare=Forwarded("a token model's data: padded (varying lengths padded at the end, -100 targets there) or "
                          "packed (full-length samples)"))
    """A token workload's data (dpcompare.run.workloads.token_stream, dpcompare.run.hf_tasks): `padded`, sequences of
    varying length padded at the end, their padding's targets -100 (the loss's ignore index), as a collator pads
    them; `packed`, every sample the full context."""
    device: DeviceChoice = run_flag("auto", help="auto: CUDA when present (NCCL process group), else CPU (gloo)")
    """auto: CUDA when available (process group NCCL), else CPU (gloo)."""
    global_batch: int | None = run_flag(
        None, help="samples per step over all ranks (default: the smallest multiple of the world size x --grad-accum "
                   f"that is at least {RUN_GLOBAL_BATCH_TARGET}, said in the run's line)",
        checks=(above(0, "use a positive whole number of samples"),),
        compare=Forwarded(f"samples per step over all ranks (default: {COMPARE_GLOBAL_BATCH_TARGET}, or the smallest "
                          "multiple of every world size above it; at 2048, compute dominates a step of mlp-wide at "
                          "world size 2 on a CPU core)"))
    """Strong scaling: samples per step over all ranks; each rank gets global_batch / world_size. None: the smallest
    multiple of world_size x grad_accum that is at least RUN_GLOBAL_BATCH_TARGET, so a run starts at any world size
    (16 ranks: 32); the run's line says what it chose."""
    local_batch: int | None = run_flag(None, help="per-rank batch (weak scaling)",
                                       checks=(above(0, "use a positive whole number of samples per rank"),))
    """Weak scaling: samples per step per rank; the global batch is local_batch * world_size."""
    scaling: Scaling = run_flag(
        "strong", help="strong: fixed global batch; weak: fixed --local-batch per rank",
        checks=(Rule(lambda v, c: v != "weak" or c.local_batch is not None,
                     "weak scaling fixes the per-rank batch: also pass --local-batch N"),),
        compare=Forwarded("strong: fixed global batch; weak: fixed per-rank batch (global batch / largest world "
                          "size)"))
    steps: int = run_flag(
        4, help="verification steps, each checked against the oracle", checks=(at_least(1, "run at least one step"),),
        compare=Forwarded("verification steps, each checked against the oracle; 2 check a fresh optimizer, then the "
                          "state the first step left", default=2))
    """Verification phase: optimizer steps with the equivalence check (see check_every)."""
    warmup_steps: int = run_flag(2, help="measurement: steps not timed", checks=(at_least(0, "use 0 or more steps"),),
                                 compare=Forwarded("untimed steps per run before the timed ones", default=3))
    """Measurement phase: unmeasured steps first (allocator, bucket rebuild, caches)."""
    measure_steps: int = run_flag(
        10, help="measurement: timed steps after the verification (0: no costs, verdict only)",
        checks=(at_least(0, "use 0 (no measurement) or more steps"),),
        compare=Forwarded("timed steps per run (0: verdicts only)", default=20))
    """Measurement phase: timed steps after the warm-up, with no check running (0: no measurement). A few by default,
    so a launcher run reports its costs; compare and the regression suite set their own."""
    ablation_steps: int | None = run_flag(
        None, help="measurement: synced/unsynced step pairs for exposed communication (default: --measure-steps)",
        checks=(at_least(0, "use 0 or more pairs"),))
    """Pairs of synced/unsynced steps for exposed communication (default: measure_steps)."""
    instrument: bool = run_flag(True, help="measurement: only the loop wall clock", settings=True)
    """Per-step clocks, memory window and native comm counters in the measurement phase (off: only the loop's wall
    clock, to measure the instrumentation's own cost)."""
    profile: bool = run_flag(False, help="measurement: a torch.profiler trace per rank of a few steps after the "
                             "measured ones (Chrome/Perfetto JSON under OUT/traces/)", compare=Forwarded(
                                 "a torch.profiler trace per rank of every run (OUT/runs/traces/)"))
    """A Chrome/Perfetto trace per rank of PROFILE_STEPS steps run after the measured window (its figures untouched)."""
    collectives: str | None = run_flag(None, help="bench-collectives JSON to quote the microbenchmark busbw from")
    """A bench-collectives JSON: its busbw at this run's message size is reported beside the run's."""
    lr: float = run_flag(0.05, help="learning rate",
                         checks=(Rule(lambda v, _: 0 < v < 1e3, "use a positive learning rate below 1000"),))
    optimizer: str = run_flag(
        "sgd", help="optimizer: sgd, adamw, or package.module:function (model) -> torch.optim.Optimizer",
        checks=(Rule(lambda v, _: v in ("sgd", "adamw") or ":" in v, "use sgd, adamw or package.module:function"),),
        compare=Forwarded("every run's optimizer: sgd, adamw (two moments per parameter: the state ZeRO and FSDP "
                          "shard) or package.module:function"))
    """sgd, adamw, or `package.module:function` returning the optimizer over the model it is given, parameter groups
    and all (dpcompare.run.optim; --lr, --momentum and --weight-decay then set nothing)."""
    scheduler: str | None = run_flag(
        None, help="learning-rate schedule: package.module:function (optimizer) -> scheduler, stepped after every "
                   "optimizer step", checks=(Rule(lambda v, _: ":" in v, "give package.module:function"),),
        compare=Forwarded("every run's learning-rate schedule: package.module:function (optimizer) -> scheduler"))
    momentum: float = run_flag(0.9, help="SGD momentum",
                               checks=(Rule(lambda v, _: 0 <= v < 1, "use a value in [0, 1)"),))
    """SGD momentum (ignored by AdamW)."""
    weight_decay: float = run_flag(0.0, help="weight decay", checks=(at_least(0, "use a value >= 0"),))
    clip_grad_norm: float | None = run_flag(
        None, metavar="MAX_NORM", settings=True,
        help="clip the reduced gradient's global norm to MAX_NORM before each step (default: no clipping)",
        checks=(above(0, "use a positive total norm, e.g. 1.0 (leave the flag out for no clipping)"),),
        compare=Forwarded("every run clips the reduced gradient's global norm to MAX_NORM before each step, each "
                          "backend by its own mechanism (default: no clipping)"))
    """Clip the reduced gradient by its global norm to at most this value before every optimizer step, each backend
    its own way (None: no clipping). The oracle's reference step clips the same way, and the total norm each backend
    reports is checked against the oracle's (the grad_norm check)."""
    activation_checkpointing: bool = run_flag(
        False, help="each block of the model (those FSDP shards) recomputes its forward in backward instead of keeping "
                    "its activations (non-reentrant torch.utils.checkpoint, dropout masks preserved)",
        compare=Forwarded("every run recomputes each block of the model in backward instead of keeping its "
                          "activations (the runs' peak memory then shows what it saves)"))
    """Each block of the model (dpcompare.block_modules, the units FSDP shards) keeps no activations for backward and
    recomputes its forward there (non-reentrant torch.utils.checkpoint, the generator state of the forward restored,
    so dropout draws the same masks). Refused for a backend whose capabilities say it cannot."""
    compile: bool = run_flag(
        False, settings=True,
        help="torch.compile the model (reference, ddp, fsdp, deepspeed, horovod); needs a C++ compiler (g++, or the "
             "one $CXX names); compile time is reported apart from the step time",
        compare=Forwarded("every run compiles its model with torch.compile (backends that declare no compiled path "
                          "are listed as unavailable); needs a C++ compiler"))
    """torch.compile the model as the backend supports it (Adapter.compile; refused where its capabilities say it
    cannot). The float64 oracle stays uncompiled; the run-precision reference's floor then includes a compiled copy's
    rounding, and compile time, graphs, graph breaks and recompilations are reported apart from the step time."""
    dtype: Dtype = run_flag(
        "float32", help="parameter and compute dtype",
        checks=(Rule(lambda v, c: c.amp == "none" or v == "float32", lambda c: f"--amp {c.amp} keeps parameters and "
                     "optimizer in float32 and runs the forward in lower precision itself; drop --dtype (or drop "
                     "--amp for a whole-model dtype)"),))
    """Parameter and compute dtype of the run; the oracle is always float64."""
    amp: Amp = run_flag(
        "none", settings=True,
        help="mixed precision: forward and loss under torch.autocast in bf16 or fp16, parameters and optimizer "
             "float32; fp16 scales the loss dynamically (deepspeed: --opt amp_recipe=engine for its own bf16/fp16 "
             "engine with fp32 master weights)",
        compare=Forwarded("mixed precision: run every backend under torch.autocast in this dtype (fp16 with each "
                          "backend's own dynamic loss scaling); deepspeed additionally runs its engine recipe (--opt "
                          "amp_recipe=engine: bf16/fp16 weights, fp32 master weights)"))
    """Mixed precision: the forward and the loss run under torch.autocast in bf16 or fp16 while parameters and optimizer
    stay float32 (DeepSpeed: `--opt amp_recipe=engine` selects its bf16/fp16 engine with fp32 master weights instead).
    fp16 scales the loss dynamically, each backend its own documented way; bf16 needs no scaling."""
    loss_scale: float | None = run_flag(
        None, settings=True,
        help="--amp fp16: initial dynamic loss scale, a power of two (default: 65536 = 2^16; 16777216 = 2^24 makes "
             "the first steps overflow, which every backend must skip)",
        checks=(Rule(lambda v, c: c.amp == "fp16", "a loss scale applies to --amp fp16 only (bf16 has float32's range "
                     "and is not scaled); add --amp fp16 or drop --loss-scale"),
                Rule(power_of_two, "use a power of two of at least 1, e.g. 65536 (2^16) or 16777216 (2^24)")))
    """--amp fp16: the initial dynamic loss scale, a power of two (None: 2^16, the default of torch.amp.GradScaler and
    of DeepSpeed). 2^24 makes the first steps overflow: every backend must skip them alike. Settings carries the
    scale the run starts from (initial_loss_scale)."""
    seed: int = run_flag(1234, help="seed of the weights and the data",
                         checks=(Rule(lambda v, _: 0 <= v < 2**32, "use a whole number from 0 to 4294967295"),))
    check_every: int = run_flag(1, help="check every Nth step (0: no checks)",
                                checks=(at_least(0, "use 0 (no checks) or a positive step interval"),))
    """Run the equivalence check every N steps (step 0 always); 0 disables gradient checks."""
    grad_accum: int = run_flag(1, help="micro-batches per step",
                               checks=(at_least(1, "use 1 (no accumulation) or more micro-batches per step"),))
    """Micro-batches per optimizer step; gradient synchronisation is switched off for all but the last
    and each micro-batch's loss is scaled by 1/grad_accum, so the step's gradient is the global mean."""
    loss_normalisation: LossNormalisation = run_flag(
        "local", help="a loss normalised over items (tokens not ignored): local (each rank and micro-batch divides by "
                      "its own count, as a plain training loop does) or global (the count summed over the ranks and "
                      "micro-batches first, as transformers' num_items_in_batch)",
        compare=Forwarded("a loss normalised over items: local (each rank's and micro-batch's own count), global (the "
                          "count summed over the ranks and micro-batches first)"))
    """How a loss over items is normalised (dpcompare.contract.normalisation): `local`, by each forward's own count;
    `global`, by the step's count, all-reduced over the ranks and summed over the micro-batches before the backward."""
    compression: Compression = run_flag("none", help="gradient compression on the wire", settings=True)
    """Gradient compression on the wire (DDP fp16/bf16 comm hook, Horovod Compression.fp16, DeepSpeed
    communication_data_type); the tolerance widens by the compressed dtype's unit roundoff."""
    bucket_mb: float | None = run_flag(None, help="all-reduce bucket / fusion size in MiB (default: the backend's own)",
                                       checks=(above(0, "use a positive size in MiB"),), settings=True)
    """All-reduce message size: DDP bucket_cap_mb, HOROVOD_FUSION_THRESHOLD; DeepSpeed ZeRO-0 has no bucket."""
    sync_bn: bool = run_flag(False, help="global-batch BatchNorm statistics")
    """Convert BatchNorm layers to a global-batch (synchronised) BatchNorm."""
    no_dropout: bool = run_flag(False, help="switch dropout off (p=0) so the forward is deterministic and the verdict "
                                            "can check it")
    """Set every dropout probability to 0: a forward that draws no random numbers can always be checked
    (with dropout on, the check applies the masks each rank drew where they can be captured, else says
    `unverifiable` and names the module)."""
    oracle_ranks: OracleRanks = run_flag(
        "all",
        help="where the oracle's forwards run: all (every rank its own forwards of the float64 oracle, the "
             "run-precision references and the reference trajectory, added in a fixed order, each rank holding its "
             "range of the parameters' sums and trajectory) or rank0 (rank 0 runs every forward alone: the "
             "single-process oracle)",
        compare=Forwarded("where each run's oracle forwards run: all (every rank its own, each holding its range) or "
                          "rank0"))
    """Where the oracle's forwards run (dpcompare.verify.memory.divider): `all`, every rank its own on a process group of the
    verifier's own; `rank0`, rank 0 alone (the same gradients to the bit with one forward per rank)."""
    check_coverage: str = run_flag(
        "auto", metavar="auto|full|SHARE",
        help="what the float64 oracle checks: auto (every parameter where its memory fits on rank 0, else as many "
             "whole blocks as fit, stated), full (all or a one-line refusal), or a share in (0, 1]",
        checks=(Rule(coverage_ok, "use auto, full or a share of the parameters in (0, 1], e.g. 0.25"),),
        compare=Forwarded("what each run's float64 oracle checks: auto (every parameter where its memory fits, else "
                          "the whole blocks that fit, stated), full, or a share of the parameters in (0, 1]"))
    """What the float64 oracle checks (dpcompare.verify.memory.oracle_coverage): `auto`, every parameter where its memory
    fits on rank 0, else as many whole blocks as fit, the coverage stated; `full`, every parameter or a one-line
    refusal; a fraction in (0, 1], whole blocks up to that share of the parameters."""
    timeout_s: float = run_flag(
        120.0, help="exit when a rank makes no progress this long",
        checks=(Rule(lambda v, _: v <= MAX_TIMEOUT_S, f"use at most {MAX_TIMEOUT_S:g} seconds (a week)"),
                above(0, "use a positive number of seconds")))
    """A rank that makes no progress for this long makes every rank exit with an error naming it."""
    out: str = run_flag("results", help="directory for the JSON result")
    """Directory for the run's JSON result."""
    dump_grads: str | None = run_flag(None, help="write checked-step gradients to this .npz")
    """Write the reduced and oracle gradients of every checked step to this .npz file (for `compare`)."""
    save_checkpoint: str | None = run_flag(
        None, metavar="DIR", help="after the verification steps, save the run's state to DIR in its backend's own "
                                  "format (--checkpoint-format), with the loop's state and the oracle's trajectory")
    """Save the state after the verification steps to this directory (dpcompare.run.checkpoint)."""
    load_checkpoint: str | None = run_flag(
        None, metavar="DIR", help="start from the checkpoint in DIR (saved with --save-checkpoint, or converted by "
                                  "`python -m dpcompare checkpoint`): its steps continue, judged against one "
                                  "uninterrupted float64 run")
    """Start from this checkpoint: the verification steps continue the saved run's (dpcompare.run.checkpoint)."""
    checkpoint_format: str | None = run_flag(
        None, help=f"the checkpoint format saved and loaded ({', '.join(FORMATS)}; default: the backend's own)",
        checks=(Rule(lambda v, _: v in FORMATS, f"use one of {', '.join(FORMATS)}"),))
    tag: str | None = run_flag(None, help="free text copied into the result (compare groups runs by it)")
    closed_if: str | None = run_flag(None, metavar="FILE", hidden=True, help="")
    """A fence file: when it exists, the run writes neither result nor gradient dump and fails. compare creates it for a
    launch it stopped waiting for: a rank that outlived its launcher never adds a late result to a finished run."""
    dp_devices: int | None = run_flag(None, help="dp: CUDA devices to replicate over (default: all)", settings=True,
                                      checks=(above(0, "use a positive device count"),))
    """Backends that replicate over devices in one process (dp): how many CUDA devices (default: all visible)."""
    inject_slowdown: float = run_flag(
        default_factory=_env_number("DPCOMPARE_INJECT_SLOWDOWN", 0.0),
        help="testing aid: each step spins this fraction of its compute time longer (a planted regression; env "
             "DPCOMPARE_INJECT_SLOWDOWN)",
        checks=(Rule(lambda v, _: 0.0 <= v <= 10.0, "use a fraction of the compute time between 0 and 10"),))
    """Testing aid for regression gates: every step spins for this fraction of its compute time (0.2: compute 20 %
    slower), on every rank or on --inject-slowdown-rank alone (a straggler). Compute is taken as 3x the measured
    forward time, since the backward's wall time also holds communication. Default from DPCOMPARE_INJECT_SLOWDOWN."""
    inject_slowdown_rank: int | None = run_flag(None, help="testing aid: --inject-slowdown on this rank alone (a straggler)")
    inject_fault: str | None = run_flag(
        None, metavar="KIND[:RANK:STEP]",
        help="testing aid: crash|kill|stop|hang:RANK:STEP makes that rank fail at that step, dupdata gives every rank "
             "rank 0's shard, ckpt-* breaks a checkpoint's load (a planted fault the run must catch)",
        checks=(Rule(_fault_ok, "use crash:RANK:STEP, kill:RANK:STEP, stop:RANK:STEP, hang:RANK:STEP, dupdata, "
                     "ckpt-optimizer, ckpt-step, ckpt-shards, ckpt-scale, ckpt-data or ckpt-rng:RANK"),
                Rule(lambda v, c: not v.startswith("ckpt-") or c.load_checkpoint is not None,
                     "a ckpt-* fault breaks a checkpoint's load: add --load-checkpoint DIR")))
    """Testing aid: `crash:RANK:STEP` (exit 17), `kill:RANK:STEP` (SIGKILL), `stop:RANK:STEP` (SIGSTOP),
    `hang:RANK:STEP` or `dupdata` (every rank reads rank 0's shard)."""
    options: dict = run_flag(
        default_factory=dict, name="opt", metavar="KEY=VALUE", settings=True,
        help="an option the backend declares (repeatable); an unknown key lists the accepted ones")
    """The backend's own options, `--opt KEY=VALUE`: checked against what its adapter declares (an unknown key
    or a bad value stops the run before it starts), typed, and handed to the adapter in its Settings."""

    def validate(self) -> None:
        """Refuse the first value a flag's checks refuse (dpcompare.run.flags.check): one line naming it."""
        flags.check(self)

    def to_args(self, *, leave_out: Sequence[str] = ()) -> list[str]:
        """The run flags that launch this config (`from_args` reads them back to an equal config); `leave_out`
        names fields left to the caller."""
        return flags.to_args(self, leave_out=leave_out)

    @classmethod
    def from_args(cls, argv: Sequence[str]) -> RunConfig:
        """The config that run flags `argv` say (ValueError naming a flag it cannot read)."""
        return cls(**flags.parse(cls, argv))

    @classmethod
    def from_namespace(cls, ns: Any) -> RunConfig:
        """The config in a namespace that a parser holding the run flags (flags.add_arguments) filled."""
        return cls(**flags.values(cls, ns))

    def settings_values(self) -> dict[str, Any]:
        """The fields an adapter sees, by name, as this config holds them (run.backend.settings_for types the
        options and starts the loss scale)."""
        return {name: getattr(self, name) for name in flags.settings_fields(type(self))}

    def check_inputs(self) -> None:
        """Refuse, before any work, an input file that the run would read only after it: --collectives must be
        a bench-collectives JSON (its busbw is looked up in the measurement's summary, at any world size)."""
        if not self.collectives:
            return
        option = f"--collectives={self.collectives!r}"
        fix = "pass the JSON that `python -m dpcompare bench-collectives --out FILE` writes"
        try:
            data = json.loads(Path(self.collectives).read_text())
        except OSError as exc:
            raise ValueError(f"{option} cannot be read ({exc.strerror or exc}): {fix}") from None
        except ValueError as exc:
            raise ValueError(f"{option} is not JSON ({exc}): pass a bench-collectives result") from None
        if not isinstance(data, dict) or not isinstance(data.get("entries"), list):
            raise ValueError(f"{option} is not a bench-collectives result (no 'entries' list): {fix}")

    def check_outputs(self) -> None:
        """Refuse, before any work, outputs that could not be written after it: --out must be (or become) a
        writable directory, --dump-grads a writable .npz path in an existing or creatable directory."""
        check_writable_dir("out", Path(self.out))
        if self.dump_grads:
            dump = Path(self.dump_grads)
            if dump.is_dir():
                raise ValueError(f"--dump-grads={self.dump_grads!r} is invalid: it is a directory; name a file, "
                                 "e.g. grads.npz")
            check_writable_dir("dump_grads", dump.parent, self.dump_grads)

    def batch_sizes(self, world_size: int) -> tuple[int, int]:
        """(global, local) batch per optimizer step; raises ValueError when they cannot be equal shards."""
        if self.scaling == "weak":
            assert self.local_batch is not None
            global_batch, local_batch = self.local_batch * world_size, self.local_batch
        elif self.global_batch is None:
            global_batch = default_global_batch(world_size * self.grad_accum)
            local_batch = global_batch // world_size
        elif self.global_batch % world_size:
            lower = self.global_batch - self.global_batch % world_size
            raise ValueError(
                f"--global-batch={self.global_batch} is not divisible by world size {world_size}: "
                f"shards must be equal; use a multiple of {world_size} (e.g. {lower or world_size}) "
                "or weak scaling (--scaling weak --local-batch N)"
            )
        else:
            global_batch, local_batch = self.global_batch, self.global_batch // world_size
        if local_batch % self.grad_accum:
            raise ValueError(
                f"--grad-accum={self.grad_accum} does not divide the per-rank batch {local_batch}: micro-batches "
                f"must be equal; use a per-rank batch that is a multiple of {self.grad_accum}"
            )
        return global_batch, local_batch

    def to_dict(self) -> dict:
        return asdict(self)


DEFAULT_LOSS_SCALE = 2.0**16
"""The initial dynamic loss scale under --amp fp16 when --loss-scale is not given (torch.amp.GradScaler's and
DeepSpeed's initial_scale_power 16)."""


def initial_loss_scale(cfg: RunConfig) -> float | None:
    """The run's initial dynamic loss scale, or None when the loss is not scaled (no --amp fp16)."""
    if cfg.amp != "fp16":
        return None
    return cfg.loss_scale if cfg.loss_scale is not None else DEFAULT_LOSS_SCALE


def check_writable_dir(flag: str, directory: Path, shown: str | None = None) -> None:
    """One line naming the flag when `directory` is not, and cannot become, a writable directory."""
    shown = shown if shown is not None else str(directory)
    option = f"--{flag.replace('_', '-')}={shown!r}"
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"{option} is invalid: {directory} is a file, not a directory; choose a directory")
    existing = directory
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{option} is invalid: {existing} is not writable by this user; choose a writable "
                         "directory")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=directory, prefix=".dpcompare-probe-", delete=True)
        probe.close()
    except OSError as exc:
        raise ValueError(f"{option} is invalid: cannot write there ({exc.strerror or exc}); choose a writable "
                         "directory") from None
