"""`primus-v4 pack | train | inspect | export`: parse, call, print. Subcommands import lazily
so that `pack` on a cache hit never imports torch."""

from __future__ import annotations

import argparse
import importlib
import sys

from primus_v4 import __version__
from primus_v4.errors import PrimusError

_DESCRIPTION = """\
Supervised fine-tuning (SFT) of DeepSeek-V4 with sequence packing: many samples share one
row of tokens (the THD layout), so little compute goes to padding. Runs on one CPU process
or on many GPUs through torchrun.
"""

_EPILOG = """\
examples:
  primus-v4 train                                  the tiny CPU demo run (about 3 minutes)
  primus-v4 train --config my_run.yaml --set train.steps=100
  primus-v4 train --config tiny_cpu_thd --dry-run  validate and print the resolved config
  primus-v4 pack --data corpus.jsonl --seq-length 4096
  primus-v4 inspect config                         every config key, its default and meaning
  primus-v4 inspect presets                        shipped model presets and run configs

Run `primus-v4 COMMAND --help` for the options of a command.
"""

# subcommand -> (module under primus_v4.commands, one-line help)
_COMMANDS = {
    "pack": ("pack", "tokenize a corpus and pack it into THD rows (cached on this node)"),
    "train": ("train", "run a fine-tuning job from a YAML config (or the tiny demo run)"),
    "inspect": (
        "inspect",
        "show the config reference, presets, a model's size, pack caches or checkpoints",
    ),
    "export": ("export", "write a training checkpoint as a released DeepSeek-V4 checkpoint"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    module = importlib.import_module(f"primus_v4.commands.{_COMMANDS[args.command][0]}")
    try:
        return int(module.run(args) or 0)
    except PrimusError as exc:
        print(f"primus-v4 {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
