"""Corpus sources: the embedded synthetic corpus, a local .json/.jsonl/.parquet file, or a hub name.

A source has a fingerprint computed without reading rows (file size + sha256 of the bytes, or
the hub name + revision), so a cache hit needs neither `datasets` nor a parse of the corpus.
Rows come back as `RawRow`s that remember where they came from (file and line, or row number),
so a bad row can be reported precisely.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from primus_v4.data.synthetic import GENERATOR_VERSION, synthetic_rows
from primus_v4.data.tokenizer import file_sha256
from primus_v4.errors import DataError

LOCAL_SUFFIXES = (".json", ".jsonl", ".parquet")
SYNTHETIC_DEFAULT_ROWS = 2000
SYNTHETIC_DEFAULT_SEED = 0

# Marks a row that cannot be read as data; it is counted as bad (its `reason`).
NOT_JSON = object()
# Bounds of one row, so that one hostile row costs bounded time and memory and never ends the
# pack: its JSON (a line) or its text (a row of a .json list or of parquet) at most 8 MiB (2M
# tokens at ~4 bytes a token, twice the 1M-token context of the V4 releases), and containers
# nested at most 100 deep (a chat row is ~6: row, messages, message, content parts, tool
# arguments). Deeper or larger rows are bad rows (`too_large`, `too_deep`).
MAX_ROW_BYTES = 8 << 20
MAX_ROW_DEPTH = 100


@dataclass(frozen=True, kw_only=True)
class RawRow:
    where: str  # e.g. "data.jsonl line 12" or "data.json row 3" (1-based), for messages
    value: Any  # the parsed row (normally a dict), or NOT_JSON
    error: str = ""  # why, when value is NOT_JSON (the JSON parser's message, a bound)
    reason: str = "not_json"  # the bad-row reason (templates.BAD_REASONS), when NOT_JSON


def row_problem(value: Any) -> tuple[str, str] | None:
    """(reason, detail) when a parsed row breaks a bound or holds text no tokenizer takes (a
    lone UTF-16 surrogate such as \\ud800, which JSON escapes can spell); None when it is fine.
    Iterative, so no depth of nesting reaches Python's recursion limit."""
    size, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            size += len(item)
            if not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError as exc:
                    code = ord(item[exc.start])
                    return "bad_text", f"a lone surrogate \\u{code:04x} (not a character)"
        elif isinstance(item, dict | list):
            if depth > MAX_ROW_DEPTH:
                return "too_deep", f"nested deeper than {MAX_ROW_DEPTH} levels"
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
            if isinstance(item, dict):
                stack.extend((key, depth + 1) for key in item)
        if size > MAX_ROW_BYTES:
            return "too_large", f"more than {MAX_ROW_BYTES >> 20} MiB of text"
    return None


def _checked(where: str, value: Any) -> RawRow:
    problem = row_problem(value)
    if problem is None:
        return RawRow(where=where, value=value)
    return RawRow(where=where, value=NOT_JSON, reason=problem[0], error=problem[1])


