"""PackedCorpus: a memory-mapped cache entry, giving THD rows (numpy or ThdBatch) on access.

Legend: S = seq_length, T = tokens of all kept samples, N = samples, P = packs.
Only the compact stream is stored; input_ids/labels/loss_mask/position_ids/cu_seqlens are derived
per pack here with a few vectorized numpy ops. Samples are numbered in pack order, so pack i
holds samples pack_sample_range(i) and its tokens are one contiguous slice of the stream.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from primus_v4.data.thd import ThdBatch

# Label where there is no next token in the same segment (matches thd.IGNORE_LABEL; not
# imported from there because thd imports torch and this module must not).
IGNORE_LABEL = -100


def layout(
    tokens: np.ndarray,
    targets: np.ndarray,
    lengths: np.ndarray,
    *,
    seq_length: int,
    pad_id: int,
) -> dict[str, np.ndarray]:
    """One THD row from consecutive samples: real segments, then padding as its own segment.

    tokens [R] (R = sum(lengths) <= S), targets [R] bool (token is a supervised target),
    lengths [n] per-sample lengths. Loss mask at t means "label t = token t+1 is supervised".
    """
    real = int(tokens.shape[0])
    s = seq_length
    seg_lengths = lengths.astype(np.int64)
    if real < s:  # trailing padding: its own segment, positions restart at 0 there
        seg_lengths = np.append(seg_lengths, s - real)
    cu_seqlens = np.zeros(len(seg_lengths) + 1, dtype=np.int32)
    np.cumsum(seg_lengths, out=cu_seqlens[1:])
    ends = cu_seqlens[1:] - 1  # last row of each segment: its label would cross a boundary

    input_ids = np.full(s, pad_id, dtype=np.int64)
    input_ids[:real] = tokens
    labels = np.full(s, IGNORE_LABEL, dtype=np.int64)
    labels[: real - 1] = input_ids[1:real]
    labels[ends] = IGNORE_LABEL
    loss_mask = np.zeros(s, dtype=np.float32)
    loss_mask[: real - 1] = targets[1:real]
    loss_mask[ends] = 0.0
    position_ids = np.arange(s, dtype=np.int64) - np.repeat(cu_seqlens[:-1], seg_lengths)
    padding_mask = np.zeros(s, dtype=bool)
    padding_mask[real:] = True
    return {
        "input_ids": input_ids,
        "labels": labels,
        "loss_mask": loss_mask,
        "position_ids": position_ids,
        "cu_seqlens": cu_seqlens,
        "padding_mask": padding_mask,
    }


def to_thd_batch(
    arrays: dict[str, np.ndarray], images: list[tuple[np.ndarray, tuple[int, int]]] = ()
) -> ThdBatch:
    """The row as tensors; `images` (uint16 bf16 bits [h * w, 3 * p * p], (h, w)) become bf16
    patches [h * w, 3, p, p]."""
    import torch

    from primus_v4.data.thd import ThdBatch

    types = arrays.get("token_types")
    pictures = []
    for bits, (h, w) in images:
        p = math.isqrt(bits.shape[1] // 3)
        patches = torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16)
        pictures.append((patches.reshape(h * w, 3, p, p), (h, w)))
    return ThdBatch(
        input_ids_S=torch.from_numpy(arrays["input_ids"]),
        labels_S=torch.from_numpy(arrays["labels"]),
        loss_mask_S=torch.from_numpy(arrays["loss_mask"]),
        position_ids_S=torch.from_numpy(arrays["position_ids"]),
        cu_seqlens_N1=torch.from_numpy(arrays["cu_seqlens"]),
        padding_mask_S=torch.from_numpy(arrays["padding_mask"]),
        token_types_S=None if types is None else torch.from_numpy(types),
        images=tuple(pictures),
    )


class SampleCorpus:
    """A corpus held in memory, read as the trainer reads a pack cache: `samples` (token ids,
    target mask) grouped into packs by `offsets` (pack i: samples offsets[i] to offsets[i + 1]),
    each pack one THD row of `seq_length` (padded with `pad_id`), or one sample per BSHD row.
    A subclass fills the three attributes (synthetic corpora of tests and benchmarks)."""

    samples: list[tuple[np.ndarray, np.ndarray]]
    offsets: list[int]
    seq_length: int
    pad_id: int = 0

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_samples(self) -> int:
        return len(self.samples)

    def pack_sample_range(self, i: int) -> tuple[int, int]:
        return self.offsets[i], self.offsets[i + 1]

    def _row(self, first: int, stop: int) -> ThdBatch:
        chosen = self.samples[first:stop]
        return to_thd_batch(layout(np.concatenate([t for t, _ in chosen]),
                                   np.concatenate([m for _, m in chosen]),
                                   np.array([len(t) for t, _ in chosen]),
                                   seq_length=self.seq_length, pad_id=self.pad_id))  # fmt: skip

    def thd_batch(self, i: int) -> ThdBatch:
        return self._row(*self.pack_sample_range(i))

    def bshd_batch(self, j: int) -> ThdBatch:
        return self._row(j, j + 1)


class PackedCorpus:
    """Packs of one cache entry. Cheap to open (mmap); every accessor is O(pack size)."""

    def __init__(self, *, entry: Path, arrays: dict[str, np.ndarray], manifest: dict[str, Any]):
        self.entry = entry
        self.manifest = manifest
        self.seq_length = int(manifest["seq_length"])
        self.pad_id = int(manifest["pad_id"])
        self.stats: dict[str, Any] = dict(manifest["stats"])
        self._tokens = arrays["tokens"]
        self._targets_bits = arrays["supervised"]
        self._sample_offsets = arrays["sample_offsets"]
        self._pack_offsets = arrays["pack_offsets"]
        self._sample_rows = arrays["sample_rows"]
        # a corpus with images (cache.IMAGE_FILES); absent for text alone
        self._token_types = arrays.get("token_types")
        self._image_arrays = {
            k: v for k, v in arrays.items() if k.startswith(("image", "sample_i"))
        }

    @property
    def has_images(self) -> bool:
        return self._token_types is not None

    def __len__(self) -> int:
        return len(self._pack_offsets) - 1

    @property
    def num_samples(self) -> int:
        return len(self._sample_offsets) - 1

    def _check(self, index: int, count: int, what: str) -> int:
        if not -count <= index < count:
            raise IndexError(f"{what} index {index} out of range [0, {count})")
        return index % count

    def pack_sample_range(self, i: int) -> tuple[int, int]:
        """(first, stop): the samples of pack i, in pack order."""
        i = self._check(i, len(self), "pack")
        return int(self._pack_offsets[i]), int(self._pack_offsets[i + 1])

    def sample_row(self, j: int) -> int:
        """0-based row of sample j in the corpus (bad rows and dropped samples have no sample)."""
        return int(self._sample_rows[self._check(j, self.num_samples, "sample")])

    def _span(self, first: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        offsets = np.asarray(self._sample_offsets[first : stop + 1], dtype=np.int64)
        t0, t1 = int(offsets[0]), int(offsets[-1])
        tokens = np.asarray(self._tokens[t0:t1])
        # Unpack only the bytes covering [t0, t1), then trim to the exact bit range.
        bits = np.unpackbits(np.asarray(self._targets_bits[t0 // 8 : (t1 + 7) // 8]))
        targets = bits[t0 % 8 : t0 % 8 + (t1 - t0)].astype(bool)
        return tokens, targets, np.diff(offsets)

    def sample_tokens(self, j: int) -> tuple[np.ndarray, np.ndarray]:
        """(token ids, target flags) of sample j."""
        j = self._check(j, self.num_samples, "sample")
        tokens, targets, _ = self._span(j, j + 1)
        return tokens, targets

    def pack_arrays(self, i: int) -> dict[str, np.ndarray]:
        """input_ids, labels, loss_mask, position_ids, cu_seqlens (int32), padding_mask (bool);
        with images also token_types (int8, -1 for text and padding)."""
        first, stop = self.pack_sample_range(i)
        return self._row(first, stop)

    def _row(self, first: int, stop: int) -> dict[str, np.ndarray]:
        tokens, targets, lengths = self._span(first, stop)
        row = layout(tokens, targets, lengths, seq_length=self.seq_length, pad_id=self.pad_id)
        if self._token_types is not None:
            t0, t1 = int(self._sample_offsets[first]), int(self._sample_offsets[stop])
            types = np.full(self.seq_length, -1, dtype=np.int8)
            types[: t1 - t0] = self._token_types[t0:t1]
            row["token_types"] = types
        return row

    def images(self, first: int, stop: int) -> list[tuple[np.ndarray, tuple[int, int]]]:
        """The pictures of samples [first, stop) in the order of their spans: (bf16 patches as
        uint16 bits [h * w, 3 * 14 * 14], (h, w) the ViT grid) each; [] for text alone."""
        if self._token_types is None:
            return []
        a = self._image_arrays
        lo, hi = int(a["sample_image_offsets"][first]), int(a["sample_image_offsets"][stop])
        out = []
        for u in np.asarray(a["image_index"][lo:hi]):
            p0, p1 = int(a["image_patch_offsets"][u]), int(a["image_patch_offsets"][u + 1])
            h, w = (int(v) for v in a["image_grids"][u])
            out.append((np.asarray(a["image_patches"][p0:p1]), (h, w)))
        return out

    def pack_images(self, i: int) -> list[tuple[np.ndarray, tuple[int, int]]]:
        """The pictures of pack i, in the order of its image spans (`images`)."""
        return self.images(*self.pack_sample_range(i))

    def thd_batch(self, i: int) -> ThdBatch:
        return to_thd_batch(self.pack_arrays(i), self.pack_images(i))

    def sample_arrays(self, j: int) -> dict[str, np.ndarray]:
        """Sample j alone, padded to seq_length: the unpacked (BSHD) baseline row."""
        j = self._check(j, self.num_samples, "sample")
        return self._row(j, j + 1)

    def bshd_batch(self, j: int) -> ThdBatch:
        j = self._check(j, self.num_samples, "sample")
        return to_thd_batch(self.sample_arrays(j), self.images(j, j + 1))

    def export_jsonl(self, path: Path) -> int:
        """One pack per line with integer lists (with images, also each token's type); returns
        the number of packs written. The file is written beside `path` and renamed into place:
        a failed export leaves no partial file."""
        keys = ("input_ids", "labels", "loss_mask", "position_ids", "cu_seqlens")
        if self.has_images:  # the spans' token types (the pictures stay in the cache)
            keys += ("token_types",)
        path = Path(path)
        tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
        try:
            with tmp.open("w", encoding="utf-8") as f:
                for i in range(len(self)):
                    arrays = self.pack_arrays(i)
                    row = {k: arrays[k].astype(np.int64).tolist() for k in keys}
                    f.write(json.dumps(row, separators=(",", ":")) + "\n")
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return len(self)
