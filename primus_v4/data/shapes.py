"""Row shapes users bring -> normalized DeepSeek-V4 messages (or a bad-row reason).

Shapes: `messages` (OpenAI chat / fine-tuning JSONL), `sharegpt` (`conversations` of
`from`/`value`), `alpaca` (instruction/input/output + system, history), `prompt_completion`
(`prompt` + `completion`, each a string or a list of messages; the conversation is prompt then
completion, supervised like `messages`).

The no-silent-drop rule: every key on a message must be one the format renders for that role,
or plain metadata (`METADATA_KEYS`); anything else makes the row bad (`unknown_key`), since an
unknown key on a message usually carries content (`thinking`, `function_call`, images...). At the
top level of a row, keys that carry conversation content in some shape (`CONTENT_KEYS`) must be
read by the row's shape (`unread_field` otherwise); other top-level keys are metadata.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from primus_v4.data.dsv4_format import TASK_TOKENS

SHAPES = ("messages", "sharegpt", "alpaca", "prompt_completion")
METADATA_KEYS = frozenset(
    {"id", "name", "source", "timestamp", "created_at", "metadata", "mask", "type"}
)
# Keys a message may carry, per role (besides role and METADATA_KEYS).
_ROLE_KEYS = {
    "system": {"content", "tools", "response_format"},
    "developer": {"content", "tools", "response_format"},
    "user": {"content", "task"},
    "assistant": {"content", "reasoning_content", "tool_calls", "weight", "wo_eos"},
    "tool": {"content", "tool_call_id"},
    "latest_reminder": {"content"},
}
CONTENT_KEYS = frozenset(
    {
        "messages",
        "conversations",
        "instruction",
        "input",
        "output",
        "system",
        "history",
        "prompt",
        "completion",
        "tools",
        "response",
        "query",
        "question",
        "answer",
        "chosen",
        "rejected",
        "text",
        "reasoning_content",
    }
)
_READS = {
    "messages": {"messages", "tools"},
    "sharegpt": {"conversations", "system", "tools"},
    "alpaca": {"instruction", "input", "output", "system", "history"},
    "prompt_completion": {"prompt", "completion", "tools"},
}
_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
    "function_call": "function_call",
    "observation": "tool",
    "tool": "tool",
}


class BadRow(Exception):
    """A row that cannot be rendered: `reason` is the stats key, `detail` says what and where."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


def detect_shape(values: Sequence[Any]) -> str | None:
    """The shape of the first object rows that match one, or None."""
    for value in values[:100]:
        if not isinstance(value, dict):
            continue
        if "messages" in value:
            return "messages"
        if "conversations" in value:
            return "sharegpt"
        if "instruction" in value and "output" in value:
            return "alpaca"
        if "prompt" in value and "completion" in value:
            return "prompt_completion"
    return None


IMAGE_PARTS = frozenset({"image", "image_url", "input_image"})
IMAGE_FIELDS = ("images", "image")
MESSAGE_LISTS = ("messages", "conversations", "prompt", "completion", "history")


def _image_part(messages: Any) -> str | None:
    """Where the first image content part of a list of messages sits, or None."""
    if not isinstance(messages, list):
        return None
    for i, msg in enumerate(messages):
        parts = msg.get("content", msg.get("value")) if isinstance(msg, dict) else None
        for k, part in enumerate(parts if isinstance(parts, list) else []):
            if isinstance(part, dict) and part.get("type") in IMAGE_PARTS:
                return f"message {i} content part {k} ({part['type']})"
    return None


def check_no_images(row: dict[str, Any]) -> None:
    """Refuse a row that carries an image (a content part of type image / image_url /
    input_image, or an `images` / `image` field) for a model without a vision tower: dropping
    the image would train on a conversation that was not had. (A DeepSeek-V4.1 release with a
    `vision_config` reads them: `image_rows`.)"""
    found = [f"field {k!r}" for k in IMAGE_FIELDS if row.get(k) not in (None, [], "")]
    found += [f"{key} {w}" for key in MESSAGE_LISTS if (w := _image_part(row.get(key)))]
    if found:
        raise BadRow(
            "image",
            f"an image ({found[0]}): this model has no vision tower (images are read for a "
            "DeepSeek-V4.1 release with a vision_config); drop the row or its image",
        )


