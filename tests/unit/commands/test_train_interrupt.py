"""Ctrl-C during `primus-v4 train`: one line naming the step a rerun resumes from, or that
nothing was saved, and exit status 130."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from primus_v4.cli import main
from primus_v4.commands import train
from primus_v4.errors import ExitCode
from primus_v4.training.checkpoint.integrity import COMPLETE


class _Interrupted:
    """A trainer whose run is stopped by Ctrl-C."""

    def __init__(self, checkpoint_dir: Path | None, resume: bool = True) -> None:
        self.cfg = SimpleNamespace(checkpoint=SimpleNamespace(
            dir=str(checkpoint_dir) if checkpoint_dir else None, resume=resume))  # fmt: skip
        self.runtime = SimpleNamespace(close=lambda: None)

    def train(self) -> None:
        raise KeyboardInterrupt


def _published(root: Path, *steps: int) -> None:
    for step in steps:
        (root / f"step_{step:08d}").mkdir(parents=True)
        for name in (COMPLETE, ".metadata"):  # what makes a checkpoint dir complete
            (root / f"step_{step:08d}" / name).write_text("")


@pytest.mark.parametrize(
    "saved,resume,says",
    [
        (None, True, "nothing was saved (checkpoint.dir is not set): a rerun starts from step 0"),
        ((), True, "yet: a rerun starts from step 0"),
        ((2, 4), True, "rerun the same command to resume from step 4"),
        ((2,), False, "checkpoint.resume is false: rerun with --set checkpoint.resume=true"),
    ],
)
def test_ctrl_c_names_what_a_rerun_starts_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    saved: tuple[int, ...] | None, resume: bool, says: str,
) -> None:  # fmt: skip
    root = None if saved is None else tmp_path / "ckpt"
    if root is not None:
        root.mkdir()
        _published(root, *saved)
    trainer = _Interrupted(root, resume)
    monkeypatch.setattr(train, "run", lambda args: train.execute(trainer))
    assert main(["train"]) == ExitCode.INTERRUPTED
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("primus-v4 train: error: interrupted; ")
    assert says in err, err
