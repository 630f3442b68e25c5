"""Corpus -> packs -> node-local cache, in one call: `build_or_load(PackSpec(...))`.

Every process calls build_or_load. A valid cache entry is memory-mapped without locking (entries
are published by atomic rename, so a visible entry is complete). Otherwise the process takes the
node-local lock for the key: the first one builds and publishes, the others wait, then find the
entry and load it. Nothing here imports torch; `datasets` is imported only to build from a hub.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from primus_v4.data import cache, chat_format, holdout, image_rows, special_text
from primus_v4.data.corpus import CorpusSource, read_rows, resolve_source
from primus_v4.data.images import IMAGE_START, TEXT
from primus_v4.data.mixing import SourceSpec, integral, parse_sources, weighted_samples
from primus_v4.data.packed_corpus import PackedCorpus
from primus_v4.data.packing import ALGORITHMS, MAX_SEQ_LENGTH, pack, segment_cap
from primus_v4.data.templates import (
    BAD_EXAMPLES,
    CHAT_MODES,
    FORMATS,
    TEMPLATE_ID,
    above_8_bit_note,
    render,
)
from primus_v4.data.tokenizer import (
    TextTokenizer,
    load_tokenizer,
    resolve_tokenizer_dir,
    tokenizer_identity,
)
from primus_v4.durable import writable_problem
from primus_v4.errors import DataError, PathError
from primus_v4.log import get_logger

log = get_logger(__name__)

OVERLONG = ("truncate", "drop")
# The stats contract of `primus-v4 pack --stats-json`, in this order; details follow them.
STATS_KEYS = (
    "cache_key",
    "cache_hit",
    "num_samples",
    "num_packs",
    "total_tokens",
    "real_tokens",
    "supervised_tokens",
    "real_fraction",
    "supervised_fraction",
    "truncated",
    "dropped",
    "bad_rows",
    "build_seconds",
)
# A pack "has an HCA window" when one of its samples spans a full 128-token compression window.
HCA_WINDOW = 128


@dataclass(frozen=True, kw_only=True)
class PackSpec:
    """What to pack and where to cache it. Only the first nine fields change pack content."""

    # "synthetic[:rows=N,seed=S]", a .json/.jsonl/.parquet file or a directory of them, a hub
    # name[@revision], or a list of sources {path, format?, weight?, split?, subset?} (mixing)
    data: str | Sequence[Any] = "synthetic"
    format: str = "auto"  # messages | sharegpt | alpaca | prompt_completion | auto (detected)
    chat_mode: str = "auto"  # chat | thinking | auto (thinking for rows with reasoning)
    # v4 | v4-0731 | v4.1 | auto (the release beside the tokenizer, else the tokenizer's)
    chat_format: str = "auto"
    seq_length: int = 4096  # tokens per pack
    algorithm: str = "ffd"  # ffd | bfd
    overlong: str = "truncate"  # samples longer than seq_length: truncate | drop
    tokenizer: str | Path | None = None  # dir with tokenizer.json; None = DeepSeek-V4's
    seed: int = 0  # draws of fractional source weights (part of the key only when used)
    strict: bool = False  # bad rows raise DataError (file + line), on a cache hit too
    cache_dir: str | Path | None = None  # None = $PRIMUS_PACK_CACHE_DIR or node-local tmp
    lock_dir: str | Path | None = None  # None = $PRIMUS_PACK_LOCK_DIR or node-local tmp
    holdout_fraction: float = 0.0  # rows held out for evaluation before packing (holdout.py)
    split: str = "all"  # all | train (rows not held out) | eval (the held-out rows)
    lock_timeout_s: float = 600.0  # max wait for another builder; keep below collective timeout
    knobs: str = "cli"  # how messages name the settings: "cli" (pack's flags) or "config" (data.*)
    special_tokens_in_text: str = "warn"  # keep | warn | error (special_text.py)

    def __post_init__(self) -> None:
        if not isinstance(self.seq_length, int) or self.seq_length < 2:
            raise DataError(f"seq_length must be an integer >= 2, got {self.seq_length!r}")
        if self.seq_length > MAX_SEQ_LENGTH:
            raise DataError(
                f"{self.knob('seq_length')}={self.seq_length} is above its bound "
                f"{MAX_SEQ_LENGTH} (4x the 1M-token context of the V4 releases)"
            )
        formats = [self.format] + [s.format for s in self.sources() if s.format is not None]
        for name, value, allowed in (
            *(("format", f, FORMATS) for f in formats),
            ("chat_mode", self.chat_mode, CHAT_MODES),
            ("chat_format", self.chat_format, chat_format.CHOICES),
            ("algorithm", self.algorithm, ALGORITHMS),
            ("overlong", self.overlong, OVERLONG),
            ("split", self.split, holdout.SPLITS),
            ("special_tokens_in_text", self.special_tokens_in_text, special_text.POLICIES),
        ):
            if value not in allowed:
                raise DataError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
        if self.lock_timeout_s <= 0:
            raise DataError(f"lock_timeout_s must be > 0, got {self.lock_timeout_s}")
        if not 0.0 <= self.holdout_fraction < 1.0:
            raise DataError(f"holdout_fraction must be in [0, 1), got {self.holdout_fraction}")

    def knob(self, name: str) -> str:
        """The flag (`primus-v4 pack`) or config key (`train`) that sets field `name`."""
        if self.knobs == "config":
            return "data.lock_timeout_s" if name == "lock_timeout_s" else f"data.{name}"
        return "--lock-timeout" if name == "lock_timeout_s" else "--" + name.replace("_", "-")

    def resolved_chat_format(self, tokenizer_dir: Path) -> str:
        if self.chat_format != "auto":
            return self.chat_format
        return chat_format.detect(tokenizer_dir)

    def sources(self) -> tuple[SourceSpec, ...]:
        return parse_sources(self.data)

    def describe(self) -> str:
        return ", ".join(
            s.path + (f" (weight {s.weight:g})" if s.weight != 1 else "") for s in self.sources()
        )

    def resolved_cache_dir(self) -> Path:
        return Path(self.cache_dir).expanduser() if self.cache_dir else cache.default_cache_dir()

    def resolved_lock_dir(self) -> Path:
        return Path(self.lock_dir).expanduser() if self.lock_dir else cache.default_lock_dir()


Resolved = list[tuple[SourceSpec, CorpusSource]]


def resolve_sources(spec: PackSpec) -> Resolved:
    out = [(s, resolve_source(s.path, split=s.split, subset=s.subset)) for s in spec.sources()]
    for s, src in out:
        if src.kind != "hub" and (s.split or s.subset):
            raise DataError(
                f"data source {s.path}: split/subset apply to hub datasets only, and this is a "
                f"local {src.kind}; drop them or point to the split's own file or directory"
            )
    return out


def key_fields(spec: PackSpec, sources: Resolved, tokenizer_dir: Path) -> dict[str, Any]:
    """Everything that changes pack content, and nothing else (paths, locks, strict do not)."""
    fields = {
        "corpus": [
            {"fingerprint": src.fingerprint(), "format": s.format or spec.format, **s.key()}
            for s, src in sources
        ],
        "chat_mode": spec.chat_mode,
        "chat_format": spec.resolved_chat_format(tokenizer_dir),
        "tokenizer": tokenizer_identity(tokenizer_dir),
        "template": TEMPLATE_ID,
        "seq_length": spec.seq_length,
        "algorithm": spec.algorithm,
        "segment_cap": segment_cap(spec.seq_length),
        "overlong": spec.overlong,
        "align": 1,  # samples start at any token; kept so a future alignment option cannot alias
        # Only a real split enters the key, so the keys of unsplit corpora stay as they were.
        **({"split": f"{spec.split}:{spec.holdout_fraction}"} if _is_split(spec) else {}),
    }
    if not integral([s for s, _ in sources]):
        fields["mix_seed"] = spec.seed
    vision = image_rows.vision_of(tokenizer_dir, fields["chat_format"])
    if vision is not None:  # rows with images are read: the grid sizes their spans
        fields["vision"] = {**asdict(vision.grid), "image_token_id": vision.token_id}
    return fields


def _is_split(spec: PackSpec) -> bool:
    return spec.split != "all" and spec.holdout_fraction > 0


def pack_key(spec: PackSpec) -> str:
    return cache.cache_key(
        key_fields(spec, resolve_sources(spec), resolve_tokenizer_dir(spec.tokenizer))
    )


def cache_lookup(spec: PackSpec) -> dict[str, Any]:
    """Where `spec`'s packs are cached and whether they are there (nothing is built or read
    beyond the corpus and tokenizer hashes the key needs): {dir, key, hit}."""
    cache_dir = spec.resolved_cache_dir()
    key = pack_key(spec)
    hit = (cache.entry_dir(cache_dir, key) / cache.MANIFEST).is_file()
    return {"dir": str(cache_dir), "key": key, "hit": hit}


class _Progress:
    """One tqdm bar per stage on stderr; enabled=None shows bars only on a terminal."""

    def __init__(self, enabled: bool | None) -> None:
        self.disable = None if enabled is None else not enabled
        self._bar: Any = None

    def __call__(self, desc: str, total: int) -> Callable[[int], None]:
        from tqdm import tqdm

        self.close()
        unit = {"tokenize": " rows", "pack": " samples", "images": " images"}.get(desc, " items")
        self._bar = tqdm(total=total, desc=desc, unit=unit, disable=self.disable)
        return self._bar.update

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


@dataclass(kw_only=True)
class _Table:
    """Every selected sample of every source, over the sources' concatenated token streams."""

    tokens: np.ndarray  # uint32 [T] all sources' rendered samples, each source once
    supervised: np.ndarray  # bool [T]
    starts: np.ndarray  # int64 [N] per selected sample (a weight > 1 repeats samples)
    lengths: np.ndarray  # int64 [N]
    rows: np.ndarray  # int64 [N] global row (rows of source k follow those of source k-1)
    source: np.ndarray  # int64 [N] source index
    info: list[dict[str, Any]] = field(default_factory=list)  # per source, for the stats
    # A model with a vision tower: each token's type, every source's images in sample order,
    # and each selected sample's first image there and its count. None / empty otherwise.
    token_types: np.ndarray | None = None  # int8 [T]
    images: list[image_rows.ImageSource] = field(default_factory=list)
    image_starts: np.ndarray | None = None  # int64 [N]
    image_counts: np.ndarray | None = None  # int64 [N]


