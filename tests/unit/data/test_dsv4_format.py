"""Conversations beyond the golden files: non-English text, several tool calls answered out of
order, developer and latest_reminder turns, tasks, drop-thinking of a developer turn. Expected
strings were rendered by the release encoder (encoding_dsv4.py) with the served-context rule."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest

from primus_v4.data import chat_format, dsv4_format, shapes
from primus_v4.data.corpus import RawRow
from primus_v4.data.dsv4_format import BOS, EOS
from primus_v4.data.templates import render, row_samples
from primus_v4.data.tokenizer import TextTokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "天气",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
U, A, T, ET = "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"


def _samples(messages: list[dict[str, Any]], mode: str) -> list[tuple[str, list[str]]]:
    """(rendered text, supervised completions) per sample."""
    _, samples = row_samples({"messages": messages}, "messages", mode)
    return [(text, [text[a:b] for a, b in spans]) for text, spans in samples]


def test_non_english_thinking_gives_one_sample_per_dropped_turn() -> None:
    messages = [
        {"role": "user", "content": "北京的天气怎么样？"},
        {"role": "assistant", "reasoning_content": "需要查询。", "content": "晴天。"},
        {"role": "user", "content": "明天呢？"},
        {"role": "assistant", "reasoning_content": "继续推断。", "content": "多云。"},
    ]
    assert _samples(messages, "thinking") == [
        (
            f"{BOS}{U}北京的天气怎么样？{A}{ET}晴天。{EOS}{U}明天呢？{A}{T}继续推断。{ET}多云。{EOS}",
            [f"继续推断。{ET}多云。{EOS}"],
        ),
        (
            f"{BOS}{U}北京的天气怎么样？{A}{T}需要查询。{ET}晴天。{EOS}",
            [f"需要查询。{ET}晴天。{EOS}"],
        ),
    ]


def _parallel_calls() -> list[dict[str, Any]]:
    calls = [
        {
            "id": "a",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
        },
        {"id": "b", "type": "function", "function": {"name": "get_time", "arguments": {}}},
    ]
    return [
        {"role": "system", "content": "Be exact.", "tools": [WEATHER, CLOCK]},
        {"role": "user", "content": "Weather in Oslo and the time?"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "b", "content": "12:00"},
        {"role": "tool", "tool_call_id": "a", "content": "-3 C"},
        {"role": "assistant", "content": "Oslo: -3 C at 12:00."},
    ]


@pytest.mark.parametrize("mode", ["chat", "thinking"])
def test_several_tool_calls_results_follow_the_call_order(mode: str) -> None:
    [(text, completions)] = _samples(_parallel_calls(), mode)  # tools: one sample, both turns
    dsml = (
        '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">Oslo</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
        '<｜DSML｜invoke name="get_time">\n\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>'
    )
    lead = ET if mode == "thinking" else ""  # empty reasoning still closes with </think>
    assert completions == [f"{lead}{dsml}{EOS}", f"{lead}Oslo: -3 C at 12:00.{EOS}"]
    opener = A + (T if mode == "thinking" else ET)
    # Results come back b then a; the turn lists them in call order (a, b).
    assert f"{U}<tool_result>-3 C</tool_result>\n\n<tool_result>12:00</tool_result>{opener}" in text
    assert text.startswith(f"{BOS}Be exact.\n\n## Tools\n\n")
    assert '\n{"name": "get_weather", "description": "天气", "parameters"' in text


def test_developer_with_tools_and_latest_reminder() -> None:
    messages = [
        {"role": "system", "content": "S."},
        {"role": "latest_reminder", "content": "2026-01-01, Paris"},
        {"role": "developer", "content": "Find it.", "tools": [WEATHER]},
        {
            "role": "assistant",
            "reasoning_content": "Look up.",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}],
        },
        {"role": "tool", "content": "sun"},
        {"role": "assistant", "reasoning_content": "Done.", "content": "Sunny."},
    ]
    [(text, completions)] = _samples(messages, "thinking")
    assert text.startswith(f"{BOS}S.<｜latest_reminder｜>2026-01-01, Paris{U}Find it.\n\n## Tools")
    assert text.endswith(f"{U}<tool_result>sun</tool_result>{A}{T}Done.{ET}Sunny.{EOS}")
    assert completions[1] == f"Done.{ET}Sunny.{EOS}"
    assert completions[0].startswith(f"Look up.{ET}\n\n<｜DSML｜tool_calls>")


def test_tasks_action_and_query() -> None:
    action = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Weather today?", "task": "action"},
        {"role": "assistant", "content": "Search"},
    ]
    assert _samples(action, "chat") == [
        (
            f"{BOS}{U}Hi{A}{ET}Hello.{EOS}{U}Weather today?{A}{ET}<｜action｜>Search{EOS}",
            [f"Hello.{EOS}", f"Search{EOS}"],
        )
    ]
    # Thinking: the task answer has no thinking part; the earlier turn is its own sample.
    assert _samples(action, "thinking") == [
        (
            f"{BOS}{U}Hi{A}{ET}Hello.{EOS}{U}Weather today?{A}{T}<｜action｜>Search{EOS}",
            [f"Search{EOS}"],
        ),
        (f"{BOS}{U}Hi{A}{T}{ET}Hello.{EOS}", [f"{ET}Hello.{EOS}"]),
    ]
    query = [
        {"role": "user", "content": "Who wrote Hamlet?", "task": "query"},
        {"role": "assistant", "content": "Hamlet author"},
    ]
    for mode in ("chat", "thinking"):
        assert _samples(query, mode) == [
            (f"{BOS}{U}Who wrote Hamlet?<｜query｜>Hamlet author{EOS}", [f"Hamlet author{EOS}"])
        ]


def test_drop_thinking_removes_an_earlier_developer_turn() -> None:
    messages = [
        {"role": "developer", "content": "Old instructions."},
        {"role": "assistant", "reasoning_content": "r1", "content": "A1"},
        {"role": "user", "content": "Next"},
        {"role": "assistant", "reasoning_content": "r2", "content": "A2"},
    ]
    assert _samples(messages, "thinking") == [
        (f"{BOS}A1{EOS}{U}Next{A}{T}r2{ET}A2{EOS}", [f"r2{ET}A2{EOS}"]),
        (f"{BOS}{U}Old instructions.{A}{T}r1{ET}A1{EOS}", [f"r1{ET}A1{EOS}"]),
    ]


REMINDER_LAST = [
    {"role": "user", "content": "Date?"},
    {"role": "latest_reminder", "content": "Today is Monday"},
    {"role": "assistant", "content": "Monday."},
]


def test_completion_right_after_reminder_text() -> None:
    # The served prompt ends inside plain text (no special token at the cut).
    assert _samples(REMINDER_LAST, "chat") == [
        (
            f"{BOS}{U}Date?{A}{ET}<｜latest_reminder｜>Today is MondayMonday.{EOS}",
            [f"Monday.{EOS}"],
        )
    ]


def test_token_ids_are_those_of_the_whole_rendered_string(tokenizer: TextTokenizer) -> None:
    """Pieces cut at supervision boundaries concatenate to the whole string's tokenization, and
    targets are the tokens starting inside a completion (both paths: cut at a special token, and
    the reminder case encoded whole)."""
    conversations = [_parallel_calls(), REMINDER_LAST]
    conversations.append(
        [
            {"role": "user", "content": "Сколько будет 2+2? <think> литерал"},
            {"role": "assistant", "reasoning_content": "Просто.", "content": "Четыре 🙂"},
        ]
    )
    for mode in ("chat", "thinking"):
        rows = [
            RawRow(where=f"row {k}", value={"messages": c}) for k, c in enumerate(conversations)
        ]
        r = render(rows, tokenizer, fmt="messages", where="t", chat_mode=mode, strict=True)
        expected = [
            s for c in conversations for s in row_samples({"messages": c}, "messages", mode)[1]
        ]
        assert len(r.lengths) == len(expected)
        offset = 0
        for (text, spans), length in zip(expected, r.lengths, strict=True):
            ids, starts = tokenizer.encode_with_offsets(text)
            want = np.zeros(len(ids), dtype=bool)
            for a, b in spans:
                want |= (starts >= a) & (starts < b)
            assert r.tokens[offset : offset + length].tolist() == ids.tolist(), text
            assert r.supervised[offset : offset + length].tolist() == want.tolist(), text
            offset += length


def test_forced_chat_mode_counts_rows_whose_reasoning_it_does_not_render(
    tokenizer: TextTokenizer,
) -> None:
    rows = [
        RawRow(
            where="r1",
            value={
                "messages": [
                    {"role": "user", "content": "q"},
                    {"role": "assistant", "content": "a", "reasoning_content": "why"},
                ]
            },
        ),
        RawRow(where="r2", value={"prompt": "q", "completion": "a"}),
    ]
    forced = render(rows[:1], tokenizer, fmt="messages", where="t", chat_mode="chat")
    assert forced.modes == {"chat, reasoning not rendered": 1}
    assert "why" not in tokenizer.decode(forced.tokens)
    auto = render(rows[:1], tokenizer, fmt="messages", where="t", chat_mode="auto")
    assert auto.modes == {"thinking": 1} and "why</think>" in tokenizer.decode(
        auto.tokens[auto.supervised]
    )
    assert render(rows[1:], tokenizer, fmt="auto", where="t").modes == {"chat": 1}


_TOOLS = [
    {"type": "function", "function": {"name": "f", "description": "d", "parameters": {"a": 1}}},
    {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
]
_CALL = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"x": [1, "é"]}'}}
LIBRARY_CASES = [
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
    [
        {"role": "system", "content": "A."},
        {"role": "system", "content": "B."},
        {"role": "user", "content": "¿Qué?"},
        {"role": "assistant", "content": None, "weight": 0},
        {"role": "user", "content": ""},
        {"role": "assistant", "reasoning_content": "hidden in chat", "content": "Nada."},
    ],
    [
        {"role": "user", "content": "a"},
        {"role": "assistant", "reasoning_content": "r1", "content": "b"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "reasoning_content": "", "content": "d", "weight": 0},
        {"role": "user", "content": "e"},
        {"role": "assistant", "reasoning_content": "r3", "content": "f"},
        {"role": "user", "content": "left unanswered"},
    ],
    [
        {"role": "user", "content": "call"},
        {"role": "assistant", "reasoning_content": "r", "content": "", "tool_calls": [_CALL]},
        {"role": "tool", "tool_call_id": "c", "content": "42"},
        {"role": "user", "content": "and?"},
        {"role": "assistant", "content": "done", "tool_calls": [_CALL]},
        {"role": "tool", "tool_call_id": "c", "content": "43"},
        {"role": "assistant", "reasoning_content": "r2", "content": "43."},
    ],
]


def test_library_renders_as_our_port_of_the_official_encoder() -> None:
    """deepseek-recipe (chat_format) and our port of encoding_dsv4.py (dsv4_format, kept for
    what the library renders otherwise or not at all) give the same samples and spans; rows the
    library would render otherwise are routed to the port."""
    through_library = 0
    grid = itertools.product(LIBRARY_CASES, ["chat", "thinking"], [0, 1], ["v4", "v4-0731"])
    for case, mode, tools, name in grid:
        fmt = chat_format.FORMATS[name]
        for schema, effort in itertools.product(_TOOLS if tools else [None], [None, "max"]):
            row = {"messages": case, "reasoning_effort": effort}
            row |= {"tools": [schema]} if schema else {}
            messages = shapes.row_messages(row, "messages")
            merged = dsv4_format.merge_tool_messages(messages)
            dsv4_format.sort_tool_results(merged)
            port = chat_format.port_effort(fmt, effort)
            ours = sorted(dsv4_format.conversation_samples(merged, mode, **port))
            got = row_samples(row, "messages", mode, fmt)[1]
            assert sorted(got) == ours, (case, mode, schema, name, effort)
            if chat_format.needs_own_encoder(messages, fmt) is None:
                library = chat_format.conversation_samples(messages, mode, fmt, effort)
                assert sorted(library) == ours, (case, mode, schema, name, effort)
                through_library += 1
    assert through_library == 3 * 2 * 2 * 2 * 2  # all but the case with two system messages
