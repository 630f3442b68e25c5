"""`primus-v4 train --config F [--set k=v ...] [--dry-run]`: one SFT run from a YAML config.

Without --config the shipped default (primus_v4/configs/runs/tiny_cpu_thd.yaml) runs.
--dry-run checks everything that can be checked without data or weights (keys, types, values,
parallel sizes against WORLD_SIZE, the model preset and its overrides, paths) and prints the
resolved config as one single-line JSON object on stdout. With --device-memory (and at every real
launch on an accelerator, with its own memory) the per-rank memory plan is printed on stderr and the
run stops with one line when a pipeline stage does not fit (memory/gate.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
from typing import Any

from primus_v4.errors import ExitCode, Interrupted

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
checkpoint. One run writes a directory at a time: a second one is refused with the first one's
host and pid, and an output.dir holding another run's outputs needs --set output.overwrite=true.
SIGTERM or SIGUSR1 (scheduler preemption) saves a checkpoint after the current step
and exits 0; without checkpoint.dir nothing is saved and the exit status is 128 + the signal.
exit status by kind of failure: `primus-v4 --help` lists them.
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
        help="override one config value (repeatable; wins over the file), read as the key's type: "
        "a string key takes the text literally (a path may hold ' #'), others parse it as YAML, "
        "e.g. --set train.steps=5 --set data.path=corpus.jsonl",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="check the config, the world size, the model preset and that every path exists and "
        "is writable; print the resolved config as one JSON line; exit without loading data "
        "or building the model",
    )
    parser.add_argument(
        "--device-memory",
        default=None,
        metavar="GIB_OR_NAME",
        help="plan every pipeline stage's memory for this device (MI300X, MI308X, MI355X or "
        "GiB), print the plan on stderr and stop when a stage does not fit; default: the "
        "accelerator's own memory at a real launch, no plan on CPU or in a dry run",
    )


def run(args: argparse.Namespace) -> int:
    from primus_v4.config import load_config, to_dict
    from primus_v4.training import run_dirs

    cfg = load_config(args.config, args.overrides)
    if not args.dry_run:  # recorded absolute: export and resume read them from anywhere
        cfg = run_dirs.absolute_dirs(cfg)
    resolved = preflight(cfg, args)
    if resolved is None:
        return 3
    main_rank = os.environ.get("RANK", "0") == "0"  # the one writer of output.dir
    if args.dry_run:
        if os.environ.get("NODE_RANK", "0") == "0":  # other nodes' checks race node 0's start
            run_dirs.check(cfg)
        payload = {**to_dict(cfg), "derived": {**resolved.summary(), **_pack_caches(resolved)}}
        print(json.dumps(payload, separators=(",", ":"), sort_keys=False))
        return 0

    from primus_v4.training.trainer import Trainer

    with run_dirs.claim(cfg) if main_rank else contextlib.nullcontext():
        return execute(Trainer(resolved))


def preflight(cfg: Any, args: argparse.Namespace) -> Any:
    """The checks a run makes before any work (packing, building, reading weights), in order;
    `--dry-run` makes these same ones, through this one function, so the two cannot drift:
    the paths (writable dirs, corpus files, tokenizer, tracker importable and its directory),
    the resolved config (every size bounded, parallel sizes, vocabulary against the tokenizer,
    the modes' refusals), a resume's change of what trains, the release (index, shard headers,
    names, its Engram token map) and the memory plan where one is asked for or an accelerator
    is used. The output and checkpoint directories are checked by `run_dirs` (the dry run) or
    claimed (the run). Returns the resolved run, or None when the memory plan does not fit (it
    said why)."""
    from primus_v4.config import resolve_run
    from primus_v4.config.preflight import check_paths
    from primus_v4.config.resolve import check_pretrained
    from primus_v4.training.checkpoint.trained_parts import check_newest

    check_paths(cfg)  # seconds, before the model config imports torch
    check_newest(cfg)  # a resume that would drop a trained part, or train one not held
    # without a memory plan, a dry run reads the model's geometry: no torch, no megatron-core
    resolved = resolve_run(cfg, geometry=args.dry_run and args.device_memory is None)
    if _config_only(cfg, args):
        print(f"primus-v4 train: model.pretrained={cfg.model.pretrained} holds a config.json and "
              "no weights: the dry run plans from the config alone; training needs the "
              "release's safetensors there", file=sys.stderr)  # fmt: skip
    else:  # a resumed run reads the release too (what its checkpoint does not hold)
        check_pretrained(cfg, resolved.model)
    check_kernels(cfg)
    if _memory_gate(resolved, args) != 0:
        return None
    return resolved


def check_kernels(cfg: Any) -> None:
    """An explicit kernel backend (`PRIMUS_V4_KERNEL_BACKEND`) is refused as building the model
    would refuse it: an op name that is not registered, or a backend that cannot run on this
    machine, for each op the run uses. Loads the kernels (torch) only when the variable is set."""
    from primus_v4.environment import KERNEL_BACKEND_ENV

    if not os.environ.get(KERNEL_BACKEND_ENV, "").strip():
        return
    from primus_v4.kernels import registry
    from primus_v4.kernels.release_round import OP_NAME as RELEASE_ROUND

    for op in registry.available_ops():
        if op != RELEASE_ROUND or cfg.train.quant_aware != "none":
            registry.choose(op)


def _config_only(cfg: Any, args: argparse.Namespace) -> bool:
    """A dry run whose model.pretrained is a release's config.json without its weights (the
    published config.json, copied to plan a run before the download)."""
    if not args.dry_run or cfg.model.pretrained is None:
        return False
    from pathlib import Path

    from primus_v4.checkpoint_formats.sharded import INDEX_FILE, SINGLE_FILE

    release = Path(cfg.model.pretrained)
    return not any((release / name).exists() for name in (INDEX_FILE, SINGLE_FILE))


def resume_point(cfg: Any) -> str:
    """What a rerun of an interrupted run starts from: the newest complete checkpoint's step,
    or that nothing was saved."""
    from pathlib import Path

    from primus_v4.training.checkpoint.integrity import complete_checkpoints

    ck = cfg.checkpoint
    if not ck.dir:
        return "nothing was saved (checkpoint.dir is not set): a rerun starts from step 0"
    saved = complete_checkpoints(Path(ck.dir))
    if not saved:
        return f"no checkpoint in {ck.dir} yet: a rerun starts from step 0"
    step = int(saved[-1].name.removeprefix("step_"))
    if not ck.resume:
        return (f"the newest checkpoint is step {step} ({saved[-1]}); checkpoint.resume is "
                "false: rerun with --set checkpoint.resume=true to resume from it")  # fmt: skip
    return f"rerun the same command to resume from step {step} ({saved[-1]})"


def _pack_caches(resolved: Any) -> dict[str, Any]:
    """The pack cache entries the run reads ({dir, key, hit}), for the dry run to show whether
    packs built ahead (`primus-v4 pack`) are the ones the run will load."""
    from primus_v4.data.pipeline import cache_lookup

    out = {"pack_cache": cache_lookup(resolved.data)}
    if resolved.eval_data is not None:
        out["eval_pack_cache"] = cache_lookup(resolved.eval_data)
    return out


def _memory_gate(resolved: Any, args: argparse.Namespace) -> int:
    """Plan and gate (memory/gate.py); 3 when a stage does not fit. Every rank checks
    (each must stop), rank 0 prints the plan and the one-line reason on stderr."""
    if args.dry_run and args.device_memory is None:
        return 0  # no plan: the planner (it imports the trainer's modules) stays unloaded
    from primus_v4.memory import gate as memory_gate

    if args.device_memory is not None:
        device = memory_gate.parse_device(args.device_memory)
    elif args.dry_run or (device := memory_gate.accelerator_memory()) is None:
        return 0
    loud = os.environ.get("RANK", "0") == "0"
    printer = (lambda text: print(text, file=sys.stderr)) if loud else None
    try:
        memory_gate.gate(resolved, device, printer=printer)
    except memory_gate.MemoryPlanError as exc:
        if loud:
            print(f"primus-v4 train: error: {exc}", file=sys.stderr)
        return 3
    return 0


def execute(trainer: Any) -> int:
    """Train, print the summary (rank 0), and say how a preempted run continues; exit status:
    0 when the run finished or saved a checkpoint to resume from, 128 + the signal's number when
    a signal stopped it before anything was saved (a scheduler must not see success)."""
    from primus_v4.training.metrics.writer import format_table

    try:
        result = trainer.train()
    except KeyboardInterrupt:
        raise Interrupted(f"interrupted; {resume_point(trainer.cfg)}") from None
    finally:
        trainer.runtime.close()
    unsaved = result.stopped_at is not None and result.saved is None
    code = ExitCode.SIGNAL_BASE + (result.signum or signal.SIGTERM) if unsaved else ExitCode.OK
    if not trainer.runtime.is_main:
        return code
    print(format_table(result.summary, title=f"run summary ({result.output_dir})"))
    for name, path in result.artifacts.items():
        print(f"{name}: {path}", file=sys.stderr)
    if result.stopped_at is None:
        return code
    if result.saved is not None:
        again = (
            "rerun the same command to resume"
            if trainer.cfg.checkpoint.resume
            else "rerun with --set checkpoint.resume=true to resume (checkpoint.resume is false)"
        )
        print(f"primus-v4 train: stopped on {result.stop_signal}: saved step {result.stopped_at} "
              f"to {result.saved}; {again}", file=sys.stderr)  # fmt: skip
    else:
        print(f"primus-v4 train: error: stopped on {result.stop_signal} after step "
              f"{result.stopped_at} and saved nothing (checkpoint.dir is not set): the run is "
              f"unfinished; exit {code}", file=sys.stderr)  # fmt: skip
    return code
