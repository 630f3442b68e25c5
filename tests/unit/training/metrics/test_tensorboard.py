"""output.tensorboard: the metrics.jsonl scalars as TensorBoard events; without the package the
run fails before any work with a line naming the extra to install."""

from __future__ import annotations

from pathlib import Path

import pytest
from train_fakes import fake_trainer

from primus_v4.config import load_config
from primus_v4.config.preflight import path_problems
from primus_v4.training.metrics import tensorboard
from primus_v4.training.metrics.writer import read_metrics


def test_missing_package_is_a_preflight_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tensorboard, "available", lambda: False)
    cfg = load_config(overrides=["output.tensorboard=true"])
    assert tensorboard.MISSING in path_problems(cfg)
    assert "primus_v4[tensorboard]" in tensorboard.MISSING
    assert tensorboard.MISSING not in path_problems(load_config())


def test_events_hold_the_metrics_scalars(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    settings = ("train.steps=3", "train.warmup_steps=1", "output.tensorboard=true")
    fake_trainer(tmp_path, *settings).train()
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    for key in ("loss", "mtp_loss", "grad_norm", "lr", "tokens_per_s"):
        points = events.Scalars(key)
        assert [p.step for p in points] == [1, 2, 3]
        # TensorBoard stores scalars as float32.
        assert [p.value for p in points] == pytest.approx([r[key] for r in rows], rel=1e-6)
    assert "nan" not in events.Tags()["scalars"]  # a flag, not a scalar
