"""Ctrl-C while `pack` writes its cache entry: `interrupted`, exit 130, and nothing of the
entry stays in the cache dir (its temp dir is removed at once, not left for the next build);
the same command then builds the entry whole."""

from __future__ import annotations

from pathlib import Path

import pytest

from primus_v4.cli import main
from primus_v4.data import cache


def test_ctrl_c_while_the_cache_entry_is_written_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    write = cache._write_array
    calls = []

    def interrupted_on_the_second_array(path: Path, array):  # type: ignore[no-untyped-def]
        calls.append(path.name)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return write(path, array)

    monkeypatch.setattr(cache, "_write_array", interrupted_on_the_second_array)
    argv = ["pack", "--data", "synthetic:rows=40", "--seq-length", "256",
            "--cache-dir", str(tmp_path / "packs")]  # fmt: skip
    assert main(argv) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "interrupted", err
    assert len(calls) == 2, calls
    assert sorted(p.name for p in (tmp_path / "packs").iterdir()) == [], "a partial entry stayed"

    monkeypatch.setattr(cache, "_write_array", write)
    assert main(argv) == 0
    [entry] = (tmp_path / "packs").iterdir()
    assert entry.name.startswith("pack-")
    cache.verify(entry, entry.name.removeprefix("pack-"))
