"""Command line: `python -m dpcompare [run] --backend B ...`, `python -m dpcompare compare ...`.

Owns: the table of subcommands (COMMANDS: the top-level --help, the names and the dispatch all come from it),
argument parsing and turning every expected failure (bad config, bad environment, missing backend) into one line
on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Callable, get_args

from dpcompare import __version__
from dpcompare.run import leave, registry
from dpcompare.contract.launch_env import tell_launcher
from dpcompare.run.registry import UserCodeError
from dpcompare.run.config import (DEFAULT_GLOBAL_BATCH, Amp, CommandLineError, Compression, DeviceChoice, Dtype,
                                  Optimizer, RunConfig, SaidByAnotherRank, Scaling)

# Exit status of `run` (docs/failures.md): 0 done; 2 bad input (nothing ran); 3 a rank made no progress for
# --timeout-s (the watchdog stopped it); 4 the run failed while running (a collective failed or timed out, a
# peer died, a backend error); 130 interrupted.
EXIT_USAGE = 2
EXIT_RUN_FAILURE = 4
EXIT_INTERRUPTED = 130
QUIET_RANK_EXIT_DELAY_S = 3.0
SAID_BY_RANK0_WAIT_S = 60.0
"""How long a rank other than 0 waits, silent, before leaving on an error of the command line alone: long enough for
rank 0 to reach the same error and say it (a launcher that ends every rank once one exits would otherwise end rank 0
first); the launcher ends the wait once rank 0 has exited."""


class _Parser(argparse.ArgumentParser):
    """argparse that fails with our one-line format (it already exits 2)."""

    def error(self, message: str) -> None:  # noqa: D102
        raise SystemExit(_fail(f"{message} (see python -m dpcompare {self.prog.split()[-1]} --help)"))


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written; every option's help ends with its default (unless it says it already, or has
    none worth saying: None, False, an empty list)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if ("default" in text or default in (None, [], argparse.SUPPRESS) or not action.option_strings
                or isinstance(action, (argparse._HelpAction, argparse._VersionAction, argparse._StoreConstAction))):
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


RUN_DESCRIPTION = ("Train one workload under one backend and check its gradients against a float64 oracle; then "
                   "measure its costs.")
"""The --help description of run (each other command's is its module's docstring)."""


@dataclass(frozen=True, slots=True)
class Command:
    """One subcommand: its name, its line in the top-level --help, and where its parser and its main live."""

    name: str
    summary: str
    module: str | None = None
    """The module holding add_arguments(parser) and main(namespace) -> exit status, its docstring the command's
    --help description; imported only when the command is named (a rank of a run loads no command module). None for
    run, which this module parses and runs itself."""
    unwind_on_sigterm: bool = False
    """SIGTERM (a CI job cancelled, `kill`) unwinds like Ctrl-C, so the launches the command started are killed
    with their whole process tree by the runner's cleanup, never left training as orphans."""

    def load(self) -> tuple[str | None, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]:
        """(its --help description, its add_arguments, its main)."""
        if self.module is None:
            return RUN_DESCRIPTION, add_run_arguments, _run
        module = importlib.import_module(self.module)
        return module.__doc__, module.add_arguments, module.main


COMMANDS = (
    Command("run", "(the default command) train one workload under one backend, check it against the float64 "
                   "oracle, measure its costs"),
    Command("compare", "run every installed backend at several world sizes and print verdicts, the gradient matrix "
                       "and costs", "dpcompare.commands.compare", unwind_on_sigterm=True),
    Command("report", "rebuild report.md and the plots from the JSON results under a directory",
            "dpcompare.commands.report"),
    Command("bench-collectives", "measure all-reduce bus bandwidth over each transport the backends use",
            "dpcompare.commands.bench_collectives", unwind_on_sigterm=True),
    Command("regress", "decide whether a build's pytest-benchmark runs are slower than a baseline's (noise-aware)",
            "dpcompare.commands.regress"),
    Command("project", "predict step time, scaling efficiency and exposed communication at larger world sizes on a "
                       "link", "dpcompare.commands.project"),
)
"""Every subcommand, in the order the top-level --help lists them; the first word of the arguments names one, else
it is run."""
SUBCOMMANDS = tuple(c.name for c in COMMANDS)
_BY_NAME = {c.name: c for c in COMMANDS}


