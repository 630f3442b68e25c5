"""Rows -> token samples in the DeepSeek-V4 conversation format, with the supervision of each token.

Per row: shape -> normalized messages (`shapes`) -> rendered samples with supervised character
spans (`dsv4_format`). Tokens are those of each sample's whole rendered string. To keep that
fast, a sample is cut at its supervision boundaries and the pieces are batch-encoded: when every
cut touches a special token (the usual case: prompts end with `</think>`, `<think>` or a task
token, completions with EOS), the tokenizer splits there anyway (added tokens are matched before
BPE and this tokenizer has no normalizer and no lstrip/rstrip), so the pieces' ids concatenate to
exactly the whole string's ids. A sample with a cut inside plain text (e.g. a completion right
after a `latest_reminder` text) is encoded whole and its targets taken from token offsets.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from primus_v4.data import chat_format, dsv4_format, shapes
from primus_v4.data.corpus import NOT_JSON, RawRow
from primus_v4.data.image_rows import (
    PLACEHOLDER,
    ImageSource,
    RowImages,
    place_column_images,
    resolve_images,
    take_images,
)
from primus_v4.data.images import TEXT, span_types
from primus_v4.data.shapes import BadRow
from primus_v4.data.tokenizer import TextTokenizer
from primus_v4.errors import DataError
from primus_v4.log import get_logger

log = get_logger(__name__)

# Part of the cache key: bump when rendering changes for the same rows and tokenizer.
TEMPLATE_ID = "deepseek_recipe-0.2/v4"
FORMATS = (*shapes.SHAPES, "auto")
# The stats' chat-mode count of rows whose reasoning a forced chat mode does not render.
CHAT_WITHOUT_REASONING = "chat, reasoning not rendered"
CHAT_MODES = dsv4_format.CHAT_MODES
# Bad rows whose file and line are kept (stats and the warning) besides the counts.
BAD_EXAMPLES = 5

# Why a row is skipped (stats "bad_rows" keys).
BAD_REASONS = {
    "not_json": "not valid JSON",
    "too_large": "above the row-size bound (corpus.MAX_ROW_BYTES)",
    "too_deep": "nested deeper than the bound (corpus.MAX_ROW_DEPTH)",
    "bad_text": "text no tokenizer takes (a lone UTF-16 surrogate)",
    "not_an_object": "not a JSON object",
    "missing_field": "missing a required field",
    "bad_field_type": "a field has the wrong type",
    "bad_messages": "a message is malformed (not an object, or no content where needed)",
    "bad_role": "a message has an unknown role",
    "unknown_key": "a message has a key the format does not render",
    "misplaced_field": "a message carries a field its role cannot have",
    "unread_field": "a content field the row's format does not read",
    "unsupported_content": "a content part that is not text",
    "image": "an image, for a model without a vision tower (V4, V4-Flash-0731)",
    "image_count": "the conversation's image placeholders and its images do not match",
    "image_missing": "an image file that does not exist",
    "image_unreadable": "an image that is not a readable picture (corrupt, too large, bad base64)",
    "image_format": "an image of a format not read (PNG, JPEG, WebP, GIF, BMP, TIFF are; EPS, "
    "PostScript and PDF are not)",
    "image_not_local": "an image URL that is not a local file (packing never downloads)",
    "bad_tools": "tools are not a list of function schemas",
    "bad_tool_call": "a tool call has no name or unusable arguments",
    "bad_task": "a user task is not a known task",
    "no_target": "no assistant turn to train on",
    "empty_response": "every assistant turn to train on is empty",
}


@dataclass(frozen=True, kw_only=True)
class Rendered:
    """Samples as one token stream (row order, before any truncation)."""

    tokens: np.ndarray  # uint32 [T]
    supervised: np.ndarray  # bool [T]: token is a target (an assistant completion)
    lengths: np.ndarray  # int64 [N]
    rows: np.ndarray  # int64 [N]: 0-based index of each sample's source row
    format: str  # the resolved shape
    bad_rows: dict[str, int]
    bad_examples: list[dict[str, str]]  # the first few bad rows: where, reason, detail
    num_rows: int
    modes: dict[str, int] = field(default_factory=dict)  # rows rendered per chat mode
    # Rows with images (a model with a vision tower): each token's type (-1 text, 0..3 the
    # parts of an image span, `images.span_types`), and the images in sample order with each
    # sample's count. None / () for text alone.
    token_types: np.ndarray | None = None  # int8 [T]
    images: tuple[ImageSource, ...] = ()
    image_counts: np.ndarray | None = None  # int64 [N]
    # Pictures of the rendered rows stored with more than 8 bits per channel (converted as
    # DeepSeek's processor converts them), and the first: "<file line>: image k (<name>): ...".
    images_above_8_bit: int = 0
    first_image_above_8_bit: str = ""


def resolve_format(rows: Sequence[RawRow], fmt: str, where: str) -> str:
    if fmt not in FORMATS:
        raise DataError(f"unknown format {fmt!r}: expected one of {', '.join(FORMATS)}")
    if fmt != "auto":
        log.info("%s: format %s (forced)", where, fmt)
        return fmt
    shape = shapes.detect_shape([r.value for r in rows])
    if shape is None:
        seen = sorted({k for r in rows[:100] if isinstance(r.value, dict) for k in r.value})
        raise DataError(
            f"cannot detect the format of {where}: no row has 'messages', 'conversations', "
            f"'instruction'+'output' or 'prompt'+'completion' (keys seen: {seen[:12]}); pass "
            f"--format {'|'.join(shapes.SHAPES)}"
        )
    log.info("%s: format %s (detected from the first rows' keys)", where, shape)
    return shape


def row_samples(
    value: Any,
    shape: str,
    chat_mode: str,
    fmt: chat_format.ChatFormat = chat_format.V4,
    *,
    image_refs: list[Any] | None = None,
    image_parts: bool = False,
) -> tuple[str, list[chat_format.Sample]]:
    """One row -> (chat mode used, samples as (text, supervised char spans)); raises BadRow.

    The mode reads CHAT_WITHOUT_REASONING for a row with reasoning rendered in forced chat mode.
    A top-level `reasoning_effort` (the Chat Completions field) sets the effort.
    `image_refs` (a model with a vision tower): the row's images, taken out by
    `image_rows.take_images`; the conversation must show one placeholder for each.
    """
    if not isinstance(value, dict):
        raise BadRow("not_an_object", f"a {type(value).__name__}, not a JSON object")
    if image_refs is None:
        shapes.check_no_images(value)
    messages = shapes.row_messages(value, shape)
    if image_refs is not None:
        place_column_images(messages, image_refs, parts=image_parts)
    shapes.check_trainable(messages)
    thinking = any(m.get("reasoning_content") for m in messages if m["role"] == "assistant")
    mode = ("thinking" if thinking else "chat") if chat_mode == "auto" else chat_mode
    label = CHAT_WITHOUT_REASONING if mode == "chat" and thinking else mode
    effort = value.get("reasoning_effort")
    own = chat_format.needs_own_encoder(messages, fmt)
    if own is None:
        return label, chat_format.conversation_samples(messages, mode, fmt, effort)
    # Our port of the official encoder, for what the library renders otherwise or not at all.
    merged = dsv4_format.merge_tool_messages(messages)
    dsv4_format.sort_tool_results(merged)
    return label, dsv4_format.conversation_samples(
        merged, mode, **chat_format.port_effort(fmt, effort)
    )


@dataclass(kw_only=True)
class _Collected:
    texts: list[str] = field(default_factory=list)  # fast-path pieces, in sample order
    piece_supervised: list[bool] = field(default_factory=list)
    piece_sample: list[int] = field(default_factory=list)
    whole: dict[int, tuple[str, list[tuple[int, int]]]] = field(default_factory=dict)
    rows: list[int] = field(default_factory=list)
    bad: Counter[str] = field(default_factory=Counter)
    examples: list[dict[str, str]] = field(default_factory=list)
    modes: Counter[str] = field(default_factory=Counter)
    images: list[list[ImageSource]] = field(default_factory=list)  # per sample
    above_8_bit: int = 0
    first_above_8_bit: str = ""


def _row_with_images(
    value: Any, shape: str, chat_mode: str, fmt: chat_format.ChatFormat, vision: RowImages
) -> tuple[str, list[chat_format.Sample], list[list[ImageSource]]]:
    """row_samples for a model with a vision tower, with each sample's images (the first n of
    the row's, n the placeholders its text shows); raises BadRow."""
    if not isinstance(value, dict):
        raise BadRow("not_an_object", f"a {type(value).__name__}, not a JSON object")
    row, refs, parts = take_images(value)
    mode, samples = row_samples(row, shape, chat_mode, fmt, image_refs=refs, image_parts=parts)
    shown = [text.count(PLACEHOLDER) for text, _ in samples]
    if max(shown, default=0) != len(refs):
        raise BadRow(
            "image_count",
            f"the rendered conversation shows {max(shown, default=0)} of its {len(refs)} images "
            f"(in {chat_mode} mode); put each image in a turn that is rendered",
        )
    images = resolve_images(refs, vision.base, vision.grid)
    return mode, samples, [images[:n] for n in shown]


