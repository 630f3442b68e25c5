"""Several corpus sources, mixed by weight: which rows of each source become samples, how often.

A source is `{path, format?, weight?, split?, subset?}` (or just a path string). `weight` is a
sampling ratio on the source's usable rows: weight w keeps every row floor(w) times plus a
seeded random round(frac(w) * rows) of them once more (no repeats inside that extra draw), so
w = 3 repeats each row three times and w = 0.25 keeps a quarter. A row's samples always travel
together. The draw depends only on (seed, source position, row count): deterministic.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from primus_v4.errors import DataError

SOURCE_KEYS = ("path", "format", "weight", "split", "subset")


@dataclass(frozen=True, kw_only=True)
class SourceSpec:
    """One corpus of a mix."""

    path: str  # "synthetic[:...]", a file, a directory of shards, or a hub name[@revision]
    format: str | None = None  # None = the pack's format (auto-detected by default)
    weight: float = 1.0  # sampling ratio: repeat (> 1) or subsample (< 1) its rows
    split: str | None = None  # hub split (default "train")
    subset: str | None = None  # hub configuration

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path.strip():
            raise DataError(f"a data source needs a non-empty 'path', got {self.path!r}")
        w = self.weight
        if isinstance(w, bool) or not isinstance(w, int | float) or not math.isfinite(w) or w <= 0:
            raise DataError(f"data source {self.path}: weight must be a number > 0, got {w!r}")

    def key(self) -> dict[str, Any]:
        return {"weight": float(self.weight), "split": self.split, "subset": self.subset}


def parse_sources(data: str | Mapping[str, Any] | Sequence[Any]) -> tuple[SourceSpec, ...]:
    """A path string, one source mapping, or a list of either -> SourceSpecs."""
    items = [data] if isinstance(data, str | Mapping | SourceSpec) else list(data)
    if not items:
        raise DataError("data: the list of sources is empty")
    out = []
    for k, item in enumerate(items):
        if isinstance(item, SourceSpec):
            out.append(item)
        elif isinstance(item, str):
            out.append(SourceSpec(path=item))
        elif isinstance(item, Mapping):
            unknown = sorted(set(item) - set(SOURCE_KEYS))
            if unknown:
                raise DataError(
                    f"data source {k}: unknown keys {unknown}; a source has {list(SOURCE_KEYS)}"
                )
            out.append(SourceSpec(**item))
        else:
            raise DataError(f"data source {k}: expected a path or a mapping, got {item!r}")
    return tuple(out)


def integral(sources: Sequence[SourceSpec]) -> bool:
    """True when no weight has a fractional part (then no random draw happens)."""
    return all(float(s.weight).is_integer() for s in sources)


def weighted_samples(
    sample_rows: np.ndarray, weight: float, *, seed: int, source_index: int
) -> np.ndarray:
    """Indices into a source's samples (grouped by row, rows ascending), repeated or drawn.

    sample_rows: int64 [N] source row of each sample, non-decreasing.
    """
    rows, first, count = np.unique(sample_rows, return_index=True, return_counts=True)
    whole = math.floor(weight)
    extra = round((weight - whole) * len(rows))
    picked = [np.tile(np.arange(len(rows)), whole)]
    if extra:
        rng = np.random.default_rng([seed, source_index, len(rows)])
        picked.append(np.sort(rng.choice(len(rows), size=extra, replace=False)))
    chosen = np.concatenate(picked)
    starts, counts = first[chosen], count[chosen]
    out_starts = np.cumsum(counts) - counts
    return np.repeat(starts - out_starts, counts) + np.arange(int(counts.sum()))