def _top_level_help() -> str:
    lines = [f"usage: python -m dpcompare [COMMAND] [ARGS...]   (dpcompare {__version__})", "",
             "Runs one model on one data stream through DDP, Horovod, nn.DataParallel, DeepSpeed (ZeRO 0-3) and FSDP2;",
             "checks the reduced gradients against a float64 oracle and measures what each backend costs.", "",
             "commands:"]
    lines += [f"  {c.name:<18} {c.summary}" for c in COMMANDS]
    lines += ["", "options:", "  -h, --help         this overview; `python -m dpcompare COMMAND --help` shows a command's flags",
              "  --version          print the version and exit", "",
              "Under a launcher: torchrun --nproc_per_node=N -m dpcompare --backend ddp;",
              "horovodrun -np N python -m dpcompare --backend horovod; deepspeed --num_gpus N --module dpcompare",
              "--backend deepspeed; mpirun -np N python -m dpcompare --backend ddp|horovod.",
              "Exit status: 0 done (whatever the verdict); 2 bad input; 3 a rank hung; 4 a run failed; 130 interrupted."]
    return "\n".join(lines)


def parser_for(command: str) -> argparse.ArgumentParser:
    """The argument parser of `command` (one of SUBCOMMANDS), as `python -m dpcompare COMMAND` builds it."""
    if command not in _BY_NAME:
        raise ValueError(f"unknown command {command!r}: use one of {', '.join(SUBCOMMANDS)}")
    description, add_arguments, _ = _BY_NAME[command].load()
    parser = _Parser(prog=f"dpcompare {command}", description=description, formatter_class=_HelpFormatter)
    add_arguments(parser)
    for action in parser._actions:  # an option without help still shows its default
        if action.help is None and action.option_strings and action.default not in (None, [], False):
            action.help = "(default: %(default)s)"
    return parser


def _fail(message: str) -> int:
    line = f"dpcompare: error: {message}"
    print(line, file=sys.stderr, flush=True)
    tell_launcher(line)
    return EXIT_USAGE