def _add_sample(
    out: _Collected, text: str, spans: list[tuple[int, int]], *, split_ok: bool
) -> None:
    n = len(out.rows) - 1
    cuts = [c for span in spans for c in span]
    specials = dsv4_format.SPECIAL_TEXTS
    inner = [c for c in cuts if 0 < c < len(text)]
    if not split_ok or not all(
        text.startswith(specials, c) or text.endswith(specials, 0, c) for c in inner
    ):
        out.whole[n] = (text, spans)
        return
    start = 0
    for a, b in spans:
        for lo, hi, sup in ((start, a, False), (a, b, True)):
            if hi > lo:
                out.texts.append(text[lo:hi])
                out.piece_supervised.append(sup)
                out.piece_sample.append(n)
        start = b
    if start < len(text):
        out.texts.append(text[start:])
        out.piece_supervised.append(False)
        out.piece_sample.append(n)


def _collect(
    rows: Sequence[RawRow],
    shape: str,
    chat_mode: str,
    fmt: chat_format.ChatFormat,
    *,
    strict: bool,
    split_ok: bool = True,
    strict_knob: str = "--strict",
    vision: RowImages | None = None,
) -> _Collected:
    out = _Collected()
    for index, row in enumerate(rows):
        try:
            if row.value is NOT_JSON:
                raise BadRow(row.reason, row.error)
            if vision is None:
                mode, samples = row_samples(row.value, shape, chat_mode, fmt)
                images: list[list[ImageSource]] = [[] for _ in samples]
            else:
                mode, samples, images = _row_with_images(row.value, shape, chat_mode, fmt, vision)
        except BadRow as exc:
            if strict:
                raise DataError(
                    f"{row.where}: {exc.detail} ({shape} format); fix the row or drop "
                    f"{strict_knob} to skip and count bad rows"
                ) from None
            out.bad[exc.reason] += 1
            if len(out.examples) < BAD_EXAMPLES:
                out.examples.append(
                    {"where": row.where, "reason": exc.reason, "detail": exc.detail}
                )
            continue
        _count_above_8_bit(out, row.where, max(images, key=len, default=[]), strict, strict_knob)
        out.modes[mode] += 1
        for (text, spans), sample_images in zip(samples, images, strict=True):
            out.rows.append(index)
            out.images.append(sample_images)
            _add_sample(out, text, spans, split_ok=split_ok)
    return out


