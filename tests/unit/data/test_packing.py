"""Packers: every sample in exactly one pack, capacity and segment cap, and equality with the
textbook O(n^2) first-fit / best-fit definitions (the fast trees must make the same choices)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from primus_v4.data.packing import pack, segment_cap


def _reference(lengths: list[int], capacity: int, max_per_pack: int, best: bool) -> list[list[int]]:
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    packs: list[list[int]] = []
    room: list[int] = []
    for i in order:
        fits = [
            p for p in range(len(packs)) if room[p] >= lengths[i] and len(packs[p]) < max_per_pack
        ]
        if not fits:
            packs.append([i])
            room.append(capacity - lengths[i])
            continue
        p = min(fits, key=lambda q: (room[q], q)) if best else fits[0]
        packs[p].append(i)
        room[p] -= lengths[i]
    return packs


def _as_lists(order: np.ndarray, offsets: np.ndarray) -> list[list[int]]:
    return [order[a:b].tolist() for a, b in itertools.pairwise(offsets)]


@pytest.mark.parametrize("algorithm", ["ffd", "bfd"])
def test_matches_reference_first_and_best_fit(algorithm: str) -> None:
    rng = np.random.default_rng(7)
    for trial in range(30):
        capacity = int(rng.integers(8, 300))
        lengths = rng.integers(1, capacity + 1, size=int(rng.integers(1, 120)))
        order, offsets = pack(lengths, seq_length=capacity, algorithm=algorithm)
        expected = _reference(
            lengths.tolist(), capacity, segment_cap(capacity) - 1, algorithm == "bfd"
        )
        assert _as_lists(order, offsets) == expected, f"trial {trial}"


@pytest.mark.parametrize("algorithm", ["ffd", "bfd"])
def test_every_sample_once_and_no_pack_over_capacity(algorithm: str) -> None:
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(120), 0.9, 5000).astype(np.int64), 1, 4096)
    order, offsets = pack(lengths, seq_length=4096, algorithm=algorithm)
    assert np.array_equal(np.sort(order), np.arange(len(lengths)))
    assert offsets[0] == 0 and offsets[-1] == len(lengths)
    assert (np.diff(offsets) >= 1).all()
    assert (np.add.reduceat(lengths[order], offsets[:-1]) <= 4096).all()
    # Small items pack almost perfectly: within one pack of the token lower bound.
    assert len(offsets) - 1 <= -(-int(lengths.sum()) // 4096) + 1


@pytest.mark.parametrize("algorithm", ["ffd", "bfd"])
def test_segment_cap_leaves_room_for_the_padding_segment(algorithm: str) -> None:
    # 2000 one-token samples would fit 4096 per pack by tokens; the cap (256 segments, one
    # reserved for padding) must split them 255 per pack.
    _, offsets = pack(np.ones(2000, dtype=np.int64), seq_length=4096, algorithm=algorithm)
    counts = np.diff(offsets)
    assert counts.max() == segment_cap(4096) - 1 == 255
    assert len(counts) == -(-2000 // 255)


def test_segment_cap_values() -> None:
    assert segment_cap(2) == 256
    assert segment_cap(4096) == 256
    assert segment_cap(8192) == 256
    assert segment_cap(131072) == 4096


def test_deterministic_and_longest_first() -> None:
    lengths = np.array([5, 9, 9, 1, 7, 3, 9, 2])
    first = pack(lengths, seq_length=10, algorithm="ffd")
    second = pack(lengths.copy(), seq_length=10, algorithm="ffd")
    assert all(np.array_equal(a, b) for a, b in zip(first, second, strict=True))
    # Longest first, ties by index: the 9s (1, 2, 6) open packs 0-2, the 7 opens pack 3, the
    # 5 opens pack 4, then 3 -> pack 3, 2 -> pack 4 (first fit), 1 -> pack 0.
    assert _as_lists(*first) == [[1, 3], [2], [6], [4, 5], [0, 7]]


def test_rejects_lengths_outside_capacity() -> None:
    with pytest.raises(ValueError, match=r"\[1, 10\]"):
        pack(np.array([3, 11]), seq_length=10)
    with pytest.raises(ValueError, match="unknown packing algorithm"):
        pack(np.array([3]), seq_length=10, algorithm="nf")
