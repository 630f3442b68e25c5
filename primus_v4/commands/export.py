"""`primus-v4 export --run DIR [--step N] --out DIR [--dtype bfloat16|fp8]`: a training
checkpoint (any parallel layout) as a released DeepSeek-V4 checkpoint directory: config.json with
the release's keys, safetensors shards of bounded size with an index, the tokenizer files. The
result loads in HF transformers (`from_pretrained(out)`) and serves with vLLM / SGLang
(`--model out`); `model.pretrained: out` starts another run from it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--run",
        required=True,
        metavar="RUN_OR_CHECKPOINT_DIR",
        help="a run's output dir, its checkpoint.dir, or one step_XXXXXXXX checkpoint dir; the "
        "checkpoint is verified as resume verifies it (a damaged newest one is skipped, a named "
        "damaged step refused)",
    )
    parser.add_argument(
        "--step", type=int, default=None, help="export this step (default: the latest complete)"
    )
    parser.add_argument("--out", required=True, help="output directory (must not exist yet)")
    parser.add_argument(
        "--dtype",
        choices=["bfloat16", "fp8"],
        default="bfloat16",
        help="bfloat16 weights, or the release's FP8 e4m3 (128x128 ue8m0 block scales) with FP4 "
        "e2m1 experts (ue8m0 scale per 32 inputs) (default: %(default)s)",
    )
    parser.add_argument(
        "--max-shard-gb",
        type=float,
        default=5.0,
        help="largest safetensors shard in GiB (default: %(default)s)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def check_out(out: Path) -> None:
    """--out must be new (or an empty dir) and creatable: checked before anything is read."""
    from primus_v4.durable import writable_problem
    from primus_v4.errors import PathError

    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        what = "is not empty" if out.is_dir() else "exists and is not a directory"
        raise PathError(f"--out {out} {what}; choose a new directory (export never overwrites)")
    problem = writable_problem(out)
    if problem is not None:
        raise PathError(f"--out {out}: {problem}; choose a directory you can write to")


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from primus_v4.errors import ConfigError
    from primus_v4.training.export_run import export_checkpoint, find_source, release_tensor_count

    if not args.max_shard_gb > 0:
        raise ConfigError(f"--max-shard-gb {args.max_shard_gb}: must be > 0 (GiB per shard)")
    check_out(Path(args.out))
    source = find_source(args.run, args.step)
    with tqdm(
        total=release_tensor_count(source), desc="exporting", unit="tensor",
        disable=args.no_progress,
    ) as bar:  # fmt: skip
        summary = export_checkpoint(
            source,
            args.out,
            dtype=args.dtype,
            max_shard_bytes=int(args.max_shard_gb * 2**30),
            progress=bar.update,
        )
    print(
        json.dumps(
            {
                "checkpoint": str(source.checkpoint),
                "out": str(summary.directory),
                "dtype": args.dtype,
                "shards": summary.shards,
                "tensors": summary.tensors,
                "bytes": summary.total_bytes,
            }
        )
    )
    return 0
