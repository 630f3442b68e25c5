"""Conversations -> training samples, rendered by DeepSeek's own `deepseek-recipe`.

The library renders a conversation as the served prompt (V4 and V4-0731: `DeepseekV4Encoding`;
V4.1: `DeepseekV41Encoding`). What it does not do is ours and stays here: which spans of a
sample are supervised, and which samples a conversation gives.

The served-context rule (FORMAT: README_thd_packed.md, "The DeepSeek-V4 conversation format"):
assistant turn i is served with the prompt `P_i = render(messages[:i])` (ending in the generation
header `<｜Assistant｜><think>` or `</think>`), and its completion `C_i` is what the encoder
continues that prompt with (`prefix=True`: reasoning + `</think>` + content + DSML calls) plus
EOS. Turn i's text is `P_i + C_i`; a later turn's sample supervises turn i too when it starts
with that text verbatim, else turn i is a sample of its own (thinking mode without tools: the
encoder drops the reasoning of turns before the last user message).

Messages here are normalized (`primus_v4.data.shapes`). What the library has no form for, or
renders otherwise than the official encoder (`needs_own_encoder` names each), is rendered by our
port of the official encoders (`dsv4_format`), in every format.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import deepseek_recipe as dr

from primus_v4.data.shapes import BadRow
from primus_v4.errors import DataError

BOS = dr.SpecialToken.Bos.default_str()
EOS = dr.SpecialToken.Eos.default_str()
SYSTEM = dr.SpecialToken.System.default_str()
# V4.1's effort line; the library writes only its named levels, so another number replaces
# the one of level "max" (100) in its text.
_V41_EFFORT = "Reasoning Effort: {} (range 1-100"
# The library continues a final assistant turn (`prefix`) that has reasoning, tool calls and no
# content as reasoning still open: `<think>r\n\n<｜DSML｜tool_calls>...`, without the `</think>`
# the official encoder writes (`encoding_dsv4.py`; golden samples official_test_1.thinking and
# tool_call_and_result.thinking). A one-character content held there and taken out after gives
# the official text.
_HOLE = "\x00"
# A call without arguments: the official encoder joins zero parameters between two newlines,
# `<｜DSML｜invoke name="f">\n\n</｜DSML｜invoke>`; the library writes one newline (test
# test_several_tool_calls_results_follow_the_call_order, the call `get_time` with `{}`).
_BARE_INVOKE = re.compile(r'(<｜DSML｜ ?invoke name="[^"\n]*">\n)(?=</｜DSML｜ ?invoke>)')
Sample = tuple[str, list[tuple[int, int]]]  # rendered text, supervised [start, end) char spans


@dataclass(frozen=True, kw_only=True)
class ChatFormat:
    """One DeepSeek conversation format: its encoder and how a row's effort reaches it."""

    name: str
    encoding: Any
    """The library's encoder (one instance: building one costs more than a render)."""
    efforts: dict[Any, str | None]
    """A row's `reasoning_effort` (None: absent) -> the library's effort level."""
    v41: bool = False
    """V4.1's format: an integer 1-100 is an effort too; system messages mid-conversation."""
    special_tokens: tuple[str, ...] = ()
    """Tokens the format writes that must be single tokens of the tokenizer."""


_V4_SPECIALS = tuple(
    t.default_str()
    for t in (
        dr.SpecialToken.Bos, dr.SpecialToken.Eos, dr.SpecialToken.User,
        dr.SpecialToken.Assistant, dr.SpecialToken.ThinkingStart, dr.SpecialToken.ThinkingEnd,
        dr.SpecialToken.Dsml, dr.SpecialToken.LatestReminder,
    )
)  # fmt: skip
FORMATS = {
    # V4 (April): no effort text by default; "max" is the text 0731 calls "high".
    "v4": ChatFormat(
        name="v4",
        encoding=dr.DeepseekV4Encoding(),
        efforts={None: "low", "low": "low", "high": "low", "max": "high"},
        special_tokens=_V4_SPECIALS,
    ),
    # V4-0731: its encoder shifted the texts down one level (a new, stronger "max").
    "v4-0731": ChatFormat(
        name="v4-0731",
        encoding=dr.DeepseekV4Encoding(),
        efforts={None: "low", "low": "low", "high": "high", "max": "max"},
        special_tokens=_V4_SPECIALS,
    ),
    # V4.1: "Reasoning Effort: N (range 1-100, ...)"; low/high/max = 50/75/100, 75 when absent.
    "v4.1": ChatFormat(
        name="v4.1",
        encoding=dr.DeepseekV41Encoding(),
        efforts={None: None, "low": "low", "high": "high", "max": "max"},
        v41=True,
        special_tokens=(*_V4_SPECIALS, SYSTEM),
    ),
}
V4 = FORMATS["v4"]
V41_LEVELS = {None: 75, "low": 50, "high": 75, "max": 100}
"""V4.1's effort numbers of the named levels (the official encoder's; absent: 75)."""
CHOICES = ("auto", *FORMATS)


