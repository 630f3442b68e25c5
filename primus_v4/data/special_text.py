"""Special tokens written as text inside a row's content.

The tokenizer matches its added tokens (`<｜Assistant｜>`, `</think>`, the EOS text...) before
BPE, so such text in a message becomes the real special id, as DeepSeek's own encoder does; in
an assistant turn it is then trained as a target, and a conversation can forge turns. Packing
counts the rows and occurrences (pack statistics `special_tokens_in_text`) and applies the
policy `data.special_tokens_in_text` / `--special-tokens-in-text`:
  keep   count only (the text stays the special token, as the encoder makes it)
  warn   count and warn once per source, naming the first rows (default)
  error  refuse the corpus, naming the first row and token
Metadata keys of rows and messages (shapes.METADATA_KEYS) are not content and are not read.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from primus_v4.data.corpus import NOT_JSON, RawRow
from primus_v4.data.shapes import METADATA_KEYS
from primus_v4.errors import DataError
from primus_v4.log import get_logger

log = get_logger(__name__)

POLICIES = ("keep", "warn", "error")
# Rows (where, token) kept as examples in the stats and the messages.
EXAMPLES = 5


class SpecialTextFinder:
    """Finds added-token texts in a string: candidates by their first two characters, then the
    longest token that starts there (a tokenizer's longest match)."""

    def __init__(self, texts: Iterable[str]) -> None:
        buckets: dict[str, list[str]] = {}
        for text in texts:
            if text:
                buckets.setdefault(text[:2], []).append(text)
        self._buckets = {k: sorted(v, key=len, reverse=True) for k, v in buckets.items()}
        self._firsts = tuple({k[0] for k in self._buckets})

    def find(self, text: str) -> list[str]:
        found, i = [], 0
        while True:  # jump from one possible first character to the next (str.find is C)
            starts = [p for c in self._firsts if (p := text.find(c, i)) >= 0]
            if not starts:
                return found
            i = min(starts)
            candidates = self._buckets.get(text[i : i + 2], ())
            hit = next((t for t in candidates if text.startswith(t, i)), None)
            if hit is None:
                i += 1
                continue
            found.append(hit)
            i += len(hit)


@dataclass(kw_only=True)
class SpecialTextCount:
    rows: int = 0
    occurrences: int = 0
    examples: list[dict[str, str]] = field(default_factory=list)

    def as_stats(self) -> dict[str, Any]:
        return {"rows": self.rows, "occurrences": self.occurrences, "examples": self.examples}


def _content_strings(value: Any) -> Iterable[str]:
    """Every string of a row outside metadata keys, in reading order (iterative)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            stack.extend(reversed([v for k, v in item.items() if k not in METADATA_KEYS]))
        elif isinstance(item, list):
            stack.extend(reversed(item))


def count(rows: Sequence[RawRow], finder: SpecialTextFinder) -> SpecialTextCount:
    out = SpecialTextCount()
    for row in rows:
        if row.value is NOT_JSON:
            continue
        found = [t for s in _content_strings(row.value) for t in finder.find(s)]
        if found:
            out.rows += 1
            out.occurrences += len(found)
            if len(out.examples) < EXAMPLES:
                out.examples.append({"where": row.where, "token": found[0]})
    return out


def apply_policy(stats: dict[str, Any], policy: str, *, where: str, knob: str) -> None:
    """Warn about or refuse counted special-token text (`stats` as `as_stats` wrote it)."""
    if policy == "keep" or not stats.get("rows"):
        return
    first = "; ".join(f"{e['where']}: {e['token']}" for e in stats["examples"])
    what = (
        f"{stats['rows']} rows of {where} hold special-token text in their content "
        f"({stats['occurrences']} times; first: {first}), which encodes as the special tokens "
        "themselves"
    )
    if policy == "error":
        raise DataError(f"{what}; fix the rows, or set {knob} warn or keep to train on them")
    log.warning("%s; set %s error to refuse such rows, keep to silence this", what, knob)