def _content(value: Any, where: str) -> str | None:
    """A string, None, or a list of {"type": "text", "text": ...} parts joined by a blank line
    (the encoder's own join for multi-part tool results)."""
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise BadRow("bad_field_type", f"{where} content is {type(value).__name__}, not a string")
    texts = []
    for k, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind != "text" or not isinstance(part.get("text"), str):
            raise BadRow(
                "unsupported_content",
                f"{where} content part {k} is {kind!r}; only text parts can be rendered",
            )
        texts.append(part["text"])
    return "\n\n".join(texts)


def _json_value(value: Any, where: str, reason: str) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            raise BadRow(reason, f"{where} is a string that is not valid JSON") from None
    return value


def tools_list(value: Any, where: str) -> list[dict[str, Any]]:
    """OpenAI tools ({"type": "function", "function": {...}}) or bare function objects."""
    value = _json_value(value, where, "bad_tools")
    if not isinstance(value, list):
        raise BadRow("bad_tools", f"{where} is not a list of tools")
    out = []
    for k, tool in enumerate(value):
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise BadRow("bad_tools", f"{where}[{k}] has no function name")
        out.append(fn)
    return out


def _arguments(raw: Any, where: str) -> dict[str, Any]:
    if isinstance(raw, dict):
        return raw
    if not isinstance(raw, str):
        raise BadRow("bad_tool_call", f"{where} arguments are {type(raw).__name__}")
    try:
        parsed = json.loads(raw)
    except json.JSONDecodeError:
        return {"arguments": raw}  # the encoder's rule for arguments that are not JSON
    if not isinstance(parsed, dict):
        raise BadRow("bad_tool_call", f"{where} arguments are JSON but not an object")
    return parsed


def tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    """OpenAI tool calls ({id, type, function: {name, arguments}}) or flat {name, arguments}."""
    if not isinstance(value, list):
        raise BadRow("bad_tool_call", f"{where} tool_calls is not a list")
    out = []
    for k, call in enumerate(value):
        here = f"{where} tool call {k}"
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise BadRow("bad_tool_call", f"{here} has no function name")
        if "arguments" not in fn:
            raise BadRow("bad_tool_call", f"{here} has no arguments")
        call_id = call.get("id") or fn.get("id") or ""
        out.append(
            {"id": call_id, "name": fn["name"], "arguments": _arguments(fn["arguments"], here)}
        )
    return out


def _check_keys(msg: dict[str, Any], role: str, where: str) -> None:
    allowed = _ROLE_KEYS[role]
    for key, value in msg.items():
        # None carries nothing: parquet and hub rows give every message every column's key.
        if key == "role" or key in allowed or key in METADATA_KEYS or value is None:
            continue
        misplaced = any(key in keys for keys in _ROLE_KEYS.values())
        raise BadRow(
            "misplaced_field" if misplaced else "unknown_key",
            f"{where} ({role}) has {key!r}, which a {role} message cannot carry"
            if misplaced
            else f"{where} ({role}) has key {key!r}, which the format does not render; remove "
            f"or rename it (known: {sorted(allowed)}; ignored metadata: {sorted(METADATA_KEYS)})",
        )


def _weight(value: Any, where: str) -> int:
    if value in (0, 1) and not isinstance(value, float):
        return int(value)
    raise BadRow("bad_field_type", f"{where} weight must be 0 or 1, got {value!r}")


