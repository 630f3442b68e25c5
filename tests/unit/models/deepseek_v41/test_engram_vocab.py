"""Engram's token map: the release's size on DeepSeek-V4's tokenizer, the golden stub's map, the
normalization rule on crafted tokens, the ASCII shortcut against the normalizer, refusals."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from primus_v4.data.tokenizer import default_tokenizer_dir
from primus_v4.errors import DataError
from primus_v4.models.deepseek_v41 import engram_vocab
from primus_v4.models.deepseek_v41.engram_vocab import build_token_map, token_map_of

GOLDEN = Path(__file__).parents[3] / "fixtures" / "dsv41_golden"
RELEASE_SIZE = 99_092  # the release's engram_compressed_vocab_size (its engram.py asserts it)


@pytest.fixture(scope="module")
def v4_map() -> engram_vocab.TokenMap:
    return build_token_map(default_tokenizer_dir())


@pytest.fixture(scope="module")
def v4_tokenizer(v4_map: engram_vocab.TokenMap) -> Tokenizer:
    return Tokenizer.from_file(str(v4_map.source))


def _word_level(tmp_path: Path, tokens: list[str]) -> Path:
    """A tokenizer.json with these tokens as ids 0.. (no decoder: an id decodes to its token)."""
    spec = {
        "version": "1.0",
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": None,
        "post_processor": None,
        "decoder": None,
        "model": {
            "type": "WordLevel",
            "vocab": {t: i for i, t in enumerate(tokens)},
            "unk_token": tokens[0],
        },
    }
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(spec))
    return path


def test_deepseek_v4_tokenizer_gives_the_release_size(
    v4_map: engram_vocab.TokenMap, v4_tokenizer: Tokenizer
) -> None:
    ids = v4_map.ids
    assert len(ids) == 129_280 and v4_map.size == RELEASE_SIZE
    # compressed ids are handed out in order of first use: 0, then each new one is max + 1
    assert ids.dtype == np.int64 and ids[0] == 0
    assert np.all(ids <= np.maximum.accumulate(np.concatenate([[-1], ids[:-1]])) + 1)
    assert len(np.unique(ids)) == RELEASE_SIZE
    token = {t: v4_tokenizer.token_to_id(t) for t in ("The", "Ġthe", "THE", "Ġhe")}
    assert None not in token.values()
    # case and the leading space are normalized away (Ġ is the byte-level space)
    assert ids[token["The"]] == ids[token["Ġthe"]] == ids[token["THE"]] != ids[token["Ġhe"]]


def test_ascii_shortcut_equals_the_normalizer(v4_tokenizer: Tokenizer) -> None:
    n = v4_tokenizer.get_vocab_size(with_added_tokens=True)
    texts = v4_tokenizer.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
    texts += ["", " ", "   ", "  A  b  ", "A B", " x", "x "]
    normalize = engram_vocab._normalizer().normalize_str
    ascii_texts = [t for t in texts if t.isascii() and t.isprintable()]
    assert len(ascii_texts) > 60_000
    assert [engram_vocab._ascii_key(t) for t in ascii_texts] == [normalize(t) for t in ascii_texts]


def test_normalization_rule(tmp_path: Path) -> None:
    tokens = ["The", " the", "THE", "\tthe\n", "café", "cafe", "CAFÉ", "ﬁ", "fi",
              " ", "  ", "\n", "", "Ā", "a", "x y", "x  y"]  # fmt: skip
    m = build_token_map(_word_level(tmp_path, tokens))
    key = dict(zip(tokens, m.ids.tolist(), strict=True))
    assert key["The"] == key[" the"] == key["THE"] == key["\tthe\n"] == 0
    assert key["café"] == key["cafe"] == key["CAFÉ"]  # accents stripped, lowercased
    assert key["ﬁ"] == key["fi"]  # NFKC folds the ligature
    assert key[" "] == key["  "] == key["\n"]  # whitespace alone collapses to one space
    assert key[""] not in (key[" "], key["x y"])  # nothing normalizes to nothing but ""
    assert key["Ā"] == key["a"] and key["x y"] == key["x  y"]
    assert m.size == len(set(key.values())) == 7


def test_golden_stub_tokenizer_gives_the_golden_map() -> None:
    golden = load_file(str(GOLDEN / "golden.safetensors"))["token_map"]
    config = json.loads((GOLDEN / "checkpoint" / "config.json").read_text())["text_config"]
    cfg = SimpleNamespace(engram_compressed_vocab_size=config["engram_compressed_vocab_size"])
    ids = token_map_of(GOLDEN / "checkpoint", cfg)
    assert ids.dtype == golden.dtype == np.int64
    assert np.array_equal(ids, golden) and np.array_equal(ids, np.arange(512) // 2)


def test_a_tokenizer_of_another_size_is_refused() -> None:
    path = GOLDEN / "checkpoint"
    with pytest.raises(DataError) as err:
        token_map_of(path, SimpleNamespace(engram_compressed_vocab_size=RELEASE_SIZE))
    message = str(err.value)
    assert "\n" not in message
    assert "256" in message and str(RELEASE_SIZE) in message
    assert str(path / "tokenizer.json") in message


def test_missing_or_broken_tokenizer_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"no tokenizer\.json"):
        build_token_map(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(DataError, match=r"not a tokenizers tokenizer\.json") as err:
        build_token_map(tmp_path)
    assert "\n" not in str(err.value)
