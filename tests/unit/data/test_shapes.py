"""Row shapes: one conversation written as messages, sharegpt, prompt_completion and alpaca gives
identical samples; unrenderable rows are counted by reason with file:line, an error under
--strict on a fresh build and on a cache hit alike; metadata is ignored, content never dropped."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from primus_v4.cli import main
from primus_v4.data.corpus import read_rows, resolve_source
from primus_v4.data.pipeline import PackSpec, build_or_load
from primus_v4.data.templates import Rendered, render
from primus_v4.data.tokenizer import TextTokenizer
from primus_v4.errors import DataError, ExitCode


def _write(path: Path, rows: list[Any]) -> Path:
    lines = [r if isinstance(r, str) else json.dumps(r, ensure_ascii=False) for r in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _render(path: Path, tokenizer: TextTokenizer, **kw: Any) -> Rendered:
    kw.setdefault("fmt", "auto")
    return render(read_rows(resolve_source(str(path))), tokenizer, where=str(path), **kw)


def _same(a: Rendered, b: Rendered) -> None:
    assert a.lengths.tolist() == b.lengths.tolist()
    assert np.array_equal(a.tokens, b.tokens) and np.array_equal(a.supervised, b.supervised)


TOOL = {"name": "lookup", "description": "Find a word", "parameters": {"type": "object"}}
SHAPES_OF_ONE_CONVERSATION = {
    "messages": {
        "id": "c1",
        "tools": [{"type": "function", "function": TOOL}],
        "messages": [
            {"role": "system", "content": "Sois bref."},
            {"role": "user", "content": "Définis « chat »."},
            {
                "role": "assistant",
                "content": "Je cherche.",
                "tool_calls": [
                    {
                        "type": "function",
                        "function": {"name": "lookup", "arguments": '{"w": "chat"}'},
                    }
                ],
            },
            {"role": "tool", "content": "félin domestique"},
            {"role": "assistant", "content": "Un félin."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "Et"}, {"type": "text", "text": "chien ?"}],
            },
            {"role": "assistant", "content": "Un canidé."},
        ],
    },
    "sharegpt": {
        "system": "Sois bref.",
        "tools": json.dumps([TOOL]),
        "conversations": [
            {"from": "human", "value": "Définis « chat »."},
            {"from": "gpt", "value": "Je cherche."},
            {
                "from": "function_call",
                "value": json.dumps({"name": "lookup", "arguments": {"w": "chat"}}),
            },
            {"from": "observation", "value": "félin domestique"},
            {"from": "gpt", "value": "Un félin."},
            {"from": "human", "value": "Et\n\nchien ?"},
            {"from": "gpt", "value": "Un canidé."},
        ],
    },
    "prompt_completion": {
        "tools": [TOOL],
        "prompt": [
            {"role": "system", "content": "Sois bref."},
            {"role": "user", "content": "Définis « chat »."},
            {
                "role": "assistant",
                "content": "Je cherche.",
                "tool_calls": [{"name": "lookup", "arguments": {"w": "chat"}}],
            },
            {"role": "tool", "content": "félin domestique"},
            {"role": "assistant", "content": "Un félin."},
            {"role": "user", "content": "Et"},
            {"role": "user", "content": "chien ?"},
        ],
        "completion": "Un canidé.",
    },
}


@pytest.mark.parametrize("mode", ["chat", "thinking"])
def test_one_conversation_in_every_shape(
    tmp_path: Path, tokenizer: TextTokenizer, mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    rendered = {}
    with caplog.at_level(logging.INFO, logger="primus_v4"):
        for shape, row in SHAPES_OF_ONE_CONVERSATION.items():
            rendered[shape] = _render(
                _write(tmp_path / f"{shape}.jsonl", [row]), tokenizer, chat_mode=mode
            )
            assert rendered[shape].format == shape and rendered[shape].bad_rows == {}
            assert f"format {shape} (detected" in caplog.text
    targets = tokenizer.decode(rendered["messages"].tokens[rendered["messages"].supervised])
    assert "Je cherche." in targets and "Un félin." in targets and "Un canidé." in targets
    _same(rendered["messages"], rendered["sharegpt"])
    _same(rendered["messages"], rendered["prompt_completion"])


def test_alpaca_single_turn_and_history_match_messages(
    tmp_path: Path, tokenizer: TextTokenizer
) -> None:
    alpaca = {
        "system": "S.",
        "instruction": "Translate:",
        "input": "Hund",
        "output": "dog",
        "history": [["Hi", "Hello"]],
    }
    messages = {
        "messages": [
            {"role": "system", "content": "S."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "Translate:"},
            {"role": "user", "content": "Hund"},  # instruction + input = one turn of two parts
            {"role": "assistant", "content": "dog"},
        ]
    }
    sharegpt = {"conversations": [{"from": "human", "value": "Q?"}, {"from": "gpt", "value": "A."}]}
    single = [
        {"instruction": "Q?", "input": "", "output": "A."},
        {"prompt": "Q?", "completion": "A."},
    ]
    _same(
        _render(_write(tmp_path / "a.jsonl", [alpaca]), tokenizer),
        _render(_write(tmp_path / "m.jsonl", [messages]), tokenizer),
    )
    base = _render(_write(tmp_path / "s.jsonl", [sharegpt]), tokenizer)
    for k, row in enumerate(single):
        _same(base, _render(_write(tmp_path / f"{k}.jsonl", [row]), tokenizer))


def _msg(*turns: dict[str, Any], **top: Any) -> str:
    return json.dumps({"messages": list(turns), **top})


USER = {"role": "user", "content": "q"}
ANSWER = {"role": "assistant", "content": "a"}
BAD = {
    "unknown_key": _msg(USER, {**ANSWER, "thinking": "hidden reasoning"}),
    "misplaced_field": _msg({**USER, "reasoning_content": "r"}, ANSWER),
    "unsupported_content": _msg(
        {"role": "user", "content": [{"type": "input_audio", "input_audio": "x"}]}, ANSWER
    ),
    "image": _msg({"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}, ANSWER),
    "bad_role": _msg({"role": "bot", "content": "q"}, ANSWER),
    "unread_field": _msg(USER, ANSWER, chosen="a better answer"),
    "bad_tool_call": _msg(
        USER,
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"arguments": "{}"}}]},
    ),
    "bad_task": _msg({**USER, "task": "dance"}, ANSWER),
    "bad_tools": _msg({"role": "system", "content": "s", "tools": "not json"}, USER, ANSWER),
    "no_target": _msg(USER, {**ANSWER, "weight": 0}),
    "empty_response": _msg(USER, {"role": "assistant", "content": "  "}),
    "bad_messages": _msg({"role": "tool", "content": None}, ANSWER),
    "not_json": "{oops",
}
GOOD_WITH_METADATA = json.dumps(
    {
        "id": 7,
        "source": "forum",
        "messages": [{**USER, "id": "m1", "name": "ana"}, {**ANSWER, "metadata": {"score": 3}}],
    }
)


def test_bad_rows_counted_by_reason_with_file_and_line(
    tmp_path: Path, tokenizer: TextTokenizer
) -> None:
    path = _write(tmp_path / "bad.jsonl", [GOOD_WITH_METADATA, *BAD.values()])
    r = _render(path, tokenizer)
    assert r.bad_rows == dict.fromkeys(sorted(BAD), 1)
    assert r.rows.tolist() == [0]  # metadata (id, source, name, metadata) is ignored
    assert [e["where"] for e in r.bad_examples] == [f"{path} line {k}" for k in range(2, 7)]
    assert (
        r.bad_examples[0]["reason"] == "unknown_key" and "'thinking'" in r.bad_examples[0]["detail"]
    )
    for line in BAD.values():  # each shape alone is an error under --strict, naming its line
        with pytest.raises(DataError, match=r"one\.jsonl line 2: "):
            _render(
                _write(tmp_path / "one.jsonl", [GOOD_WITH_METADATA, line]), tokenizer, strict=True
            )


def test_strict_fails_on_a_fresh_build_and_on_a_cache_hit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(
        tmp_path / "mixed.jsonl", [GOOD_WITH_METADATA, BAD["unknown_key"], BAD["bad_role"]]
    )
    dirs = {"cache_dir": tmp_path / "c", "lock_dir": tmp_path / "l"}
    with pytest.raises(DataError, match=r"mixed\.jsonl line 2: .*'thinking'"):
        build_or_load(PackSpec(data=str(path), seq_length=64, strict=True, **dirs))
    built = build_or_load(PackSpec(data=str(path), seq_length=64, **dirs))
    assert built.stats["bad_rows"] == {"bad_role": 1, "unknown_key": 1}
    assert built.stats["bad_row_examples"][1]["where"] == f"{path} line 3"
    with pytest.raises(DataError, match=r"--strict: the cached packs .* 2 bad rows .*line 2"):
        build_or_load(PackSpec(data=str(path), seq_length=64, strict=True, **dirs))
    argv = [
        "pack",
        "--data",
        str(path),
        "--seq-length",
        "64",
        "--cache-dir",
        str(dirs["cache_dir"]),
    ]
    argv += ["--lock-dir", str(dirs["lock_dir"]), "--no-progress"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "hit" in out and f"{path} line 2" in out  # the first bad rows are in the summary
    assert main([*argv, "--strict"]) == ExitCode.DATA
    assert "--strict: the cached packs" in capsys.readouterr().err


def test_parquet_rows_with_every_column_on_every_message(
    tmp_path: Path, tokenizer: TextTokenizer
) -> None:
    """Parquet (and hub) rows give each message every key of the column, None where unused."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    row = SHAPES_OF_ONE_CONVERSATION["messages"]
    path = tmp_path / "chat.parquet"
    messages = [{**m} for m in row["messages"]]
    for m in messages:  # a plain-text content column: parts become their joined text
        if isinstance(m.get("content"), list):
            m["content"] = "Et\n\nchien ?"
        if m.get("tool_calls"):
            m["tool_calls"] = [{"function": c["function"]} for c in m["tool_calls"]]
    pq.write_table(pa.Table.from_pylist([{**row, "messages": messages, "chosen": None}]), path)
    got = _render(path, tokenizer, strict=True)
    assert read_rows(resolve_source(str(path)))[0].value["messages"][0]["tool_calls"] is None
    _same(got, _render(_write(tmp_path / "m.jsonl", [row]), tokenizer))