def above_8_bit_note(count: int, first: str) -> str:
    """What is said of pictures above 8 bits per channel (the warning, a cache hit's refusal
    under strict)."""
    return (
        f"{count} picture{'s' if count != 1 else ''} of more than 8 bits per channel, converted "
        "to 8-bit RGB as DeepSeek-V4.1's processor converts them (16-bit and float grey clip "
        f"toward white); first: {first}"
    )


def _count_above_8_bit(
    out: _Collected, where: str, images: list[ImageSource], strict: bool, strict_knob: str
) -> None:
    """Count a row's pictures above 8 bits per channel (DataError naming the first if strict)."""
    for k, image in enumerate(images):
        if image.bits <= 8:
            continue
        said = f"{where}: image {k + 1} ({image.name}): {image.bits} bits per channel"
        if strict:
            raise DataError(
                f"{said}, above the 8 bits a picture is read with (DeepSeek-V4.1's processor "
                f"converts it to 8-bit RGB); convert it to 8 bits or drop {strict_knob}"
            )
        out.above_8_bit += 1
        out.first_above_8_bit = out.first_above_8_bit or said


def _encode_whole(
    tokenizer: TextTokenizer, text: str, spans: list[tuple[int, int]]
) -> tuple[np.ndarray, np.ndarray]:
    ids, starts = tokenizer.encode_with_offsets(text)
    sup = np.zeros(len(ids), dtype=bool)
    for a, b in spans:
        sup |= (starts >= a) & (starts < b)
    return ids, sup