def _source_info(
    s: SourceSpec, src: CorpusSource, r: Any, row_offset: int, special: Any
) -> dict[str, Any]:
    return {
        "path": src.describe(),
        "format": r.format,
        "weight": s.weight,
        "rows": r.num_rows,
        "row_offset": row_offset,
        "bad_rows": r.bad_rows,
        "bad_examples": r.bad_examples,
        "chat_modes": r.modes,
        "special_tokens_in_text": special.as_stats(),
        **(_above_8_bit_of(r) if r.token_types is not None else {}),  # with a vision tower
    }


def _above_8_bit_of(r: Any) -> dict[str, Any]:
    return {"images_above_8_bit": r.images_above_8_bit,
            "first_image_above_8_bit": r.first_image_above_8_bit}  # fmt: skip


def _above_8_bit(info: list[dict[str, Any]]) -> dict[str, Any]:
    """The stats of pictures above 8 bits per channel over the sources (none without a vision
    tower): their count, and the first's row and name when there is one."""
    counted = [i for i in info if "images_above_8_bit" in i]
    if not counted:
        return {}
    first = next((i["first_image_above_8_bit"] for i in counted if i["images_above_8_bit"]), "")
    return {"images_above_8_bit": sum(i["images_above_8_bit"] for i in counted),
            **({"first_image_above_8_bit": first} if first else {})}  # fmt: skip


