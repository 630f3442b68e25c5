"""Golden samples of the release encoder (tests/fixtures/dsv4_format, provenance in its README):
each conversation, packed through the whole pipeline in its mode, gives exactly the golden samples
(ids and targets)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from primus_v4.data.pipeline import PackSpec, build_or_load
from primus_v4.data.tokenizer import TextTokenizer

GOLDEN = Path(__file__).resolve().parents[2] / "fixtures" / "dsv4_format"
GOLDEN_FILES = sorted(GOLDEN.glob("*.json"))


def _targets(length: int, spans: list[list[int]]) -> list[bool]:
    flags = [False] * length
    for start, stop in spans:
        flags[start:stop] = [True] * (stop - start)
    return flags


def _describe(tokenizer: TextTokenizer, ids: list[int], targets: list[bool]) -> str:
    picked = np.asarray(ids)[np.asarray(targets, dtype=bool)]
    return f"{len(ids)} ids, targets decode to {tokenizer.decode(picked)!r}"


def test_golden_folder_is_complete() -> None:
    assert len(GOLDEN_FILES) == 20, f"expected 20 golden files under {GOLDEN}"


@pytest.mark.parametrize("path", GOLDEN_FILES, ids=[p.stem for p in GOLDEN_FILES])
def test_golden_conversation_packs_into_its_samples(
    path: Path, tmp_path: Path, tokenizer: TextTokenizer
) -> None:
    golden = json.loads(path.read_text(encoding="utf-8"))
    corpus_file = tmp_path / "row.jsonl"
    corpus_file.write_text(json.dumps(golden["row"], ensure_ascii=False) + "\n", encoding="utf-8")
    spec = PackSpec(
        data=str(corpus_file),
        chat_mode=golden["mode"],
        seq_length=4096,
        cache_dir=tmp_path / "cache",
        lock_dir=tmp_path / "locks",
        strict=True,
    )
    corpus = build_or_load(spec)
    got = []
    for j in range(corpus.num_samples):
        ids, targets = corpus.sample_tokens(j)
        got.append((ids.tolist(), targets.tolist()))
    want = [
        (s["input_ids"], _targets(len(s["input_ids"]), s["supervised_spans"]))
        for s in golden["samples"]
    ]
    # The set of samples is what matters, in any order.
    assert sorted(got) == sorted(want), (
        f"{path.name}: got [{'; '.join(_describe(tokenizer, *g) for g in sorted(got))}], "
        f"want [{'; '.join(_describe(tokenizer, *w) for w in sorted(want))}]"
    )
