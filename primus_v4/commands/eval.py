"""`primus-v4 eval (--run DIR [--step N] | --model DIR) [--data PATH] [--config F] [--set k=v]
[--json]`: the held-out loss of a training checkpoint, an export or a release on a corpus.

The model is built as `train` builds it (training.trainer.Trainer with `evaluate_only`: the same
assembly, release reads, image encoder, CP splitter and quant-aware context, no optimizer) and
the corpus packed as `train` packs its evaluation corpus (`pack_spec(split="eval")` through the
node-local pack cache), so the number is the one the trainer's own evaluation reports for the
same weights and rows (training/evaluation.py). `--run` loads one checkpoint's model weights
(found and verified as `export --run` finds them) under the step's own config.yaml; `--model`
reads a release directory as `model.pretrained`. Nothing is written into the run's output or
checkpoint dirs, its lock is not taken and no release reads are recorded; the pack cache is
the one place written (as `pack` and `train` write it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

DESCRIPTION = """\
Evaluate a training run's checkpoint (--run), or an export or release directory (--model), on a
corpus: the token-mean held-out loss (and the MTP and drafter terms where the model has them),
the rows and tokens read and the throughput. The corpus is packed and rendered as `train` packs
its evaluation corpus; a checkpoint gives the number the run's own evaluation gives for the
same step and rows.
"""

EPILOG = """\
examples:
  primus-v4 eval --run outputs/my_run                 the newest checkpoint, on the run's
                                                      held-out rows (data.eval_fraction or
                                                      data.eval_path of its config)
  primus-v4 eval --run outputs/my_run --step 200 --data eval.jsonl --json
  primus-v4 eval --model /models/my-v4-sft --data eval.jsonl --set data.seq_length=8192

--run reads the step's own config.yaml (change a value with --set); --model reads
--config (default: the tiny CPU demo config) with model.pretrained=DIR and model.preset=null.
--data PATH (or --set data.path=PATH) evaluates every row of PATH; without it the config's
held-out rows are evaluated. Evaluation writes nothing into the run's dirs. Launch with
torchrun like `train` for a model that needs several GPUs, with `--` before `eval` (torchrun
would read --run as its own --run-path): torchrun --nproc-per-node 8 -m primus_v4 -- eval --run DIR
exit status by kind of failure: `primus-v4 --help` lists them.
"""

_HELD_OUT = "data.eval_"  # the held-out settings (data.eval_path, data.eval_fraction)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--run",
        metavar="RUN_OR_CHECKPOINT_DIR",
        help="a training run's output dir, its checkpoint.dir, or one step_XXXXXXXX dir; the "
        "checkpoint is verified as resume and export verify it",
    )
    which.add_argument(
        "--model",
        metavar="DIR",
        help="an export (`primus-v4 export --out DIR`) or a released checkpoint directory",
    )
    parser.add_argument(
        "--step",
        type=int,
        default=None,
        help="with --run: evaluate this step's checkpoint (default: the newest complete one)",
    )
    repeated: dict[str, Any] = {"action": "append", "default": []}  # each use adds one
    parser.add_argument(
        "--data",
        metavar="PATH",
        help="the corpus to evaluate, every row of it, as `pack --data` takes it (repeat to mix "
        "sources; options after '::'); default: the config's held-out rows (data.eval_path, or "
        "data.eval_fraction of data.path)",
        **repeated,
    )
    parser.add_argument(
        "--config",
        metavar="FILE_OR_NAME",
        help="with --model: the run config whose data, parallel and model settings apply "
        "(default: the tiny CPU demo config); --run uses the step's own config.yaml",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        metavar="SECTION.KEY=VALUE",
        help="override one config value, as `train --set` does, e.g. --set data.seq_length=8192",
        **repeated,
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object instead of the table"
    )


def _set_keys(args: argparse.Namespace) -> set[str]:
    """The config keys the command line's --set items give."""
    return {item.partition("=")[0].strip() for item in args.overrides}


