"""Checkpoints a run can trust (trainer mechanics on the fake LM, so each run takes a second):
a bit-flipped or truncated latest checkpoint is reported by file and skipped for the previous
one, and the continued run equals the uninterrupted one; keep_last; `inspect checkpoint
--verify`; resume rules (model changes are errors naming the keys, a schedule change applies
from the resumed step); metrics.jsonl holds each step once across a resume."""

from __future__ import annotations

import dataclasses
import math
import shutil
from pathlib import Path

import pytest
import torch
from faults import captured_logs
from train_fakes import RAGGED_PACKS, FakeCorpus, FakeLM, tiny_run

from primus_v4.cli import main
from primus_v4.errors import CheckpointError, ResumeError
from primus_v4.training.checkpoint.store import step_dir
from primus_v4.training.metrics.writer import read_metrics
from primus_v4.training.optim.lr_schedule import warmup_cosine

STEPS = ("train.steps=6", "train.warmup_steps=1", "train.global_batch_size=2")
KEYS = ("loss", "mtp_loss", "aux_loss", "grad_norm", "lr")


class _LM(FakeLM):
    """FakeLM plus a 1-D parameter: torch's flat optimizer state dict cannot load back an
    optimizer whose no-decay group is empty, and real models always have norms there."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.Parameter(torch.ones(4))  # untouched: gets zero gradients


def _trainer(tmp: Path, *settings: str, world: int = 1):
    from primus_v4.config import resolve_run
    from primus_v4.training.trainer import Trainer

    ck = (f"checkpoint.dir={tmp / 'ckpt'}", "checkpoint.interval=2", "output.plot=true")
    run = resolve_run(tiny_run(tmp, *STEPS, *ck, *settings).cfg, world=world)
    return Trainer(run, corpus=FakeCorpus(RAGGED_PACKS[:4]), model=_LM())


def _run(tmp: Path, *settings: str):
    return _trainer(tmp, *settings).train()


@pytest.fixture(scope="module")
def full(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted 6-step run with checkpoints at steps 2, 4, 6, all kept."""
    tmp = tmp_path_factory.mktemp("full")
    _run(tmp, "checkpoint.keep_last=0")
    return tmp


def _stopped_after_4(full: Path, tmp: Path) -> Path:
    """The same run as if it stopped after step 4: checkpoints 2 and 4, metrics rows 1-4."""
    ck = tmp / "ckpt"
    ck.mkdir(parents=True)
    for step in (2, 4):
        shutil.copytree(step_dir(full / "ckpt", step), step_dir(ck, step))
    (ck / "latest").write_text("step_00000004\n")
    (tmp / "run").mkdir()
    rows = (full / "run" / "metrics.jsonl").read_text().splitlines(keepends=True)
    (tmp / "run" / "metrics.jsonl").write_text("".join(rows[:4]))
    return ck


def _largest_shard(path: Path) -> Path:
    return max(path.glob("*.distcp"), key=lambda p: p.stat().st_size)


