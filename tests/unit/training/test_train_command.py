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


def test_a_run_that_fails_before_its_first_step_leaves_output_dir_as_it_found_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tensorboard path that is a file is refused by the preflight, before any packing. A
    set-up failure after config.yaml was written (the tracker fails to open): the run removes
    what it wrote, so the same command, rerun once the cause is gone, runs instead of being
    refused as another run's outputs. What was there before stays."""
    from primus_v4.cli import main
    from primus_v4.training import trainer

    out = tmp_path / "run"
    out.mkdir()
    (out / "tensorboard").write_text("not a directory\n")
    (out / "notes.txt").write_text("the user's own file\n")
    items = [
        "data.path=synthetic:rows=24", "data.seq_length=256",
        f"data.cache_dir={tmp_path / 'cache'}", f"data.lock_dir={tmp_path / 'locks'}",
        "train.steps=1", "train.warmup_steps=0", "train.global_batch_size=1",
        f"output.dir={out}", "output.progress_bar=false", "output.tracker=tensorboard",
    ]  # fmt: skip
    argv = ["train", *[arg for item in items for arg in ("--set", item)]]
    assert main(argv) == 8
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith(f"output.tracker: tensorboard writes into {out / 'tensorboard'}, "
                            "which is not a directory; move it away or choose another "
                            "output.dir"), err  # fmt: skip
    assert not (tmp_path / "cache").exists(), "packed before refusing"
    (out / "tensorboard").unlink()

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(trainer, "open_tracker", broken)
    assert main(argv) != 0
    assert "No space left on device" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == ["notes.txt"]
    monkeypatch.undo()
    assert main(argv) == 0, capsys.readouterr().err
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1]
    assert (out / "notes.txt").read_text() == "the user's own file\n"
