"""Nothing is written through a link planted in a run's directories: at every name a run writes
in output.dir or checkpoint.dir, a symbolic link (or a hard link to a file elsewhere) is either
refused in one line naming it, or, where the file is published by rename, replaced as a name
without its target being touched. The lock file's own cases: test_run_dirs.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from train_fakes import fake_trainer

from primus_v4.errors import PathError, PrimusError

STEPS = ("train.steps=2", "train.global_batch_size=1", "train.warmup_steps=1")
PRECIOUS = "precious\n"


def _plant(tmp_path: Path, at: Path, link: str) -> Path:
    victim = tmp_path / "victim"
    victim.write_text(PRECIOUS)
    at.parent.mkdir(parents=True, exist_ok=True)
    if link == "symbolic":
        at.symlink_to(victim)
    else:
        os.link(victim, at)
    return victim


# name in the run (relative to tmp_path), what happens: "refused" or "replaced"
PLACES = {
    "run/metrics.jsonl": "refused",
    "run/config.yaml": "replaced",
    "run/loss.png": "replaced",
    "ckpt/.tmp_step_00000001": "refused",
    "ckpt/latest": "replaced",
}


@pytest.mark.parametrize("link", ["symbolic", "hard"])
@pytest.mark.parametrize("place", list(PLACES))
def test_no_write_lands_through_a_planted_link(tmp_path: Path, place: str, link: str) -> None:
    at = tmp_path / place
    victim = _plant(tmp_path, at, link)
    trainer = fake_trainer(tmp_path, *STEPS, "output.plot=true", "checkpoint.interval=1",
                           f"checkpoint.dir={tmp_path / 'ckpt'}")  # fmt: skip
    if PLACES[place] == "refused":
        with pytest.raises(PrimusError) as err:
            trainer.train()
        text = str(err.value)
        print(text)
        assert "\n" not in text.strip() and str(at) in text, text
        assert "nothing written through it" in text, text
    else:  # published by rename: the planted name is replaced, its target never opened
        trainer.train()
        assert not at.is_symlink() and at.stat().st_nlink == 1
    assert victim.read_text() == PRECIOUS


@pytest.mark.parametrize("tracker", ["tensorboard"])
def test_a_planted_tracker_dir_link_is_refused(tmp_path: Path, tracker: str) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / tracker).symlink_to(elsewhere)
    trainer = fake_trainer(tmp_path, *STEPS, f"output.tracker={tracker}")
    with pytest.raises(PathError, match=rf"output.dir {tmp_path / 'run'}: {tmp_path / 'run'}/"
                       rf"{tracker} is a symbolic link \(to {elsewhere}\); refused"):  # fmt: skip
        trainer.train()
    assert list(elsewhere.iterdir()) == []