def _damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "bitflip":
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
    else:
        path.write_bytes(bytes(data[: len(data) // 2]))


@pytest.mark.parametrize("how", ["bitflip", "truncate"])
def test_damaged_latest_falls_back_and_continues_exactly(full: Path, tmp_path: Path, how) -> None:
    ck = _stopped_after_4(full, tmp_path)
    victim = _largest_shard(step_dir(ck, 4))
    _damage(victim, how)
    assert main(["inspect", "checkpoint", str(ck), "--verify"]) == 1
    with captured_logs() as logs:
        result = _run(tmp_path)
    warning = next(m for m in logs if m.startswith("skipping unusable checkpoint"))
    assert str(victim) in warning
    assert ("corrupt" if how == "bitflip" else "truncated") in warning
    assert [r.step for r in result.rows] == [3, 4, 5, 6]  # resumed from step 2
    want = read_metrics(full / "run" / "metrics.jsonl")
    for key in KEYS:  # exact: same state, same data, same arithmetic
        assert [getattr(r, key) for r in result.rows] == [w[key] for w in want[2:]], key
    # metrics.jsonl: each step once (the old rows 3-4 replaced), summary over all 6 steps.
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in rows] == [w["loss"] for w in want]
    assert result.summary["steps"] == 6 and (tmp_path / "run" / "loss.png").is_file()


def test_keep_last_keeps_the_newest(tmp_path: Path) -> None:
    _run(tmp_path, "checkpoint.interval=1", "checkpoint.keep_last=2")
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step_*")) == [
        "step_00000005",
        "step_00000006",
    ]
    assert main(["inspect", "checkpoint", str(tmp_path / "ckpt"), "--verify"]) == 0


def test_inspect_checkpoint_verify(full: Path, tmp_path: Path, capsys) -> None:
    one = tmp_path / "step_00000002"
    shutil.copytree(step_dir(full / "ckpt", 2), one)
    assert main(["inspect", "checkpoint", str(one), "--verify"]) == 0
    assert "verified" in capsys.readouterr().out
    (one / "extra").mkdir()
    (one / "extra" / "notes.bin").write_bytes(b"added later")
    assert main(["inspect", "checkpoint", str(one), "--verify"]) == 1
    assert f"{one / 'extra/notes.bin'}: not in MANIFEST.json (1 file(s) the save did not " \
        "write)" in capsys.readouterr().out  # fmt: skip
    (one / "extra" / "notes.bin").unlink()
    (one / ".metadata").write_bytes((one / ".metadata").read_bytes() + b"x")
    assert main(["inspect", "checkpoint", str(one), "--verify"]) == 1
    assert f"{one / '.metadata'}: truncated or resized" in capsys.readouterr().out
    (one / "config.yaml").unlink()
    assert main(["inspect", "checkpoint", str(one), "--verify", "--json"]) == 1
    assert f"{one / 'config.yaml'}: missing" in capsys.readouterr().out


def test_every_checkpoint_damaged_is_an_error(full: Path, tmp_path: Path) -> None:
    ck = _stopped_after_4(full, tmp_path)
    for step in (2, 4):
        _damage(_largest_shard(step_dir(ck, step)), "bitflip")
    unusable = r"no usable checkpoint in .*step_00000004 \(.*corrupt.*step_00000002 \("
    with pytest.raises(CheckpointError, match=unusable):
        _run(tmp_path)


def test_resume_with_another_model_names_the_keys(full: Path, tmp_path: Path) -> None:
    _stopped_after_4(full, tmp_path)
    keys = r"model.overrides.hidden_size: None -> 128, model.overrides.vocab_size: 512 -> 1024"
    with pytest.raises(ResumeError, match=keys):
        _run(tmp_path, "model.overrides.hidden_size=128", "model.overrides.vocab_size=1024")


def test_changed_schedule_is_the_new_one_from_the_resumed_step(full: Path, tmp_path: Path) -> None:
    _stopped_after_4(full, tmp_path)
    shutil.rmtree(step_dir(tmp_path / "ckpt", 2))
    with captured_logs() as logs:
        result = _run(tmp_path, "train.steps=8", "train.lr=2e-3", "train.min_lr=1e-4")
    assert any("changed schedule" in m and "train.lr: 0.005 -> 0.002" in m for m in logs)
    factor = warmup_cosine(lr=2e-3, min_lr=1e-4, warmup_steps=1, total_steps=8)
    assert [r.step for r in result.rows] == [5, 6, 7, 8]
    for row in result.rows:  # the lr a step uses is the schedule at the steps done before it
        assert math.isclose(row.lr, 2e-3 * factor(row.step - 1), rel_tol=1e-15), row.step


def test_resume_with_other_model_parallel_sizes_is_an_error(full: Path, tmp_path: Path) -> None:
    from primus_v4.training.checkpoint.lifecycle import check_resumable

    saved = step_dir(full / "ckpt", 2)
    cfg = _trainer(tmp_path).cfg
    check_resumable(saved, cfg, world=1)  # same model, one rank: fine
    with captured_logs() as logs:
        check_resumable(saved, cfg, world=2)  # only the data-parallel size changes: resharded
    assert any("saved by 1 ranks on 2 ranks" in m for m in logs)
    other = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, cp=2))
    with pytest.raises(ResumeError, match=r"changed in parallel.cp: 1 -> 2"):
        check_resumable(saved, other, world=2)