def _assemble(
    out: _Collected, tokenizer: TextTokenizer, progress: Callable[[int], None] | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Token stream, supervision and per-sample lengths in sample order."""
    n = len(out.rows)
    flat, text_lengths = tokenizer.encode_texts(out.texts, on_progress=progress)
    supervised = np.repeat(np.asarray(out.piece_supervised, dtype=bool), text_lengths)
    sample_of = np.asarray(out.piece_sample, dtype=np.int64)
    lengths = np.bincount(sample_of, weights=text_lengths, minlength=n).astype(np.int64)
    if not out.whole:
        return flat, supervised, lengths
    # Rare path: splice the samples encoded whole into their places.
    whole = {j: _encode_whole(tokenizer, *ts) for j, ts in out.whole.items()}
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    tokens_parts, sup_parts = [], []
    for j in range(n):
        if j in whole:
            ids, sup = whole[j]
            lengths[j] = len(ids)
        else:
            ids, sup = flat[bounds[j] : bounds[j + 1]], supervised[bounds[j] : bounds[j + 1]]
        tokens_parts.append(ids)
        sup_parts.append(sup)
    return np.concatenate(tokens_parts).astype(np.uint32), np.concatenate(sup_parts), lengths


def _expand_images(
    tokens: np.ndarray,
    supervised: np.ndarray,
    lengths: np.ndarray,
    images: list[list[ImageSource]],
    token_id: int,
    where: list[int],
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Each image's one placeholder token -> its span (every position `token_id`, never a
    target), with each token's type; -> (tokens, supervised, token types, lengths)."""
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    out_tok, out_sup, out_types = [], [], []
    new_lengths = lengths.copy()
    for j, sample_images in enumerate(images):
        ids, sup = tokens[bounds[j] : bounds[j + 1]], supervised[bounds[j] : bounds[j + 1]]
        at = np.flatnonzero(ids == token_id)
        if len(at) != len(sample_images):
            raise DataError(
                f"row {where[j] + 1}: {len(sample_images)} image placeholders tokenized to "
                f"{len(at)} image tokens (id {token_id}); the tokenizer must keep "
                f"{PLACEHOLDER} one token"
            )
        types = np.full(len(ids), TEXT, dtype=np.int8)
        start = 0
        for pos, image in zip(at, sample_images, strict=True):
            out_tok += [ids[start:pos], np.full(image.span, token_id, dtype=ids.dtype)]
            out_sup += [sup[start:pos], np.zeros(image.span, dtype=bool)]
            out_types += [types[start:pos], np.asarray(span_types(image.llm_h, image.llm_w),
                                                       dtype=np.int8)]  # fmt: skip
            start = pos + 1
            new_lengths[j] += image.span - 1
        out_tok.append(ids[start:])
        out_sup.append(sup[start:])
        out_types.append(types[start:])
    return (np.concatenate(out_tok).astype(np.uint32), np.concatenate(out_sup),
            np.concatenate(out_types), new_lengths)  # fmt: skip


def _check_image_token(tokenizer: TextTokenizer, token_id: int) -> None:
    ids, _ = tokenizer.encode_texts([PLACEHOLDER])
    if list(ids) != [token_id]:
        raise DataError(
            f"tokenizer {tokenizer.dir}: {PLACEHOLDER} encodes to {list(ids)}, not the model's "
            f"image_token_id {token_id}; use the tokenizer released with the model"
        )


def _rows_done(
    out: _Collected, advance: Callable[[int], None] | None
) -> Callable[[int], None] | None:
    """The tokenizer reports texts (a row renders to several); the bar counts rows."""
    if advance is None:
        return None
    sample_of = out.piece_sample
    done = {"texts": 0, "rows": 0}

    def on_texts(n: int) -> None:
        done["texts"] += n
        rows = sample_of[done["texts"] - 1] + 1 if done["texts"] else 0
        if rows > done["rows"]:
            advance(rows - done["rows"])
            done["rows"] = rows

    return on_texts


def render(
    rows: Sequence[RawRow],
    tokenizer: TextTokenizer,
    *,
    fmt: str,
    where: str,
    chat_mode: str = "auto",
    chat_format_name: str = "v4",
    strict: bool = False,
    progress: Callable[[str, int], Callable[[int], None]] | None = None,
    strict_knob: str = "--strict",
    images: RowImages | None = None,
) -> Rendered:
    """Validate, render and tokenize rows; bad rows are counted by reason (or raise if strict:
    the error names `strict_knob`, the setting that turns strict off).

    `progress(desc, total)` returns the callback that advances a progress bar by n texts.
    `images` (a model with a vision tower): rows with images are read (`image_rows`), each
    image a span of image tokens; without it a row with an image is a bad row (`image`).
    """
    if chat_mode not in CHAT_MODES:
        raise DataError(f"unknown chat mode {chat_mode!r}: expected one of {', '.join(CHAT_MODES)}")
    shape = resolve_format(rows, fmt, where)
    conversation = chat_format.checked(chat_format_name, tokenizer)
    if images is not None:
        _check_image_token(tokenizer, images.token_id)
    out = _collect(rows, shape, chat_mode, conversation, strict=strict,
                   split_ok=tokenizer.splits_at_specials, strict_knob=strict_knob,
                   vision=images)  # fmt: skip
    if out.bad:
        first = "; ".join(f"{e['where']}: {e['detail']}" for e in out.examples)
        log.warning(
            "skipped %d bad rows of %s: %s; first: %s",
            sum(out.bad.values()),
            where,
            dict(out.bad),
            first,
        )
    if out.above_8_bit:
        note = above_8_bit_note(out.above_8_bit, out.first_above_8_bit)
        log.warning("%s: %s; %s refuses them", where, note, strict_knob)
    if out.modes.get(CHAT_WITHOUT_REASONING):
        log.warning(
            "%s: %d rows carry reasoning_content that chat mode does not render (as served in "
            "chat mode); use --chat-mode thinking or auto to train on it",
            where,
            out.modes[CHAT_WITHOUT_REASONING],
        )
    if not out.rows:
        raise DataError(
            f"no usable row in {where} ({len(rows)} rows, bad: {dict(out.bad)}) as {shape} format"
            + (
                f"; first: {out.examples[0]['where']}: {out.examples[0]['detail']}"
                if out.examples
                else ""
            )
        )
    advance = progress("tokenize", len(out.rows)) if progress is not None else None
    tokens, supervised, lengths = _assemble(out, tokenizer, _rows_done(out, advance))
    token_types, counts = None, None
    if images is not None:
        tokens, supervised, token_types, lengths = _expand_images(
            tokens, supervised, lengths, out.images, images.token_id, out.rows
        )
        counts = np.asarray([len(i) for i in out.images], dtype=np.int64)
    return Rendered(
        tokens=tokens,
        supervised=supervised,
        lengths=lengths,
        rows=np.asarray(out.rows, dtype=np.int64),
        format=shape,
        bad_rows=dict(sorted(out.bad.items())),
        bad_examples=out.examples,
        num_rows=len(rows),
        modes=dict(sorted(out.modes.items())),
        token_types=token_types,
        images=tuple(image for sample in out.images for image in sample),
        image_counts=counts,
        images_above_8_bit=out.above_8_bit,
        first_image_above_8_bit=out.first_above_8_bit,
    )
