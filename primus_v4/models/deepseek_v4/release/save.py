"""Models out in the release layout: bf16, or the release's FP8 linears + FP4 experts.

`write_release_state(cfg, state, out)` is the one writer: `state` yields our state-dict tensors
(a live model's, or a training checkpoint's read one layer at a time by the export), renamed
and laid out by the name table (`state_dict_adapter.to_release`) and written by the sharded
writer with the release's config.json keys.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch
from tqdm import tqdm

from primus_v4.checkpoint_formats.carried import copy_carried
from primus_v4.checkpoint_formats.sharded import (
    CheckpointReader,
    ExportDtype,
    WriteSummary,
    write_checkpoint,
)
from primus_v4.errors import CheckpointFormatError
from primus_v4.log import get_logger
from primus_v4.models.deepseek_v4.config import DeepseekV4Config
from primus_v4.models.deepseek_v4.model import DeepseekV4Model
from primus_v4.models.deepseek_v4.release import state_dict_adapter as adapter

log = get_logger(__name__)


def write_release_state(
    cfg: DeepseekV4Config,
    state: Iterable[dict[str, torch.Tensor]],
    out: str | os.PathLike,
    *,
    dtype: ExportDtype = "bfloat16",
    max_shard_bytes: int = 5 * 2**30,
    extra_files: Sequence[str | os.PathLike] = (),
    progress: Callable[[int], None] | None = None,
    carry_from: str | os.PathLike | None = None,
) -> WriteSummary:
    """Write the state-dict pieces `state` (each a dict of our names; together the whole
    model) as a release directory at `out`, atomically. A release with a DSpark drafter
    (`cfg.dspark`) gets the drafter's tensors copied byte for byte from `carry_from`, the
    release the model was loaded from."""
    kinds = {r.name: r.kind for r in adapter.release_tensors(cfg).values()}
    tensors = (item for piece in state for item in adapter.to_release(cfg, piece))
    if cfg.dspark and dtype == "bfloat16":
        log.warning(
            "the DSpark drafter (mtp.*) is carried as released (FP8/FP4 where the release "
            "quantizes it) beside a bf16 backbone; export with dtype fp8 for a config.json whose "
            "quantization_config describes both"
        )
    return write_checkpoint(
        out,
        tensors,
        kinds,
        adapter.config_to_release(cfg),
        dtype=dtype,
        max_shard_bytes=max_shard_bytes,
        extra_files=extra_files,
        progress=progress,
        carry=_carry(cfg, carry_from),
    )


def _carry(cfg: DeepseekV4Config, source: str | os.PathLike | None):
    """The writer's `carry` hook: the drafter's tensors of `source`, None without a drafter."""
    if not cfg.dspark:
        return None
    if source is None:
        raise CheckpointFormatError(
            "this model's release has a DSpark drafter (mtp.*) that is carried, not trained: "
            "name the release it came from (carry_from) so the export holds it"
        )
    with CheckpointReader(source) as reader:
        names = adapter.carried(cfg, reader.stored_names())
    if not names:
        raise CheckpointFormatError(f"{source}: holds no mtp.* tensor of the DSpark drafter")
    return lambda tmp: copy_carried(Path(source), tmp, names)


def save_pretrained(
    model: DeepseekV4Model,
    out: str | os.PathLike,
    *,
    dtype: ExportDtype = "bfloat16",
    max_shard_bytes: int = 5 * 2**30,
    extra_files: Sequence[str | os.PathLike] = (),
    progress: bool = True,
    carry_from: str | os.PathLike | None = None,
) -> WriteSummary:
    """Write `model` (a whole DeepseekV4Model) in the release layout; returns the summary.
    A DSpark drafter is carried from `carry_from`, by default the release `load_pretrained`
    read."""
    state = model.state_dict()
    names = adapter.needed(model.cfg, list(state))
    bar = tqdm(total=len(names), desc="saving", unit="tensor", disable=not progress)
    try:
        return write_release_state(
            model.cfg,
            [state],
            out,
            dtype=dtype,
            max_shard_bytes=max_shard_bytes,
            extra_files=extra_files,
            progress=bar.update,
            carry_from=carry_from or getattr(model, "release_dir", None),
        )
    finally:
        bar.close()
