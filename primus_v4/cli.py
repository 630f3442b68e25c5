"""`primus-v4 pack | train | inspect | export`: parse, call, print. Subcommands import lazily
so that `pack` on a cache hit never imports torch."""

from __future__ import annotations

import argparse
import importlib
import sys

from primus_v4 import __version__
from primus_v4.errors import PrimusError

# subcommand -> (module under primus_v4.commands, one-line help)
_COMMANDS = {
    "pack": ("pack", "tokenize a corpus and pack it into THD rows (node-local cache)"),
    "train": ("train", "supervised fine-tuning run from a YAML config"),
    "inspect": ("inspect", "show a pack cache, a config or a model preset"),
    "export": ("export", "write a training checkpoint as a released DeepSeek-V4 checkpoint"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="primus-v4", description=__doc__)
    parser.add_argument("--version", action="version", version=f"primus-v4 {__version__}")
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="{" + ",".join(_COMMANDS) + "}"
    )
    for name, (module, help_text) in _COMMANDS.items():
        command = importlib.import_module(f"primus_v4.commands.{module}")
        command.add_arguments(sub.add_parser(name, help=help_text, description=help_text))
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