def checked(name: str, tokenizer: Any) -> ChatFormat:
    """The format `name`, refused when the tokenizer lacks one of its tokens (V4.1 with
    DeepSeek-V4's tokenizer: no `<｜System｜>`)."""
    if name not in FORMATS:
        raise DataError(f"chat format {name!r}: expected one of {', '.join(FORMATS)}")
    fmt = FORMATS[name]
    missing = tokenizer.missing_tokens(fmt.special_tokens)
    if missing:
        raise DataError(
            f"chat format {name} needs the token {missing[0]!r}, which tokenizer {tokenizer.dir} "
            "lacks (it splits it into several ids): use the tokenizer of the release being "
            "fine-tuned, or the chat format of this tokenizer's model"
        )
    return fmt


def release_format(directory: Path) -> str | None:
    """The chat format of the release at `directory` from its config.json `model_type` (and
    V4-0731's `dspark_*` keys); None without a config.json or for another model type."""
    file = Path(directory) / "config.json"
    if not file.is_file():
        return None
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"cannot read {file}: {exc}") from None
    kind = config.get("model_type", "deepseek_v4") if isinstance(config, dict) else None
    if kind == "deepseek_v41":
        return "v4.1"
    if kind == "deepseek_v4":
        return "v4-0731" if any(k.startswith("dspark_") for k in config) else "v4"
    return None


def detect(tokenizer_dir: Path) -> str:
    """`auto` from a tokenizer directory: the release's config.json there, else the tokenizer
    itself (V4.1's has `<｜System｜>` as one token, V4's and V4-0731's do not). A V4.1 config
    beside a DeepSeek-V4 tokenizer (V4's tokens, not V4.1's: the export of a V4.1 preset run,
    which carries the bundled tokenizer) writes v4, the format its tokens can write."""
    by_release = release_format(tokenizer_dir)
    if by_release not in (None, "v4.1"):
        return by_release
    return tokenizer_format(tokenizer_dir) or by_release or "v4"


def tokenizer_format(tokenizer_dir: str | Path) -> str | None:
    """The format a DeepSeek tokenizer writes: "v4.1" with `<｜System｜>` as one token, "v4"
    with V4's BOS and not that; None for another tokenizer (neither)."""
    text = (Path(tokenizer_dir) / "tokenizer.json").read_text(encoding="utf-8")
    if re.search(r'"content"\s*:\s*"' + SYSTEM + '"', text):
        return "v4.1"
    return "v4" if re.search(r'"content"\s*:\s*"' + BOS + '"', text) else None


UNRENDERED = ("developer", "task", "response_format", "wo_eos", "latest_reminder")
"""What the library has no form for (FORMAT: "deepseek-recipe 0.2.0 has no developer role"),
or renders otherwise than the official encoder: a reminder after a user message comes after
the generation header there (`<｜User｜>q<｜Assistant｜></think><｜latest_reminder｜>r`), before
it in the library (test_completion_right_after_reminder_text)."""


_TOOL_KEYS = ["name", "description", "parameters"]


def needs_own_encoder(messages: list[dict[str, Any]], fmt: ChatFormat) -> str | None:
    """What in `messages` the library cannot render as the official encoder does, None if
    nothing. Besides UNRENDERED: tools anywhere but a leading system message (it takes them for
    the whole conversation only); a tool schema not of exactly the keys name, description,
    parameters (it writes them all, in that order, where the official encoder dumps the
    schema as given); in V4, several system messages (it joins them with a blank line, the
    official encoder with nothing)."""
    systems = 0
    for k, m in enumerate(messages):
        for key in UNRENDERED:
            if m["role"] == key or m.get(key):
                return key
        systems += m["role"] == "system"
        if m.get("tools") and (k > 0 or any(list(t) != _TOOL_KEYS for t in m["tools"])):
            return "tools on a later message or a schema with other keys than " + str(_TOOL_KEYS)
    if systems > 1 and not fmt.v41:
        return "several system messages"
    return None


def effort_of(fmt: ChatFormat, value: Any) -> tuple[str | None, int | None]:
    """A row's `reasoning_effort` -> (the library's level, a V4.1 number to write instead)."""
    if fmt.v41 and isinstance(value, int) and not isinstance(value, bool):
        if not 1 <= value <= 100:
            raise BadRow("bad_field_type", f"reasoning_effort {value} is not in 1-100")
        return "max", value
    if isinstance(value, str | type(None)) and value in fmt.efforts:
        return fmt.efforts[value], None
    known = [k for k in fmt.efforts if k is not None]
    numbers = " or an integer 1-100" if fmt.v41 else ""
    raise BadRow(
        "bad_field_type",
        f"reasoning_effort {value!r} is not one of {known}{numbers} (format {fmt.name})",
    )


