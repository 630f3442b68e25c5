"""The V4.1 golden conversations (tests/fixtures/dsv41_format/) and how each file is made.

The same conversation shapes as the V4 set, plus V4.1's own: mid-conversation system messages
and numeric reasoning efforts. A file holds what packing must produce from its row: each
sample's rendered text (deepseek-recipe's `DeepseekV41Encoding`, or, for the roles it renders
otherwise or not at all, our port of the official `encoding/encoding.py`), its ids under V4.1's
tokenizer.json (tests/fixtures/dsv41_tokenizer/) and its supervised token spans.

Regenerate (from the repository root): `python tests/helpers/dsv41_golden.py`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from primus_v4.data import chat_format, dsv4_format, shapes
from primus_v4.data.templates import row_samples
from primus_v4.data.tokenizer import load_tokenizer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
GOLDEN = FIXTURES / "dsv41_format"
TOKENIZER = FIXTURES / "dsv41_tokenizer"
V41 = chat_format.FORMATS["v4.1"]

_WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
_TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Local time of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def _call(call_id: str, name: str, args: dict[str, Any]) -> dict[str, Any]:
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": json.dumps(args)}}  # fmt: skip


ROWS: dict[str, dict[str, Any]] = {
    "single_turn": {"messages": [
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4."},
    ]},
    "system_single_turn": {"messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Capital of Japan?"},
        {"role": "assistant", "content": "Tokyo."},
    ]},
    "multi_turn": {"messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris."},
    ]},
    "reasoning_multi": {"messages": [
        {"role": "user", "content": "Is 91 prime?"},
        {"role": "assistant", "reasoning_content": "91 = 7 x 13.", "content": "No."},
        {"role": "user", "content": "And 97?"},
        {"role": "assistant", "reasoning_content": "No divisor up to 9.", "content": "Yes."},
    ]},
    "tool_call_and_result": {"tools": [_WEATHER], "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Weather in Paris for 2 days?"},
        {"role": "assistant", "reasoning_content": "Call get_weather.", "content": "",
         "tool_calls": [_call("c1", "get_weather", {"city": "Paris", "days": 2})]},
        {"role": "tool", "tool_call_id": "c1", "content": "{\"temp_c\": 18, \"sky\": \"cloudy\"}"},
        {"role": "assistant", "reasoning_content": "Summarize.", "content": "18 C, cloudy."},
    ]},
    "parallel_tool_calls": {"tools": [_WEATHER, _TIME], "messages": [
        {"role": "user", "content": "Weather and time in Oslo?"},
        {"role": "assistant", "reasoning_content": "Both at once.", "content": "",
         "tool_calls": [_call("a", "get_weather", {"city": "Oslo"}),
                        _call("b", "get_time", {"city": "Oslo"})]},
        {"role": "tool", "tool_call_id": "b", "content": "12:00"},
        {"role": "tool", "tool_call_id": "a", "content": "-3 C"},
        {"role": "assistant", "reasoning_content": "", "content": "Oslo: -3 C at 12:00."},
    ]},
    "mid_system": {"messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "reasoning_content": "Greet.", "content": "Hello!"},
        {"role": "system", "content": "From now on answer in French."},
        {"role": "assistant", "reasoning_content": "Switch language.", "content": "Bonjour !"},
        {"role": "user", "content": "Capital of Italy?"},
        {"role": "assistant", "reasoning_content": "Rome.", "content": "Rome."},
    ]},
    "effort_low": {"reasoning_effort": "low", "messages": [
        {"role": "user", "content": "2 + 3?"},
        {"role": "assistant", "reasoning_content": "Add.", "content": "5."},
    ]},
    "effort_max": {"reasoning_effort": "max", "messages": [
        {"role": "system", "content": "Check every step."},
        {"role": "user", "content": "17 x 23?"},
        {"role": "assistant", "reasoning_content": "17 x 20 + 17 x 3.", "content": "391."},
    ]},
    "effort_numeric": {"reasoning_effort": 33, "messages": [
        {"role": "user", "content": "Name a prime above 10."},
        {"role": "assistant", "reasoning_content": "11 is prime.", "content": "11."},
    ]},
    "weight_zero_turn": {"messages": [
        {"role": "user", "content": "Say hi."},
        {"role": "assistant", "content": "Hi!", "weight": 0},
        {"role": "user", "content": "Say bye."},
        {"role": "assistant", "content": "Bye!"},
    ]},
    "latest_reminder": {"messages": [
        {"role": "system", "content": "You are a calendar assistant."},
        {"role": "user", "content": "What day is it?"},
        {"role": "latest_reminder", "content": "Today is Monday."},
        {"role": "assistant", "reasoning_content": "The reminder says.", "content": "Monday."},
    ]},
    "developer": {"messages": [
        {"role": "system", "content": "You are helpful."},
        {"role": "developer", "content": "Answer with one word."},
        {"role": "assistant", "reasoning_content": "Comply.", "content": "Understood."},
        {"role": "user", "content": "Sky color?"},
        {"role": "assistant", "reasoning_content": "Blue.", "content": "Blue."},
    ]},
}  # fmt: skip
MODES = ("chat", "thinking")


def library_renders(row: dict[str, Any]) -> bool:
    """Whether deepseek-recipe renders the row (else our port of the official encoder does)."""
    return chat_format.needs_own_encoder(shapes.row_messages(row, "messages"), V41) is None


def port_samples(row: dict[str, Any], mode: str) -> list[chat_format.Sample]:
    """The row's samples by our port of the official V4.1 encoder (dsv4_format)."""
    messages = dsv4_format.merge_tool_messages(shapes.row_messages(row, "messages"))
    dsv4_format.sort_tool_results(messages)
    effort = chat_format.port_effort(V41, row.get("reasoning_effort"))
    return dsv4_format.conversation_samples(messages, mode, **effort)


def golden(name: str, mode: str) -> dict[str, Any]:
    tokenizer = load_tokenizer(TOKENIZER)
    row = ROWS[name]
    samples = []
    for text, spans in row_samples(row, "messages", mode, V41)[1]:
        ids, starts = tokenizer.encode_with_offsets(text)
        sup = np.zeros(len(ids), dtype=bool)
        for a, b in spans:
            sup |= (starts >= a) & (starts < b)
        edges = np.flatnonzero(np.diff(np.concatenate([[0], sup.astype(np.int8), [0]])))
        samples.append({
            "text": text,
            "input_ids": ids.tolist(),
            "supervised_spans": edges.reshape(-1, 2).tolist(),
        })  # fmt: skip
    return {"name": name, "mode": mode, "row": row, "samples": samples}


def main() -> int:
    for name in ROWS:
        for mode in MODES:
            path = GOLDEN / f"{name}.{mode}.json"
            text = json.dumps(golden(name, mode), ensure_ascii=False, indent=1) + "\n"
            path.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
