"""The config reference: every `section.key` with its type, default and documentation.

The documentation is the attribute docstring written under each field in `schema.py` (the one
place it is maintained); it is read from the module source, which ships with the package.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import textwrap
import typing
from typing import Any

from primus_v4.config import schema


def _field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a dataclass: the string literal right after each field."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, after in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _type_text(hint: Any) -> str:
    text = str(hint) if typing.get_origin(hint) else getattr(hint, "__name__", str(hint))
    return text.replace("typing.", "")


def reference() -> list[dict[str, Any]]:
    """One entry per config key, in declaration order."""
    entries = []
    for section, cls in schema.SECTIONS.items():
        docs = _field_docs(cls)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            entries.append(
                {
                    "key": f"{section}.{f.name}",
                    "type": _type_text(hints[f.name]),
                    "default": _default(f),
                    "doc": docs.get(f.name, ""),
                    "section_doc": " ".join((cls.__doc__ or "").split()),
                }
            )
    return entries


def format_reference(section: str | None = None) -> str:
    """The reference as text, one block per section."""
    lines: list[str] = []
    current = None
    for entry in reference():
        name = entry["key"].partition(".")[0]
        if section is not None and name != section:
            continue
        if name != current:
            current = name
            lines += [""] if lines else []
            lines.append(f"{name}: {entry['section_doc']}")
        lines.append(f"  {entry['key']} ({entry['type']}, default {entry['default']!r})")
        lines += textwrap.wrap(entry["doc"], 96, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(lines)
