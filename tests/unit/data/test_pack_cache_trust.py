"""A pack cache entry is believed only for its content: an edited manifest (a value, a type, a
field removed), an entry planted under this call's key from another corpus, or one whose
manifest checksum was recomputed after the edit is rebuilt and said in one line, never a hit;
a cache or lock dir another user owns or others may write is refused before anything in it is
read. Also the special-token-text policy and the bad-row bounds of the pack statistics."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from faults import captured_logs

from primus_v4.data import cache
from primus_v4.data.corpus import MAX_ROW_DEPTH
from primus_v4.data.pipeline import PackSpec, build_or_load
from primus_v4.errors import DataError, PathError

ROWS = "synthetic:rows=60,seed=5"
OTHER = "synthetic:rows=90,seed=6"


def _spec(tmp_path: Path, data: str = ROWS, **overrides: object) -> PackSpec:
    dirs = {"cache_dir": tmp_path / "cache", "lock_dir": tmp_path / "locks"}
    return PackSpec(data=data, seq_length=512, **{**dirs, **overrides})


def _edit(entry: Path, change: Callable[[dict], None], *, rehash: bool = False) -> None:
    manifest = json.loads((entry / cache.MANIFEST).read_text())
    change(manifest)
    if rehash:
        manifest[cache.CHECKSUM] = cache.manifest_checksum(manifest)
    (entry / cache.MANIFEST).write_text(json.dumps(manifest))


def _set(path: str, value: object) -> Callable[[dict], None]:
    def change(manifest: dict) -> None:
        *parents, last = path.split(".")
        node = manifest
        for name in parents:
            node = node[name]
        node[last] = value

    return change


EDITS = {
    "pad_id 1 -> 7": (_set("pad_id", 7), False),
    "pad_id of the wrong type, checksum recomputed": (_set("pad_id", "1"), True),
    "seq_length 512 -> 500, checksum recomputed": (_set("seq_length", 500), True),
    "files.tokens = null": (_set("files.tokens", None), False),
    "stats of the wrong type": (_set("stats", [1, 2]), True),
    "key_fields rewritten": (_set("key_fields.seq_length", 4096), True),
}


@pytest.mark.parametrize("name", list(EDITS))
def test_an_edited_manifest_is_rebuilt_and_said_never_a_hit(tmp_path: Path, name: str) -> None:
    first = build_or_load(_spec(tmp_path))
    change, rehash = EDITS[name]
    _edit(first.entry, change, rehash=rehash)
    with captured_logs() as logs:
        again = build_or_load(_spec(tmp_path))
    said = [m for m in logs if "pack cache entry is invalid, rebuilding it" in m]
    assert len(said) == 1, logs
    assert "\n" not in said[0]
    assert again.stats["cache_hit"] is False
    assert again.pad_id == first.pad_id and again.seq_length == 512
    for i in range(len(first)):
        for k, v in first.pack_arrays(i).items():
            np.testing.assert_array_equal(again.pack_arrays(i)[k], v)


def test_an_entry_planted_under_this_key_from_another_corpus_is_rebuilt(tmp_path: Path) -> None:
    """Another corpus's entry copied under this call's key, its key rewritten and its checksum
    recomputed (the S2 probe): the key fields recomputed from this call's inputs differ."""
    mine = build_or_load(_spec(tmp_path))
    rows = mine.num_samples
    other = build_or_load(_spec(tmp_path, OTHER))
    planted = mine.entry
    cache.discard(planted)
    os.rename(other.entry, planted)
    _edit(planted, _set("key", planted.name.removeprefix("pack-")), rehash=True)
    # the planter also makes the key the hash of the key fields it claims: still not ours
    _edit(planted, lambda m: m["key_fields"].update(seq_length=512), rehash=True)
    with captured_logs() as logs:
        again = build_or_load(_spec(tmp_path))
    assert any("rebuilding it" in m for m in logs), logs
    assert again.stats["cache_hit"] is False and again.num_samples == rows


def test_a_cache_dir_of_another_user_or_writable_by_others_is_refused(tmp_path: Path) -> None:
    build_or_load(_spec(tmp_path))
    (tmp_path / "cache").chmod(0o777)
    with pytest.raises(PathError, match=r"writable by group or others \(mode 777\)"):
        build_or_load(_spec(tmp_path))
    (tmp_path / "cache").chmod(0o700)
    if os.geteuid() == 0:  # only root can hand a directory to another user
        os.chown(tmp_path / "cache", 65534, 65534)
        with pytest.raises(PathError, match="is owned by uid 65534, not by this user"):
            build_or_load(_spec(tmp_path))
        os.chown(tmp_path / "cache", 0, 0)
    assert build_or_load(_spec(tmp_path)).stats["cache_hit"] is True


