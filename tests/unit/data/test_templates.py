"""Template rendering: the supervised tokens are exactly the completions (+ EOS), checked by
decoding; bad rows are counted by reason or, with strict, reported with file and line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from primus_v4.data.corpus import read_rows, resolve_source
from primus_v4.data.templates import Rendered, render
from primus_v4.data.tokenizer import (
    ASSISTANT_TEXT,
    BOS_TEXT,
    EOS_TEXT,
    USER_TEXT,
    TextTokenizer,
)
from primus_v4.errors import DataError

# Chat mode: every answer opens after `<｜Assistant｜></think>` (the prompt's last token).
OPEN = ASSISTANT_TEXT + "</think>"


def _write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _sample(r: Rendered, j: int) -> tuple[np.ndarray, np.ndarray]:
    start = int(r.lengths[:j].sum())
    stop = start + int(r.lengths[j])
    return r.tokens[start:stop], r.supervised[start:stop]


def test_alpaca_render_and_supervision(tmp_path: Path, tokenizer: TextTokenizer) -> None:
    path = _write_jsonl(
        tmp_path / "a.jsonl",
        [
            '{"instruction": "Add the numbers.", "input": "2 and 3", "output": "The sum is 5."}',
            '{"instruction": "Say hi.", "input": "", "output": "Hi there!"}',
        ],
    )
    r = render(read_rows(resolve_source(str(path))), tokenizer, fmt="auto", where="t")
    assert r.format == "alpaca" and r.rows.tolist() == [0, 1] and r.bad_rows == {}
    tokens, targets = _sample(r, 0)
    assert tokenizer.decode(tokens) == (
        f"{BOS_TEXT}{USER_TEXT}Add the numbers.\n\n2 and 3{OPEN}The sum is 5.{EOS_TEXT}"
    )
    assert tokenizer.decode(tokens[targets]) == f"The sum is 5.{EOS_TEXT}"
    assert tokenizer.decode(tokens[~targets]).endswith(OPEN)
    tokens, targets = _sample(r, 1)  # empty input: no "\n\n" separator
    assert tokenizer.decode(tokens[~targets]) == f"{BOS_TEXT}{USER_TEXT}Say hi.{OPEN}"
    assert tokenizer.decode(tokens[targets]) == f"Hi there!{EOS_TEXT}"


def test_messages_supervise_only_assistant_turns(tmp_path: Path, tokenizer: TextTokenizer) -> None:
    path = _write_jsonl(
        tmp_path / "m.jsonl",
        [
            '{"messages": [{"role": "system", "content": "Be brief."},'
            ' {"role": "user", "content": "Capital of France?"},'
            ' {"role": "assistant", "content": "Paris."},'
            ' {"role": "user", "content": "And Italy?"},'
            ' {"role": "assistant", "content": "Rome."},'
            ' {"role": "user", "content": "unanswered"}]}'
        ],
    )
    r = render(read_rows(resolve_source(str(path))), tokenizer, fmt="auto", where="t")
    assert r.format == "messages"
    tokens, targets = _sample(r, 0)
    assert tokenizer.decode(tokens[targets]) == f"Paris.{EOS_TEXT}Rome.{EOS_TEXT}"
    # A sample is the whole conversation: the unanswered user turn is rendered, not supervised.
    assert tokenizer.decode(tokens) == (
        f"{BOS_TEXT}Be brief.{USER_TEXT}Capital of France?{OPEN}Paris.{EOS_TEXT}"
        f"{USER_TEXT}And Italy?{OPEN}Rome.{EOS_TEXT}{USER_TEXT}unanswered{OPEN}"
    )
    assert not targets[0]


BAD_LINES = [
    '{"instruction": "ok", "output": "fine"}',
    "{not json",
    '["a", "list"]',
    '{"instruction": "no output"}',
    '{"instruction": "blank", "output": "   "}',
    '{"instruction": 3, "output": "typed"}',
    "",
    '{"instruction": "ok too", "input": "x", "output": "good"}',
]


def test_bad_rows_are_counted_by_reason(tmp_path: Path, tokenizer: TextTokenizer) -> None:
    path = _write_jsonl(tmp_path / "bad.jsonl", BAD_LINES)
    r = render(read_rows(resolve_source(str(path))), tokenizer, fmt="alpaca", where="t")
    assert r.bad_rows == {
        "bad_field_type": 1,
        "empty_response": 1,
        "missing_field": 1,
        "not_an_object": 1,
        "not_json": 1,
    }
    assert r.rows.tolist() == [0, 6]  # 0-based rows of the two good lines (blank line skipped)
    tokens, targets = _sample(r, 1)
    assert tokenizer.decode(tokens[targets]) == f"good{EOS_TEXT}"


def test_strict_names_file_and_line(tmp_path: Path, tokenizer: TextTokenizer) -> None:
    path = _write_jsonl(tmp_path / "bad.jsonl", BAD_LINES)
    rows = read_rows(resolve_source(str(path)))
    with pytest.raises(DataError, match=r"bad\.jsonl line 2: not valid JSON"):
        render(rows, tokenizer, fmt="alpaca", where="t", strict=True)
    with pytest.raises(DataError, match=r"bad\.jsonl line 4: missing field 'output'"):
        render(rows[3:], tokenizer, fmt="alpaca", where="t", strict=True)


def test_all_rows_bad_or_undetectable_is_an_error(tmp_path: Path, tokenizer: TextTokenizer) -> None:
    path = _write_jsonl(tmp_path / "x.jsonl", ['{"question": "q", "answer": "a"}'])
    rows = read_rows(resolve_source(str(path)))
    with pytest.raises(DataError, match="cannot detect the format"):
        render(rows, tokenizer, fmt="auto", where="x")
    with pytest.raises(DataError, match="no usable row"):
        render(rows, tokenizer, fmt="messages", where="x")