def _image_base(src: CorpusSource) -> Path | None:
    """Where a source's relative image paths start: its file's directory, or the directory."""
    if src.kind == "file":
        return src.path.parent
    return src.path if src.kind == "dir" else None


def _render_sources(
    spec: PackSpec, sources: Resolved, tokenizer: TextTokenizer, bar: Any
) -> _Table:
    names = ("tok", "sup", "st", "len", "row", "src", "types", "img_st", "img_n")
    parts: dict[str, list[np.ndarray]] = {k: [] for k in names}
    info, tokens_before, rows_before = [], 0, 0
    vision = image_rows.vision_of(tokenizer.dir, spec.resolved_chat_format(tokenizer.dir))
    images: list[image_rows.ImageSource] = []
    for k, (s, src) in enumerate(sources):
        rows = read_rows(src)
        if _is_split(spec):  # held out before weighting and packing: eval rows never train
            fraction, where = spec.holdout_fraction, src.describe()
            rows = holdout.select(rows, fraction=fraction, split=spec.split, where=where)
        special = special_text.count(rows, special_text.SpecialTextFinder(tokenizer.added_texts))
        special_text.apply_policy(special.as_stats(), spec.special_tokens_in_text,
                                  where=src.describe(),
                                  knob=spec.knob("special_tokens_in_text"))  # fmt: skip
        r = render(
            rows,
            tokenizer,
            fmt=s.format or spec.format,
            where=src.describe(),
            chat_mode=spec.chat_mode,
            chat_format_name=spec.resolved_chat_format(tokenizer.dir),
            strict=spec.strict,
            strict_knob=spec.knob("strict"),
            progress=bar,
            images=None if vision is None else dataclasses.replace(vision, base=_image_base(src)),
        )
        pick = (
            np.arange(len(r.lengths))
            if s.weight == 1
            else weighted_samples(r.rows, s.weight, seed=spec.seed, source_index=k)
        )
        starts = np.cumsum(r.lengths) - r.lengths
        for name, value in (
            ("tok", r.tokens),
            ("sup", r.supervised),
            ("st", starts[pick] + tokens_before),
            ("len", r.lengths[pick]),
            ("row", r.rows[pick] + rows_before),
            ("src", np.full(len(pick), k, dtype=np.int64)),
        ):
            parts[name].append(value)
        if vision is not None:
            assert r.token_types is not None and r.image_counts is not None
            image_starts = np.cumsum(r.image_counts) - r.image_counts + len(images)
            parts["types"].append(r.token_types)
            parts["img_st"].append(image_starts[pick])
            parts["img_n"].append(r.image_counts[pick])
            images.extend(r.images)
        info.append(_source_info(s, src, r, rows_before, special))
        tokens_before += len(r.tokens)
        rows_before += r.num_rows
    cat = {name: np.concatenate(values) for name, values in parts.items() if values}
    return _Table(
        tokens=cat["tok"],
        supervised=cat["sup"],
        starts=cat["st"],
        lengths=cat["len"],
        rows=cat["row"],
        source=cat["src"],
        info=info,
        token_types=cat.get("types"),
        images=images,
        image_starts=cat.get("img_st"),
        image_counts=cat.get("img_n"),
    )