def test_the_default_root_is_created_private(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.delenv("PRIMUS_PACK_CACHE_DIR", raising=False)
    monkeypatch.delenv("PRIMUS_PACK_LOCK_DIR", raising=False)
    corpus = build_or_load(PackSpec(data=ROWS, seq_length=512))
    root = tmp_path / f"primus_v4-{os.getuid()}"
    for directory in (root, root / "packs", root / "locks"):
        assert directory.stat().st_mode & 0o777 == 0o700, directory
    assert corpus.entry.parent == root / "packs"


def test_inspect_cache_reports_a_manifest_of_the_wrong_types_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from primus_v4 import cli

    entry = build_or_load(_spec(tmp_path)).entry
    _edit(entry, _set("seq_length", "512"))
    assert cli.main(["inspect", "cache", "--cache-dir", str(tmp_path / "cache")]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if entry.name in line]
    assert len(lines) == 1 and "field 'seq_length' is str, not int" in lines[0], out


# --- what the pack statistics count -----------------------------------------------------------

GOOD = {"instruction": "a", "output": "b"}


def _rows(tmp_path: Path, *lines: str) -> str:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


def test_bad_rows_of_any_kind_are_counted_with_file_and_line(tmp_path: Path) -> None:
    deep = "[" * 200_000 + "]" * 200_000
    just_too_deep = json.dumps({**GOOD, "metadata": json.loads("[" * MAX_ROW_DEPTH + "]" * 100)})
    data = _rows(tmp_path, json.dumps(GOOD), '{"instruction": "a\\ud800", "output": "b"}',
                 '{"instruction": "a", "output": "b", "metadata": ' + deep + "}",
                 just_too_deep, json.dumps({**GOOD, "output": "x" * (9 << 20)}),
                 json.dumps(GOOD))  # fmt: skip
    stats = build_or_load(_spec(tmp_path, data)).stats
    assert stats["bad_rows"] == {"bad_text": 1, "too_deep": 2, "too_large": 1}
    assert stats["num_samples"] == 2
    where = [e["where"].rsplit(" ", 2)[1:] for e in stats["bad_row_examples"]]
    assert where == [["line", "2"], ["line", "3"], ["line", "4"], ["line", "5"]]
    with pytest.raises(DataError, match=r"rows\.jsonl line 2: a lone surrogate \\ud800"):
        build_or_load(_spec(tmp_path, data, strict=True, cache_dir=tmp_path / "c2"))


def test_special_token_text_is_counted_and_follows_its_policy(tmp_path: Path) -> None:
    data = _rows(tmp_path, json.dumps(GOOD),
                 json.dumps({"instruction": "say <｜Assistant｜> now", "output": "b</think>"}),
                 json.dumps({**GOOD, "metadata": {"note": "<｜User｜>"}}))  # fmt: skip
    with captured_logs() as logs:
        stats = build_or_load(_spec(tmp_path, data)).stats
    assert stats["special_tokens_in_text"] == {"rows": 1, "occurrences": 2}
    warned = [m for m in logs if "special-token text" in m]
    assert len(warned) == 1 and "rows.jsonl line 2: <｜Assistant｜>" in warned[0], logs
    with captured_logs() as logs:
        build_or_load(_spec(tmp_path, data, special_tokens_in_text="keep"))
    assert not [m for m in logs if "special-token text" in m]
    # on a cache hit too, before anything is returned
    with pytest.raises(DataError, match=r"1 rows of .*rows\.jsonl hold special-token text"):
        build_or_load(_spec(tmp_path, data, special_tokens_in_text="error"))


def test_a_row_nested_too_deep_in_a_json_list_is_one_bad_row(tmp_path: Path) -> None:
    deep = "[" * 200_000 + "]" * 200_000
    tricky = {**GOOD, "output": 'brackets "[{" and \\ in text, ]}'}
    path = tmp_path / "rows.json"
    path.write_text(
        f'[{json.dumps(GOOD)}, {{"instruction": "a", "output": "b", "metadata": {deep}}},\n'
        f" {json.dumps(tricky)}, {{not json}}]",
        encoding="utf-8",
    )
    stats = build_or_load(_spec(tmp_path, str(path))).stats
    assert stats["bad_rows"] == {"not_json": 1, "too_deep": 1}
    assert stats["num_samples"] == 2
    where = [e["where"].rsplit(" ", 2)[1:] for e in stats["bad_row_examples"]]
    assert where == [["row", "2"], ["row", "4"]]
    with pytest.raises(DataError, match=r"rows\.json row 2: nested deeper than 100 levels"):
        build_or_load(_spec(tmp_path, str(path), strict=True, cache_dir=tmp_path / "c2"))
