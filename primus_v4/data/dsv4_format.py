"""Our port of the DeepSeek-V4 encoder, for what `deepseek-recipe` cannot render as it does.

Conversations are rendered by DeepSeek's library (chat_format.py); rows with a developer role,
a user task, a response_format, wo_eos, a latest_reminder, several system messages or tool
schemas of other keys come here (chat_format.needs_own_encoder says why for each).
A re-implementation of the release's `encoding/encoding_dsv4.py` rendering (the rules in brief:
README_thd_packed.md, "The DeepSeek-V4 conversation format"; golden samples of the release
encoder: tests/fixtures/dsv4_format/), kept message-for-message equal to it, plus the
served-context rule that decides what is supervised: assistant turn i is served with the prompt
`render(messages[:i])`; its completion is `render(messages[:i+1])` minus that prompt. The whole
conversation is one sample supervising every turn whose prompt + completion is a prefix of it;
any other supervised turn (thinking mode with drop-thinking: reasoning of earlier turns is not
rendered) is a sample of its own, `render(messages[:i+1])`, supervising only turn i.

Messages here are already normalized (`primus_v4.data.shapes`): plain dicts with `role` and the
fields below, content always a string (or None), tool calls as {id, name, arguments}.
"""

from __future__ import annotations

import json
from typing import Any

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK = "<think>"
END_THINK = "</think>"
DSML = "｜DSML｜"
LATEST_REMINDER = "<｜latest_reminder｜>"
SYSTEM = "<｜System｜>"  # V4.1
V41_EFFORT = (
    "Reasoning Effort: {} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"
)
TASK_TOKENS = {
    "action": "<｜action｜>",
    "query": "<｜query｜>",
    "authority": "<｜authority｜>",
    "domain": "<｜domain｜>",
    "title": "<｜title｜>",
    "read_url": "<｜read_url｜>",
}
# Every special token the renderer itself writes; each must be one token of the tokenizer.
SPECIAL_TEXTS = (BOS, EOS, USER, ASSISTANT, THINK, END_THINK, DSML, LATEST_REMINDER)
SPECIAL_TEXTS += tuple(TASK_TOKENS.values())
CHAT_MODES = ("chat", "thinking", "auto")
ROLES = ("system", "user", "assistant", "tool", "developer", "latest_reminder")

# The tools preamble the served model sees, byte for byte (golden files tool_call_and_result.*).
_TOOLS_PREAMBLE = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools "
    f'by writing a "<{DSML}tool_calls>" block like the following:\n\n'
    f"<{DSML}tool_calls>\n"
    f'<{DSML}invoke name="$TOOL_NAME">\n'
    f'<{DSML}parameter name="$PARAMETER_NAME" string="true|false">'
    f"$PARAMETER_VALUE</{DSML}parameter>\n"
    "...\n"
    f"</{DSML}invoke>\n"
    f'<{DSML}invoke name="$TOOL_NAME2">\n'
    "...\n"
    f"</{DSML}invoke>\n"
    f"</{DSML}tool_calls>\n\n"
    'String parameters should be specified as is and set `string="true"`. For all other types '
    '(numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.'
    "\n\n"
    f"If thinking_mode is enabled (triggered by {THINK}), you MUST output your complete reasoning "
    f"inside {THINK}...{END_THINK} BEFORE any tool calls or final response.\n\n"
    f"Otherwise, output directly after {END_THINK} with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
)
_TOOLS_CLOSING = (
    "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke "
    "tool calls.\n"
)
_RESPONSE_FORMAT = (
    "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
)


def to_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def tools_block(tools: list[dict[str, Any]], v41: bool = False) -> str:
    """`tools` are function objects ({name, description, parameters}), one JSON line each."""
    return _spelled(_TOOLS_PREAMBLE, v41) + "\n".join(to_json(t) for t in tools) + _TOOLS_CLOSING


def _spelled(dsml: str, v41: bool) -> str:
    """DSML markup as V4.1 spells it: `<｜DSML｜ calls>`, `<｜DSML｜ invoke`, ` parameter`."""
    if not v41:
        return dsml
    for old, new in (("tool_calls", " calls"), ("invoke", " invoke"), ("parameter", " parameter")):
        dsml = dsml.replace(DSML + old, DSML + new)
    return dsml


