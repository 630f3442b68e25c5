"""Rows -> token samples with the DeepSeek-V4 chat format, and the supervision of each token.

Rendering (special tokens are inserted as ids, never encoded from text):
    alpaca:   BOS <｜User｜> prompt <｜Assistant｜> response EOS
              prompt = instruction, plus "\\n\\n" + input when input is non-empty
    messages: BOS [system text] then per turn: <｜User｜> text | <｜Assistant｜> text EOS
Supervised tokens (targets) are exactly the assistant texts and their EOS. Prompt and response
texts are encoded separately and concatenated, so the supervision boundary is exact.

Each sample is a list of pieces (a text or one special id, with a supervised flag); all texts are
batch-encoded at once and the token stream is assembled from the pieces with numpy gathers.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from primus_v4.data.corpus import NOT_JSON, RawRow
from primus_v4.data.tokenizer import SpecialIds, TextTokenizer
from primus_v4.errors import DataError
from primus_v4.log import get_logger

log = get_logger(__name__)

# Part of the cache key: bump when rendering changes for the same rows and tokenizer.
TEMPLATE_ID = "deepseek_v4_chat/v1"
FORMATS = ("alpaca", "messages", "auto")
_ROLES = ("system", "user", "assistant")

# Why a row is skipped (stats "bad_rows" keys) and how --strict words it.
BAD_REASONS = {
    "not_json": "not valid JSON",
    "not_an_object": "not a JSON object",
    "missing_field": "missing a required field",
    "bad_field_type": "a field has the wrong type",
    "empty_response": "the response is empty",
    "bad_messages": "messages is not a list of {role, content} turns",
}


class _BadRow(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


@dataclass(kw_only=True)
class _Pieces:
    """Flat per-piece arrays over all samples, in sample order."""

    texts: list[str] = field(default_factory=list)
    text_of_piece: list[int] = field(default_factory=list)  # index into texts, -1 = special
    special_of_piece: list[int] = field(default_factory=list)  # the id when text_of_piece == -1
    supervised: list[bool] = field(default_factory=list)
    sample_of_piece: list[int] = field(default_factory=list)

    def text(self, sample: int, text: str, *, supervised: bool) -> None:
        self.text_of_piece.append(len(self.texts))
        self.texts.append(text)
        self.special_of_piece.append(-1)
        self.supervised.append(supervised)
        self.sample_of_piece.append(sample)

    def mark(self) -> tuple[int, int]:
        return len(self.texts), len(self.text_of_piece)

    def rollback(self, mark: tuple[int, int]) -> None:
        texts, pieces = mark
        del self.texts[texts:]
        for column in (
            self.text_of_piece,
            self.special_of_piece,
            self.supervised,
            self.sample_of_piece,
        ):
            del column[pieces:]

    def special(self, sample: int, token_id: int, *, supervised: bool) -> None:
        self.text_of_piece.append(-1)
        self.special_of_piece.append(token_id)
        self.supervised.append(supervised)
        self.sample_of_piece.append(sample)


@dataclass(frozen=True, kw_only=True)
class Rendered:
    """Samples as one token stream (original row order, before any truncation)."""

    tokens: np.ndarray  # uint32 [T]
    supervised: np.ndarray  # bool [T]: token is a target (assistant text or its EOS)
    lengths: np.ndarray  # int64 [N]
    rows: np.ndarray  # int64 [N]: 0-based index of each sample's source row
    format: str  # the resolved format (alpaca or messages)
    bad_rows: dict[str, int]
    num_rows: int


def detect_format(rows: Sequence[RawRow], where: str) -> str:
    """`messages` or `alpaca` from the keys of the first object rows."""
    seen: set[str] = set()
    for row in rows[:100]:
        if not isinstance(row.value, dict):
            continue
        if "messages" in row.value:
            return "messages"
        if "instruction" in row.value and "output" in row.value:
            return "alpaca"
        seen.update(row.value)
    raise DataError(
        f"cannot detect the format of {where}: no row has 'messages' or 'instruction'+'output' "
        f"(keys seen: {sorted(seen)[:12]}); pass --format alpaca|messages"
    )


def _string_field(row: dict[str, Any], name: str, *, required: bool) -> str:
    value = row.get(name)
    if value is None:
        if required:
            raise _BadRow("missing_field", f"missing field {name!r}")
        return ""
    if not isinstance(value, str):
        raise _BadRow("bad_field_type", f"field {name!r} is {type(value).__name__}, not a string")
    return value


def _alpaca(row: dict[str, Any], n: int, out: _Pieces, ids: SpecialIds) -> None:
    instruction = _string_field(row, "instruction", required=True)
    context = _string_field(row, "input", required=False)
    response = _string_field(row, "output", required=True)
    if not response.strip():
        raise _BadRow("empty_response", "field 'output' is empty")
    prompt = f"{instruction}\n\n{context}" if context.strip() else instruction
    out.special(n, ids.bos, supervised=False)
    out.special(n, ids.user, supervised=False)
    out.text(n, prompt, supervised=False)
    out.special(n, ids.assistant, supervised=False)
    out.text(n, response, supervised=True)
    out.special(n, ids.eos, supervised=True)


def _check_turns(row: dict[str, Any]) -> list[tuple[str, str]]:
    messages = row.get("messages")
    if messages is None:
        raise _BadRow("missing_field", "missing field 'messages'")
    if not isinstance(messages, list):
        raise _BadRow("bad_messages", "field 'messages' is not a list")
    turns: list[tuple[str, str]] = []
    for i, turn in enumerate(messages):
        if not isinstance(turn, dict) or turn.get("role") not in _ROLES:
            raise _BadRow("bad_messages", f"turn {i} has no role in {_ROLES}")
        content = turn.get("content")
        if not isinstance(content, str):
            raise _BadRow("bad_messages", f"turn {i} content is not a string")
        turns.append((turn["role"], content))
    # Turns after the last assistant reply carry no target; keep the sample without them.
    last = max((i for i, (role, _) in enumerate(turns) if role == "assistant"), default=-1)
    if last < 0 or not turns[last][1].strip():
        raise _BadRow("empty_response", "no non-empty assistant turn ends the conversation")
    return turns[: last + 1]


def _messages(row: dict[str, Any], n: int, out: _Pieces, ids: SpecialIds) -> None:
    turns = _check_turns(row)
    out.special(n, ids.bos, supervised=False)
    for role, content in turns:
        if role == "system":
            out.text(n, content, supervised=False)
        elif role == "user":
            out.special(n, ids.user, supervised=False)
            out.text(n, content, supervised=False)
        else:
            out.special(n, ids.assistant, supervised=False)
            out.text(n, content, supervised=True)
            out.special(n, ids.eos, supervised=True)


def _collect(
    rows: Sequence[RawRow], fmt: str, ids: SpecialIds, *, strict: bool
) -> tuple[_Pieces, list[int], Counter[str]]:
    fill = _alpaca if fmt == "alpaca" else _messages
    pieces = _Pieces()
    kept: list[int] = []
    bad: Counter[str] = Counter()
    for index, row in enumerate(rows):
        mark = pieces.mark()
        try:
            if row.value is NOT_JSON:
                raise _BadRow("not_json", f"not valid JSON ({row.error})")
            if not isinstance(row.value, dict):
                raise _BadRow("not_an_object", f"a {type(row.value).__name__}, not a JSON object")
            fill(row.value, len(kept), pieces, ids)
        except _BadRow as exc:
            pieces.rollback(mark)  # a bad row found mid-render leaves no pieces behind
            if strict:
                raise DataError(
                    f"{row.where}: {exc.detail} ({fmt} format); fix the row or drop --strict "
                    "to skip and count bad rows"
                ) from None
            bad[exc.reason] += 1
            continue
        kept.append(index)
    return pieces, kept, bad


def _assemble(
    pieces: _Pieces, flat: np.ndarray, text_lengths: np.ndarray, n: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Token stream, supervision and per-sample lengths from pieces (numpy gathers only)."""
    text_of = np.asarray(pieces.text_of_piece, dtype=np.int64)
    is_text = text_of >= 0
    text_starts = np.zeros(len(text_lengths), dtype=np.int64)
    np.cumsum(text_lengths[:-1], out=text_starts[1:])
    piece_len = np.ones(len(text_of), dtype=np.int64)
    piece_len[is_text] = text_lengths[text_of[is_text]]
    # Specials live after the encoded texts in one source array, one slot per special piece.
    specials = np.asarray(pieces.special_of_piece, dtype=np.int64)[~is_text].astype(np.uint32)
    source = np.concatenate([flat, specials])
    piece_src = np.empty(len(text_of), dtype=np.int64)
    piece_src[is_text] = text_starts[text_of[is_text]]
    piece_src[~is_text] = len(flat) + np.arange(len(specials))
    total = int(piece_len.sum())
    piece_out = np.cumsum(piece_len) - piece_len
    gather = np.repeat(piece_src - piece_out, piece_len) + np.arange(total)
    tokens = source[gather]
    supervised = np.repeat(np.asarray(pieces.supervised, dtype=bool), piece_len)
    sample_of = np.asarray(pieces.sample_of_piece, dtype=np.int64)
    lengths = np.bincount(sample_of, weights=piece_len, minlength=n).astype(np.int64)
    return tokens, supervised, lengths


