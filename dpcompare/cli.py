"""Command line: `python -m dpcompare [run] --backend B ...`, `python -m dpcompare compare ...`.

Owns: the table of subcommands (COMMANDS: the top-level --help, the names and the dispatch all come from it),
argument parsing and turning every expected failure (bad config, bad environment, missing backend) into one line
on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Callable

from dpcompare import __version__
from dpcompare.run import flags, leave
from dpcompare.contract.launch_env import tell_launcher
from dpcompare.run.registry import UserCodeError
from dpcompare.run.config import CommandLineError, RunConfig, SaidByAnotherRank

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
    Command("checkpoint", "save under one backend and world size, load under another, and judge the continuation "
                          "against one uninterrupted float64 run", "dpcompare.commands.checkpoint",
            unwind_on_sigterm=True),
    Command("convert", "carry a checkpoint between DeepSpeed ZeRO 1-3, DCP and torch, optimizer state included, "
                       "verified bitwise", "dpcompare.commands.convert"),
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


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """The run's flags: every RunConfig field's, as its metadata declares it (dpcompare.run.flags), and the
    launchers' own noise."""
    p.add_argument("--version", action="version", version=f"dpcompare {__version__}")
    flags.add_arguments(p, RunConfig)
    # The deepspeed launcher appends --local_rank=N unless told --no_local_rank; LOCAL_RANK is read instead.
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)


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
    cfg = RunConfig.from_namespace(ns)
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
