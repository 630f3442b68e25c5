"""Ctrl-C in any command exits 130 with one line, however it arrives: a KeyboardInterrupt that a
library wrapped (torch's CheckpointException around one rank's failure in `export`) included;
the export leaves nothing at its output."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp
from train_fakes import RAGGED_PACKS, FakeCorpus, tiny_run

from primus_v4.cli import main
from primus_v4.training.trainer import Trainer


def test_ctrl_c_during_export_exits_130_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = tmp_path / "ckpt"
    run = tiny_run(tmp_path, "train.steps=1", f"checkpoint.dir={ckpt}", "checkpoint.interval=1")
    Trainer(run, corpus=FakeCorpus(RAGGED_PACKS)).train()

    def ctrl_c(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(dcp.FileSystemReader, "read_data", ctrl_c)
    code = main(["export", "--run", str(ckpt), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 130, err
    assert err.strip().splitlines()[-1] == "interrupted", err
    assert "Traceback" not in err and "CheckpointException" not in err
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
