"""What packing says: a wait for another builder is announced (not a silent minute), an invalid
cache entry is reported once, errors name the setting of the command that runs (`--strict` for
`pack`, `data.strict` for `train`), and a cache dir that cannot be written is one line before
any build."""

from __future__ import annotations

import fcntl
from pathlib import Path

import pytest
from faults import captured_logs, read_only_dir

from primus_v4.cli import main
from primus_v4.config import load_config
from primus_v4.config.resolve import pack_spec
from primus_v4.data import cache
from primus_v4.data.pipeline import PackSpec, build_or_load, pack_key
from primus_v4.errors import DataError, ExitCode

SMALL = "synthetic:rows=60,seed=5"


def _spec(tmp_path: Path, **overrides: object) -> PackSpec:
    base = {"data": SMALL, "seq_length": 512, "cache_dir": tmp_path / "cache",
            "lock_dir": tmp_path / "locks"}  # fmt: skip
    return PackSpec(**{**base, **overrides})


def test_a_wait_for_another_builder_is_announced(tmp_path: Path) -> None:
    spec = _spec(tmp_path, lock_timeout_s=0.5)
    path = cache.lock_path(spec.resolved_lock_dir(), spec.resolved_cache_dir(), pack_key(spec))
    path.parent.mkdir(parents=True)
    with path.open("a") as held, captured_logs() as logs:
        fcntl.flock(held, fcntl.LOCK_EX)  # what a builder in another process holds
        with pytest.raises(DataError, match="raise --lock-timeout"):
            build_or_load(spec)
    assert any(m.startswith("waiting for another process on this node") for m in logs), logs


def test_an_invalid_entry_is_reported_once(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    entry = build_or_load(spec).entry
    (entry / "tokens.npy").write_bytes(b"damaged")
    with captured_logs() as logs:
        assert build_or_load(spec).stats["cache_hit"] is False
    assert sum("pack cache entry is invalid" in m for m in logs) == 1, logs


def test_the_strict_error_names_the_setting_of_the_command(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"instruction": "a", "output": "b"}\n{"instruction": "a"}\n')
    items = [f"data.path={bad}", "data.strict=true", f"data.cache_dir={tmp_path / 'c'}",
             f"data.lock_dir={tmp_path / 'l'}"]  # fmt: skip
    with pytest.raises(DataError, match=r"line 2: .*drop data.strict to skip") as err:
        build_or_load(pack_spec(load_config(overrides=items)))
    assert "--strict" not in str(err.value)
    with pytest.raises(DataError, match=r"line 2: .*drop --strict to skip"):
        build_or_load(_spec(tmp_path, data=str(bad), strict=True))


def test_a_read_only_cache_dir_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with read_only_dir(tmp_path) as ro:
        argv = ["pack", "--data", SMALL, "--seq-length", "512", "--cache-dir", str(ro / "packs"),
                "--lock-dir", str(tmp_path / "locks"), "--no-progress"]  # fmt: skip
        assert main(argv) == ExitCode.PATH
        err = capsys.readouterr().err
        assert err.startswith(f"primus-v4 pack: error: pack cache dir {ro / 'packs'}: ")
        assert "point --cache-dir at a writable" in err
        assert len(err.splitlines()) == 1 and not (ro / "packs").exists()