def message(msg: Any, where: str) -> dict[str, Any]:
    """One OpenAI-style message -> a normalized message dict (see dsv4_format)."""
    if not isinstance(msg, dict):
        raise BadRow("bad_messages", f"{where} is not an object")
    role = msg.get("role")
    if role not in _ROLE_KEYS:
        raise BadRow("bad_role", f"{where} has role {role!r}; expected one of {list(_ROLE_KEYS)}")
    _check_keys(msg, role, where)
    out: dict[str, Any] = {"role": role, "content": _content(msg.get("content"), where)}
    if role in ("system", "developer"):
        if msg.get("tools"):
            out["tools"] = tools_list(msg["tools"], f"{where} tools")
        if msg.get("response_format") is not None:
            out["response_format"] = msg["response_format"]
        if role == "developer" and not out["content"]:
            raise BadRow("bad_messages", f"{where} (developer) has empty content")
    elif role == "assistant":
        reasoning = msg.get("reasoning_content")
        if reasoning is not None and not isinstance(reasoning, str):
            raise BadRow("bad_field_type", f"{where} reasoning_content is not a string")
        out["reasoning_content"] = reasoning
        if msg.get("tool_calls"):
            out["tool_calls"] = tool_calls(msg["tool_calls"], where)
        if msg.get("weight") is not None:
            out["weight"] = _weight(msg["weight"], where)
        if msg.get("wo_eos"):
            out["wo_eos"] = True
    else:
        if out["content"] is None:
            raise BadRow("bad_messages", f"{where} ({role}) has no content")
        if role == "user" and msg.get("task") is not None:
            if msg["task"] not in TASK_TOKENS:
                raise BadRow(
                    "bad_task", f"{where} task {msg['task']!r} is not one of {list(TASK_TOKENS)}"
                )
            out["task"] = msg["task"]
        if role == "tool":
            out["tool_call_id"] = msg.get("tool_call_id") or ""
    return out


def _attach_tools(messages: list[dict[str, Any]], row: dict[str, Any]) -> None:
    """Top-level `tools` go to the first system message (an empty one is added if none)."""
    if not row.get("tools"):
        return
    tools = tools_list(row["tools"], "top-level tools")
    system = next((m for m in messages if m["role"] == "system"), None)
    if system is None:
        messages.insert(0, {"role": "system", "content": "", "tools": tools})
    elif system.get("tools"):
        raise BadRow("bad_tools", "tools are declared both at the top level and on the system")
    else:
        system["tools"] = tools


def _message_list(value: Any, field: str) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise BadRow("bad_messages", f"field {field!r} is not a list of messages")
    return [message(m, f"{field}[{k}]") for k, m in enumerate(value)]


def _text_field(row: dict[str, Any], name: str, *, required: bool) -> str:
    value = row.get(name)
    if value is None:
        if required:
            raise BadRow("missing_field", f"missing field {name!r}")
        return ""
    if not isinstance(value, str):
        raise BadRow("bad_field_type", f"field {name!r} is {type(value).__name__}, not a string")
    return value


def _alpaca(row: dict[str, Any]) -> list[dict[str, Any]]:
    instruction = _text_field(row, "instruction", required=True)
    context = _text_field(row, "input", required=False)
    output = _text_field(row, "output", required=True)
    messages = []
    system = _text_field(row, "system", required=False)
    if system:
        messages.append({"role": "system", "content": system})
    history = row.get("history") or []
    if not isinstance(history, list):
        raise BadRow("bad_field_type", "field 'history' is not a list of [prompt, response]")
    for k, pair in enumerate(history):
        if not (
            isinstance(pair, list | tuple)
            and len(pair) == 2
            and all(isinstance(p, str) for p in pair)
        ):
            raise BadRow("bad_field_type", f"history[{k}] is not a [prompt, response] string pair")
        messages.append({"role": "user", "content": pair[0]})
        messages.append({"role": "assistant", "content": pair[1]})
    # Instruction and input are two parts of one user turn, joined like merged user messages.
    prompt = f"{instruction}\n\n{context}" if context.strip() else instruction
    messages.append({"role": "user", "content": prompt})
    messages.append({"role": "assistant", "content": output})
    return messages


def _sharegpt_call(value: str, where: str) -> list[dict[str, Any]]:
    parsed = _json_value(value, f"{where} value", "bad_tool_call")
    calls = parsed if isinstance(parsed, list) else [parsed]
    return tool_calls(calls, where)


