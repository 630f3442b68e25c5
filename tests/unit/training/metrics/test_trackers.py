"""output.tracker: each installed tracker gets, offline, the metrics.jsonl scalars at every step,
the resolved config as parameters and loss.png as an artifact; a missing package is one line
naming the pip extra; the older output.tensorboard: true still selects TensorBoard."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from train_fakes import RAGGED_PACKS, FakeCorpus, FakeLM, fake_trainer, tiny_run
from wandb_records import read_offline_run

from primus_v4.config import load_config, preflight
from primus_v4.errors import ConfigError
from primus_v4.training.metrics import trackers
from primus_v4.training.metrics.writer import read_metrics

KEYS = ("loss", "mtp_loss", "grad_norm", "lr", "tokens_per_s", "peak_memory_bytes")
STEPS = ("train.steps=3", "train.warmup_steps=1")


def _run(tmp_path: Path, tracker: str) -> tuple[Path, list[dict]]:
    pytest.importorskip(
        preflight.TRACKER_MODULES[tracker], reason=f"the {tracker} extra is not installed"
    )
    fake_trainer(tmp_path, *STEPS, f"output.tracker={tracker}").train()
    out = tmp_path / "run"
    return out, read_metrics(out / "metrics.jsonl")


@pytest.mark.parametrize("tracker", ["tensorboard", "wandb", "mlflow"])
def test_missing_package_is_one_line_naming_the_extra(tracker, monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(preflight, "tracker_available", lambda name: name == "none")
    monkeypatch.setattr(trackers, "tracker_available", lambda name: name == "none")
    cfg = load_config(overrides=[f"output.tracker={tracker}"])
    module = preflight.TRACKER_MODULES[tracker]
    line = (
        f"output.tracker: {tracker} needs the {module} package: "
        f"pip install 'primus_v4[{tracker}]', or set output.tracker=none"
    )
    assert line in preflight.path_problems(cfg)
    assert not [p for p in preflight.path_problems(load_config()) if "output.tracker" in p]
    with pytest.raises(ConfigError, match=r"pip install 'primus_v4\[" + tracker):
        trackers.open_tracker(cfg, tmp_path)


def test_older_tensorboard_flag_selects_tensorboard() -> None:
    assert load_config(overrides=["output.tensorboard=true"]).output.tracker == "tensorboard"
    assert load_config().output.tracker == "none"
    with pytest.raises(
        ConfigError,
        match=r"output\.tensorboard: true asks for tensorboard but output\.tracker is wandb",
    ):
        load_config(overrides=["output.tensorboard=true", "output.tracker=wandb"])


def test_mlflow_online_needs_a_tracking_uri(monkeypatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = load_config(overrides=["output.tracker=mlflow", "output.tracker_mode=online"])
    assert any("needs MLFLOW_TRACKING_URI" in p for p in preflight.path_problems(cfg))


def test_tensorboard_offline_run(tmp_path: Path) -> None:
    out, rows = _run(tmp_path, "tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    for key in KEYS:
        points = events.Scalars(key)
        assert [p.step for p in points] == [1, 2, 3]
        # TensorBoard stores scalars as float32.
        assert [p.value for p in points] == pytest.approx([r[key] for r in rows], rel=1e-6)
    assert "nan" not in events.Tags()["scalars"]  # a flag, not a scalar
    start = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = plugin_data_pb2.HParamsPluginData.FromString(start).session_start_info.hparams
    assert hparams["train.steps"].number_value == 3
    assert hparams["output.tracker"].string_value == "tensorboard"
    (image,) = events.Images("loss")
    assert image.encoded_image_string[:8] == b"\x89PNG\r\n\x1a\n"


def test_wandb_offline_run(tmp_path: Path) -> None:
    out, rows = _run(tmp_path, "wandb")
    (run_dir,) = (out / "wandb").glob("offline-run-*")
    got = read_offline_run(run_dir)
    assert [h["_step"] for h in got["history"]] == [1, 2, 3]
    for key in KEYS:
        assert [h[key] for h in got["history"]] == pytest.approx([r[key] for r in rows])
    assert got["config"]["train"]["steps"] == 3
    assert got["config"]["output"]["tracker"] == "wandb"
    assert sorted(got["files"]) == ["loss.png", "metrics.jsonl"]
    assert (run_dir / "files" / "loss.png").read_bytes() == (out / "loss.png").read_bytes()


def test_mlflow_offline_run(tmp_path: Path) -> None:
    out, rows = _run(tmp_path, "mlflow")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(out / "mlruns").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("primus_v4").experiment_id])
    assert run.info.run_name == "run" and run.info.status == "FINISHED"
    for key in KEYS:
        history = client.get_metric_history(run.info.run_id, key)
        assert [m.step for m in history] == [1, 2, 3]
        assert [m.value for m in history] == pytest.approx([r[key] for r in rows])
    assert run.data.params["train.steps"] == "3"
    assert run.data.params["output.tracker"] == "mlflow"
    names = sorted(a.path for a in client.list_artifacts(run.info.run_id))
    assert names == ["loss.png", "metrics.jsonl"]


class _ResumableLM(FakeLM):
    """FakeLM with a 1-D parameter, so its optimizer state (a no-decay group) loads back."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.Parameter(torch.ones(4))


