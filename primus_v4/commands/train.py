"""`primus-v4 train --config F [--set k=v ...] [--dry-run]`: one SFT run from a YAML config.

Without --config the embedded default (configs/runs/tiny_cpu_thd.yaml) runs. --dry-run checks
everything that can be checked without data or weights (keys, types, values, parallel sizes
against WORLD_SIZE, the model preset and its overrides) and prints the resolved config as one
single-line JSON object on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys

from primus_v4.config import DEFAULT_CONFIG, load_config, resolve_run, to_dict


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        default=str(DEFAULT_CONFIG),
        help="run config YAML (default: the embedded tiny CPU THD run, %(default)s)",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a config value (YAML-typed, repeatable), e.g. --set train.steps=5",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="validate, print the resolved config as one JSON line, exit without training",
    )


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    resolved = resolve_run(cfg)
    if args.dry_run:
        payload = {**to_dict(cfg), "derived": resolved.summary()}
        print(json.dumps(payload, separators=(",", ":"), sort_keys=False))
        return 0

    from primus_v4.training.metrics import format_table
    from primus_v4.training.trainer import Trainer

    trainer = Trainer(resolved)
    try:
        result = trainer.train()
    finally:
        trainer.runtime.close()
    if trainer.runtime.is_main:
        print(format_table(result.summary, title=f"run summary ({result.output_dir})"))
        for name, path in result.artifacts.items():
            print(f"{name}: {path}", file=sys.stderr)
    return 0
