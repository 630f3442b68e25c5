"""V4.1 golden samples (tests/fixtures/dsv41_format, provenance in its README): each conversation,
packed through the whole pipeline in V4.1's format with V4.1's tokenizer, gives exactly the golden
samples; and DeepSeek's deepseek-recipe agrees with our port of the official V4.1 encoder on every
conversation it renders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dsv41_golden import GOLDEN, MODES, ROWS, TOKENIZER, V41, library_renders, port_samples
from golden_samples import golden_samples, packed_samples

from primus_v4.data import chat_format, shapes
from primus_v4.data.pipeline import PackSpec, build_or_load

GOLDEN_FILES = sorted(GOLDEN.glob("*.json"))


def test_golden_folder_is_complete() -> None:
    assert len(GOLDEN_FILES) == len(ROWS) * len(MODES) == 26


@pytest.mark.parametrize("path", GOLDEN_FILES, ids=[p.stem for p in GOLDEN_FILES])
def test_golden_conversation_packs_into_its_samples(path: Path, tmp_path: Path) -> None:
    golden = json.loads(path.read_text(encoding="utf-8"))
    corpus_file = tmp_path / "row.jsonl"
    corpus_file.write_text(json.dumps(golden["row"], ensure_ascii=False) + "\n", encoding="utf-8")
    spec = PackSpec(data=str(corpus_file), chat_mode=golden["mode"], chat_format="v4.1",
                    tokenizer=TOKENIZER, seq_length=4096, cache_dir=tmp_path / "cache",
                    lock_dir=tmp_path / "locks", strict=True)  # fmt: skip
    assert packed_samples(build_or_load(spec)) == golden_samples(golden)


def test_library_agrees_with_the_official_encoder_port() -> None:
    """deepseek-recipe's DeepseekV41Encoding and our port of the official encoding.py give the
    same samples and spans for every golden conversation the library renders (11 of 13, both
    modes); the other two (latest_reminder, developer) are rendered by the port."""
    agree = 0
    for name, row in ROWS.items():
        if not library_renders(row):
            continue
        messages = shapes.row_messages(row, "messages")
        for mode in MODES:
            effort = row.get("reasoning_effort")
            library = chat_format.conversation_samples(messages, mode, V41, effort)
            assert sorted(library) == sorted(port_samples(row, mode)), (name, mode)
            agree += 1
    assert agree == 22