def port_effort(fmt: ChatFormat, value: Any) -> dict[str, Any]:
    """A row's effort as our encoder port (dsv4_format) takes it: V4.1's number, or V4's text
    (the library's own, read off the start of a rendered prompt)."""
    level, number = effort_of(fmt, value)
    if fmt.v41:
        return {"v41_effort": number or V41_LEVELS[level]}
    user = dr.SpecialToken.User.default_str()
    probe = dr.Conversation([dr.UserMessage("")], thinking_mode=True, reasoning_effort=level)
    prompt = fmt.encoding.render_conversation(probe).prompt
    return {"v4_effort": prompt[len(BOS) : prompt.index(user)]}


def _library_message(m: dict[str, Any], *, thinking: bool, prefix: bool = False) -> Any:
    role = m["role"]
    if role == "system":  # its tools are the conversation's (needs_own_encoder)
        return dr.SystemMessage(m["content"] or "")
    if role == "user":
        return dr.UserMessage(m["content"] or "")
    if role == "tool":
        return dr.ToolMessage(m["content"] or "", m.get("tool_call_id") or None)
    if role == "latest_reminder":
        return dr.LatestReminderMessage(m["content"] or "")
    calls = [
        dr.ToolCall(c["id"], c["name"], json.dumps(c["arguments"], ensure_ascii=False))
        for c in m.get("tool_calls") or ()
    ]
    content = m["content"] or ""
    if prefix and thinking and calls and not content:
        content = _HOLE  # see _HOLE
    return dr.AssistantMessage(
        content,
        reasoning_content=(m.get("reasoning_content") or "") if thinking else None,
        tool_calls=calls or None,
        prefix=prefix,
    )


def _tool(fn: dict[str, Any]) -> Any:
    return dr.ToolDefinition(fn["name"], fn.get("description"), fn.get("parameters"))


@dataclass(frozen=True, kw_only=True)
class _Renderer:
    fmt: ChatFormat
    thinking: bool
    effort: str | None
    number: int | None

    tools: list[Any]
    bare_calls: bool

    def __call__(self, messages: list[Any]) -> str:
        conversation = dr.Conversation(
            messages, thinking_mode=self.thinking, reasoning_effort=self.effort, tools=self.tools
        )
        text = self.fmt.encoding.render_conversation(conversation).prompt.replace(_HOLE, "")
        if self.bare_calls:
            text = _BARE_INVOKE.sub(r"\1\n", text)
        if self.number is not None and self.thinking:
            text = text.replace(_V41_EFFORT.format(100), _V41_EFFORT.format(self.number), 1)
        return text


def conversation_samples(
    messages: list[dict[str, Any]], mode: str, fmt: ChatFormat, effort: Any = None
) -> list[Sample]:
    """Samples of one conversation (see the module docstring); samples without a supervised
    span are not returned."""
    thinking = mode == "thinking"
    level, number = effort_of(fmt, effort)
    tools = [_tool(t) for t in messages[0].get("tools") or ()]
    bare = any(not c["arguments"] for m in messages for c in m.get("tool_calls") or ())
    render = _Renderer(
        fmt=fmt, thinking=thinking, effort=level, number=number, tools=tools, bare_calls=bare
    )
    history = [_library_message(m, thinking=thinking) for m in messages]
    turns: list[tuple[str, tuple[int, int] | None]] = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = render(history[:i])
        full = render([*history[:i], _library_message(m, thinking=thinking, prefix=True)]) + EOS
        if not full.startswith(prompt):
            raise BadRow("bad_messages", f"message {i}: its completion does not follow its prompt")
        span = (len(prompt), len(full)) if m.get("weight", 1) != 0 else None
        turns.append((full, span))
    if messages[-1]["role"] != "assistant":  # a conversation is rendered whole
        turns.append((render(history), None))
    return _group(turns)


def _group(turns: list[tuple[str, tuple[int, int] | None]]) -> list[Sample]:
    """One sample per turn text that no later turn's text starts with; it supervises the spans
    of the turns whose text it starts with (each turn in its first such sample)."""
    samples: list[Sample] = []
    taken: set[int] = set()
    for k, (text, _) in enumerate(turns):
        if any(later.startswith(text) for later, _ in turns[k + 1 :]):
            continue
        mine = [j for j in range(k + 1) if j not in taken and text.startswith(turns[j][0])]
        taken.update(mine)
        spans = [s for j in mine if (s := turns[j][1]) is not None]
        if spans:
            samples.append((text, spans))
    return samples[-1:] + samples[:-1]  # the whole conversation first, then turns of their own
