"""The demo corpora of examples/data/: the committed files are exactly their generator's output,
and they have the spread of a real SFT corpus that the data tests rely on (one-word and long
answers, rows with and without input, chat and thinking conversations)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from primus_v4.data.pipeline import PackSpec, build_or_load
from primus_v4.data.tokenizer import TextTokenizer

DEMO_DATA = Path(__file__).resolve().parents[3] / "examples" / "data"
GENERATOR = DEMO_DATA / "make_demo_corpus.py"
FILES = ("alpaca_demo.json", "chat_demo.jsonl")


def _generate(out_dir: Path, *args: str) -> None:
    proc = subprocess.run(
        [sys.executable, str(GENERATOR), "--out-dir", str(out_dir), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr


def test_committed_files_are_the_generators_output(tmp_path: Path) -> None:
    _generate(tmp_path)
    for name in FILES:
        committed = DEMO_DATA / name
        assert committed.stat().st_size < 2**20, f"{name} should stay a small demo"
        assert (tmp_path / name).read_bytes() == committed.read_bytes(), (
            f"examples/data/{name} is not the generator's output: run "
            "`python examples/data/make_demo_corpus.py` and commit the result"
        )


def test_the_seed_and_row_counts_are_honoured(tmp_path: Path) -> None:
    _generate(tmp_path, "--seed", "1", "--rows", "40", "--chat-rows", "5")
    rows = json.loads((tmp_path / FILES[0]).read_text(encoding="utf-8"))
    seed0 = json.loads((DEMO_DATA / FILES[0]).read_text(encoding="utf-8"))
    assert len(rows) == 40 and rows != seed0[:40]
    assert len((tmp_path / FILES[1]).read_text(encoding="utf-8").splitlines()) == 5


def test_alpaca_demo_has_a_real_length_spread(alpaca_demo: Path, tokenizer: TextTokenizer) -> None:
    rows = json.loads(alpaca_demo.read_text(encoding="utf-8"))
    assert len(rows) == 1000
    assert all(sorted(r) == ["input", "instruction", "output"] for r in rows)
    assert len({json.dumps(r, sort_keys=True) for r in rows}) == len(rows)  # no repeated row
    with_input = sum(bool(r["input"]) for r in rows) / len(rows)
    assert 0.3 < with_input < 0.5  # Alpaca: ~40% of rows have an input
    _, lengths = tokenizer.encode_texts([r["output"] for r in rows])
    assert lengths.min() <= 2  # one-word labels
    assert 40 <= np.median(lengths) <= 150
    # A long tail: enough answers alone outgrow the 512-token packs of the data tests.
    assert (lengths > 512).sum() >= 5 and lengths.max() < 1024


def test_chat_demo_packs_strictly_in_both_modes(chat_demo: Path, tmp_path: Path) -> None:
    rows = [json.loads(line) for line in chat_demo.read_text(encoding="utf-8").splitlines()]
    thinking = sum(any("reasoning_content" in m for m in r["messages"]) for r in rows)
    assert 0.2 < thinking / len(rows) < 0.5
    assert any(r["messages"][0]["role"] == "system" for r in rows)
    assert any(sum(m["role"] == "user" for m in r["messages"]) == 3 for r in rows)
    spec = PackSpec(
        data=str(chat_demo),
        chat_mode="auto",
        seq_length=4096,
        cache_dir=tmp_path / "cache",
        lock_dir=tmp_path / "locks",
        strict=True,  # any bad row would be an error
    )
    stats = build_or_load(spec).stats
    assert stats["chat_modes"] == {"chat": len(rows) - thinking, "thinking": thinking}
    # Thinking mode drops earlier turns' reasoning, so each of their turns is a sample of its own.
    turns = sum(
        sum(m["role"] == "assistant" for m in r["messages"])
        for r in rows
        if any("reasoning_content" in m for m in r["messages"])
    )
    assert stats["num_samples"] == len(rows) - thinking + turns
