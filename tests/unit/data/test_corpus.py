"""Corpus sources: what --data means, readers for each file kind, content fingerprints, and the
embedded synthetic corpus (deterministic, Alpaca-like lengths)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from primus_v4.data.corpus import NOT_JSON, read_rows, resolve_source
from primus_v4.data.synthetic import synthetic_rows
from primus_v4.data.templates import render
from primus_v4.data.tokenizer import TextTokenizer
from primus_v4.errors import DataError


def test_resolve_source_kinds(tmp_path: Path) -> None:
    s = resolve_source("synthetic")
    assert (s.kind, s.rows, s.seed) == ("synthetic", 2000, 0)
    s = resolve_source("synthetic:rows=50,seed=3")
    assert (s.kind, s.rows, s.seed) == ("synthetic", 50, 3)
    hub = resolve_source("tatsu-lab/alpaca@abc123")
    assert (hub.kind, hub.name, hub.revision) == ("hub", "tatsu-lab/alpaca", "abc123")
    assert hub.fingerprint() == "hub:tatsu-lab/alpaca@abc123:subset=:split=train"
    sub = resolve_source("org/set", split="test", subset="en")
    assert sub.fingerprint() == "hub:org/set@main:subset=en:split=test"
    with pytest.raises(DataError, match="does not exist"):
        resolve_source(str(tmp_path / "absent.jsonl"))
    with pytest.raises(DataError, match="does not exist"):
        resolve_source("./data/alpaca")  # a path, not a hub name
    assert resolve_source(str(tmp_path)).kind == "dir"
    with pytest.raises(DataError, match="holds no"):
        resolve_source(str(tmp_path)).fingerprint()
    odd = tmp_path / "rows.csv"
    odd.write_text("a,b\n")
    with pytest.raises(DataError, match="unsupported file type"):
        resolve_source(str(odd))
    with pytest.raises(DataError, match="rows must be >= 1"):
        resolve_source("synthetic:rows=0")


def test_fingerprint_follows_content_not_path(tmp_path: Path) -> None:
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text('{"instruction": "x", "output": "y"}\n')
    b.write_text('{"instruction": "x", "output": "y"}\n')
    assert resolve_source(str(a)).fingerprint() == resolve_source(str(b)).fingerprint()
    b.write_text('{"instruction": "x", "output": "z"}\n')
    assert resolve_source(str(a)).fingerprint() != resolve_source(str(b)).fingerprint()


def test_readers_json_jsonl_in_json_and_parquet(tmp_path: Path) -> None:
    rows = [{"instruction": f"i{k}", "input": "", "output": f"o{k}"} for k in range(3)]
    as_list = tmp_path / "list.json"
    as_list.write_text(json.dumps(rows))
    as_lines = tmp_path / "lines.json"  # JSON Lines content under a .json name
    as_lines.write_text("\n".join(json.dumps(r) for r in rows) + "\n{oops\n")
    import pyarrow as pa
    import pyarrow.parquet as pq

    parquet = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    for path in (as_list, as_lines, parquet):
        got = read_rows(resolve_source(str(path)))
        assert [r.value for r in got[:3]] == rows, path
    bad = read_rows(resolve_source(str(as_lines)))[3]
    assert bad.value is NOT_JSON and bad.where.endswith("lines.json line 4")


def test_synthetic_is_deterministic_and_alpaca_like(tokenizer: TextTokenizer) -> None:
    assert synthetic_rows(rows=30, seed=1) == synthetic_rows(rows=30, seed=1)
    assert synthetic_rows(rows=30, seed=1) != synthetic_rows(rows=30, seed=2)
    rows = read_rows(resolve_source("synthetic"))
    assert len(rows) == 2000
    assert all(r.value["output"].strip() and r.value["instruction"] for r in rows)
    lengths = render(rows, tokenizer, fmt="auto", where="synthetic").lengths
    # Alpaca under this tokenizer and template: median ~100-130 tokens, a tail to ~600.
    assert 100 <= np.median(lengths) <= 130
    assert 400 <= lengths.max() <= 650 and np.percentile(lengths, 99) > 350


def test_a_line_that_is_not_utf8_is_one_bad_row(tmp_path: Path) -> None:
    good = json.dumps({"instruction": "a", "output": "b"}).encode()
    lines = tmp_path / "mixed.jsonl"
    lines.write_bytes(good + b"\n" + b'{"instruction": "caf\xe9", "output": "x"}\n' + good + b"\n")
    rows = read_rows(resolve_source(str(lines)))
    assert [r.where for r in rows] == [f"{lines} line {i}" for i in (1, 2, 3)]
    assert rows[1].value is NOT_JSON and rows[1].error == "not UTF-8 (byte 0xe9 at column 21)"
    assert rows[0].value == rows[2].value == json.loads(good)
    whole = tmp_path / "list.json"
    whole.write_bytes(b'[\n{"instruction": "a",\n "output": "\xff"}]\n')
    with pytest.raises(DataError, match=rf"corpus {whole} line 3, column 13: byte 0xff is not UTF"):
        read_rows(resolve_source(str(whole)))


def test_a_utf8_bom_is_not_a_row(tmp_path: Path) -> None:
    row = {"instruction": "a", "output": "b"}
    for name, body in (("bom.jsonl", json.dumps(row)), ("bom.json", json.dumps([row]))):
        path = tmp_path / name
        path.write_bytes(b"\xef\xbb\xbf" + body.encode() + b"\n")
        assert [r.value for r in read_rows(resolve_source(str(path)))] == [row], name


def test_a_fifo_named_like_a_shard_is_refused_not_skipped(tmp_path: Path) -> None:
    import os

    corpus = tmp_path / "corpus"
    (corpus / "part").mkdir(parents=True)
    (corpus / "a.jsonl").write_text(json.dumps({"instruction": "x", "output": "y"}) + "\n")
    os.mkfifo(corpus / "part" / "b.jsonl")
    with pytest.raises(DataError) as err:
        resolve_source(str(corpus)).shards()
    assert str(err.value) == (
        f"corpus directory {corpus}: part/b.jsonl is named like a shard but is not a regular "
        "file (a FIFO, socket or device); remove it or move it out of the corpus"
    )
    (corpus / "part" / "b.jsonl").unlink()
    assert [p.name for p in resolve_source(str(corpus)).shards()] == ["a.jsonl"]
