"""`primus-v4 train` end to end on a few real packs: synthetic corpus -> pack cache -> tiny model
-> metrics.jsonl, loss.png, config.yaml and the printed summary."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from primus_v4.commands import train
from primus_v4.config import load_config
from primus_v4.training.metrics.writer import read_metrics


def test_train_command_runs_the_real_pipeline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    out = tmp_path / "run"
    items = [
        "data.path=synthetic:rows=24",
        "data.seq_length=256",
        f"data.cache_dir={tmp_path / 'cache'}",
        f"data.lock_dir={tmp_path / 'locks'}",
        "train.steps=2",
        "train.warmup_steps=1",
        "train.global_batch_size=1",
        f"output.dir={out}",
        "output.progress_bar=false",
    ]
    args = parser.parse_args([arg for item in items for arg in ("--set", item)])
    assert train.run(args) == 0
    assert "run summary" in capsys.readouterr().out
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and not any(r["nan"] for r in rows)
    assert 0 < rows[0]["supervised_tokens"] < rows[0]["real_tokens"] <= 256
    assert rows[0]["mtp_loss"] > 0 and rows[0]["aux_loss"] > 0
    assert (out / "loss.png").is_file()
    assert load_config(out / "config.yaml").data.path == "synthetic:rows=24"
