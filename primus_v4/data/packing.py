"""Bin packing of sample lengths into packs of `seq_length` tokens: FFD and BFD in O(n log n).

Both sort samples by length, longest first (ties by sample index, so the result is a pure
function of the lengths), and place each into a pack:
  ffd: the lowest-numbered pack with room       (segment tree over packs, max remaining room)
  bfd: the pack with the least room that fits   (segment tree over room values 0..seq_length)
A pack holds at most `segment_cap(seq_length) - 1` samples: the trailing padding is its own
segment, so a pack never has more than `segment_cap` segments.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

import numpy as np

ALGORITHMS = ("ffd", "bfd")
# Upper bound of seq_length: 4x the 1M-token context of the V4 releases. The BFD tree and every
# micro-batch are this long, so a typo (10**12) fails in the config, before any allocation.
MAX_SEQ_LENGTH = 1 << 22
# The progress callback fires once per this many placed samples (cheap; no per-item call).
_PROGRESS_EVERY = 8192


def segment_cap(seq_length: int) -> int:
    """Max segments per pack: 256 up to 8k tokens, then one per 32 tokens (4096 at 128k)."""
    return max(256, seq_length // 32)


class _MaxTree:
    """Max segment tree over `n` leaves; finds the leftmost leaf whose value is >= x."""

    def __init__(self, n: int, fill: int) -> None:
        size = 1
        while size < n:
            size *= 2
        self.size = size
        self.tree = [fill] * (2 * size)

    def leftmost_at_least(self, x: int) -> int:
        tree = self.tree
        if tree[1] < x:
            return -1
        node = 1
        size = self.size
        while node < size:
            node *= 2
            if tree[node] < x:
                node += 1
        return node - size

    def set(self, leaf: int, value: int) -> None:
        tree = self.tree
        node = leaf + self.size
        tree[node] = value
        node //= 2
        while node:
            left = tree[2 * node]
            right = tree[2 * node + 1]
            best = left if left >= right else right
            if tree[node] == best:
                break  # ancestors already hold this max
            tree[node] = best
            node //= 2


def _ffd(order: list[int], lengths: list[int], capacity: int, max_per_pack: int, tick) -> list:
    # Leaves = packs, value = remaining room (-1 once full by count). Unused leaves hold the full
    # capacity, so "leftmost leaf with room" opens a new pack exactly when no open one fits.
    tree = _MaxTree(len(order), capacity)
    room: list[int] = []
    packs: list[list[int]] = []
    for placed, sample in enumerate(order):
        length = lengths[sample]
        p = tree.leftmost_at_least(length)
        if p == len(packs):
            packs.append([])
            room.append(capacity)
        packs[p].append(sample)
        room[p] -= length
        tree.set(p, room[p] if len(packs[p]) < max_per_pack else -1)
        if tick is not None and placed % _PROGRESS_EVERY == _PROGRESS_EVERY - 1:
            tick(_PROGRESS_EVERY)
    return packs


def _bfd(order: list[int], lengths: list[int], capacity: int, max_per_pack: int, tick) -> list:
    # Leaves = room values; leaf r holds r while some open pack has exactly r free tokens, so
    # the leftmost leaf >= length is the tightest fit. Packs with equal room: lowest id first.
    tree = _MaxTree(capacity + 1, -1)
    by_room: dict[int, list[int]] = {}
    room: list[int] = []
    packs: list[list[int]] = []
    for placed, sample in enumerate(order):
        length = lengths[sample]
        r = tree.leftmost_at_least(length)
        if r < 0:
            p = len(packs)
            packs.append([])
            room.append(capacity)
        else:
            bucket = by_room[r]
            p = heapq.heappop(bucket)
            if not bucket:
                tree.set(r, -1)
        packs[p].append(sample)
        room[p] -= length
        left = room[p]
        if left > 0 and len(packs[p]) < max_per_pack:
            bucket = by_room.setdefault(left, [])
            if not bucket:
                tree.set(left, left)
            heapq.heappush(bucket, p)
        if tick is not None and placed % _PROGRESS_EVERY == _PROGRESS_EVERY - 1:
            tick(_PROGRESS_EVERY)
    return packs


def pack(
    lengths: np.ndarray,
    *,
    seq_length: int,
    algorithm: str = "ffd",
    on_progress: Callable[[int], None] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Assign samples to packs -> (order, pack_offsets).

    order:        int64 [N] sample indices in pack order (pack by pack, longest first inside)
    pack_offsets: int64 [P+1]; pack i holds order[pack_offsets[i]:pack_offsets[i+1]]
    Every length must be in [1, seq_length].
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown packing algorithm {algorithm!r}: expected one of {ALGORITHMS}")
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) and (lengths.min() < 1 or lengths.max() > seq_length):
        raise ValueError(f"sample lengths must be in [1, {seq_length}] before packing")
    # Stable sort on the negated length: longest first, ties by index.
    order = np.argsort(-lengths, kind="stable")
    place = _ffd if algorithm == "ffd" else _bfd
    packs = place(
        order.tolist(), lengths.tolist(), seq_length, segment_cap(seq_length) - 1, on_progress
    )
    if on_progress is not None:
        on_progress(len(order) % _PROGRESS_EVERY)
    counts = np.fromiter(map(len, packs), dtype=np.int64, count=len(packs))
    offsets = np.zeros(len(packs) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    flat = np.fromiter((s for p in packs for s in p), dtype=np.int64, count=len(order))
    return flat, offsets
