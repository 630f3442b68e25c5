"""`primus-v4 export --run DIR [--step N] --out DIR [--format release|peft] [--dtype ...]
[--release DIR]`: a training checkpoint (any parallel layout) as a released DeepSeek-V4 / V4.1
checkpoint directory: config.json with the release's keys, safetensors shards of bounded size
with an index, the tokenizer files. A run that started from a release is exported with it
(`--release`: where it is now, when it moved). The result loads in HF transformers
(`from_pretrained(out)`) and serves with vLLM / SGLang (`--model out`); `model.pretrained: out`
starts another run from it. A LoRA run is merged into its base; `--format peft` writes its
adapters alone, in PEFT's format on transformers' module names
(`PeftModel.from_pretrained(model, out)`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

MAX_SHARD_GB = 1024.0
"""The largest --max-shard-gb taken (GiB): far above any release's shards (about 4 GiB)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--run",
        required=True,
        metavar="RUN_OR_CHECKPOINT_DIR",
        help="a run's output dir, its checkpoint.dir, or one step_XXXXXXXX checkpoint dir; the "
        "checkpoint is verified as resume verifies it, and a damaged one (the newest, or --step) "
        "refused by name",
    )
    parser.add_argument(
        "--step", type=int, default=None, help="export this step (default: the latest complete)"
    )
    parser.add_argument("--out", required=True, help="output directory (must not exist yet)")
    parser.add_argument(
        "--release",
        default=None,
        metavar="DIR",
        help="where the release the run started from is now (a copy of its model.pretrained, "
        "which the export reads: its tokenizer and the tensors the run did not train, checked "
        "against the digests the run recorded of them); default: where the run recorded it",
    )
    parser.add_argument(
        "--format",
        choices=["release", "peft"],
        default="release",
        help="release: the whole model in the release layout (a LoRA run merged into its base); "
        "peft: a LoRA run's adapters alone, adapter_config.json + adapter_model.safetensors on "
        "transformers' DeepseekV4ForCausalLM names (default: %(default)s)",
    )
    parser.add_argument(
        "--dtype",
        choices=["bfloat16", "fp8"],
        default=None,
        help="release: bfloat16 weights (the default), or the release's FP8 e4m3 with ue8m0 "
        "block scales (DeepSeek-V4 128x128, V4.1 32x32) and FP4 e2m1 experts (ue8m0 scale per "
        "32 inputs); peft: bfloat16 adapters (default: as the checkpoint holds them)",
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
    from primus_v4.durable import remove_stale, writable_problem
    from primus_v4.errors import PathError
    from primus_v4.log import get_logger

    log = get_logger(__name__)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        what = "is not empty" if out.is_dir() else "exists and is not a directory"
        raise PathError(f"--out {out} {what}; choose a new directory (export never overwrites)")
    problem = writable_problem(out)
    if problem is not None:
        raise PathError(f"--out {out}: {problem}; choose a directory you can write to")
    left = remove_stale(out.parent, f".{out.name}.partial-")
    if left:
        log.warning("removed %s in %s, left by an export to %s that was killed", ", ".join(left),
                    out.parent, out)  # fmt: skip


def check_apart(out: Path, run: str, source: Any) -> None:
    """--out must not be, hold, or lie inside anything the export reads."""
    from primus_v4.durable import overlap_problem
    from primus_v4.errors import PathError

    cfg = source.run
    inputs = {"--run": run, "the checkpoint": source.checkpoint,
              "the base release (model.pretrained)": cfg.model.pretrained,
              "the tokenizer (data.tokenizer)": cfg.data.tokenizer}  # fmt: skip
    clash = overlap_problem(out, inputs)
    if clash is not None:
        raise PathError(f"--out {out}: {clash}; choose a directory apart from what export reads")


def _source(args: argparse.Namespace) -> Any:
    """The verified checkpoint of `--run` / `--step`, its release read from `--release`."""
    from primus_v4.export.run import find_source, with_release

    return with_release(find_source(args.run, args.step), args.release)


def _run_peft(args: argparse.Namespace) -> int:
    import torch

    from primus_v4.export.run import export_adapters

    source = _source(args)
    check_apart(Path(args.out), args.run, source)
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else None
    summary = export_adapters(source, args.out, dtype=dtype)
    print(
        json.dumps(
            {
                "checkpoint": str(source.checkpoint),
                "out": str(summary.directory),
                "format": "peft",
                "dtype": args.dtype or "as stored",
                "tensors": summary.tensors,
                "bytes": summary.total_bytes,
                "mtp_adapter_tensors_left_out": summary.left_out,
            }
        )
    )
    return 0


def run(args: argparse.Namespace) -> int:
    from primus_v4.errors import CheckpointError, ConfigError, UsageError

    if args.format == "peft" and args.dtype == "fp8":
        raise UsageError(
            "--dtype fp8 quantizes release weights; --format peft writes adapters (bfloat16, or "
            "as stored without --dtype)"
        )
    if not 0 < args.max_shard_gb <= MAX_SHARD_GB:  # nan and inf fail this too
        raise ConfigError(
            f"--max-shard-gb {args.max_shard_gb}: must be > 0 and at most {MAX_SHARD_GB} "
            "(GiB per shard)"
        )
    check_out(Path(args.out))
    if not Path(args.run).is_dir():  # answered before torch loads (seconds)
        raise CheckpointError(
            f"{args.run}: not a directory (pass a run's output dir or checkpoint dir)"
        )
    if args.format == "peft":
        return _run_peft(args)
    from tqdm import tqdm

    from primus_v4.export.run import export_checkpoint, release_tensor_count

    dtype = args.dtype or "bfloat16"
    source = _source(args)
    check_apart(Path(args.out), args.run, source)
    with tqdm(
        total=release_tensor_count(source), desc="exporting", unit="tensor",
        disable=args.no_progress or not sys.stderr.isatty(),
    ) as bar:  # fmt: skip
        summary = export_checkpoint(
            source,
            args.out,
            dtype=dtype,
            max_shard_bytes=int(args.max_shard_gb * 2**30),
            progress=bar.update,
        )
    print(
        json.dumps(
            {
                "checkpoint": str(source.checkpoint),
                "out": str(summary.directory),
                "format": "release",
                "dtype": dtype,
                "shards": summary.shards,
                "tensors": summary.tensors,
                "bytes": summary.total_bytes,
            }
        )
    )
    return 0
