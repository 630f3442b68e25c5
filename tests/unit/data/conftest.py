"""Fixtures for the data tests: the default tokenizer and one packed demo corpus, built once."""

from __future__ import annotations

from pathlib import Path

import pytest

from primus_v4.data.packed_corpus import PackedCorpus
from primus_v4.data.pipeline import PackSpec, build_or_load
from primus_v4.data.tokenizer import TextTokenizer, load_tokenizer, resolve_tokenizer_dir

# Short packs so the 1000 demo rows (~134 tokens per sample) give many packs and the longest
# samples (up to ~620 tokens) are truncated.
DEMO_SEQ_LENGTH = 512


@pytest.fixture(scope="session")
def tokenizer() -> TextTokenizer:
    return load_tokenizer(resolve_tokenizer_dir(None))


@pytest.fixture(scope="session")
def pack_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("packs")
    return {"cache_dir": root / "cache", "lock_dir": root / "locks"}


@pytest.fixture(scope="session")
def demo_spec(alpaca_demo: Path, pack_dirs: dict[str, Path]) -> PackSpec:
    return PackSpec(data=str(alpaca_demo), seq_length=DEMO_SEQ_LENGTH, **pack_dirs)


@pytest.fixture(scope="session")
def demo_corpus(demo_spec: PackSpec) -> PackedCorpus:
    return build_or_load(demo_spec)