def _train(tmp_path: Path, tracker: str, steps: int) -> None:
    from primus_v4.training.trainer import Trainer

    ck = (f"checkpoint.dir={tmp_path / 'ckpt'}", "checkpoint.interval=2")
    run = tiny_run(tmp_path, f"train.steps={steps}", "train.warmup_steps=1", *ck,
                   f"output.tracker={tracker}")  # fmt: skip
    Trainer(run, corpus=FakeCorpus(RAGGED_PACKS[:4]), model=_ResumableLM()).train()


@pytest.mark.parametrize("tracker", ["wandb", "mlflow"])
def test_a_resumed_run_continues_its_tracker_run(tmp_path: Path, tracker: str) -> None:
    pytest.importorskip(preflight.TRACKER_MODULES[tracker], reason=f"no {tracker} extra")
    _train(tmp_path, tracker, steps=2)
    out = tmp_path / "run"
    first = json.loads((out / trackers.RUN_ID_FILE).read_text())
    _train(tmp_path, tracker, steps=4)  # resumes from the step-2 checkpoint
    assert json.loads((out / trackers.RUN_ID_FILE).read_text()) == first
    if tracker == "wandb":  # one offline dir per attempt, both of the run (wandb sync joins them)
        attempts = sorted((out / "wandb").glob("offline-run-*"))
        # offline-run-<time>-<id>, with -1 appended when both attempts start in one second
        assert len(attempts) == 2 and all(f"-{first['id']}" in p.name for p in attempts)
        assert [h["_step"] for h in read_offline_run(attempts[1])["history"]] == [3, 4]
    else:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=(out / "mlruns").as_uri())
        (run,) = client.search_runs([client.get_experiment_by_name("primus_v4").experiment_id])
        assert run.info.run_id == first["id"] and run.info.status == "FINISHED"
        assert [m.step for m in client.get_metric_history(first["id"], "loss")] == [1, 2, 3, 4]


@pytest.mark.parametrize("text", ["[1, 2]", "42", '"wandb"', '{"tracker": "wandb", "id": 7}'])
def test_a_tracker_record_that_is_not_one_starts_a_new_run(tmp_path: Path, text: str) -> None:
    """Valid JSON of another shape is named in one warning, not a crash on every resume."""
    from faults import captured_logs

    (tmp_path / trackers.RUN_ID_FILE).write_text(text)
    with captured_logs() as logs:
        assert trackers._previous_run_id(tmp_path, "wandb") is None
    assert any(f"{tmp_path / trackers.RUN_ID_FILE}: not a tracker record" in m for m in logs), logs
