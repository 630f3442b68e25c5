"""A checkpoint lifecycle that never loses the newest run (trainer mechanics on the fake LM):
a run that does not resume refuses a dir holding another run's checkpoints; pruning never
deletes the checkpoint just saved, one `latest` names, or one past the run; a checkpoint
without its manifest is damaged; a checkpoint past the run's last step is refused; an override
equal to the model's own value is no change; a preempted run says how it continues, and one
that saved nothing does not exit 0."""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
from faults import captured_logs
from test_run_checkpoints import _damage, _largest_shard, _run, _stopped_after_4
from test_run_checkpoints import full as full  # the module-scoped uninterrupted 6-step run

from primus_v4.cli import main
from primus_v4.commands.train import execute
from primus_v4.errors import ExitCode, ResumeError
from primus_v4.training.checkpoint import integrity
from primus_v4.training.checkpoint.store import step_dir
from primus_v4.training.metrics.writer import read_metrics


@pytest.fixture(scope="module")
def older(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An older run's checkpoints at steps 4, 6 and 8 (8 steps, interval 2, keep_last 3)."""
    tmp = tmp_path_factory.mktemp("older")
    _run(tmp, "train.steps=8")
    assert [p.name for p in integrity.complete_checkpoints(tmp / "ckpt")] == [
        "step_00000004", "step_00000006", "step_00000008"
    ]  # fmt: skip
    return tmp


def _snapshot(root: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_a_fresh_run_refuses_a_dir_with_another_runs_checkpoints(
    older: Path, tmp_path: Path
) -> None:
    shutil.copytree(older / "ckpt", tmp_path / "ckpt")
    before = _snapshot(tmp_path / "ckpt")
    held = r"already holds checkpoints \(step_00000004, step_00000006, step_00000008\) and "
    with pytest.raises(ResumeError, match=held + "checkpoint.resume is false"):
        _run(tmp_path, "checkpoint.resume=false", "train.steps=2")
    assert _snapshot(tmp_path / "ckpt") == before  # nothing deleted, `latest` unchanged
    assert not (tmp_path / "run").exists()  # refused before any work


def _fake_checkpoint(root: Path, step: int) -> Path:
    path = step_dir(root, step)
    path.mkdir(parents=True)
    (path / ".metadata").write_text("")
    (path / "COMPLETE").write_text(json.dumps({"step": step, "model_layout": 2}))
    return path


def test_prune_keeps_the_newest_and_what_latest_names(tmp_path: Path) -> None:
    for step in (2, 4, 6, 8, 10):
        _fake_checkpoint(tmp_path, step)
    (tmp_path / "latest").write_text("step_00000004\n")
    deleted = integrity.prune(tmp_path, 1, newest=step_dir(tmp_path, 6))
    assert deleted == [step_dir(tmp_path, 2)]
    left = [p.name for p in integrity.complete_checkpoints(tmp_path)]
    # 4: `latest` names it; 6: just saved; 8 and 10: past the run (never its to delete)
    assert left == ["step_00000004", "step_00000006", "step_00000008", "step_00000010"]


def test_prune_never_follows_a_link_out_of_the_checkpoint_dir(tmp_path: Path) -> None:
    other = _fake_checkpoint(tmp_path / "other_run", 2)
    ck = tmp_path / "ck"
    ck.mkdir()
    step_dir(ck, 2).symlink_to(other, target_is_directory=True)  # another run's step, linked in
    for step in (4, 6):
        _fake_checkpoint(ck, step)
    assert integrity.prune(ck, 1, newest=step_dir(ck, 6)) == [step_dir(ck, 2), step_dir(ck, 4)]
    assert not step_dir(ck, 2).is_symlink() and not step_dir(ck, 4).exists()
    assert sorted(p.name for p in other.iterdir()) == [".metadata", "COMPLETE"]  # untouched


def test_a_checkpoint_without_its_manifest_is_damaged(full: Path, tmp_path: Path) -> None:
    ck = _stopped_after_4(full, tmp_path)
    (step_dir(ck, 4) / "MANIFEST.json").unlink()
    _damage(_largest_shard(step_dir(ck, 4)), "bitflip")  # unverifiable, and corrupt
    assert main(["inspect", "checkpoint", str(ck)]) == ExitCode.VERIFY_FAILED  # no hashing
    with captured_logs() as logs:
        result = _run(tmp_path)
    warning = next(m for m in logs if m.startswith("skipping unusable checkpoint"))
    assert f"{step_dir(ck, 4) / 'MANIFEST.json'}: missing" in warning
    assert [r.step for r in result.rows] == [3, 4, 5, 6]  # resumed from the intact step 2
    want = read_metrics(full / "run" / "metrics.jsonl")
    assert [r.loss for r in result.rows] == [w["loss"] for w in want[2:]]
    assert [p.name for p in integrity.complete_checkpoints(ck)] == [
        "step_00000002", "step_00000004", "step_00000006"
    ]  # fmt: skip
    assert integrity.problems(step_dir(ck, 4)) == []  # step 4 saved again, intact


def test_a_checkpoint_past_the_last_step_is_refused(older: Path, tmp_path: Path) -> None:
    shutil.copytree(older / "ckpt", tmp_path / "ckpt")
    with pytest.raises(ResumeError, match=r"step_00000008: it is at step 8, past this run's 5 "):
        _run(tmp_path, "train.steps=5")


def test_an_override_equal_to_the_models_value_is_no_change(full: Path, tmp_path: Path) -> None:
    _stopped_after_4(full, tmp_path)
    result = _run(tmp_path, "model.overrides.hidden_size=64", "model.overrides.num_layers=3")
    assert [r.step for r in result.rows] == [5, 6]  # the tiny preset's own values: resumed


def _stopped(tmp_path: Path, *, saved: bool, resume: bool = True) -> SimpleNamespace:
    result = SimpleNamespace(
        summary={"steps": 2}, output_dir=tmp_path, artifacts={}, stopped_at=2,
        stop_signal="SIGTERM", signum=signal.SIGTERM,
        saved=tmp_path / "step_00000002" if saved else None,
    )  # fmt: skip
    return SimpleNamespace(
        train=lambda: result,
        runtime=SimpleNamespace(close=lambda: None, is_main=True),
        cfg=SimpleNamespace(checkpoint=SimpleNamespace(resume=resume)),
    )


def test_a_preempted_run_that_saved_nothing_is_not_a_success(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert execute(_stopped(tmp_path, saved=False)) == 128 + signal.SIGTERM
    assert "saved nothing (checkpoint.dir is not set)" in capsys.readouterr().err
    assert execute(_stopped(tmp_path, saved=True)) == 0
    assert "rerun the same command to resume" in capsys.readouterr().err
    assert execute(_stopped(tmp_path, saved=True, resume=False)) == 0
    err = capsys.readouterr().err
    assert "rerun with --set checkpoint.resume=true to resume" in err
    assert "rerun the same command" not in err


def test_a_full_disk_during_a_save_is_one_error_and_leaves_nothing(tmp_path: Path) -> None:
    """Disk full mid-save (a 400 KiB tmpfs: one ~270 KiB checkpoint fits, the next does not):
    one DiskFullError naming the step, the dir and what is intact; the partial save removed."""
    from faults import limited_writes, small_disk

    from primus_v4.errors import DiskFullError

    with small_disk(tmp_path, 400 << 10) as disk:
        if disk is None:  # no tmpfs here: the first save's shard runs into RLIMIT_FSIZE instead
            return _full_by_rlimit(tmp_path, limited_writes(150_000))
        ck = disk / "ck"
        with pytest.raises(DiskFullError) as err:
            _run(tmp_path, "train.steps=4", "checkpoint.interval=1", f"checkpoint.dir={ck}")
        message = str(err.value)
        assert message.startswith(f"cannot save checkpoint step_00000002 into {ck}: disk full")
        assert "removed the partial .tmp_step_00000002" in message
        assert "the previous checkpoint step_00000001 is intact" in message
        assert sorted(p.name for p in ck.iterdir()) == ["latest", "step_00000001"]
        assert integrity.problems(step_dir(ck, 1)) == []


def _full_by_rlimit(tmp_path: Path, limit) -> None:
    import subprocess
    import sys

    here = Path(__file__).parent
    code = (
        f"import sys; sys.path[:0] = [{str(here)!r}, {str(here.parents[1] / 'helpers')!r}]\n"
        "from pathlib import Path\n"
        "from test_run_checkpoints import _run\nfrom primus_v4.errors import PrimusError\n"
        f"try: _run(Path({str(tmp_path)!r}), 'train.steps=2', 'checkpoint.interval=1')\n"
        "except PrimusError as e: print(e, file=sys.stderr); sys.exit(int(e.exit_code))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          preexec_fn=limit, timeout=300)  # fmt: skip
    assert proc.returncode == ExitCode.DISK_FULL, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"cannot save checkpoint step_00000001 into {tmp_path / 'ckpt'}")
    assert "file size limit" in last and "removed the partial .tmp_step_00000001" in last
    assert not any((tmp_path / "ckpt").glob("*step_*"))