def _cut_before_spans(t: _Table, limit: np.ndarray) -> np.ndarray:
    """A truncated sample never ends inside an image span: its cut moves back to the span's
    start (the image is left out whole). Per-sample kept images."""
    assert t.token_types is not None and t.image_counts is not None
    kept_images = t.image_counts.copy()
    for k in np.flatnonzero((limit < t.lengths) & (t.image_counts > 0)):
        types = t.token_types[t.starts[k] : t.starts[k] + t.lengths[k]]
        cut = int(limit[k])
        if cut > 0 and types[cut] not in (TEXT, IMAGE_START):  # inside a span
            cut = int(np.flatnonzero(types[:cut] == IMAGE_START)[-1])
            limit[k] = cut
        kept_images[k] = int((types[:cut] == IMAGE_START).sum())
    return kept_images


def _limit_lengths(
    t: _Table, seq_length: int, overlong: str
) -> tuple[np.ndarray, np.ndarray, dict[str, int]]:
    """Per-sample kept length (0 = dropped) after the overlong policy; targets kept; counts.
    A corpus with images: `t.image_counts` becomes the images each kept prefix holds."""
    over = t.lengths > seq_length
    limit = (
        np.minimum(t.lengths, seq_length)
        if overlong == "truncate"
        else np.where(over, 0, t.lengths)
    )
    if t.token_types is not None:
        t.image_counts = _cut_before_spans(t, limit)
    # Targets left inside the kept prefix; a truncation that cuts every target leaves a sample
    # with nothing to learn, so it is dropped too (counted apart).
    targets_cum = np.concatenate([[0], np.cumsum(t.supervised, dtype=np.int64)])
    kept_targets = targets_cum[t.starts + limit] - targets_cum[t.starts]
    no_target = (limit > 0) & (kept_targets == 0)
    limit = np.where(no_target, 0, limit)
    counts = {
        "truncated": int((over & (limit > 0)).sum()) if overlong == "truncate" else 0,
        "dropped_overlong": int(over.sum()) if overlong == "drop" else 0,
        "dropped_no_target": int(no_target.sum()),
    }
    return limit, kept_targets, counts


