"""Mixing sources: weights repeat or subsample rows (seeded, stable), the cache key follows the
weights, stats report samples and tokens per source; a directory of shards is one source."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from primus_v4.cli import main
from primus_v4.data.mixing import parse_sources, weighted_samples
from primus_v4.data.pipeline import PackSpec, build_or_load, pack_key
from primus_v4.errors import DataError


@pytest.fixture()
def two_sources(tmp_path: Path) -> tuple[Path, Path]:
    alpaca = tmp_path / "a.jsonl"
    alpaca.write_text(
        "".join(
            json.dumps({"instruction": f"Say {k}.", "input": "", "output": f"{k}!"}) + "\n"
            for k in range(40)
        )
    )
    chat = tmp_path / "b.jsonl"
    chat.write_text(
        "".join(
            json.dumps(
                {
                    "conversations": [
                        {"from": "human", "value": f"q{k}"},
                        {"from": "gpt", "value": f"r{k}"},
                    ]
                }
            )
            + "\n"
            for k in range(40)
        )
    )
    return alpaca, chat


def _spec(tmp_path: Path, sources: list[dict], **kw) -> PackSpec:
    return PackSpec(
        data=sources, seq_length=256, cache_dir=tmp_path / "c", lock_dir=tmp_path / "l", **kw
    )


def _per_source_rows(corpus, offsets: list[int]) -> list[list[int]]:
    rows = [corpus.sample_row(j) for j in range(corpus.num_samples)]
    split = offsets[1]
    return [sorted(r for r in rows if r < split), sorted(r - split for r in rows if r >= split)]


def test_weights_three_to_one(tmp_path: Path, two_sources: tuple[Path, Path]) -> None:
    a, b = two_sources
    corpus = build_or_load(_spec(tmp_path, [{"path": str(a), "weight": 3}, {"path": str(b)}]))
    stats = corpus.stats["sources"]
    assert [s["samples"] for s in stats] == [120, 40]
    assert [s["format"] for s in stats] == ["alpaca", "sharegpt"]
    assert sum(s["tokens"] for s in stats) == corpus.stats["real_tokens"]
    assert sum(s["supervised_tokens"] for s in stats) == corpus.stats["supervised_tokens"]
    rows_a, rows_b = _per_source_rows(corpus, [s["row_offset"] for s in stats])
    assert rows_a == sorted(list(range(40)) * 3) and rows_b == list(range(40))


def test_fractional_weight_is_seeded_and_keyed(
    tmp_path: Path, two_sources: tuple[Path, Path]
) -> None:
    a, b = two_sources
    mix = [{"path": str(a), "weight": 1.5}, {"path": str(b), "weight": 0.25}]
    first = build_or_load(_spec(tmp_path, mix, seed=1))
    assert [s["samples"] for s in first.stats["sources"]] == [60, 10]
    rows = _per_source_rows(first, [0, 40])
    again = build_or_load(_spec(tmp_path / "fresh", mix, seed=1))  # a fresh cache dir
    assert again.stats["cache_hit"] is False and _per_source_rows(again, [0, 40]) == rows
    other = build_or_load(_spec(tmp_path, mix, seed=2))
    assert other.stats["cache_key"] != first.stats["cache_key"]
    assert _per_source_rows(other, [0, 40]) != rows
    # Whole weights draw nothing: the seed is not part of their key.
    whole = [{"path": str(a), "weight": 3}, {"path": str(b)}]
    assert pack_key(_spec(tmp_path, whole, seed=1)) == pack_key(_spec(tmp_path, whole, seed=2))


def test_cache_key_follows_weights_and_formats(
    tmp_path: Path, two_sources: tuple[Path, Path]
) -> None:
    a, b = two_sources
    keys = {
        pack_key(_spec(tmp_path, [{"path": str(a), "weight": w}, {"path": str(b)}]))
        for w in (1, 2, 3)
    }
    assert len(keys) == 3
    forced = pack_key(_spec(tmp_path, [{"path": str(a), "format": "alpaca"}, {"path": str(b)}]))
    assert forced not in keys
    assert pack_key(_spec(tmp_path, [str(a)])) == pack_key(PackSpec(data=str(a), seq_length=256))


def test_weighted_samples_keep_a_rows_samples_together() -> None:
    rows = np.array([0, 0, 1, 3, 3, 3])  # row 0 gave 2 samples, row 3 gave 3 (thinking mode)
    assert weighted_samples(rows, 2, seed=0, source_index=0).tolist() == [0, 1, 2, 3, 4, 5] * 2
    # 0.5 of 3 rows: round(1.5) = 2 rows drawn once, each with all of its samples.
    half = weighted_samples(rows, 0.5, seed=0, source_index=0)
    assert half.tolist() == sorted(half.tolist())
    picked = sorted(set(rows[half].tolist()))
    assert len(picked) == 2
    assert sorted(rows[half].tolist()) == sorted(r for r in rows.tolist() if r in picked)
    assert weighted_samples(rows, 0.5, seed=0, source_index=0).tolist() == half.tolist()


def test_bad_sources_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="weight must be a number > 0"):
        parse_sources([{"path": "x.jsonl", "weight": 0}])
    with pytest.raises(DataError, match="unknown keys \\['wieght'\\]"):
        parse_sources([{"path": "x.jsonl", "wieght": 2}])
    with pytest.raises(DataError, match="format must be one of"):
        PackSpec(data=[{"path": "x.jsonl", "format": "csv"}])


def test_directory_of_shards_and_cli_mixing(
    tmp_path: Path, two_sources: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = two_sources
    shards = tmp_path / "shards"
    (shards / "part").mkdir(parents=True)
    import pyarrow as pa
    import pyarrow.parquet as pq

    lines = a.read_text().splitlines()
    (shards / "0.jsonl").write_text("\n".join(lines[:25]) + "\n")
    pq.write_table(
        pa.Table.from_pylist([json.loads(x) for x in lines[25:]]), shards / "part" / "1.parquet"
    )
    whole = build_or_load(PackSpec(data=str(a), seq_length=256, cache_dir=tmp_path / "c"))
    sharded = build_or_load(PackSpec(data=str(shards), seq_length=256, cache_dir=tmp_path / "c"))
    assert sharded.stats["num_samples"] == whole.stats["num_samples"] == 40
    assert sharded.stats["real_tokens"] == whole.stats["real_tokens"]
    argv = ["pack", "--seq-length", "256", "--cache-dir", str(tmp_path / "c"), "--no-progress"]
    argv += ["--lock-dir", str(tmp_path / "l"), "--stats-json", str(tmp_path / "s.json")]
    assert main([*argv, "--data", f"{shards}::weight=3", "--data", f"{b}::format=sharegpt"]) == 0
    stats = json.loads((tmp_path / "s.json").read_text())
    assert [s["samples"] for s in stats["sources"]] == [120, 40]
    assert "source 2" in capsys.readouterr().out