def _whole(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def _env_number(name: str, default: float) -> float:
    text = os.environ.get(name)
    if not text:
        return default
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is invalid: use a number, e.g. {name}=0.2") from None


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    d = RunConfig()
    p.add_argument("--version", action="version", version=f"dpcompare {__version__}")
    p.add_argument("--backend", default=d.backend, help=f"{', '.join(registry.BACKENDS)}, or package.module:Class")
    p.add_argument("--model", default=d.model,
                   help=f"{', '.join(registry.MODELS)}, package.module:function, or hf:NAME_OR_PATH (a Hugging Face "
                        "transformers config: a folder holding config.json, or a hub name whose config is cached)")
    p.add_argument("--seq-len", type=_whole, default=None,
                   help="hf: causal language models: tokens per sample (default: 128, at most the config's context)")
    p.add_argument("--device", default=d.device, choices=get_args(DeviceChoice),
                   help="auto: CUDA when present (NCCL process group), else CPU (gloo)")
    p.add_argument("--global-batch", type=_whole, default=d.global_batch,
                   help=f"samples per step over all ranks (default: the smallest multiple of the world size x "
                        f"--grad-accum that is at least {DEFAULT_GLOBAL_BATCH}, said in the run's line)")
    p.add_argument("--local-batch", type=_whole, default=None, help="per-rank batch (weak scaling)")
    p.add_argument("--scaling", default=d.scaling, choices=get_args(Scaling),
                   help="strong: fixed global batch; weak: fixed --local-batch per rank")
    p.add_argument("--steps", type=_whole, default=d.steps, help="verification steps, each checked against the oracle")
    p.add_argument("--lr", type=_number, default=d.lr, help="learning rate")
    p.add_argument("--optimizer", default=d.optimizer, choices=get_args(Optimizer), help="optimizer")
    p.add_argument("--momentum", type=_number, default=d.momentum, help="SGD momentum")
    p.add_argument("--weight-decay", type=_number, default=d.weight_decay, help="weight decay")
    p.add_argument("--clip-grad-norm", type=_number, default=None, metavar="MAX_NORM",
                   help="clip the reduced gradient's global norm to MAX_NORM before each step (default: no clipping)")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="each block of the model (those FSDP shards) recomputes its forward in backward instead of "
                        "keeping its activations (non-reentrant torch.utils.checkpoint, dropout masks preserved)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the model (reference, ddp, fsdp, deepspeed, horovod); needs a C++ compiler "
                        "(g++, or the one $CXX names); compile time is reported apart from the step time")
    p.add_argument("--dtype", default=d.dtype, choices=get_args(Dtype), help="parameter and compute dtype")
    p.add_argument("--amp", default=d.amp, choices=get_args(Amp),
                   help="mixed precision: forward and loss under torch.autocast in bf16 or fp16, parameters and optimizer "
                        "float32; fp16 scales the loss dynamically (deepspeed: --opt amp_recipe=engine for its own "
                        "bf16/fp16 engine with fp32 master weights)")
    p.add_argument("--loss-scale", type=_number, default=None,
                   help="--amp fp16: initial dynamic loss scale, a power of two (default: 65536 = 2^16; 16777216 = 2^24 "
                        "makes the first steps overflow, which every backend must skip)")
    p.add_argument("--seed", type=_whole, default=d.seed, help="seed of the weights and the data")
    p.add_argument("--warmup-steps", type=_whole, default=d.warmup_steps, help="measurement: steps not timed")
    p.add_argument("--measure-steps", type=_whole, default=d.measure_steps,
                   help="measurement: timed steps after the verification (0: no costs, verdict only)")
    p.add_argument("--ablation-steps", type=_whole, default=None,
                   help="measurement: synced/unsynced step pairs for exposed communication (default: --measure-steps)")
    p.add_argument("--no-instrument", dest="instrument", action="store_false", help="measurement: only the loop wall clock")
    p.add_argument("--collectives", default=None, help="bench-collectives JSON to quote the microbenchmark busbw from")
    p.add_argument("--check-every", type=_whole, default=d.check_every, help="check every Nth step (0: no checks)")
    p.add_argument("--check-coverage", default=d.check_coverage, metavar="auto|full|SHARE",
                   help="what the float64 oracle checks: auto (every parameter where its memory fits on rank 0, else as "
                        "many whole blocks as fit, stated), full (all or a one-line refusal), or a share in (0, 1]")
    p.add_argument("--grad-accum", type=_whole, default=d.grad_accum, help="micro-batches per step")
    p.add_argument("--compression", default=d.compression, choices=get_args(Compression), help="gradient compression on the wire")
    p.add_argument("--bucket-mb", type=_number, default=None,
                   help="all-reduce bucket / fusion size in MiB (default: the backend's own)")
    p.add_argument("--sync-bn", action="store_true", help="global-batch BatchNorm statistics")
    p.add_argument("--no-dropout", action="store_true",
                   help="switch dropout off (p=0) so the forward is deterministic and the verdict can check it")
    p.add_argument("--timeout-s", type=_number, default=d.timeout_s, help="exit when a rank makes no progress this long")
    p.add_argument("--out", default=d.out, help="directory for the JSON result")
    p.add_argument("--dump-grads", default=None, help="write checked-step gradients to this .npz")
    p.add_argument("--tag", default=None, help="free text copied into the result (compare groups runs by it)")
    p.add_argument("--closed-if", default=None, metavar="FILE", help=argparse.SUPPRESS)
    p.add_argument("--dp-devices", type=_whole, default=None, help="dp: CUDA devices to replicate over (default: all)")
    p.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE",
                   help="an option the backend declares (repeatable); an unknown key lists the accepted ones")
    p.add_argument("--inject-fault", default=None, metavar="KIND[:RANK:STEP]",
                   help="testing aid: crash|kill|stop|hang:RANK:STEP makes that rank fail at that step, dupdata gives "
                        "every rank rank 0's shard (a planted fault the run must catch)")
    p.add_argument("--inject-slowdown", type=_number, default=_env_number("DPCOMPARE_INJECT_SLOWDOWN", 0.0),
                   help="testing aid: each step spins this fraction of its compute time longer (a planted regression; "
                        "env DPCOMPARE_INJECT_SLOWDOWN)")
    # The deepspeed launcher appends --local_rank=N unless told --no_local_rank; LOCAL_RANK is read instead.
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)


