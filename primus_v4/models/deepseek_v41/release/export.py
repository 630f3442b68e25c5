"""A V4.1 model out in its release layout, beside the release it came from.

The writer (`release/save.py`: FP8 32 x 32 / FP4 / Engram FP8 rows as released, or bf16; the
source's non-text tensors carried over byte for byte) takes {release name: tensor}; this module
gives it the model's weights through the name table (`state_dict_adapter.to_release`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from primus_v4.checkpoint_formats.sharded import WriteSummary
from primus_v4.errors import CheckpointFormatError
from primus_v4.models.deepseek_v41.release import state_dict_adapter as adapter

NO_SOURCE = (
    "a DeepSeek-V4.1 export is written beside the release it came from (its non-text tensors "
    "are carried over): pass source=<release directory>"
)


def release_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """{release name: tensor} of every text-backbone weight of a whole model (logical,
    unquantized: [out, in], routed experts one tensor per expert and projection)."""
    return adapter.to_release(model.cfg, model.state_dict())


def save_pretrained(
    model: nn.Module,
    out: str | os.PathLike,
    *,
    dtype: str = "bfloat16",
    source: str | os.PathLike | None = None,
    **options: Any,
) -> Any:
    """Write a whole model as a release directory at `out` (`dtype` "bfloat16" or "fp8": as
    released); `source` (default: the release the model was loaded from) gives the layout and
    the tensors carried over."""
    src = source or getattr(model, "release_source", None)
    if src is None:
        raise CheckpointFormatError(NO_SOURCE)
    _check_dtype(dtype)
    from primus_v4.models.deepseek_v41.release.save import save_release

    options.pop("progress", None)  # the release writer reports per tensor through a callback
    return save_release(release_state(model), Path(src), out, dtype=dtype, **options)


def _check_dtype(dtype: str) -> None:
    if dtype not in ("bfloat16", "fp8"):
        raise CheckpointFormatError(
            f"export dtype {dtype!r}: a DeepSeek-V4.1 release is written as 'bfloat16' or 'fp8'"
        )


def write_state(
    cfg: Any,
    state: Iterable[dict[str, torch.Tensor]],
    out: str | os.PathLike,
    *,
    dtype: str = "bfloat16",
    source: str | os.PathLike | None = None,
    carry_from: str | os.PathLike | None = None,
    **options: Any,
) -> WriteSummary:
    """Write state-dict pieces (our names; together the whole model) as a release at `out`
    beside `source` (a training run's export passes the release it started from as
    `carry_from`)."""
    source = source or carry_from
    if source is None:
        raise CheckpointFormatError(NO_SOURCE)
    _check_dtype(dtype)
    from primus_v4.models.deepseek_v41.release.save import save_release

    options.pop("extra_files", None)  # the writer copies the source's tokenizer files
    pieces = (adapter.to_release(cfg, piece) for piece in state)
    return save_release(pieces, Path(source), out, dtype=dtype, **options).summary