def _gather_spans(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Indices of the concatenated spans [starts[k], starts[k] + lengths[k]) (no Python loop)."""
    out_starts = np.cumsum(lengths) - lengths
    return np.repeat(starts - out_starts, lengths) + np.arange(int(lengths.sum()))


def _stats(lengths: np.ndarray, targets: int, pack_offsets: np.ndarray, spec: PackSpec) -> dict:
    num_packs = len(pack_offsets) - 1
    per_pack = np.diff(pack_offsets)
    real = int(lengths.sum())
    total = num_packs * spec.seq_length
    # Max sample length per pack, to count packs where no sample spans a full HCA window.
    longest = np.maximum.reduceat(lengths, pack_offsets[:-1]) if num_packs else np.zeros(0)
    return {
        "num_samples": len(lengths),
        "num_packs": num_packs,
        "total_tokens": total,
        "real_tokens": real,
        "supervised_tokens": targets,
        "real_fraction": round(real / total, 6) if total else 0.0,
        "supervised_fraction": round(targets / total, 6) if total else 0.0,
        "lower_bound_packs": -(-real // spec.seq_length),
        "samples_per_pack_mean": round(len(lengths) / num_packs, 3) if num_packs else 0.0,
        "samples_per_pack_min": int(per_pack.min()) if num_packs else 0,
        "samples_per_pack_max": int(per_pack.max()) if num_packs else 0,
        "packs_without_128_window": int((longest < HCA_WINDOW).sum()),
    }


def _render_and_pack(
    spec: PackSpec, sources: Resolved, tokenizer: TextTokenizer, progress: bool | None
) -> tuple[_Table, np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict[str, int]]:
    """-> (table, kept sample ids, their kept lengths, pack order, pack offsets, counts)."""
    bar = _Progress(progress)
    try:
        table = _render_sources(spec, sources, tokenizer, bar)
        limit, kept_targets, counts = _limit_lengths(table, spec.seq_length, spec.overlong)
        kept = np.flatnonzero(limit > 0)
        if not len(kept):
            raise DataError(
                f"no sample of {spec.describe()} survives seq_length={spec.seq_length} with "
                f"overlong={spec.overlong} ({counts}); raise {spec.knob('seq_length')} or set "
                f"{spec.knob('overlong')} truncate"
            )
        lengths = limit[kept]
        order, pack_offsets = pack(
            lengths,
            seq_length=spec.seq_length,
            algorithm=spec.algorithm,
            on_progress=bar("pack", len(kept)),
        )
    finally:
        bar.close()
    # Per-source stats of what is packed (after weighting and the overlong policy).
    n = len(table.info)
    src = table.source[kept]
    samples = np.bincount(src, minlength=n)
    tokens = np.bincount(src, weights=lengths, minlength=n)
    targets = np.bincount(src, weights=kept_targets[kept], minlength=n)
    for k, info in enumerate(table.info):
        info.update(
            samples=int(samples[k]), tokens=int(tokens[k]), supervised_tokens=int(targets[k])
        )
    return table, kept, lengths, order, pack_offsets, counts


def _merged_bad_rows(info: list[dict[str, Any]]) -> tuple[dict[str, int], list[dict[str, str]]]:
    bad: dict[str, int] = {}
    examples: list[dict[str, str]] = []
    for source in info:
        for reason, count in source["bad_rows"].items():
            bad[reason] = bad.get(reason, 0) + count
        examples.extend(source["bad_examples"])
    return dict(sorted(bad.items())), examples[:BAD_EXAMPLES]


def _build(
    spec: PackSpec, sources: Resolved, tokenizer_dir: Path, progress: bool | None
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    tokenizer = load_tokenizer(tokenizer_dir)
    table, kept, lengths, order, pack_offsets, counts = _render_and_pack(
        spec, sources, tokenizer, progress
    )
    # Lay the kept (possibly truncated) samples out in pack order as one stream.
    ordered_lengths = lengths[order]
    gather = _gather_spans(table.starts[kept][order], ordered_lengths)
    tokens = table.tokens[gather]
    targets = table.supervised[gather]
    sample_offsets = np.zeros(len(order) + 1, dtype=np.int64)
    np.cumsum(ordered_lengths, out=sample_offsets[1:])
    arrays = {
        "tokens": tokens.astype(np.uint32, copy=False),
        "supervised": np.packbits(targets),
        "sample_offsets": sample_offsets,
        "pack_offsets": pack_offsets,
        "sample_rows": table.rows[kept][order],
    }
    stats = _stats(ordered_lengths, int(targets.sum()), pack_offsets, spec)
    assert table.image_counts is not None or table.token_types is None
    if table.token_types is not None and int(table.image_counts[kept].sum()) > 0:
        vision = image_rows.vision_of(tokenizer_dir, spec.resolved_chat_format(tokenizer_dir))
        assert vision is not None  # the table has token types only then
        image_arrays, image_stats = _image_arrays(table, kept[order], gather, vision, progress)
        arrays.update(image_arrays)
        stats.update(image_stats)
        image_files = stats.pop("image_files")
    bad, examples = _merged_bad_rows(table.info)
    modes: dict[str, int] = {}
    for info in table.info:
        for mode, count in info["chat_modes"].items():
            modes[mode] = modes.get(mode, 0) + count
    stats.update(
        truncated=counts["truncated"],
        dropped=counts["dropped_overlong"] + counts["dropped_no_target"],
        dropped_overlong=counts["dropped_overlong"],
        dropped_no_target=counts["dropped_no_target"],
        bad_rows=bad,
        bad_row_examples=examples,
        num_rows=sum(info["rows"] for info in table.info),
        format=",".join(dict.fromkeys(info["format"] for info in table.info)),
        chat_modes=dict(sorted(modes.items())),
        chat_format=spec.resolved_chat_format(tokenizer_dir),
        sources=table.info,
        special_tokens_in_text={
            k: sum(i["special_tokens_in_text"][k] for i in table.info)
            for k in ("rows", "occurrences")
        },
        **_above_8_bit(table.info),
    )
    manifest = {"pad_id": tokenizer.special.pad, "stats": stats}
    if "token_types" in arrays:  # text alone, with a vision tower or not, has no image arrays
        manifest["image_files"] = image_files
    return arrays, manifest


def _image_arrays(
    table: _Table,
    samples: np.ndarray,
    gather: np.ndarray,
    vision: image_rows.RowImages,
    progress: bool | None,
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The image arrays of a corpus with images (cache.IMAGE_FILES), samples in pack order:
    each distinct picture (by sha256) is processed once into its bf16 patches, stored as
    uint16 bits; a sample names its pictures in the order of its spans."""
    from primus_v4.data.images import image_patches

    assert table.token_types is not None
    assert table.image_starts is not None and table.image_counts is not None
    counts = table.image_counts[samples]
    offsets = np.zeros(len(samples) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    distinct: dict[str, int] = {}
    index = np.zeros(int(offsets[-1]), dtype=np.int64)
    chosen: list[image_rows.ImageSource] = []
    for k, sample in enumerate(samples):
        first = int(table.image_starts[sample])
        for j in range(int(counts[k])):
            image = table.images[first + j]
            if image.digest not in distinct:
                distinct[image.digest] = len(chosen)
                chosen.append(image)
            index[offsets[k] + j] = distinct[image.digest]
    bar = _Progress(progress)
    advance = bar("images", len(chosen))
    grids, pieces = np.zeros((len(chosen), 2), dtype=np.int32), []
    try:
        for u, image in enumerate(chosen):
            patches, (h, w) = image_patches(image.read(), vision.grid)
            grids[u] = (h, w)
            pieces.append(patches.reshape(h * w, -1).view(_int16()).numpy().view(np.uint16))
            advance(1)
    finally:
        bar.close()
    patch_offsets = np.zeros(len(chosen) + 1, dtype=np.int64)
    np.cumsum([len(p) for p in pieces], out=patch_offsets[1:])
    width = 3 * vision.grid.patch_size**2
    patches = np.concatenate(pieces) if pieces else np.zeros((0, width), dtype=np.uint16)
    types = table.token_types[gather]
    arrays = {
        "token_types": types.astype(np.int8, copy=False),
        "sample_image_offsets": offsets,
        "image_index": index,
        "image_grids": grids,
        "image_patch_offsets": patch_offsets,
        "image_patches": patches,
    }
    stats = {
        "images": int(offsets[-1]),
        "distinct_images": len(chosen),
        "image_tokens": int((types >= 0).sum()),
        "image_patch_bytes": int(patches.nbytes),
        # the files the patches were made from: a load finds one changed (image_files_changed)
        "image_files": [_file_record(i) for i in chosen if i.path is not None],
    }
    return arrays, stats


def _file_record(image: image_rows.ImageSource) -> list[Any]:
    assert image.path is not None
    st = image.path.stat()
    return [str(image.path), st.st_size, st.st_mtime_ns, image.digest]


def image_files_changed(manifest: dict[str, Any]) -> str | None:
    """The first image file of a cache entry whose content is not what its patches were made
    from (missing, or another sha256; a file whose size and mtime are unchanged is trusted
    without reading it), or None."""
    import hashlib

    records = manifest.get("image_files", [])
    for record in records if isinstance(records, list) else [None]:
        if not (isinstance(record, list) and len(record) == 4
                and [type(v) for v in record] == [str, int, int, str]):  # fmt: skip
            return f"image_files holds {str(record)[:80]}, not [path, size, mtime_ns, sha256]"
        path, size, mtime_ns, digest = record
        try:
            st = Path(path).stat()
            if (st.st_size, st.st_mtime_ns) == (size, mtime_ns):
                continue
            if hashlib.sha256(Path(path).read_bytes()).hexdigest() != digest:
                return f"image {path} changed since the packs were built (sha256 differs)"
        except OSError as exc:
            return f"image {path} is gone or unreadable since the packs were built ({exc})"
    return None


def _int16() -> Any:
    import torch

    return torch.int16


def _try_load(
    entry: Path, key: str, fields: dict[str, Any], *, quiet: bool = False
) -> PackedCorpus | None:
    """The valid entry, or None (an invalid one is reported, unless `quiet`: already said)."""
    if not entry.exists():
        return None
    try:
        manifest = cache.verify(entry, key, fields)
        changed = image_files_changed(manifest)
        if changed is not None:
            raise cache.CacheInvalid(f"{entry}: {changed}")
    except cache.CacheInvalid as exc:
        if not quiet:
            log.warning("pack cache entry is invalid, rebuilding it: %s", exc)
        return None
    return PackedCorpus(entry=entry, arrays=cache.map_arrays(entry, manifest), manifest=manifest)


def _finish(
    corpus: PackedCorpus, *, key: str, hit: bool, build_s: float, t0: float
) -> PackedCorpus:
    # cache_hit and the timings describe this call; everything else comes from the manifest.
    stats = {
        **corpus.stats,
        "cache_key": key,
        "cache_hit": hit,
        "build_seconds": round(build_s, 3),
        "load_seconds": round(time.perf_counter() - t0 - build_s, 3),
        "cache_dir": str(corpus.entry.parent),
    }
    ordered = {k: stats[k] for k in STATS_KEYS}
    corpus.stats = {**ordered, **{k: v for k, v in stats.items() if k not in ordered}}
    log.info(
        "pack cache %s key=%s host=%s: %d samples -> %d packs (%.1f%% real, %.1f%% supervised)",
        "HIT" if hit else "BUILT",
        key,
        socket.gethostname(),
        corpus.num_samples,
        len(corpus),
        100 * corpus.stats["real_fraction"],
        100 * corpus.stats["supervised_fraction"],
    )
    return corpus


def _check_strict(spec: PackSpec, corpus: PackedCorpus, key: str) -> None:
    """--strict on a cache entry built without it: its recorded bad rows, and pictures above 8
    bits per channel, are an error."""
    bad = corpus.stats.get("bad_rows") or {}
    above = corpus.stats.get("images_above_8_bit") or 0
    if spec.strict and above:
        first = corpus.stats.get("first_image_above_8_bit", "?")
        raise DataError(
            f"--strict: the cached packs {key} of {spec.describe()} hold "
            f"{above_8_bit_note(above, first)}. Convert them to 8 bits or drop "
            f"{spec.knob('strict')}"
        )
    if not spec.strict or not bad:
        return
    first = "; ".join(
        f"{e['where']}: {e['detail']}" for e in corpus.stats.get("bad_row_examples", [])
    )
    raise DataError(
        f"--strict: the cached packs {key} of {spec.describe()} were built skipping "
        f"{sum(bad.values())} bad rows ({bad}); first: {first}. Fix the rows or drop "
        f"{spec.knob('strict')}"
    )


def _hit(spec: PackSpec, corpus: PackedCorpus, key: str, t0: float) -> PackedCorpus:
    _check_strict(spec, corpus, key)
    above = corpus.stats.get("images_above_8_bit")
    if above:  # said at build time; said again on a hit
        first = corpus.stats.get("first_image_above_8_bit", "?")
        note = above_8_bit_note(above, first)
        log.warning("%s: %s; %s refuses them", spec.describe(), note, spec.knob("strict"))
    for source in corpus.stats.get("sources", []):  # said at build time; said again on a hit
        special_text.apply_policy(source.get("special_tokens_in_text", {}),
                                  spec.special_tokens_in_text, where=source["path"],
                                  knob=spec.knob("special_tokens_in_text"))  # fmt: skip
    return _finish(corpus, key=key, hit=True, build_s=0.0, t0=t0)


def _require_writable(spec: PackSpec, directory: Path, field: str) -> None:
    problem = writable_problem(directory)
    if problem is not None:
        raise PathError(
            f"pack {field.replace('_', ' ')} {directory}: {problem}; point {spec.knob(field)} at "
            "a writable node-local directory"
        )


def _data_for_manifest(spec: PackSpec) -> Any:
    return spec.data if isinstance(spec.data, str) else [asdict(s) for s in spec.sources()]


def build_or_load(spec: PackSpec, *, progress: bool | None = None) -> PackedCorpus:
    """The packs for `spec` from the node-local cache, built once per node when missing."""
    t0 = time.perf_counter()
    sources = resolve_sources(spec)
    tokenizer_dir = resolve_tokenizer_dir(spec.tokenizer)
    fields = key_fields(spec, sources, tokenizer_dir)
    key = cache.cache_key(fields)
    cache_dir = spec.resolved_cache_dir()
    entry = cache.entry_dir(cache_dir, key)
    cache.require_private(cache_dir, spec.knob("cache_dir"))  # before anything in it is read

    corpus = _try_load(entry, key, fields)
    if corpus is not None:
        return _hit(spec, corpus, key, t0)

    _require_writable(spec, cache_dir, "cache_dir")  # before a build that could not be kept
    lock_dir = spec.resolved_lock_dir()
    cache.require_private(lock_dir, spec.knob("lock_dir"), "lock")
    _require_writable(spec, lock_dir, "lock_dir")
    lock = cache.lock_path(lock_dir, cache_dir, key)
    was_there = entry.exists()
    with cache.node_lock(lock, timeout_s=spec.lock_timeout_s, key=key,
                         timeout_knob=spec.knob("lock_timeout_s")):  # fmt: skip
        # built by the process we waited for
        corpus = _try_load(entry, key, fields, quiet=was_there)
        if corpus is not None:
            return _hit(spec, corpus, key, t0)
        log.info("pack cache MISS key=%s: building %s into %s", key, spec.describe(), cache_dir)
        t_build = time.perf_counter()
        if cache_dir.exists():
            cache.remove_stale_temps(cache_dir, key)
            cache.discard(entry)  # an invalid entry found above
        arrays, manifest = _build(spec, sources, tokenizer_dir, progress)
        manifest.update(
            format_version=cache.FORMAT_VERSION,
            key_fields=fields,
            seq_length=spec.seq_length,
            data=_data_for_manifest(spec),
            created_by={"host": socket.gethostname(), "pid": os.getpid(), "time": time.time()},
        )
        manifest["stats"]["cold_build_seconds"] = round(time.perf_counter() - t_build, 3)
        entry = cache.publish(cache_dir, key, arrays, manifest)
        build_s = time.perf_counter() - t_build
        # publish may hand back an equal entry another host published first: read its manifest.
        manifest = cache.read_manifest(entry)
        corpus = PackedCorpus(
            entry=entry, arrays=cache.map_arrays(entry, manifest), manifest=manifest
        )
    return _finish(corpus, key=key, hit=False, build_s=build_s, t0=t0)
