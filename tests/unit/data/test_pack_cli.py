"""`primus-v4 pack` and `primus-v4 inspect cache`: the CLI contract (stats keys, export format,
cache hit without torch) and bad input reported as one clear error line with exit status 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from primus_v4.cli import main
from primus_v4.errors import ExitCode

REPO = Path(__file__).resolve().parents[3]
STATS_KEYS = [
    "cache_key",
    "cache_hit",
    "num_samples",
    "num_packs",
    "total_tokens",
    "real_tokens",
    "supervised_tokens",
    "real_fraction",
    "supervised_fraction",
    "truncated",
    "dropped",
    "bad_rows",
    "build_seconds",
]
# Runs the CLI in a fresh interpreter and reports which heavy modules the command imported.
CLI_PROBE = """
import sys
from primus_v4.cli import main
code = main(sys.argv[1:])
print("IMPORTED", "torch" in sys.modules, "datasets" in sys.modules)
sys.exit(code)
"""


def _pack_cli(*args: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PRIMUS_PACK_LOCK_DIR": str(tmp_path / "locks")}
    return subprocess.run(
        [sys.executable, "-c", CLI_PROBE, "pack", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )


def test_pack_demo_then_cache_hit_without_torch(tmp_path: Path, alpaca_demo: Path) -> None:
    rows = len(json.loads(alpaca_demo.read_text()))
    stats_path = tmp_path / "stats.json"
    args = ["--data", str(alpaca_demo), "--seq-length", "4096", "--cache-dir", str(tmp_path / "c")]
    cold = _pack_cli(*args, "--stats-json", str(stats_path), "--no-progress", tmp_path=tmp_path)
    assert cold.returncode == 0, cold.stderr
    stats = json.loads(stats_path.read_text())
    assert list(stats)[: len(STATS_KEYS)] == STATS_KEYS
    assert stats["cache_hit"] is False and stats["num_samples"] == rows
    assert stats["num_packs"] <= -(-stats["real_tokens"] // 4096) + 1
    assert "samples per pack" in cold.stdout and stats["cache_key"] in cold.stdout

    hot = _pack_cli(*args, "--stats-json", str(stats_path), tmp_path=tmp_path)
    assert hot.returncode == 0, hot.stderr
    hit = json.loads(stats_path.read_text())
    assert hit["cache_hit"] is True and hit["cache_key"] == stats["cache_key"]
    assert hit["num_packs"] == stats["num_packs"]
    assert "IMPORTED False False" in hot.stdout  # neither torch nor datasets on a hit


def test_export_jsonl_matches_the_packs(
    tmp_path: Path, demo_spec, demo_corpus, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "packs.jsonl"
    argv = ["pack", "--data", demo_spec.data, "--seq-length", str(demo_spec.seq_length)]
    argv += ["--cache-dir", str(demo_spec.cache_dir), "--lock-dir", str(demo_spec.lock_dir)]
    assert main([*argv, "--export-jsonl", str(out)]) == 0
    assert "hit" in capsys.readouterr().out
    lines = out.read_text().splitlines()
    assert len(lines) == len(demo_corpus)
    for i in (0, len(lines) - 1):
        row = json.loads(lines[i])
        assert sorted(row) == ["cu_seqlens", "input_ids", "labels", "loss_mask", "position_ids"]
        arrays = demo_corpus.pack_arrays(i)
        for name, values in row.items():
            assert np.array_equal(np.asarray(values), arrays[name]), name


def _error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == ExitCode.DATA
    err = capsys.readouterr().err
    assert err.startswith("primus-v4 pack: error: ") and "Traceback" not in err
    return err


def test_bad_input_is_one_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--cache-dir", str(tmp_path / "c"), "--lock-dir", str(tmp_path / "l")]
    pack = ["pack", "--seq-length", "64", *base, "--data"]
    assert "does not exist" in _error([*pack, str(tmp_path / "missing.jsonl")], capsys)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert "is empty" in _error([*pack, str(empty)], capsys)
    broken = tmp_path / "broken.json"
    broken.write_text("[1, 2")
    assert "is not valid JSON (line 1" in _error([*pack, str(broken)], capsys)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"instruction": "a", "output": "b"}\n{"instruction": "a"}\n')
    err = _error([*pack, str(bad), "--strict"], capsys)
    assert "bad.jsonl line 2: missing field 'output'" in err
    err = _error(["pack", "--seq-length", "1", *base, "--data", "synthetic"], capsys)
    assert "seq_length must be an integer >= 2" in err
    no_tok = tmp_path / "tok"
    no_tok.mkdir()
    err = _error([*pack, "synthetic:rows=5", "--tokenizer", str(no_tok)], capsys)
    assert "has no tokenizer.json" in err
    assert "bad synthetic corpus option" in _error([*pack, "synthetic:rows=x"], capsys)
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").iterdir())


def test_offline_hub_name_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    argv = ["pack", "--seq-length", "64", "--cache-dir", str(tmp_path / "c")]
    err = _error([*argv, "--lock-dir", str(tmp_path / "l"), "--data", "nobody/no-such-set"], capsys)
    assert "cannot load hub dataset 'nobody/no-such-set'" in err and "Offline" in err


def test_inspect_cache_lists_entries(demo_corpus, capsys: pytest.CaptureFixture[str]) -> None:
    cache_dir = demo_corpus.entry.parent
    assert main(["inspect", "cache", str(cache_dir), "--verify"]) == 0
    out = capsys.readouterr().out
    assert demo_corpus.stats["cache_key"] in out and "verified" in out
    assert main(["inspect", "cache", str(cache_dir), "--json"]) == 0
    items = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    mine = next(i for i in items if i.get("key") == demo_corpus.stats["cache_key"])
    assert mine["num_packs"] == len(demo_corpus) and mine["bytes"] > 0


def test_inspect_cache_verify_exits_1_on_a_corrupt_entry(
    demo_corpus, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    copy = tmp_path / "packs" / demo_corpus.entry.name
    shutil.copytree(demo_corpus.entry, copy)
    victim = max((p for p in copy.iterdir() if p.suffix == ".npy"), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF  # one flipped byte in the largest array
    victim.write_bytes(bytes(data))
    assert main(["inspect", "cache", str(copy.parent)]) == 0  # listing does not read the data
    capsys.readouterr()
    assert main(["inspect", "cache", str(copy.parent), "--verify"]) == 1
    assert "CORRUPT" in capsys.readouterr().out
    assert main(["inspect", "cache", str(copy.parent), "--verify", "--json"]) == 1


def test_inspect_cache_marks_the_entry_a_config_reads(
    tmp_path: Path, alpaca_demo: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    monkeypatch.setenv("PRIMUS_PACK_LOCK_DIR", str(tmp_path / "locks"))
    cache_dir = tmp_path / "packs"
    config = ["--config", "tiny_cpu_thd", "--set", f"data.path={alpaca_demo}",
              "--set", f"data.cache_dir={cache_dir}"]  # fmt: skip
    assert main(["inspect", "cache", *config]) == 0
    assert "data.path: key" in capsys.readouterr().out.splitlines()[-1]
    assert main(["pack", "--data", str(alpaca_demo), "--seq-length", "4096",
                 "--cache-dir", str(cache_dir), "--no-progress"]) == 0  # fmt: skip
    key = next(line.split("key=")[1] for line in capsys.readouterr().out.splitlines()
               if "key=" in line)  # fmt: skip
    assert main(["inspect", "cache", *config]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[0] == key and lines[1].endswith("<- data.path")
    assert lines[-1] == (f"config tiny_cpu_thd, data.path: key {key} in {cache_dir}: hit: the run "
                         "loads it")  # fmt: skip


def test_bars_count_rows_and_stay_out_of_a_log_file(
    tmp_path: Path, alpaca_demo: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from primus_v4.data.pipeline import PackSpec, build_or_load

    rows = len(json.loads(alpaca_demo.read_text()))
    spec = PackSpec(data=str(alpaca_demo), seq_length=4096, cache_dir=tmp_path / "a",
                    lock_dir=tmp_path / "locks")  # fmt: skip
    build_or_load(spec, progress=True)
    bars = capsys.readouterr().err
    assert "tokenize: 100%" in bars and f"{rows}/{rows}" in bars and " rows/s" in bars
    # stderr a pipe (a log file): the default shows no bar
    args = ["--data", str(alpaca_demo), "--seq-length", "4096", "--cache-dir", str(tmp_path / "b")]
    cold = _pack_cli(*args, tmp_path=tmp_path)
    assert cold.returncode == 0 and "%|" not in cold.stderr, cold.stderr
