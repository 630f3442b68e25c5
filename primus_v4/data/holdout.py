"""A held-out evaluation split of one corpus, chosen before packing (`data.eval_fraction`).

Row i of the corpus is held out when u_i < fraction, with u a fixed-seed uniform draw per row
position: the same rows for every run, rank and node, independent of the training seed, so the
evaluation rows are never trained on. The split is part of the pack-cache key.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import numpy as np

from primus_v4.errors import DataError

SPLITS = ("all", "train", "eval")
_SEED = 0x5EED_E7A1  # fixed: the split must not move with train.seed
T = TypeVar("T")


def held_out(num_rows: int, fraction: float) -> np.ndarray:
    """Boolean mask of the held-out rows."""
    return np.random.default_rng(_SEED).random(num_rows) < fraction


def select(rows: Sequence[T], *, fraction: float, split: str, where: str) -> list[T]:
    """The rows of `split` ("all": every row)."""
    if split == "all" or fraction <= 0:
        return list(rows)
    mask = held_out(len(rows), fraction)
    chosen = [r for r, h in zip(rows, mask, strict=True) if h == (split == "eval")]
    if not chosen:
        raise DataError(
            f"data.eval_fraction={fraction} leaves no {split} rows of the {len(rows)} rows in "
            f"{where}; raise or lower it, or pass data.eval_path"
        )
    return chosen
