"""`primus-v4 train --config F [--set k=v ...] [--dry-run]`: one SFT run from a YAML config.

Without --config the shipped default (primus_v4/configs/runs/tiny_cpu_thd.yaml) runs.
--dry-run checks everything that can be checked without data or weights (keys, types, values,
parallel sizes against WORLD_SIZE, the model preset and its overrides, paths) and prints the
resolved config as one single-line JSON object on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from primus_v4.config import load_config, resolve_run, to_dict

DESCRIPTION = """\
Run one fine-tuning job. The config is a YAML file with one section per concern (data, model,
parallel, optim, train, output, checkpoint); every key is optional and unknown keys are errors.
Launch with torchrun (one process per GPU) for parallel runs; parallel sizes come from the
config and WORLD_SIZE.
"""

EPILOG = """\
config reference: `primus-v4 inspect config` lists every key with its type, default and meaning
(`primus-v4 inspect config --section train` for one section); shipped configs and model presets:
`primus-v4 inspect presets`.

outputs: output.dir gets config.yaml (the resolved config), metrics.jsonl (one row per step) and
loss.png; with checkpoint.dir set, rerunning the same command resumes from the newest complete
checkpoint. SIGTERM or SIGUSR1 (scheduler preemption) saves a checkpoint after the current step
and exits 0.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        default=None,
        metavar="FILE_OR_NAME",
        help="your run config YAML file, or the name of a shipped one (e.g. tiny_cpu_bshd); "
        "default: the tiny CPU demo run (tiny_cpu_thd)",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config value, parsed as YAML (repeatable; wins over the file), e.g. "
        "--set train.steps=5 --set data.path=corpus.jsonl",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="check the config, the world size, the model preset and that every path exists and "
        "is writable; print the resolved config as one JSON line; exit without loading data "
        "or building the model",
    )


def run(args: argparse.Namespace) -> int:
    from primus_v4.config.preflight import check_paths

    cfg = load_config(args.config, args.overrides)
    check_paths(cfg)  # seconds, before the model config imports torch
    resolved = resolve_run(cfg)
    if args.dry_run:
        payload = {**to_dict(cfg), "derived": resolved.summary()}
        print(json.dumps(payload, separators=(",", ":"), sort_keys=False))
        return 0

    from primus_v4.training.trainer import Trainer

    return execute(Trainer(resolved))


def execute(trainer: Any) -> int:
    """Train, print the summary (rank 0), and say how a preempted run continues; exit status."""
    from primus_v4.training.metrics import format_table

    try:
        result = trainer.train()
    finally:
        trainer.runtime.close()
    if not trainer.runtime.is_main:
        return 0
    print(format_table(result.summary, title=f"run summary ({result.output_dir})"))
    for name, path in result.artifacts.items():
        print(f"{name}: {path}", file=sys.stderr)
    if result.stopped_at is not None:
        if result.saved is not None:
            print(
                f"primus-v4 train: stopped on {result.stop_signal}: saved step "
                f"{result.stopped_at} to {result.saved}; rerun the same command to resume",
                file=sys.stderr,
            )
        else:
            print(
                f"primus-v4 train: stopped on {result.stop_signal} after step "
                f"{result.stopped_at}; nothing saved (checkpoint.dir is not set)",
                file=sys.stderr,
            )
    return 0