@dataclass(frozen=True, kw_only=True)
class CorpusSource:
    kind: Literal["synthetic", "file", "dir", "hub"]
    name: str  # file or directory path, hub dataset name, or "synthetic"
    revision: str | None = None  # hub revision (branch, tag or commit)
    split: str | None = None  # hub split (default "train")
    subset: str | None = None  # hub configuration name
    rows: int = SYNTHETIC_DEFAULT_ROWS  # synthetic only
    seed: int = SYNTHETIC_DEFAULT_SEED  # synthetic only

    @property
    def path(self) -> Path:
        return Path(self.name)

    def shards(self) -> list[Path]:
        """The files of a directory source (sorted, recursive), or the one file."""
        if self.kind != "dir":
            return [self.path]
        named = sorted(p for p in self.path.rglob("*") if p.suffix.lower() in LOCAL_SUFFIXES)
        odd = [p for p in named if not p.is_file() and not p.is_dir()]
        if odd:  # a FIFO, socket or device named like a shard: never read, never skipped quietly
            raise DataError(
                f"corpus directory {self.path}: {odd[0].relative_to(self.path)} is named like a "
                "shard but is not a regular file (a FIFO, socket or device); remove it or move "
                "it out of the corpus"
            )
        files = [p for p in named if p.is_file()]
        if not files:
            raise DataError(
                f"corpus directory {self.path} holds no {', '.join(LOCAL_SUFFIXES)} shard"
            )
        return files

    def fingerprint(self) -> str:
        """What identifies the corpus content in the cache key (no row is parsed)."""
        if self.kind == "synthetic":
            return f"synthetic:{GENERATOR_VERSION}:rows={self.rows}:seed={self.seed}"
        if self.kind in ("file", "dir"):
            # Content, not path: the same file copied elsewhere shares its cache.
            try:
                parts = [
                    f"{p.relative_to(self.path) if self.kind == 'dir' else ''}:"
                    f"{p.stat().st_size}:{file_sha256(p)}"
                    for p in self.shards()
                ]
            except OSError as exc:
                raise DataError(f"cannot read corpus {self.path}: {exc.strerror}") from exc
            return f"{self.kind}:" + ",".join(parts)
        # Offline we cannot resolve a moving branch to a commit; pin `name@commit` for a key
        # that can never alias two different snapshots.
        where = f"hub:{self.name}@{self.revision or 'main'}"
        return where + f":subset={self.subset or ''}:split={self.split or 'train'}"

    def describe(self) -> str:
        if self.kind == "synthetic":
            return f"synthetic(rows={self.rows}, seed={self.seed})"
        if self.kind == "hub":
            extra = "".join(
                f" {k}={v}" for k, v in (("subset", self.subset), ("split", self.split)) if v
            )
            return (
                f"hub dataset {self.name}" + (f"@{self.revision}" if self.revision else "") + extra
            )
        return str(self.path)