def config_from_args(ns: argparse.Namespace) -> RunConfig:
    options = {}
    for item in ns.opt:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise CommandLineError(f"--opt {item!r} is invalid: use KEY=VALUE, e.g. --opt gradient_as_bucket_view=true")
        options[key] = value
    fields = {k: v for k, v in vars(ns).items() if k not in ("opt", "command", "local_rank")}
    return RunConfig(**fields, options=options)


def main(argv: list[str] | None = None) -> int:
    """The command line's exit status. A rank of a launch that got as far as its backend never returns: it leaves with
    os._exit once its lines are out (dpcompare.run.leave), whatever the status, so no destructor can keep it alive."""
    try:
        status = _main(argv)
    except BaseException:
        if leave.holding():
            traceback.print_exc()
            sys.stderr.flush()
            leave.exit_if_held(EXIT_RUN_FAILURE)
        raise
    leave.exit_if_held(status)
    return status


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # The deepspeed launcher puts --local_rank=N before the user's arguments (LOCAL_RANK is read instead).
    while argv and (argv[0].startswith("--local_rank") or argv[0].startswith("--local-rank")):
        argv.pop(0)
    if not argv or argv[0] in ("-h", "--help"):
        print(_top_level_help())
        return 0
    if argv[0] == "--version":
        print(f"dpcompare {__version__}")
        return 0
    command = _BY_NAME[argv.pop(0) if argv[0] in SUBCOMMANDS else "run"]
    if command.unwind_on_sigterm:
        signal.signal(signal.SIGTERM, _unwind_on_signal)
    try:
        _, _, command_main = command.load()
        return command_main(parser_for(command.name).parse_args(argv))
    except SaidByAnotherRank as exc:  # another rank says why the run ends; this one adds nothing
        if exc.wait_for_launcher:
            time.sleep(SAID_BY_RANK0_WAIT_S)
        return EXIT_USAGE
    except (ValueError, ImportError) as exc:
        # Configuration errors are usually the same on every rank: let rank 0 say it once. The other ranks wait
        # first, so a launcher that stops every rank when the first one exits does not stop rank 0 before it has said
        # it. A setting refused for the command line alone (CommandLineError) is refused alike everywhere: the other
        # ranks never say it, and wait until the launcher ends them once rank 0 has. For any other error, a rank
        # still alive after a moment failed alone (its device, its environment) and says so itself, with its rank.
        rank = _rank()
        if rank != 0 and isinstance(exc, CommandLineError):
            time.sleep(SAID_BY_RANK0_WAIT_S)
            return EXIT_USAGE
        if rank != 0 and not getattr(exc, "rank0_silent", False):  # the run has seen rank 0 stay silent
            time.sleep(QUIET_RANK_EXIT_DELAY_S)
        _fail(f"[rank {rank}] {exc}" if rank else str(exc))
        if isinstance(exc, UserCodeError) and exc.__cause__ is not None:
            traceback.print_exception(exc.__cause__, file=sys.stderr)
        return EXIT_USAGE
    except RuntimeError as exc:
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        _fail(f"[rank {_rank()}] {message}")
        return EXIT_RUN_FAILURE
    except KeyboardInterrupt:
        _fail("interrupted")
        return EXIT_INTERRUPTED


def _run(ns: argparse.Namespace) -> int:
    """The run command: train, check and measure in this process (one rank of a launch), print its line."""
    cfg = config_from_args(ns)
    from dpcompare.run import trainer

    payload = trainer.run(cfg)
    if payload:
        print(trainer.summary_line(payload), flush=True)
    return 0


def _unwind_on_signal(signum: int, _frame) -> None:
    raise SystemExit(128 + signum)


def _rank() -> int:
    try:
        from dpcompare.contract.launch_env import detect

        return detect().rank
    except Exception:  # noqa: BLE001 - only used to decide who prints
        return 0
