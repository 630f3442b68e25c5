"""Cache: the key tracks exactly the content-changing parameters; hits, determinism, corruption
detection and rebuild, the bounded lock wait, and cleanup after a dead builder."""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from primus_v4.data import cache
from primus_v4.data.pipeline import PackSpec, build_or_load, pack_key
from primus_v4.data.tokenizer import default_tokenizer_dir
from primus_v4.errors import DataError

SMALL = "synthetic:rows=120,seed=5"


def _spec(tmp_path: Path, **overrides: object) -> PackSpec:
    base = {
        "data": SMALL,
        "seq_length": 1024,
        "cache_dir": tmp_path / "cache",
        "lock_dir": tmp_path / "locks",
    }
    return PackSpec(**{**base, **overrides})


def _all_arrays(corpus) -> list[np.ndarray]:
    return [v for i in range(len(corpus)) for v in corpus.pack_arrays(i).values()]


def test_key_changes_with_each_content_parameter_only(tmp_path: Path, alpaca_demo: Path) -> None:
    corpus = tmp_path / "corpus.json"
    shutil.copy(alpaca_demo, corpus)
    base = _spec(tmp_path, data=str(corpus))
    key = pack_key(base)

    # A different tokenizer: same tokenizer.json, different tokenizer_config.json.
    tok = tmp_path / "tok"
    tok.mkdir()
    shutil.copy(default_tokenizer_dir() / "tokenizer.json", tok / "tokenizer.json")
    config = json.loads((default_tokenizer_dir() / "tokenizer_config.json").read_text())
    (tok / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 7}))
    edited = tmp_path / "edited.json"
    rows = json.loads(alpaca_demo.read_text())
    rows[10]["output"] += " (edited)"
    edited.write_text(json.dumps(rows))
    changing = {
        "data": str(edited),
        "format": "alpaca",
        "seq_length": 2048,
        "algorithm": "bfd",
        "overlong": "drop",
        "tokenizer": str(tok),
    }
    keys = {name: pack_key(dataclasses.replace(base, **{name: v})) for name, v in changing.items()}
    assert key not in keys.values() and len(set(keys.values())) == len(changing)

    # Same content under another path, and every non-content setting: same key.
    copy = tmp_path / "elsewhere" / "corpus.json"
    copy.parent.mkdir()
    shutil.copy(corpus, copy)
    same = {
        "data": str(copy),
        "strict": True,
        "cache_dir": tmp_path / "other_cache",
        "lock_dir": tmp_path / "other_locks",
        "lock_timeout_s": 5.0,
        "tokenizer": str(default_tokenizer_dir()),
    }
    for name, value in same.items():
        assert pack_key(dataclasses.replace(base, **{name: value})) == key, name
    assert pack_key(_spec(tmp_path, data="synthetic:rows=120,seed=6")) != pack_key(_spec(tmp_path))


def test_second_call_is_a_hit_with_identical_packs(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    built = build_or_load(spec)
    assert built.stats["cache_hit"] is False and built.stats["build_seconds"] > 0
    hit = build_or_load(spec)
    assert hit.stats["cache_hit"] is True and hit.stats["build_seconds"] == 0
    assert hit.stats["cache_key"] == built.stats["cache_key"]
    assert all(
        np.array_equal(a, b) for a, b in zip(_all_arrays(built), _all_arrays(hit), strict=True)
    )
    # Memory-mapped, not read into memory.
    assert isinstance(hit._tokens, np.memmap)


def test_builds_are_deterministic(tmp_path: Path) -> None:
    one = build_or_load(_spec(tmp_path / "a"))
    two = build_or_load(_spec(tmp_path / "b"))
    assert one.manifest["files"] == two.manifest["files"]  # same bytes: same sha256 per file


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_damaged_cache_is_detected_and_rebuilt(tmp_path: Path, damage: str) -> None:
    spec = _spec(tmp_path)
    first = build_or_load(spec)
    reference = _all_arrays(first)
    tokens = first.entry / "tokens.npy"
    del first
    data = bytearray(tokens.read_bytes())
    if damage == "truncate":
        data = data[: len(data) - 40]
    else:
        data[-5] ^= 0xFF
    tokens.write_bytes(bytes(data))
    with pytest.raises(cache.CacheInvalid, match=r"tokens\.npy"):
        cache.verify(tokens.parent, spec_key := pack_key(spec))
    rebuilt = build_or_load(spec)
    assert rebuilt.stats["cache_hit"] is False
    cache.verify(rebuilt.entry, spec_key)
    assert all(np.array_equal(a, b) for a, b in zip(reference, _all_arrays(rebuilt), strict=True))


def test_lock_wait_is_bounded_with_a_clear_error(tmp_path: Path) -> None:
    spec = _spec(tmp_path, lock_timeout_s=0.3)
    key = pack_key(spec)
    path = cache.lock_path(spec.resolved_lock_dir(), spec.resolved_cache_dir(), key)
    path.parent.mkdir(parents=True)
    with path.open("a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # what a builder in another process holds
        start = time.monotonic()
        with pytest.raises(DataError, match=rf"waited 0.3 s for the pack cache lock .*{key}"):
            build_or_load(spec)
        assert time.monotonic() - start < 5
    assert not cache.entry_dir(spec.resolved_cache_dir(), key).exists()


def test_stale_temp_of_a_dead_builder_is_removed(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    key = pack_key(spec)
    cache_dir = spec.resolved_cache_dir()
    cache_dir.mkdir(parents=True)
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)  # a pid that is certainly dead now
    stale = cache_dir / f".tmp-pack-{key}-{cache._host()}-{pid}"
    stale.mkdir()
    (stale / "tokens.npy").write_bytes(b"partial")
    build_or_load(spec)
    assert not stale.exists()
    assert [p.name for p in cache_dir.iterdir()] == [f"pack-{key}"]


def test_bad_settings_are_data_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="seq_length must be an integer >= 2"):
        _spec(tmp_path, seq_length=1)
    with pytest.raises(DataError, match="algorithm must be one of"):
        _spec(tmp_path, algorithm="nfd")
    empty = tmp_path / "tok"
    empty.mkdir()
    with pytest.raises(DataError, match=r"has no tokenizer\.json"):
        build_or_load(_spec(tmp_path, tokenizer=str(empty)))
    with pytest.raises(DataError, match="survives seq_length=8 with overlong=drop"):
        build_or_load(_spec(tmp_path, seq_length=8, overlong="drop"))


def test_overlong_policies_truncate_or_drop_and_count(tmp_path: Path, tokenizer) -> None:
    from primus_v4.data.corpus import read_rows, resolve_source
    from primus_v4.data.templates import render

    natural = render(read_rows(resolve_source(SMALL)), tokenizer, fmt="auto", where="s").lengths
    over = int((natural > 128).sum())
    assert 0 < over < len(natural)
    dropped = build_or_load(_spec(tmp_path, seq_length=128, overlong="drop"))
    assert dropped.stats["dropped"] == over and dropped.stats["truncated"] == 0
    assert dropped.num_samples == len(natural) - over
    kept_rows = {dropped.sample_row(j) for j in range(dropped.num_samples)}
    assert kept_rows == set(np.flatnonzero(natural <= 128).tolist())
    truncated = build_or_load(_spec(tmp_path, seq_length=128))
    stats = truncated.stats
    assert stats["truncated"] + stats["dropped_no_target"] == over
    assert stats["truncated"] > 0 and truncated.num_samples == len(natural) - stats["dropped"]
    longest = max(truncated.sample_tokens(j)[0].size for j in range(truncated.num_samples))
    assert longest == 128
