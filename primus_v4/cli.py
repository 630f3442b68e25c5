"""`primus-v4 pack | train | eval | inspect | export`: parse, call, print. Subcommands import
lazily so that `pack` on a cache hit never imports torch."""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
from typing import NoReturn

from primus_v4 import __version__
from primus_v4.environment import check_environment
from primus_v4.errors import ExitCode, PrimusError, describe_os_error, is_disk_full

_DESCRIPTION = """\
Supervised fine-tuning (SFT) of DeepSeek-V4 with sequence packing: many samples share one
row of tokens (the THD layout), so little compute goes to padding. Runs on one CPU process
or on many GPUs through torchrun.
"""

_EPILOG = """\
examples:
  primus-v4 train                                  the tiny CPU demo run (30 steps)
  primus-v4 train --config my_run.yaml --set train.steps=100
  primus-v4 train --config tiny_cpu_thd --dry-run  validate and print the resolved config
  primus-v4 pack --data corpus.jsonl --seq-length 4096
  primus-v4 eval --run outputs/my_run --json       held-out loss of the newest checkpoint
  primus-v4 inspect config                         every config key, its default and meaning
  primus-v4 inspect presets                        shipped model presets and run configs

Run `primus-v4 COMMAND --help` for the options of a command.

exit status: 0 done; 1 `inspect --verify` found damage; 2 usage; 3 config; 4 data (corpus,
tokenizer, pack cache); 5 training checkpoint (missing, damaged, other layout); 6 resume refused;
7 release directory (model.pretrained); 8 a path (unreadable, unwritable, output exists);
9 disk full; 10 non-finite loss; 11 run setup; 12 `inspect memory`: a stage over the device;
70 internal error; 130 interrupted; 128+N stopped by signal N before anything was saved.
Every error is one line on stderr.
"""

# subcommand -> (module under primus_v4.commands, one-line help)
_COMMANDS = {
    "pack": ("pack", "tokenize a corpus and pack it into THD rows (cached on this node)"),
    "train": ("train", "run a fine-tuning job from a YAML config (or the tiny demo run)"),
    "eval": ("eval", "held-out loss of a run's checkpoint, an export or a release on a corpus"),
    "inspect": (
        "inspect",
        "show the config reference, presets, a model's size, pack caches or checkpoints",
    ),
    "export": ("export", "write a training checkpoint as a released DeepSeek-V4 checkpoint"),
}


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error as one line (what, and where to read the options)."""

    def error(self, message: str) -> NoReturn:
        self.exit(ExitCode.USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="primus-v4",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--version", action="version", version=f"primus-v4 {__version__}", help="print the version"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", title="commands")
    for name, (module, help_text) in _COMMANDS.items():
        command = importlib.import_module(f"primus_v4.commands.{module}")
        command.add_arguments(
            sub.add_parser(
                name,
                help=help_text,
                description=getattr(command, "DESCRIPTION", help_text),
                epilog=getattr(command, "EPILOG", None),
                formatter_class=argparse.RawDescriptionHelpFormatter,
            )
        )
    return parser


def _one_line(message: str) -> str:
    """An error as one line: a message of several lines (one per problem) joined by '; '."""
    return "; ".join(line.strip() for line in message.splitlines() if line.strip())


def _fail(command: str, message: str, code: int) -> int:
    print(f"primus-v4 {command}: error: {_one_line(message)}", file=sys.stderr)
    return code


def _stdout_closed() -> int:
    """The reader of stdout went away (`primus-v4 inspect config | head`): stop quietly, as
    other tools in a pipe do, and keep Python from complaining again when it flushes at exit."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return ExitCode.SIGNAL_BASE + signal.SIGPIPE


def _interrupted(exc: BaseException) -> bool:
    """A Ctrl-C however it arrives: itself, the cause or context of another error, or one rank's
    failure that a checkpoint read or write wraps (torch's CheckpointException `failures`)."""
    todo: list[BaseException | None] = [exc]
    seen: set[int] = set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, KeyboardInterrupt):
            return True
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)
        for failure in failures.values() if isinstance(failures, dict) else ():
            if isinstance(failure, tuple) and failure and isinstance(failure[0], BaseException):
                todo.append(failure[0])
    return False


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    module = importlib.import_module(f"primus_v4.commands.{_COMMANDS[args.command][0]}")
    command = args.command
    try:
        check_environment()  # launcher and user variables, before any work
        code = int(module.run(args) or 0)
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        return _stdout_closed()
    except PrimusError as exc:
        return _fail(command, str(exc), exc.exit_code)
    except OSError as exc:  # a path problem no command anticipated: still one line, by kind
        err = describe_os_error(exc)
        return _fail(command, str(err), err.exit_code)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return ExitCode.INTERRUPTED
    except BaseException as exc:  # torch's CheckpointException is a BaseException too
        if _interrupted(exc):  # a Ctrl-C that a library wrapped in its own error
            print("interrupted", file=sys.stderr)
            return ExitCode.INTERRUPTED
        traceback = os.environ.get("PRIMUS_V4_TRACEBACK", "0") not in ("", "0")
        if traceback or isinstance(exc, (SystemExit, GeneratorExit)):
            raise
        code = ExitCode.DISK_FULL if is_disk_full(exc) else ExitCode.INTERNAL
        what = "disk full" if code == ExitCode.DISK_FULL else "internal error (a bug)"
        return _fail(
            command,
            f"{what}: {type(exc).__name__}: {exc} (rerun with PRIMUS_V4_TRACEBACK=1 for the "
            "traceback)",
            code,
        )


if __name__ == "__main__":
    sys.exit(main())
