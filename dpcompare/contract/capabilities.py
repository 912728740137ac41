"""What an adapter declares as data, and what reaches it from the run's config.

Owns: `Capabilities` (what the backend can do, instead of anyone branching on its name), `Option` (an `--opt` key it
accepts, typed, with its parser), `Settings` (what reaches it from the config, one way, validated before it is built)
and `Note` (a coded sentence for the verdict). The `Adapter` base class that declares them is
dpcompare.contract.adapter's. Imports no adapter, and no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping


@dataclass(frozen=True, slots=True)
class Capabilities:
    multi_process: bool
    """One process per replica (ddp, horovod, deepspeed) rather than one process for all (reference, dp)."""
    launchers: frozenset[str]
    """Launchers this backend can run under; the trainer refuses others with the right command."""
    launch_hint: str
    """How to start it, shown when it was started wrongly."""
    can_disable_sync: bool = True
    """`sync(False)` really skips gradient communication for one step (the exposed-communication ablation relies on
    it; ZeRO-2/3 reduce every micro-batch whatever the accumulation boundary)."""
    native_launcher: str = "python"
    """The launcher its users start it with (compare and the tests start it the same way)."""
    scaling_baseline: bool = False
    """Its single-process throughput is the denominator of scaling efficiency (the plain reference run)."""
    device_replicas: bool = False
    """One process replicates the model over several devices (`--dp-devices` sizes it)."""
    compressions: frozenset[str] = frozenset({"none"})
    """Gradient compressions (`--compression`) the backend offers."""
    has_buckets: bool = False
    """`--bucket-mb` changes its all-reduce message size."""
    collective_transport: str = "torch"
    """Which bench-collectives transport measures the link this backend's all-reduce uses."""
    shards: str = "none"
    """What each rank holds only a part of: none (every rank a full replica), optimizer (its state: ZeRO-1),
    gradients (and the optimizer state: ZeRO-2) or parameters (all three: ZeRO-3, FSDP). An adapter whose options
    change it sets its instance's `capabilities` in `__init__`."""
    compiles: bool = False
    """`compile()` puts the step's forward and backward under torch.compile the way this backend supports it
    (--compile); False: --compile is refused before the run starts."""
    compile_refusal: str = ""
    """Where `compiles` is False: why, said when --compile is refused."""
    shard_replicas: int = 1
    """Copies of the sharded state (HSDP): the ranks form this many replica groups, each sharding over
    world_size / shard_replicas ranks (the shard group, which the memory formula divides by and the reduce-scatter and
    all-gather span), and the groups all-reduce their gradient shards with each other. 1: one shard group of every
    rank."""
    activation_checkpointing: bool = True
    """It runs a model whose blocks recompute their forward in backward (--activation-checkpointing,
    `Adapter.checkpoint_activations`); False: the flag is refused before the run."""


@dataclass(frozen=True, slots=True)
class Note:
    """A known semantic difference or fact stated with the verdict: readers match the code, people read the text."""

    code: str
    text: str
    concerns: tuple[str, ...] = ()
    """The components of the model's state it explains where they differ between backends (the state table's: forward,
    masters, grads, wire, optimizer, loss_scale; dpcompare.run.state_table)."""

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "text": self.text, **({"concerns": list(self.concerns)} if self.concerns else {})}


_TYPE_WORDS = {bool: "true/false", int: "a whole number", float: "a number", str: "text"}


@dataclass(frozen=True, slots=True)
class Option:
    """An `--opt NAME=VALUE` key an adapter accepts: its type, default and meaning, declared as data."""

    name: str
    type: type
    default: Any
    meaning: str
    choices: tuple[Any, ...] = ()

    def parse(self, value: Any) -> Any:
        """The typed value of `value` (text from the command line, or already typed from Python)."""
        try:
            if self.type is bool:
                parsed = value if isinstance(value, bool) else {"1": True, "true": True, "yes": True, "0": False,
                                                                "false": False, "no": False}[str(value).lower()]
            else:
                parsed = self.type(value)
        except (KeyError, ValueError, TypeError):
            raise ValueError(f"--opt {self.name}={value!r} is invalid: expected {_TYPE_WORDS.get(self.type, self.type.__name__)} "
                             f"({self.meaning})") from None
        if self.choices and parsed not in self.choices:
            raise ValueError(f"--opt {self.name}={value!r} is invalid: choose one of {', '.join(map(str, self.choices))}")
        return parsed

    def describe(self) -> str:
        return f"{self.name} ({_TYPE_WORDS.get(self.type, self.type.__name__)}, default {self.default!r}: {self.meaning})"


@dataclass(frozen=True, slots=True)
class Settings:
    """What reaches an adapter from the run's config, validated once before the adapter is built: the knobs
    every backend has are typed fields, the backend's own `--opt` keys are typed values of its declaration."""

    compression: str = "none"
    """Gradient dtype on the wire: none, fp16 or bf16 (one of Capabilities.compressions)."""
    bucket_mb: float | None = None
    """All-reduce message size in MiB (None: the backend's default)."""
    dp_devices: int | None = None
    """Devices one process replicates over (Capabilities.device_replicas; None: all visible)."""
    instrument: bool = True
    """Off (--no-instrument): the backend's own timers and logs stay off too."""
    amp: str = "none"
    """Mixed precision (--amp): none, bf16 or fp16; the forward and the loss run under `Adapter.autocast()`."""
    loss_scale: float | None = None
    """--amp fp16: the initial dynamic loss scale (None when the loss is not scaled)."""
    clip_grad_norm: float | None = None
    """--clip-grad-norm: the global gradient norm the backend clips to before each step (None: no clipping); the
    trainer calls `Adapter.clip_grad_norm` with it, and a backend that clips inside its own step reads it here."""
    compile: bool = False
    """--compile: the trainer calls `Adapter.compile()` after `wrap` (only where Capabilities.compiles)."""
    options: Mapping[str, Any] = field(default_factory=dict)
    """Every declared option, typed: the value given with --opt, else its default."""
