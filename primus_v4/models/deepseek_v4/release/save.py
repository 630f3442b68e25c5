"""Models out in the release layout: bf16, or the release's FP8 linears + FP4 experts.

`write_release_state(cfg, state, out)` is the one writer: `state` yields our state-dict tensors
(a live model's, or a training checkpoint's read one layer at a time by the export), renamed
and laid out by the name table (`state_dict_adapter.to_release`) and written by the sharded
writer with the release's config.json keys.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence

import torch
from tqdm import tqdm

from primus_v4.checkpoint_formats.sharded import ExportDtype, WriteSummary, write_checkpoint
from primus_v4.models.deepseek_v4.config import DeepseekV4Config
from primus_v4.models.deepseek_v4.model import DeepseekV4Model
from primus_v4.models.deepseek_v4.release import state_dict_adapter as adapter


def write_release_state(
    cfg: DeepseekV4Config,
    state: Iterable[dict[str, torch.Tensor]],
    out: str | os.PathLike,
    *,
    dtype: ExportDtype = "bfloat16",
    max_shard_bytes: int = 5 * 2**30,
    extra_files: Sequence[str | os.PathLike] = (),
    progress: Callable[[int], None] | None = None,
) -> WriteSummary:
    """Write the state-dict pieces `state` (each a dict of our names; together the whole
    model) as a release directory at `out`, atomically."""
    kinds = {r.name: r.kind for r in adapter.release_tensors(cfg).values()}
    tensors = (item for piece in state for item in adapter.to_release(cfg, piece))
    return write_checkpoint(
        out,
        tensors,
        kinds,
        adapter.config_to_release(cfg),
        dtype=dtype,
        max_shard_bytes=max_shard_bytes,
        extra_files=extra_files,
        progress=progress,
    )


def save_pretrained(
    model: DeepseekV4Model,
    out: str | os.PathLike,
    *,
    dtype: ExportDtype = "bfloat16",
    max_shard_bytes: int = 5 * 2**30,
    extra_files: Sequence[str | os.PathLike] = (),
    progress: bool = True,
) -> WriteSummary:
    """Write `model` (a whole DeepseekV4Model) in the release layout; returns the summary."""
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
        )
    finally:
        bar.close()
