"""One writer per run (training/run_dirs.py): a live holder of output.dir or checkpoint.dir is
named (host, pid) and refused, a dead one of this host is taken over and said so, one of another
host is refused with the file to delete; another run's outputs need output.overwrite."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import subprocess
from pathlib import Path

import pytest
from faults import captured_logs

from primus_v4.config import load_config
from primus_v4.errors import PathError, ResumeError
from primus_v4.training import run_dirs


def _cfg(tmp: Path, *sets: str):
    return load_config(overrides=[f"output.dir={tmp / 'run'}", f"checkpoint.dir={tmp / 'ck'}",
                                  *sets])  # fmt: skip


def _plant(directory: Path, **holder: object) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / run_dirs.LOCK_FILE).write_text(json.dumps(holder))


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_a_live_holder_is_refused_by_host_and_pid(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    held = rf"output.dir {tmp_path / 'run'} is in use by another run: pid {os.getpid()} on host "
    with run_dirs.claim(cfg):  # the first run, this process
        with pytest.raises(PathError, match=held + socket.gethostname()), run_dirs.claim(cfg):
            pass
        with pytest.raises(ResumeError, match=r"checkpoint.dir .* is in use .* wait for it"):
            run_dirs.check(_cfg(tmp_path, f"output.dir={tmp_path / 'other'}"))
    assert not (tmp_path / "run" / run_dirs.LOCK_FILE).exists()  # released at the end
    with run_dirs.claim(cfg):
        pass


def test_a_stale_lock_of_this_host_is_taken_over_and_one_of_another_host_refused(
    tmp_path: Path,
) -> None:
    cfg = _cfg(tmp_path)
    pid = _dead_pid()
    _plant(tmp_path / "ck", host=socket.gethostname(), pid=pid, since="then")
    with captured_logs() as logs, run_dirs.claim(cfg):
        pass
    assert any(f"took over the stale lock of pid {pid}" in m for m in logs), logs
    _plant(tmp_path / "run", host="node-7", pid=4242, since="then")
    lock = tmp_path / "run" / run_dirs.LOCK_FILE
    for attempt in (lambda: run_dirs.check(cfg), lambda: run_dirs.claim(cfg).__enter__()):
        with pytest.raises(PathError, match=rf"pid 4242 on host node-7 .* delete {lock}"):
            attempt()
    assert lock.is_file()  # never taken from a host that cannot be checked


def test_an_earlier_elastic_attempt_of_the_same_job_is_taken_over_from_any_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torchrun restarted the worker group (rank 0 may now run on another node): the previous
    attempt's lock is taken over, even while its flock is still held; another job's is not."""
    cfg = _cfg(tmp_path)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "slurm-77")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    _plant(tmp_path / "run", host="node-7", pid=4242, since="then", job="slurm-77",
           attempt=[0, 0])  # fmt: skip
    lock = tmp_path / "ck" / run_dirs.LOCK_FILE
    _plant(tmp_path / "ck", host="node-7", pid=4242, since="then", job="slurm-77", attempt=[0, 0])
    held = os.open(lock, os.O_RDWR)  # the dead node's flock, as a shared filesystem keeps it
    fcntl.flock(held, fcntl.LOCK_EX)
    try:
        run_dirs.check(cfg)  # nothing to refuse
        with captured_logs() as logs, run_dirs.claim(cfg):
            mine = json.loads(lock.read_text())
    finally:
        os.close(held)
    assert (mine["job"], mine["attempt"], mine["pid"]) == ("slurm-77", [0, 1], os.getpid())
    assert any("breaking the lock of pid 4242 on host node-7" in m for m in logs), logs
    assert any("an earlier attempt of job slurm-77" in m for m in logs), logs
    # The same attempt, or another job, on a host that cannot be checked: refused as before.
    for job, attempt in (("slurm-77", [0, 1]), ("slurm-78", [0, 0])):
        _plant(tmp_path / "run", host="node-7", pid=4242, since="then", job=job, attempt=attempt)
        with pytest.raises(PathError, match=r"pid 4242 on host node-7"):
            run_dirs.check(cfg)


def test_another_runs_outputs_need_overwrite_unless_resumed(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    (out / "loss.png").write_bytes(b"png")
    (out / "config.yaml").write_text(f"checkpoint:\n  dir: {tmp_path / 'old_ck'}\n")
    cfg = _cfg(tmp_path)
    with pytest.raises(PathError, match=r"already holds another run's outputs \(config.yaml, "
                       r"metrics.jsonl\).*output.overwrite=true"):  # fmt: skip
        run_dirs.check(cfg)
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml", "loss.png", "metrics.jsonl"]
    # the run that wrote them, resumed (same checkpoint.dir, resume on), continues them
    (out / "config.yaml").write_text(f"checkpoint:\n  dir: {tmp_path / 'ck'}\n")
    run_dirs.check(cfg)
    with pytest.raises(PathError):
        run_dirs.check(_cfg(tmp_path, "checkpoint.resume=false"))
    with captured_logs() as logs, run_dirs.claim(_cfg(tmp_path, "output.overwrite=true")):
        assert sorted(p.name for p in out.iterdir()) == [".primus-v4.lock", "config.yaml"]
    assert any("removed the previous run's metrics.jsonl, loss.png" in m for m in logs)