def render(
    rows: Sequence[RawRow],
    tokenizer: TextTokenizer,
    *,
    fmt: str,
    where: str,
    strict: bool = False,
    progress: Callable[[str, int], Callable[[int], None]] | None = None,
) -> Rendered:
    """Validate, render and tokenize rows; bad rows are counted by reason (or raise if strict).

    `progress(desc, total)` returns the callback that advances a progress bar by n texts.
    """
    if fmt not in FORMATS:
        raise DataError(f"unknown format {fmt!r}: expected one of {', '.join(FORMATS)}")
    resolved = detect_format(rows, where) if fmt == "auto" else fmt
    pieces, kept, bad = _collect(rows, resolved, tokenizer.special, strict=strict)
    if bad:
        log.warning("skipped %d bad rows of %s: %s", sum(bad.values()), where, dict(bad))
    if not kept:
        raise DataError(
            f"no usable row in {where} ({len(rows)} rows, bad: {dict(bad)}) as {resolved} format"
        )
    on_progress = progress("tokenize", len(pieces.texts)) if progress is not None else None
    flat, text_lengths = tokenizer.encode_texts(pieces.texts, on_progress=on_progress)
    tokens, supervised, lengths = _assemble(pieces, flat, text_lengths, len(kept))
    return Rendered(
        tokens=tokens,
        supervised=supervised,
        lengths=lengths,
        rows=np.asarray(kept, dtype=np.int64),
        format=resolved,
        bad_rows=dict(sorted(bad.items())),
        num_rows=len(rows),
    )