def _sharegpt_call_turn(messages: list[dict[str, Any]], turn: dict[str, Any], where: str) -> None:
    """A function_call turn joins the gpt text right before it (one assistant message), or is
    an assistant message of its own."""
    calls = _sharegpt_call(turn["value"], where)
    weight = None if turn.get("weight") is None else _weight(turn["weight"], where)
    prev = messages[-1] if messages else None
    if prev is not None and prev["role"] == "assistant" and not prev.get("tool_calls"):
        if weight is not None and weight != prev.get("weight", 1):
            raise BadRow("bad_field_type", f"{where} weight differs from the gpt turn before it")
        prev["tool_calls"] = calls
        return
    msg: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": calls}
    if weight is not None:
        msg["weight"] = weight
    messages.append(msg)


def _sharegpt(row: dict[str, Any]) -> list[dict[str, Any]]:
    turns = row.get("conversations")
    if not isinstance(turns, list):
        raise BadRow("bad_messages", "field 'conversations' is not a list")
    messages: list[dict[str, Any]] = []
    system = _text_field(row, "system", required=False)
    if system:
        messages.append({"role": "system", "content": system})
    for k, turn in enumerate(turns):
        where = f"conversations[{k}]"
        if not isinstance(turn, dict) or turn.get("from") not in _SHAREGPT_ROLES:
            got = turn.get("from") if isinstance(turn, dict) else turn
            raise BadRow("bad_role", f"{where} has from={got!r}; expected {list(_SHAREGPT_ROLES)}")
        extra = {k for k, v in turn.items() if v is not None} - {"from", "value", "weight"}
        extra -= METADATA_KEYS
        if extra:
            raise BadRow("unknown_key", f"{where} has keys {sorted(extra)} that are not rendered")
        role = _SHAREGPT_ROLES[turn["from"]]
        value = turn.get("value")
        if not isinstance(value, str):
            raise BadRow("bad_field_type", f"{where} value is not a string")
        if role == "function_call":
            _sharegpt_call_turn(messages, turn, where)
            continue
        msg: dict[str, Any] = {"role": role, "content": value}
        if role == "assistant":
            msg["reasoning_content"] = None
            if turn.get("weight") is not None:
                msg["weight"] = _weight(turn["weight"], where)
        elif role == "tool":
            msg["tool_call_id"] = ""
        messages.append(msg)
    return messages


def _prompt_completion(row: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for field, role in (("prompt", "user"), ("completion", "assistant")):
        value = row.get(field)
        if value is None:
            raise BadRow("missing_field", f"missing field {field!r}")
        if isinstance(value, str):
            out.append({"role": role, "content": value})
        else:
            out.extend(_message_list(value, field))
    return out


def _messages(row: dict[str, Any]) -> list[dict[str, Any]]:
    if row.get("messages") is None:
        raise BadRow("missing_field", "missing field 'messages'")
    return _message_list(row["messages"], "messages")


_READERS = {
    "messages": _messages,
    "sharegpt": _sharegpt,
    "alpaca": _alpaca,
    "prompt_completion": _prompt_completion,
}


def row_messages(row: dict[str, Any], shape: str) -> list[dict[str, Any]]:
    """A row of `shape` -> normalized messages; raises BadRow."""
    messages = _READERS[shape](row)
    unread = [
        k for k, v in row.items() if k in CONTENT_KEYS and k not in _READS[shape] and v is not None
    ]
    if unread:
        raise BadRow(
            "unread_field",
            f"fields {unread} carry conversation content but a {shape} row does not read them; "
            "remove them or pass the row's real format with --format",
        )
    if shape != "alpaca":
        _attach_tools(messages, row)
    return messages


def check_trainable(messages: list[dict[str, Any]]) -> None:
    """A row needs an assistant turn to train on, and not every such turn may be blank."""
    turns = [m for m in messages if m["role"] == "assistant" and m.get("weight", 1) != 0]
    if not turns:
        raise BadRow("no_target", "no assistant turn to train on (none, or all have weight 0)")
    if not any(
        (m.get("content") or "").strip() or m.get("tool_calls") or m.get("reasoning_content")
        for m in turns
    ):
        raise BadRow("empty_response", "every assistant turn to train on is empty")
