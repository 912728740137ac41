"""Run configuration: one validated dataclass, built from the command line or from an experiment.

Owns: the fields of a run and their validation. Errors name the field, the value received and the fix.
Imports no backend and no torch.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

Optimizer = Literal["sgd", "adamw"]
Dtype = Literal["float32", "float64", "bfloat16"]
Compression = Literal["none", "fp16", "bf16"]
Amp = Literal["none", "bf16", "fp16"]
Scaling = Literal["strong", "weak"]
DeviceChoice = Literal["auto", "cpu", "cuda"]


class CommandLineError(ValueError):
    """A setting refused for what the command line says alone: every rank of a launch refuses it the same way, so
    rank 0 says it and the other ranks leave without a word (however late rank 0 gets there)."""


class SaidByAnotherRank(Exception):
    """This rank leaves without a word: another rank of the launch says why the run ends (its model raised, a setting
    the run refused), and what failed here (a collective that lost that rank) follows from it. wait_for_launcher: that
    rank has yet to say it, so this one waits, silent, for the launcher to end it rather than leave first (a launcher
    ends every rank once one has left)."""

    def __init__(self, wait_for_launcher: bool = False) -> None:
        super().__init__("another rank says why the run ends")
        self.wait_for_launcher = wait_for_launcher


@dataclass(kw_only=True, slots=True)
class RunConfig:
    backend: str = "reference"
    """Registered backend name (reference, dp, ddp, horovod, deepspeed, fsdp: dpcompare.run.registry.BACKENDS) or
    `package.module:Class`."""
    model: str = "mlp"
    """Built-in workload (dpcompare.run.registry.MODELS: the toys mlp, mlp-wide, mlp-dropout, mlp-unused, cnn, lm; the
    real models resnet18, resnet50, resnet18-cifar, resnet50-cifar, gpt-tiny, gpt-mini, gpt2-small, gpt2-medium) or
    `package.module:function` returning a Workload, or `hf:NAME_OR_PATH`: a Hugging Face transformers model built from
    its config with random weights (dpcompare.run.hf_models; needs the `hf` extra)."""
    seq_len: int | None = None
    """Tokens per sample of an `hf:` causal language model (default: 128, at most the config's context)."""
    device: DeviceChoice = "auto"
    """auto: CUDA when available (process group NCCL), else CPU (gloo)."""
    global_batch: int | None = None
    """Strong scaling: samples per step over all ranks; each rank gets global_batch / world_size. None: the smallest
    multiple of world_size x grad_accum that is at least DEFAULT_GLOBAL_BATCH, so a run starts at any world size
    (16 ranks: 32); the run's line says what it chose."""
    local_batch: int | None = None
    """Weak scaling: samples per step per rank; the global batch is local_batch * world_size."""
    scaling: Scaling = "strong"
    steps: int = 4
    """Verification phase: optimizer steps with the equivalence check (see check_every)."""
    warmup_steps: int = 2
    """Measurement phase: unmeasured steps first (allocator, bucket rebuild, caches)."""
    measure_steps: int = 10
    """Measurement phase: timed steps after the warm-up, with no check running (0: no measurement). A few by default,
    so a launcher run reports its costs; compare and the regression suite set their own."""
    ablation_steps: int | None = None
    """Pairs of synced/unsynced steps for exposed communication (default: measure_steps)."""
    instrument: bool = True
    """Per-step clocks, memory window and native comm counters in the measurement phase (off: only the
    loop's wall clock, to measure the instrumentation's own cost)."""
    collectives: str | None = None
    """A bench-collectives JSON: its busbw at this run's message size is reported beside the run's."""
    lr: float = 0.05
    optimizer: Optimizer = "sgd"
    momentum: float = 0.9
    """SGD momentum (ignored by AdamW)."""
    weight_decay: float = 0.0
    clip_grad_norm: float | None = None
    """Clip the reduced gradient by its global norm to at most this value before every optimizer step, each backend
    its own way (None: no clipping). The oracle's reference step clips the same way, and the total norm each backend
    reports is checked against the oracle's (the grad_norm check)."""
    activation_checkpointing: bool = False
    """Each block of the model (dpcompare.block_modules, the units FSDP shards) keeps no activations for backward and
    recomputes its forward there (non-reentrant torch.utils.checkpoint, the generator state of the forward restored,
    so dropout draws the same masks). Refused for a backend whose capabilities say it cannot."""
    compile: bool = False
    """torch.compile the model as the backend supports it (Adapter.compile; refused where its capabilities say it
    cannot). The float64 oracle stays uncompiled; the run-precision reference's floor then includes a compiled copy's
    rounding, and compile time, graphs, graph breaks and recompilations are reported apart from the step time."""
    dtype: Dtype = "float32"
    """Parameter and compute dtype of the run; the oracle is always float64."""
    amp: Amp = "none"
    """Mixed precision: the forward and the loss run under torch.autocast in bf16 or fp16 while parameters and optimizer
    stay float32 (DeepSpeed: `--opt amp_recipe=engine` selects its bf16/fp16 engine with fp32 master weights instead).
    fp16 scales the loss dynamically, each backend its own documented way; bf16 needs no scaling."""
    loss_scale: float | None = None
    """--amp fp16: the initial dynamic loss scale, a power of two (None: 2^16, the default of torch.amp.GradScaler and
    of DeepSpeed). 2^24 makes the first steps overflow: every backend must skip them alike."""
    seed: int = 1234
    check_every: int = 1
    """Run the equivalence check every N steps (step 0 always); 0 disables gradient checks."""
    grad_accum: int = 1
    """Micro-batches per optimizer step; gradient synchronisation is switched off for all but the last
    and each micro-batch's loss is scaled by 1/grad_accum, so the step's gradient is the global mean."""
    compression: Compression = "none"
    """Gradient compression on the wire (DDP fp16/bf16 comm hook, Horovod Compression.fp16, DeepSpeed
    communication_data_type); the tolerance widens by the compressed dtype's unit roundoff."""
    bucket_mb: float | None = None
    """All-reduce message size: DDP bucket_cap_mb, HOROVOD_FUSION_THRESHOLD; DeepSpeed ZeRO-0 has no bucket."""
    sync_bn: bool = False
    """Convert BatchNorm layers to a global-batch (synchronised) BatchNorm."""
    no_dropout: bool = False
    """Set every dropout probability to 0: a forward that draws no random numbers can always be checked
    (with dropout on, the check applies the masks each rank drew where they can be captured, else says
    `unverifiable` and names the module)."""
    check_coverage: str = "auto"
    """What the float64 oracle checks (dpcompare.verify.oracle_coverage): `auto`, every parameter where its memory fits on
    rank 0, else as many whole blocks as fit, the coverage stated; `full`, every parameter or a one-line refusal;
    a fraction in (0, 1], whole blocks up to that share of the parameters."""
    timeout_s: float = 120.0
    """A rank that makes no progress for this long makes every rank exit with an error naming it."""
    out: str = "results"
    """Directory for the run's JSON result."""
    dump_grads: str | None = None
    """Write the reduced and oracle gradients of every checked step to this .npz file (for `compare`)."""
    tag: str | None = None
    """Free text copied into the result (compare uses it to group runs)."""
    closed_if: str | None = None
    """A fence file: when it exists, the run writes neither its result nor its gradient dump and fails. compare
    creates it for a launch it has stopped waiting for, so a rank that outlived its launcher (on another host,
    say) never adds a late result to a finished run folder."""
    dp_devices: int | None = None
    """Backends that replicate over devices in one process (dp): how many CUDA devices (default: all visible)."""
    inject_slowdown: float = 0.0
    """Testing aid for regression gates: every step spins for this fraction of its compute time on every rank
    (0.2: compute 20 % slower), a planted slowdown. Compute is taken as 3x the measured forward time, since the
    backward's wall time also holds communication. Default from DPCOMPARE_INJECT_SLOWDOWN."""
    inject_fault: str | None = None
    """Testing aid: `crash:RANK:STEP` (exit 17), `kill:RANK:STEP` (SIGKILL), `stop:RANK:STEP` (SIGSTOP),
    `hang:RANK:STEP` or `dupdata` (every rank reads rank 0's shard)."""
    options: dict = field(default_factory=dict)
    """The backend's own options, `--opt KEY=VALUE`: checked against what its adapter declares (an unknown key
    or a bad value stops the run before it starts), typed, and handed to the adapter in its Settings."""

    def validate(self) -> None:
        def bad(name: str, value: object, fix: str) -> ValueError:
            return ValueError(f"--{name.replace('_', '-')}={value!r} is invalid: {fix}")

        for name in ("lr", "momentum", "weight_decay", "timeout_s", "inject_slowdown", "bucket_mb", "loss_scale",
                     "clip_grad_norm"):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise bad(name, value, "use a finite number")
        if not 0 <= self.seed < 2**32:
            raise bad("seed", self.seed, "use a whole number from 0 to 4294967295")
        if self.timeout_s > MAX_TIMEOUT_S:
            raise bad("timeout_s", self.timeout_s, f"use at most {MAX_TIMEOUT_S:g} seconds (a week)")
        if not self.backend:
            raise bad("backend", self.backend, "name a backend (reference, dp, ddp, horovod, deepspeed, fsdp) or package.module:Class")
        if self.global_batch is not None and self.global_batch < 1:
            raise bad("global_batch", self.global_batch, "use a positive whole number of samples")
        if self.local_batch is not None and self.local_batch < 1:
            raise bad("local_batch", self.local_batch, "use a positive whole number of samples per rank")
        if self.scaling == "weak" and self.local_batch is None:
            raise bad("scaling", self.scaling, "weak scaling fixes the per-rank batch: also pass --local-batch N")
        if self.seq_len is not None and self.seq_len < 1:
            raise bad("seq_len", self.seq_len, "use a positive number of tokens per sample")
        if self.seq_len is not None and not self.model.startswith("hf:"):
            raise bad("seq_len", self.seq_len, f"it sets the sample length of an hf: causal language model; "
                      f"--model {self.model} fixes its own: drop --seq-len")
        if self.check_coverage not in ("auto", "full"):
            try:
                share = float(self.check_coverage)
            except ValueError:
                share = float("nan")
            if not 0 < share <= 1:
                raise bad("check_coverage", self.check_coverage, "use auto, full or a share of the parameters in "
                          "(0, 1], e.g. 0.25")
        if self.steps < 1:
            raise bad("steps", self.steps, "run at least one step")
        if self.warmup_steps < 0:
            raise bad("warmup_steps", self.warmup_steps, "use 0 or more steps")
        if self.measure_steps < 0:
            raise bad("measure_steps", self.measure_steps, "use 0 (no measurement) or more steps")
        if self.ablation_steps is not None and self.ablation_steps < 0:
            raise bad("ablation_steps", self.ablation_steps, "use 0 or more pairs")
        if not (self.lr > 0 and self.lr < 1e3):
            raise bad("lr", self.lr, "use a positive learning rate below 1000")
        if not 0 <= self.momentum < 1:
            raise bad("momentum", self.momentum, "use a value in [0, 1)")
        if self.weight_decay < 0:
            raise bad("weight_decay", self.weight_decay, "use a value >= 0")
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            raise bad("clip_grad_norm", self.clip_grad_norm, "use a positive total norm, e.g. 1.0 (leave the flag out "
                      "for no clipping)")
        if self.grad_accum < 1:
            raise bad("grad_accum", self.grad_accum, "use 1 (no accumulation) or more micro-batches per step")
        if self.bucket_mb is not None and not self.bucket_mb > 0:
            raise bad("bucket_mb", self.bucket_mb, "use a positive size in MiB")
        if self.check_every < 0:
            raise bad("check_every", self.check_every, "use 0 (no checks) or a positive step interval")
        if not self.timeout_s > 0:
            raise bad("timeout_s", self.timeout_s, "use a positive number of seconds")
        if self.amp != "none" and self.dtype != "float32":
            raise bad("dtype", self.dtype, f"--amp {self.amp} keeps parameters and optimizer in float32 and runs the "
                      "forward in lower precision itself; drop --dtype (or drop --amp for a whole-model dtype)")
        if self.loss_scale is not None:
            if self.amp != "fp16":
                raise bad("loss_scale", self.loss_scale, "a loss scale applies to --amp fp16 only (bf16 has float32's "
                          "range and is not scaled); add --amp fp16 or drop --loss-scale")
            if not (math.isfinite(self.loss_scale) and self.loss_scale >= 1
                    and math.frexp(self.loss_scale)[0] == 0.5):
                raise bad("loss_scale", self.loss_scale, "use a power of two of at least 1, e.g. 65536 (2^16) or "
                          "16777216 (2^24)")
        if self.dp_devices is not None and self.dp_devices < 1:
            raise bad("dp_devices", self.dp_devices, "use a positive device count")
        if not 0.0 <= self.inject_slowdown <= 10.0:
            raise bad("inject_slowdown", self.inject_slowdown, "use a fraction of the compute time between 0 and 10")
        if self.inject_fault is not None:
            parts = self.inject_fault.split(":")
            ok = parts == ["dupdata"] or (
                len(parts) == 3 and parts[0] in ("crash", "kill", "stop", "hang") and parts[1].isdigit()
                and parts[2].isdigit()
            )
            if not ok:
                raise bad("inject_fault", self.inject_fault,
                          "use crash:RANK:STEP, kill:RANK:STEP, stop:RANK:STEP, hang:RANK:STEP or dupdata")

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
            global_batch = default_global_batch(world_size, self.grad_accum)
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


DEFAULT_GLOBAL_BATCH = 24
"""The global batch a run aims at when --global-batch is not given (rounded up to what its world size divides)."""


def smallest_multiple(unit: int, at_least: int) -> int:
    """The smallest multiple of `unit` that is at least `at_least`."""
    return unit * -(-at_least // unit)


def default_global_batch(world_size: int, grad_accum: int = 1) -> int:
    """The smallest multiple of world_size x grad_accum that is at least DEFAULT_GLOBAL_BATCH: equal shards of equal
    micro-batches at any world size (1-3 ranks: 24; 16 ranks: 32; 5 ranks: 25)."""
    return smallest_multiple(world_size * grad_accum, DEFAULT_GLOBAL_BATCH)


MAX_TIMEOUT_S = 7 * 24 * 3600.0
"""--timeout-s above this is refused: watchdogs and socket timeouts take it as a C integer of milliseconds."""


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