def _usage(args: argparse.Namespace) -> None:
    """Options that cannot go together (argparse checks each alone)."""
    from primus_v4.errors import UsageError

    if args.step is not None and args.run is None:
        raise UsageError("--step names a checkpoint of --run; --model evaluates its own weights")
    if args.run is not None and args.config is not None:
        raise UsageError("--config: --run evaluates with the step's own config.yaml; change its "
                         "values with --set")  # fmt: skip
    held = sorted(k for k in _set_keys(args) if k.startswith(_HELD_OUT))
    if args.data and held:
        raise UsageError(f"--data evaluates every row of its corpus; --set {held[0]} chooses "
                         "held-out rows instead: pass one of them")  # fmt: skip


def _checkpoint(args: argparse.Namespace) -> Any:
    """The verified checkpoint of --run / --step (export's `find_source`, in eval's words)."""
    from primus_v4.errors import CheckpointError
    from primus_v4.export.run import ExportError, find_source

    if not Path(args.run).is_dir():  # answered before torch loads
        raise CheckpointError(f"--run {args.run}: not a directory (pass a run's output dir, its "
                              "checkpoint.dir or one step_XXXXXXXX dir)")  # fmt: skip
    try:
        return find_source(args.run, args.step, verb="evaluate")
    except ExportError as exc:  # the same refusal, as a checkpoint error of this command
        raise CheckpointError(str(exc)) from None


def _config(args: argparse.Namespace, source: Any) -> tuple[Any, str, bool]:
    """The run config evaluated, where it comes from (the step's own config.yaml for --run,
    --config with model.pretrained=--model) and whether every row of data.path is evaluated
    (--data, or --set data.path without a held-out setting)."""
    from primus_v4.commands.pack import parse_data_args
    from primus_v4.config import load_config
    from primus_v4.config.loader import DEFAULT_CONFIG
    from primus_v4.errors import CheckpointFormatError

    if source is not None:
        cfg, where = load_config(source.config_file, args.overrides), str(source.config_file)
    else:
        if not Path(args.model).is_dir():
            raise CheckpointFormatError(f"--model {args.model}: not a directory (pass an export "
                                        "or a released checkpoint directory)")  # fmt: skip
        model = [f"model.pretrained={args.model}", "model.preset=null"]
        cfg = load_config(args.config, [*args.overrides, *model])
        where = args.config or f"the default config {DEFAULT_CONFIG.stem}"
    keys = _set_keys(args)
    path = parse_data_args(args.data) if args.data else None
    if path is None and "data.path" in keys and not any(k.startswith(_HELD_OUT) for k in keys):
        path = cfg.data.path
    if path is None:
        return cfg, where, False
    data = dataclasses.replace(cfg.data, path=path, eval_path=None, eval_fraction=0.0)
    return dataclasses.replace(cfg, data=data), where, True


def _any_world(cfg: Any) -> Any:
    """An evaluation takes no step, so train.global_batch_size need not divide over this
    launch's data-parallel ranks (a run evaluated on another number of GPUs): one that does not
    becomes train.micro_batch_size x dp. Bad parallel sizes are left for `resolve_run` to name."""
    from primus_v4.config.resolve import world_size_from_env
    from primus_v4.errors import ConfigError
    from primus_v4.parallel.dims import ParallelDims

    p, t = cfg.parallel, cfg.train
    try:
        dims = ParallelDims(world=world_size_from_env(), tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep,
                            etp=p.etp)  # fmt: skip
    except ConfigError:
        return cfg
    if t.global_batch_size % (t.micro_batch_size * dims.dp) == 0:
        return cfg
    train = dataclasses.replace(t, global_batch_size=t.micro_batch_size * dims.dp)
    return dataclasses.replace(cfg, train=train)


