"""Training checkpoint (DCP, any parallel layout) -> the release layout (bf16 or FP8 + FP4).

DCP stores each of our tensors once under `model.<name>` with its global shape (expert shards
are dim-0 DTensor shards of the global [E, ...] tensor; pipeline stages hold disjoint names), so
one process reads them back at any layout. The export streams: one layer's tensors are read at
a time, renamed and reshaped by the name table (state_dict_adapter.py `to_release`), quantized
if asked and written into bounded shards (pretrained/save.py `write_release_state`), so memory
stays about one layer plus one shard. The run's config.yaml (beside the checkpoints or in the
run's output dir) gives the model config; the tokenizer files of the run travel along.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from primus_v4.checkpoint_formats.sharded import ExportDtype, WriteSummary, tokenizer_files
from primus_v4.config import RunConfig, load_config
from primus_v4.config.resolve import model_config, tokenizer_of
from primus_v4.data.tokenizer import resolve_tokenizer_dir
from primus_v4.errors import PrimusError
from primus_v4.log import get_logger
from primus_v4.models.deepseek_v4 import state_dict_adapter as adapter
from primus_v4.models.deepseek_v4.config import DeepseekV4Config
from primus_v4.pretrained.save import write_release_state
from primus_v4.training.checkpoint import check_layout, find_latest, step_dir

log = get_logger(__name__)
MODEL_PREFIX = "model."


class ExportError(PrimusError):
    """The training checkpoint cannot be exported (missing, incomplete, or another model)."""


@dataclass(kw_only=True, frozen=True)
class ExportSource:
    """A published training checkpoint and the run config that produced it."""

    checkpoint: Path
    run: RunConfig
    config_file: Path


def _find_config(*candidates: Path) -> Path:
    for directory in candidates:
        if (directory / "config.yaml").is_file():
            return directory / "config.yaml"
    raise ExportError(
        f"no config.yaml in {', '.join(str(c) for c in candidates)}: pass a run's output dir or "
        "its checkpoint dir (the trainer writes config.yaml into both)"
    )


def find_source(path: str | os.PathLike, step: int | None = None) -> ExportSource:
    """Resolve `--run` (a run output dir, a checkpoint dir, or one step's dir) and `--step`."""
    p = Path(path)
    if not p.is_dir():
        raise ExportError(f"{p}: not a directory (pass a run's output dir or checkpoint dir)")
    if (p / ".metadata").is_file():  # one step's checkpoint
        if step is not None:
            raise ExportError(f"{p} is already one step's checkpoint; drop --step {step}")
        config_file = _find_config(p.parent, p.parent.parent)
        return ExportSource(checkpoint=p, run=load_config(config_file), config_file=config_file)
    config_file = _find_config(p)
    run = load_config(config_file)
    if any(p.glob("step_*")):
        root = p
    elif run.checkpoint.dir:
        root = Path(run.checkpoint.dir)  # as the trainer saw it (relative to the launch dir)
    else:
        raise ExportError(f"{config_file}: checkpoint.dir is unset, so the run saved nothing")
    found = step_dir(root, step) if step is not None else find_latest(root)
    if found is None or not (found / ".metadata").is_file():
        what = f"step {step}" if step is not None else "a complete checkpoint"
        steps = sorted(d.name for d in root.glob("step_*")) if root.is_dir() else []
        raise ExportError(f"{root}: no {what} (present: {steps or 'none'})")
    return ExportSource(checkpoint=found, run=run, config_file=config_file)


def _stored_model_tensors(checkpoint: Path) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Our tensor name -> (global shape, dtype) as the DCP metadata records them (after the
    checkpoint's model layout is checked to be this version's)."""
    check_layout(checkpoint)
    meta = FileSystemReader(checkpoint).read_metadata().state_dict_metadata
    out = {}
    for key, m in meta.items():
        if key.startswith(MODEL_PREFIX) and hasattr(m, "size"):
            out[key[len(MODEL_PREFIX) :]] = (m.size, m.properties.dtype)
    return out


def _check_names(cfg: DeepseekV4Config, stored: dict, checkpoint: Path) -> None:
    table = adapter.name_table(cfg)
    missing = [n for n in table if n not in stored]
    unknown = [n for n in stored if n not in table]
    wrong = [
        f"{n} {list(stored[n][0])} (config: {list(table[n].shape)})"
        for n in table
        if n in stored and tuple(stored[n][0]) != tuple(table[n].shape)
    ]
    if missing or unknown or wrong:
        raise ExportError(
            f"{checkpoint}: does not hold the model of its config.yaml: missing {missing[:8]}, "
            f"unknown {unknown[:8]}, shape mismatches {wrong[:8]}"
        )


def _groups(names: list[str]) -> list[list[str]]:
    """Tensors read together: one decoder layer or MTP depth at a time, the rest together."""
    groups: dict[str, list[str]] = {}
    for name in names:
        parts = name.split(".")
        key = ".".join(parts[:2]) if parts[0] in ("layers", "mtp") else ""
        groups.setdefault(key, []).append(name)
    return list(groups.values())


def _stored_state(checkpoint: Path, groups: list[list[str]], stored: dict) -> Iterator[dict]:
    for group in groups:
        state = {n: torch.empty(stored[n][0], dtype=stored[n][1]) for n in group}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP's no_dist notice
            dcp.load({"model": state}, checkpoint_id=checkpoint, no_dist=True)
        yield state


def export_checkpoint(
    source: ExportSource,
    out: str | os.PathLike,
    *,
    dtype: ExportDtype = "bfloat16",
    max_shard_bytes: int = 5 * 2**30,
    progress: Callable[[int], None] | None = None,
) -> WriteSummary:
    """Write `source` as a release directory at `out` (atomic; see the module docstring)."""
    cfg = model_config(source.run)
    stored = _stored_model_tensors(source.checkpoint)
    _check_names(cfg, stored, source.checkpoint)
    tokenizer_dir = resolve_tokenizer_dir(tokenizer_of(source.run))
    summary = write_release_state(
        cfg,
        _stored_state(source.checkpoint, _groups(list(adapter.name_table(cfg))), stored),
        out,
        dtype=dtype,
        max_shard_bytes=max_shard_bytes,
        extra_files=tokenizer_files(tokenizer_dir),
        progress=progress,
    )
    log.info("exported %s -> %s (%s, %d shards)", source.checkpoint, out, dtype, summary.shards)
    return summary


def release_tensor_count(source: ExportSource) -> int:
    """How many logical release tensors an export of `source` writes (the progress total)."""
    return len(adapter.release_tensors(model_config(source.run)))