def _dsml_call(call: dict[str, Any]) -> str:
    params = []
    for key, value in call["arguments"].items():
        is_str = isinstance(value, str)
        text = value if is_str else to_json(value)
        params.append(
            f'<{DSML}parameter name="{key}" string="{"true" if is_str else "false"}">'
            f"{text}</{DSML}parameter>"
        )
    body = "\n".join(params)
    return f'<{DSML}invoke name="{call["name"]}">\n{body}\n</{DSML}invoke>'


def dsml_block(calls: list[dict[str, Any]]) -> str:
    invokes = "\n".join(_dsml_call(c) for c in calls)
    return f"\n\n<{DSML}tool_calls>\n{invokes}\n</{DSML}tool_calls>"


def merge_tool_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool results and consecutive user messages become one user turn of blocks (encoder rule:
    a user message after a user turn that carries a task starts a new turn)."""
    merged: list[dict[str, Any]] = []
    for msg in messages:
        role = msg["role"]
        prev = merged[-1] if merged and merged[-1]["role"] == "user" else None
        if role == "tool":
            block = ("tool", msg["content"], msg.get("tool_call_id") or "")
            if prev is not None:
                prev["blocks"].append(block)
            else:
                merged.append({"role": "user", "blocks": [block], "task": None})
        elif role == "user":
            block = ("text", msg["content"], "")
            if prev is not None and prev.get("task") is None:
                prev["blocks"].append(block)
            else:
                merged.append({**msg, "blocks": [block]})
        else:
            merged.append(msg)
    return merged


def sort_tool_results(messages: list[dict[str, Any]]) -> None:
    """Order each turn's tool results like the previous assistant's tool_call ids (in place)."""
    order: dict[str, int] = {}
    for msg in messages:
        if msg["role"] == "assistant" and msg.get("tool_calls"):
            order = {c["id"]: k for k, c in enumerate(msg["tool_calls"]) if c.get("id")}
        elif msg["role"] == "user":
            tools = [b for b in msg["blocks"] if b[0] == "tool"]
            if len(tools) > 1 and order:
                ranked = iter(sorted(tools, key=lambda b: order.get(b[2], 0)))
                msg["blocks"] = [next(ranked) if b[0] == "tool" else b for b in msg["blocks"]]


def _asks(messages: list[dict[str, Any]], idx: int, v41: bool) -> bool:
    """A turn the assistant answers: user or developer, and in V4.1 a system message after the
    first message (a mid-conversation system message)."""
    role = messages[idx]["role"]
    return role in ("user", "developer") or (v41 and role == "system" and idx > 0)


def _last_user(messages: list[dict[str, Any]], v41: bool = False) -> int:
    for idx in range(len(messages) - 1, -1, -1):
        if _asks(messages, idx, v41):
            return idx
    return -1


def _system_like(msg: dict[str, Any], v41: bool = False) -> str:
    text = msg.get("content") or ""
    if msg.get("tools"):
        text += "\n\n" + tools_block(msg["tools"], v41)
    if msg.get("response_format") is not None:
        text += "\n\n" + _RESPONSE_FORMAT + to_json(msg["response_format"])
    return text


def _user_text(msg: dict[str, Any]) -> str:
    parts = [
        text if kind == "text" else f"<tool_result>{text}</tool_result>"
        for kind, text, _ in msg["blocks"]
    ]
    return "\n\n".join(parts)


def _assistant(
    idx: int, messages: list[dict[str, Any]], thinking: bool, keep: bool, v41: bool
) -> str:
    msg = messages[idx]
    calls = _spelled(dsml_block(msg["tool_calls"]), v41) if msg.get("tool_calls") else ""
    after_task = idx > 0 and messages[idx - 1].get("task") is not None
    reasoning = ""
    if thinking and not after_task and keep:
        reasoning = (msg.get("reasoning_content") or "") + END_THINK
    return reasoning + (msg.get("content") or "") + calls + ("" if msg.get("wo_eos") else EOS)


def _transition(msg: dict[str, Any], thinking: bool, open_think: bool, asks: bool) -> str:
    task = msg.get("task")
    if task is not None:
        if task != "action":
            return TASK_TOKENS[task]
        return ASSISTANT + (THINK if thinking else END_THINK) + TASK_TOKENS[task]
    if asks:
        return ASSISTANT + (THINK if thinking and open_think else END_THINK)
    return ""


def render_segments(
    messages: list[dict[str, Any]], mode: str, v41_effort: int | None = None, v4_effort: str = ""
) -> list[tuple[int, str]]:
    """(index into `messages`, rendered text) per rendered message; BOS not included.

    `messages` are merged (merge_tool_messages + sort_tool_results); drop-thinking removes some.
    `v41_effort`: render V4.1's format (the official `encoding/encoding.py`) at this reasoning
    effort (written in thinking mode only); None: V4's, with the effort text `v4_effort` before
    the first message in thinking mode.
    """
    thinking, v41 = mode == "thinking", v41_effort is not None
    drop = not any(m.get("tools") for m in messages)
    indexed = list(enumerate(messages))
    if thinking and drop:
        last = _last_user(messages, v41)
        indexed = [
            (i, m if m["role"] != "assistant" or i >= last else {**m, "reasoning_content": None})
            for i, m in indexed
            if i >= last or m["role"] != "developer"
        ]
    msgs = [m for _, m in indexed]
    last = _last_user(msgs, v41)
    out = []
    for idx, (orig, msg) in enumerate(indexed):
        role = msg["role"]
        if v41:
            text = _v41_lead(idx, role, thinking, v41_effort)
        else:
            text = v4_effort if idx == 0 and thinking else ""
        if role == "system":
            text += (SYSTEM if v41 and idx > 0 else "") + _system_like(msg, v41)
        elif role == "developer":
            text += USER + _system_like(msg, v41)
        elif role == "user":
            text += USER + _user_text(msg)
        elif role == "latest_reminder":
            text += LATEST_REMINDER + msg["content"]
        else:
            text += _assistant(idx, msgs, thinking, keep=not drop or idx > last, v41=v41)
        nxt = msgs[idx + 1]["role"] if idx + 1 < len(msgs) else None
        if nxt is None or nxt in ("assistant", "latest_reminder"):
            open_think = not drop or idx >= last
            text += _transition(msg, thinking, open_think, _asks(msgs, idx, v41))
        out.append((orig, text))
    return out


def _v41_lead(idx: int, role: str, thinking: bool, effort: int) -> str:
    """V4.1's prompt opening, before the first message: `<｜System｜>` when it is a system
    message or an effort line follows (thinking mode), then the effort line."""
    if idx > 0 or not (thinking or role == "system"):
        return ""
    return SYSTEM + (V41_EFFORT.format(effort) if thinking else "")


def supervised_turns(messages: list[dict[str, Any]]) -> list[int]:
    """Indices (into merged messages) of the assistant turns that are trained on."""
    return [
        i for i, m in enumerate(messages) if m["role"] == "assistant" and m.get("weight", 1) != 0
    ]


def conversation_samples(
    messages: list[dict[str, Any]], mode: str, v41_effort: int | None = None, v4_effort: str = ""
) -> list[tuple[str, list[tuple[int, int]]]]:
    """Samples of one merged conversation: (rendered text, supervised [start, end) char spans).

    Samples without any supervised span are not returned.
    """
    segments = render_segments(messages, mode, v41_effort, v4_effort)
    whole = BOS + "".join(text for _, text in segments)
    spans: list[tuple[int, int]] = []
    own: list[tuple[str, list[tuple[int, int]]]] = []
    turns = supervised_turns(messages)
    if mode == "chat":
        # Chat mode renders each message from itself and its neighbours only, so every prefix
        # render is a prefix of the whole: each turn's completion is its own segment.
        where, offset = {}, len(BOS)
        for orig, text in segments:
            where[orig] = (offset, offset + len(text))
            offset += len(text)
        spans = [where[i] for i in turns]
    else:
        for i in turns:
            prefix = render_segments(messages[: i + 1], mode, v41_effort, v4_effort)
            text = BOS + "".join(t for _, t in prefix)
            span = (len(text) - len(prefix[-1][1]), len(text))
            if whole.startswith(text):
                spans.append(span)
            else:
                own.append((text, [span]))
    samples = [(whole, spans)] if spans else []
    return samples + own