def _resolved(cfg: Any, where: str, whole: bool) -> Any:
    """The run resolved as `train` resolves it, with its evaluation corpus (every row of
    data.path when `whole`); one line naming what to pass when there is none."""
    from primus_v4.config import resolve_run
    from primus_v4.config.resolve import pack_spec
    from primus_v4.errors import UsageError

    resolved = resolve_run(_any_world(cfg))
    if whole:
        return dataclasses.replace(resolved, eval_data=pack_spec(cfg, split="eval"))
    if resolved.eval_data is None:
        raise UsageError(f"nothing to evaluate: {where} sets neither data.eval_path nor "
                         "data.eval_fraction; pass --data PATH (a corpus), or --set "
                         "data.eval_path=PATH")  # fmt: skip
    return resolved


def _corpus(resolved: Any) -> Any:
    """The evaluation corpus packed through the pack cache, as the trainer packs it, before
    the model is built (a bad corpus costs no model build)."""
    from primus_v4.data.pipeline import build_or_load
    from primus_v4.data.stats_table import summary_table
    from primus_v4.log import get_logger
    from primus_v4.training.trainer import check_images

    spec = resolved.eval_data
    corpus = build_or_load(spec)
    get_logger(__name__).info("evaluation corpus %s:\n%s", spec.describe(),
                              summary_table(corpus.stats))  # fmt: skip
    check_images(corpus, resolved, spec.describe(), training=False)
    return corpus


def _data_name(spec: Any) -> str:
    held = spec.split == "eval"
    return spec.describe() + (f" (held-out {spec.holdout_fraction:g} of its rows)" if held else "")


def evaluate(trainer: Any, *, show: bool) -> tuple[dict[str, Any], float]:
    """The trainer's evaluation of its current weights, timed, with a progress bar when `show`."""
    from tqdm import tqdm

    evaluator = trainer.evaluator
    total = evaluator.forwards(trainer.runtime.dp_size)
    with tqdm(total=total, desc="evaluating", unit="row", disable=not show,
              dynamic_ncols=True) as bar:  # fmt: skip
        start = time.perf_counter()
        losses = evaluator.run(trainer, progress=bar.update)
        seconds = time.perf_counter() - start
    return losses, seconds


def report(
    trainer: Any, losses: dict[str, Any], seconds: float, *, source: str, step: int | None
) -> dict[str, Any]:
    """What `eval` prints: where, which rows, the losses and the throughput."""
    counts = trainer.evaluator.counts
    kept = {k: v for k, v in losses.items() if k != "eval_mtp_loss" or trainer.mtp_depths}
    rate = 1.0 / max(seconds, 1e-9)
    return {
        "source": source,
        "step": step,
        "data": _data_name(trainer.run.eval_data),
        "rows": trainer.evaluator.num_rows,
        "samples": counts.samples,
        "tokens": counts.total,
        "supervised_tokens": counts.supervised,
        **kept,
        "seconds": seconds,
        "tokens_per_s": counts.total * rate,
        "supervised_tokens_per_s": counts.supervised * rate,
    }


def _table(out: dict[str, Any]) -> str:
    from primus_v4.training.metrics.writer import format_table

    rows = {k: v for k, v in out.items() if k != "source" and v is not None}
    lists = {k: ", ".join(f"{x:.4f}" for x in v) for k, v in rows.items() if isinstance(v, list)}
    return format_table(rows | lists, title=f"evaluation of {out['source']}")


def run(args: argparse.Namespace) -> int:
    from primus_v4.commands.train import check_kernels

    _usage(args)
    source = _checkpoint(args) if args.run is not None else None
    cfg, where, whole = _config(args, source)
    resolved = _resolved(cfg, where, whole)
    check_kernels(cfg)
    corpus = _corpus(resolved)

    from primus_v4.training.trainer import Trainer

    trainer = Trainer(resolved, eval_corpus=corpus, evaluate_only=True)
    try:
        step = trainer.load_weights(source.checkpoint) if source is not None else None
        show = trainer._bars() and sys.stdout.isatty()
        losses, seconds = evaluate(trainer, show=show)
    finally:
        trainer.runtime.close()
    if not trainer.runtime.is_main:
        return 0
    where_from = str(source.checkpoint) if source is not None else str(args.model)
    out = report(trainer, losses, seconds, source=where_from, step=step)
    print(json.dumps(out) if args.json else _table(out))
    return 0
