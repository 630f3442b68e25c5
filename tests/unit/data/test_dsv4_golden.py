"""Golden samples of the release encoder (tests/fixtures/dsv4_format, provenance in its README):
each conversation, packed through the whole pipeline in its mode, gives exactly the golden samples
(ids and targets)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from golden_samples import golden_samples, packed_samples

from primus_v4.data import chat_format, shapes
from primus_v4.data.pipeline import PackSpec, build_or_load
from primus_v4.data.tokenizer import TextTokenizer

GOLDEN = Path(__file__).resolve().parents[2] / "fixtures" / "dsv4_format"
GOLDEN_FILES = sorted(GOLDEN.glob("*.json"))


def _describe(tokenizer: TextTokenizer, ids: list[int], targets: list[bool]) -> str:
    picked = np.asarray(ids)[np.asarray(targets, dtype=bool)]
    return f"{len(ids)} ids, targets decode to {tokenizer.decode(picked)!r}"


def test_golden_folder_is_complete() -> None:
    assert len(GOLDEN_FILES) == 20, f"expected 20 golden files under {GOLDEN}"


@pytest.mark.parametrize("chat_format", ["v4", "v4-0731"])  # the same rendering without effort
@pytest.mark.parametrize("path", GOLDEN_FILES, ids=[p.stem for p in GOLDEN_FILES])
def test_golden_conversation_packs_into_its_samples(
    path: Path, chat_format: str, tmp_path: Path, tokenizer: TextTokenizer
) -> None:
    golden = json.loads(path.read_text(encoding="utf-8"))
    corpus_file = tmp_path / "row.jsonl"
    corpus_file.write_text(json.dumps(golden["row"], ensure_ascii=False) + "\n", encoding="utf-8")
    spec = PackSpec(
        data=str(corpus_file),
        chat_mode=golden["mode"],
        chat_format=chat_format,
        seq_length=4096,
        cache_dir=tmp_path / "cache",
        lock_dir=tmp_path / "locks",
        strict=True,
    )
    got, want = packed_samples(build_or_load(spec)), golden_samples(golden)
    # The set of samples is what matters, in any order.
    assert sorted(got) == sorted(want), (
        f"{path.name}: got [{'; '.join(_describe(tokenizer, *g) for g in sorted(got))}], "
        f"want [{'; '.join(_describe(tokenizer, *w) for w in sorted(want))}]"
    )


def test_library_renders_every_golden_text() -> None:
    """deepseek-recipe's rendering (the default path) gives every golden sample's text byte for
    byte (the ids and targets are checked through the pipeline above)."""
    texts = 0
    for path in GOLDEN_FILES:
        golden = json.loads(path.read_text(encoding="utf-8"))
        messages = shapes.row_messages(golden["row"], "messages")
        assert chat_format.needs_own_encoder(messages, chat_format.V4) is None, path.name
        got = chat_format.conversation_samples(messages, golden["mode"], chat_format.V4)
        assert sorted(t for t, _ in got) == sorted(s["text"] for s in golden["samples"])
        texts += len(got)
    assert texts == 23
