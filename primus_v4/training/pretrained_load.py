"""Start a run from a released checkpoint: each rank reads only what it keeps.

The trainer builds the whole model on the meta device and cuts it to the rank's pipeline stage
and expert shard (primus_v4/parallel/parallelize.py); `materialize` then allocates just those
tensors and calls `load_rank_weights` instead of the random init. Our tensor names carry global
layer indices and an expert shard knows its global rows (`MoE.expert_offset`), so the name table
(release.py) turns the rank's state-dict keys into exactly the release tensors it needs; each
is read from its shard with positioned reads and decoded straight into the parameter (in its
dtype).
Before reading, every rank checks the checkpoint's names against the whole model's (names only):
a checkpoint of another model fails on every rank with the same message.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from primus_v4.log import get_logger
from primus_v4.models.deepseek_v4 import release
from primus_v4.models.deepseek_v4.release_io import ReleaseReader, load_workers

log = get_logger(__name__)


@dataclass(kw_only=True, frozen=True)
class RankLoad:
    """What one rank read: tensors filled, stored bytes read, the checkpoint's total bytes."""

    tensors: int
    bytes_read: int
    checkpoint_bytes: int


def expert_range(model: nn.Module) -> tuple[int, int] | None:
    """Global experts [lo, hi) this rank's MoE layers hold (all of them alike), None if no MoE."""
    from primus_v4.models.deepseek_v4.moe import MoE

    ranges = {
        (getattr(m, "expert_offset", 0), getattr(m, "expert_offset", 0) + m.w_gate_up.shape[0])
        for m in model.modules()
        if isinstance(m, MoE)
    }
    if len(ranges) > 1:
        raise ValueError(f"MoE layers of one rank hold different experts: {sorted(ranges)}")
    return ranges.pop() if ranges else None


@torch.no_grad()
def load_rank_weights(
    model: nn.Module, directory: str | os.PathLike, *, progress: bool = False
) -> RankLoad:
    """Fill every parameter and persistent buffer of `model` (a whole model, a pipeline stage,
    an expert shard) from the release at `directory`, reading only the tensors it keeps."""
    from tqdm import tqdm

    from primus_v4.models.deepseek_v4.pretrained import check_consumed

    cfg = model.cfg  # type: ignore[attr-defined]
    own = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    targets = {name: own[name] for name in model.state_dict()}
    experts = expert_range(model)
    with ReleaseReader(directory) as reader:
        check_consumed(reader, cfg)
        wanted = release.needed(cfg, list(targets), expert_range=experts)
        bar = tqdm(total=len(wanted), desc="loading", unit="tensor", disable=not progress)

        with bar, reader.concurrent(load_workers(), progress=bar.update) as read_into:
            release.fill_state(cfg, targets, expert_range=experts, read_into=read_into)
        done = RankLoad(
            tensors=len(wanted), bytes_read=reader.bytes_read, checkpoint_bytes=reader.total_bytes()
        )
    log.info(
        "loaded %d tensors from %s: %.1f MiB of its %.1f MiB (experts %s)",
        done.tensors, Path(directory), done.bytes_read / 2**20, done.checkpoint_bytes / 2**20,
        experts,
    )  # fmt: skip
    return done


def rank_loader(
    directory: str | os.PathLike, *, progress: bool = False
) -> Callable[[nn.Module], None]:
    """The `weights=` callback of `parallelize`: load this rank's slice of `directory`."""

    def load(model: nn.Module) -> None:
        load_rank_weights(model, directory, progress=progress)

    return load
