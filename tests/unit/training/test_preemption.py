"""Preemption, in a real process: SIGTERM (or SIGUSR1) mid-run finishes the step, saves a
checkpoint, writes metrics and exits 0 saying how to resume; the rerun of the same command
continues bit-exact to the uninterrupted run; keep_last holds; a second signal exits at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_run_checkpoints import KEYS, _run

from primus_v4.cli import main
from primus_v4.training.metrics.writer import read_metrics

REPO = Path(__file__).resolve().parents[3]
WORKER = Path(__file__).with_name("preempt_worker.py")
SETTINGS = ("train.steps=8", "checkpoint.interval=1", "checkpoint.keep_last=2")


def _start(tmp: Path, delay: float) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(WORKER), str(tmp), str(delay), *SETTINGS],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for_rows(tmp: Path, rows: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    metrics = tmp / "run" / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= rows:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    proc.kill()
    pytest.fail(f"no {rows} metrics rows within {timeout} s")


def _stop_with(tmp: Path, signum: int) -> int:
    """Signal a run after its second step; check the exit, message, metrics and checkpoints;
    return the step it stopped after."""
    proc = _start(tmp, delay=0.5)
    _wait_for_rows(tmp, 2, proc)
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    rows = read_metrics(tmp / "run" / "metrics.jsonl")
    stopped = rows[-1]["step"]
    assert 2 <= stopped < 8 and [r["step"] for r in rows] == list(range(1, stopped + 1))
    assert f"saved step {stopped} " in err and "rerun the same command to resume" in err
    ck = tmp / "ckpt"
    kept = [f"step_{s:08d}" for s in (stopped - 1, stopped)]  # keep_last=2
    assert sorted(p.name for p in ck.glob("step_*")) == kept
    assert main(["inspect", "checkpoint", str(ck), "--verify"]) == 0
    assert "run summary" in out
    return stopped


def test_sigusr1_saves_and_exits_0(tmp_path: Path) -> None:
    _stop_with(tmp_path, signal.SIGUSR1)


def test_sigterm_saves_and_the_rerun_continues_exactly(tmp_path: Path) -> None:
    _stop_with(tmp_path, signal.SIGTERM)
    rerun = _start(tmp_path, delay=0.0)
    _, err = rerun.communicate(timeout=120)
    assert rerun.returncode == 0, err
    resumed = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == list(range(1, 9))
    _run(tmp_path / "full", *SETTINGS)
    full = read_metrics(tmp_path / "full" / "run" / "metrics.jsonl")
    for key in KEYS:  # exact: the resumed state and data position equal the uninterrupted ones
        assert [r[key] for r in resumed] == [r[key] for r in full], key
    ck = tmp_path / "ckpt"
    assert sorted(p.name for p in ck.glob("step_*")) == ["step_00000007", "step_00000008"]


def test_second_signal_exits_at_once(tmp_path: Path) -> None:
    proc = _start(tmp_path, delay=4.0)
    _wait_for_rows(tmp_path, 1, proc)
    time.sleep(1.0)  # both signals land inside step 2's 4 s
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM
    assert "SIGTERM again: exiting now without saving" in err
    assert not (tmp_path / "ckpt" / "step_00000002").exists()
