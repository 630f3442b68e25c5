"""Engram's token map: every token id -> a compressed id shared by tokens whose text normalizes
alike (" The", "the" and "THE" hash as one), built from a tokenizer.json as the release builds it.

The release's rule (its `inference/engram.py`): decode each id alone with the raw fast tokenizer
(specials included, no clean-up); a text holding U+FFFD (a partial UTF-8 byte token) is keyed by
its raw token string, any other text by its normalization (NFKC -> NFD -> strip accents ->
lowercase -> runs of space/tab/CR/LF to one space -> strip; a text that is exactly one space
stays one space), or by itself when that normalizes to nothing. Keys get compressed ids in order
of their first id. The map's size fixes every hash multiplier, so a tokenizer whose size differs
from the config's `engram_compressed_vocab_size` would silently rehash every table: it is
refused. DeepSeek-V4's tokenizer (and V4.1's, 9 ids renamed) gives 99,092.

Torch-free: the map is a numpy int64 array (`torch.from_numpy` shares it).
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
from tokenizers import Regex, Tokenizer, normalizers

from primus_v4.errors import DataError

TOKENIZER_FILE = "tokenizer.json"
# a private-use character: a token that is exactly one space survives the strip as itself
_ONE_SPACE = "\ue000"
_SPACES = re.compile(" +")


class EngramSizes(Protocol):
    """What the check reads of a model config."""

    engram_compressed_vocab_size: int


@dataclass(kw_only=True, frozen=True)
class TokenMap:
    """`ids[token_id]` is the compressed id; `size` the number of compressed ids."""

    ids: np.ndarray
    size: int
    source: Path


def _normalizer() -> normalizers.Normalizer:
    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), _ONE_SPACE),
            normalizers.Strip(),
            normalizers.Replace(_ONE_SPACE, " "),
        ]
    )


def _ascii_key(text: str) -> str:
    """The normalizer's result on printable ASCII (0x20-0x7e), by Python string methods: there
    NFKC, NFD and accent stripping change nothing, lowercasing is A-Z -> a-z, and the only
    whitespace is the space. Half of DeepSeek-V4's ids, at a fifth of the normalizer's cost."""
    key = _SPACES.sub(" ", text.lower())
    return key if key == " " else key.strip(" ")


def tokenizer_file(path: str | os.PathLike) -> Path:
    """`path` itself when it is a file, else the tokenizer.json inside the directory `path`."""
    p = Path(path)
    file = p if p.is_file() else p / TOKENIZER_FILE
    if not file.is_file():
        raise DataError(f"{file}: no tokenizer.json (the Engram token map is built from it)")
    return file


def build_token_map(path: str | os.PathLike) -> TokenMap:
    """The Engram token map of the tokenizer at `path` (a tokenizer.json or its directory).

    Every id below the tokenizer's size (added tokens included, as `len(tokenizer)` counts) is
    decoded alone in one batch call; ~1 s for DeepSeek-V4's 129,280 ids."""
    file = tokenizer_file(path)
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as err:  # the Rust parser raises its own exception type
        raise DataError(f"{file}: not a tokenizers tokenizer.json ({err})") from None
    n = tokenizer.get_vocab_size(with_added_tokens=True)
    texts = tokenizer.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
    normalize = _normalizer().normalize_str
    keys: dict[str, int] = {}
    ids = np.empty(n, dtype=np.int64)
    for token_id, text in enumerate(texts):
        if text.isascii() and text.isprintable():
            key = _ascii_key(text) or text
        elif "\ufffd" in text:
            key = tokenizer.id_to_token(token_id)
        else:
            key = normalize(text) or text
        ids[token_id] = keys.setdefault(key, len(keys))
    return TokenMap(ids=ids, size=len(keys), source=file)


@functools.lru_cache(maxsize=4)
def _built(file: str, size: int, mtime_ns: int) -> TokenMap:
    del size, mtime_ns  # the cache key: a rewritten tokenizer.json is built again
    return build_token_map(file)


def cached_token_map(path: str | os.PathLike) -> TokenMap:
    """`build_token_map`, built once per tokenizer file (path, size, mtime)."""
    file = tokenizer_file(path)
    st = file.stat()
    return _built(str(file), st.st_size, st.st_mtime_ns)


def token_map_of(path: str | os.PathLike, cfg: EngramSizes) -> np.ndarray:
    """The token map of the tokenizer at `path` (a release or tokenizer directory, or the
    tokenizer.json) for the model `cfg`: refused unless its size is the config's
    `engram_compressed_vocab_size`. Built once per tokenizer file (path, size, mtime): the
    release check of a dry run and the run's load share it."""
    token_map = cached_token_map(path)
    expected = cfg.engram_compressed_vocab_size
    if token_map.size != expected:
        raise DataError(
            f"{token_map.source}: its Engram token map has {token_map.size} compressed ids but the "
            f"model config's engram_compressed_vocab_size is {expected}; use the tokenizer the "
            "model was released with"
        )
    return token_map.ids