def _parse_synthetic(data: str) -> CorpusSource:
    rows, seed = SYNTHETIC_DEFAULT_ROWS, SYNTHETIC_DEFAULT_SEED
    _, _, options = data.partition(":")
    for item in filter(None, (part.strip() for part in options.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in ("rows", "seed") or not value.strip().lstrip("-").isdigit():
            raise DataError(
                f"bad synthetic corpus option {item!r} in --data {data!r}: expected "
                "synthetic[:rows=N,seed=S] with integers"
            )
        if key == "rows":
            rows = int(value)
        else:
            seed = int(value)
    if rows < 1:
        raise DataError(f"--data {data!r}: rows must be >= 1")
    return CorpusSource(kind="synthetic", name="synthetic", rows=rows, seed=seed)


def _looks_like_path(data: str) -> bool:
    return (
        data.startswith(("/", "./", "../", "~"))
        or data.lower().endswith(LOCAL_SUFFIXES)
        or data.count("/") > 1
    )


def resolve_source(
    data: str, *, split: str | None = None, subset: str | None = None
) -> CorpusSource:
    """`synthetic[:rows=N,seed=S]`, a local file or directory of shards, or a hub name
    `owner/name[@rev]` (with `split` / `subset`)."""
    data = data.strip()
    if not data:
        raise DataError(
            "--data is empty: pass a .json/.jsonl/.parquet file, a hub name or synthetic"
        )
    if data == "synthetic" or data.startswith("synthetic:"):
        return _parse_synthetic(data)
    path = Path(data).expanduser()
    if path.exists():
        if path.is_dir():
            return CorpusSource(kind="dir", name=str(path))
        if path.suffix.lower() not in LOCAL_SUFFIXES:
            raise DataError(
                f"corpus {path}: unsupported file type {path.suffix!r} "
                f"(expected one of {', '.join(LOCAL_SUFFIXES)})"
            )
        return CorpusSource(kind="file", name=str(path))
    if _looks_like_path(data):
        raise DataError(f"corpus file {path} does not exist")
    name, _, revision = data.partition("@")
    return CorpusSource(
        kind="hub", name=name, revision=revision or None, split=split, subset=subset
    )


def _iter_json_lines(path: Path, data: bytes) -> Iterator[RawRow]:
    """One row per line. Lines are split on newlines only (JSON strings may hold U+2028 and
    other characters str.splitlines would split at) and decoded one by one, so a line that is
    not UTF-8 is one bad row, counted with its line number, not the end of the file."""
    for lineno, raw in enumerate(data.split(b"\n"), start=1):
        where = f"{path} line {lineno}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            detail = f"not UTF-8 (byte 0x{raw[exc.start]:02x} at column {exc.start + 1})"
            yield RawRow(where=where, value=NOT_JSON, error=detail)
            continue
        if not line.strip():
            continue  # blank lines carry no row; not worth a "bad row" count
        if len(raw) > MAX_ROW_BYTES:  # not even parsed
            detail = f"{len(raw)} bytes, above the row bound of {MAX_ROW_BYTES >> 20} MiB"
            yield RawRow(where=where, value=NOT_JSON, reason="too_large", error=detail)
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            yield RawRow(where=where, value=NOT_JSON, error=f"not valid JSON ({exc.msg})")
            continue
        except RecursionError:
            detail = f"nested deeper than {MAX_ROW_DEPTH} levels"
            yield RawRow(where=where, value=NOT_JSON, reason="too_deep", error=detail)
            continue
        yield _checked(where, value)


_JSON_MARKS = re.compile(r'[][{}",\\]')


def _array_items(text: str) -> Iterator[str]:
    """The texts of the top-level items of the JSON array `text`, found by scanning brackets
    and strings (no recursion: a row nested deeper than the parser goes is still one item)."""
    depth, in_string, skip = 0, False, -1
    item_start = text.index("[") + 1
    for mark in _JSON_MARKS.finditer(text, item_start):
        i, c = mark.start(), mark.group()
        if i <= skip:
            continue
        if in_string:
            skip = i + 1 if c == "\\" else skip
            in_string = c != '"'
        elif c == '"':
            in_string = True
        elif c in "[{":
            depth += 1
        elif c in "]}" and depth:
            depth -= 1
        elif c in "]}" or not depth:  # a comma between items, or the array's end
            if text[item_start:i].strip():
                yield text[item_start:i]
            if c != ",":
                return
            item_start = i + 1


def _iter_json_items(path: Path, text: str) -> Iterator[RawRow]:
    """The rows of a JSON list one by one, each parsed alone, so a row nested too deep or not
    valid JSON is one bad row (with its row number) rather than the end of the file."""
    for i, item in enumerate(_array_items(text), start=1):
        where = f"{path} row {i}"
        if len(item) > MAX_ROW_BYTES:
            detail = f"{len(item)} characters, above the row bound of {MAX_ROW_BYTES >> 20} MiB"
            yield RawRow(where=where, value=NOT_JSON, reason="too_large", error=detail)
            continue
        try:
            value = json.loads(item)
        except json.JSONDecodeError as exc:
            yield RawRow(where=where, value=NOT_JSON, error=f"not valid JSON ({exc.msg})")
        except RecursionError:
            detail = f"nested deeper than {MAX_ROW_DEPTH} levels"
            yield RawRow(where=where, value=NOT_JSON, reason="too_deep", error=detail)
        else:
            yield _checked(where, value)


def _not_utf8(path: Path, data: bytes, exc: UnicodeDecodeError) -> DataError:
    line = data.count(b"\n", 0, exc.start) + 1
    column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
    return DataError(
        f"corpus {path} line {line}, column {column}: byte 0x{data[exc.start]:02x} is not UTF-8; "
        "save the file as UTF-8 (in JSON Lines such a line is skipped and counted instead)"
    )


def _read_json_file(path: Path) -> Iterator[RawRow]:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise DataError(f"cannot read corpus {path}: {exc.strerror}") from exc
    data = data.removeprefix(codecs.BOM_UTF8)  # editors on Windows write one; it is no row
    if path.suffix.lower() == ".jsonl":
        yield from _iter_json_lines(path, data)
        return
    looks_like_lines = data.lstrip().startswith(b"{")
    try:
        text = data.decode("utf-8")
        value = json.loads(text)
    except UnicodeDecodeError as exc:
        if looks_like_lines:
            yield from _iter_json_lines(path, data)
            return
        raise _not_utf8(path, data, exc) from None
    except (json.JSONDecodeError, RecursionError) as exc:
        # Many ".json" corpora are really JSON Lines; one object per line is the tell.
        if looks_like_lines:
            yield from _iter_json_lines(path, data)
            return
        if isinstance(exc, RecursionError) and text.lstrip().startswith("["):
            yield from _iter_json_items(path, text)  # a row nested too deep is one bad row
            return
        raise DataError(
            f"corpus {path} is not valid JSON (line {exc.lineno}, column {exc.colno}: "
            f"{exc.msg}); expected a list of rows or JSON Lines"
        ) from exc
    if isinstance(value, dict):
        value = [value]  # a single-row file
    if not isinstance(value, list):
        raise DataError(f"corpus {path}: expected a JSON list of rows, got {type(value).__name__}")
    for i, row in enumerate(value, start=1):
        yield _checked(f"{path} row {i}", row)


def _read_parquet(path: Path) -> Iterator[RawRow]:
    # pyarrow is the engine `datasets` itself uses; reading it directly avoids datasets' import
    # cost and its Arrow cache copy in ~/.cache.
    try:
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
    except Exception as exc:  # pyarrow raises ArrowInvalid / OSError variants
        raise DataError(f"cannot read parquet corpus {path}: {exc}") from exc
    for i, row in enumerate(rows, start=1):
        yield _checked(f"{path} row {i}", row)


def _read_hub(source: CorpusSource) -> Iterator[RawRow]:
    try:
        import datasets

        ds = datasets.load_dataset(
            source.name, source.subset, revision=source.revision, split=source.split or "train"
        )
    except Exception as exc:  # network, auth and not-found errors all land here
        raise DataError(
            f"cannot load hub dataset {source.name!r} ({type(exc).__name__}: {exc}). Offline or "
            "misspelled? Pass a local .json/.jsonl/.parquet file, or --data synthetic"
        ) from exc
    for i, row in enumerate(_undecoded(ds), start=1):
        yield _checked(f"hub dataset {source.name} row {i}", row)


def _undecoded(ds: Any) -> Any:
    """`ds` with every Image feature (nested in lists and structs too) left as its bytes and
    path: `datasets` would decode a picture with every Pillow plugin (EPS runs Ghostscript);
    undecoded, it reaches the image rows' own decoder, which opens still-image formats only
    (data/images.py)."""
    import dataclasses

    import datasets

    def plain(feature: Any) -> Any:
        if isinstance(feature, datasets.Image):
            return datasets.Image(mode=feature.mode, decode=False)
        if isinstance(feature, dict):
            return {key: plain(value) for key, value in feature.items()}
        if isinstance(feature, list | tuple):
            return [plain(value) for value in feature]
        if dataclasses.is_dataclass(feature) and hasattr(feature, "feature"):
            return dataclasses.replace(feature, feature=plain(feature.feature))
        return feature

    features = getattr(ds, "features", None)
    if not features:
        return ds
    undecoded = datasets.Features({key: plain(value) for key, value in features.items()})
    return ds if undecoded == features else ds.cast(undecoded)


def read_rows(source: CorpusSource) -> list[RawRow]:
    """All rows of the source; raises DataError when the source is unreadable or empty."""
    if source.kind == "synthetic":
        values = synthetic_rows(rows=source.rows, seed=source.seed)
        rows = [RawRow(where=f"synthetic row {i}", value=v) for i, v in enumerate(values, 1)]
    elif source.kind == "hub":
        rows = list(_read_hub(source))
    else:
        rows = []
        for shard in source.shards():
            reader = _read_parquet if shard.suffix.lower() == ".parquet" else _read_json_file
            rows.extend(reader(shard))
    if not rows:
        raise DataError(f"corpus {source.describe()} is empty (no rows)")
    return rows
