"""One writer per run (training/run_dirs.py): a live holder of output.dir or checkpoint.dir is
named (host, pid) and refused, a dead one of this host is taken over and said so, one of another
host is refused with the file to delete; another run's outputs need output.overwrite."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import subprocess
import threading
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


@pytest.fixture
def elastic_restart(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process: attempt 1 of job slurm-77 (torchrun restarted the worker group once)."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "slurm-77")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    monkeypatch.setattr(run_dirs, "LOCK_WAIT_S", 0.3)


def test_an_earlier_attempt_that_released_its_flock_is_inherited_from_any_host(
    tmp_path: Path, elastic_restart: None
) -> None:
    """rank 0 of the restart may run on another node: the earlier attempt's lock, its flock
    released (that attempt is gone), is inherited; another job's, or the same attempt's, not."""
    cfg = _cfg(tmp_path)
    for d in ("run", "ck"):
        _plant(tmp_path / d, host="node-7", pid=4242, since="then", job="slurm-77",
               attempt=[0, 0])  # fmt: skip
    run_dirs.check(cfg)  # nothing to refuse
    with captured_logs() as logs, run_dirs.claim(cfg):
        mine = json.loads((tmp_path / "ck" / run_dirs.LOCK_FILE).read_text())
    assert (mine["job"], mine["attempt"], mine["pid"]) == ("slurm-77", [0, 1], os.getpid())
    note = "inherited the lock of pid 4242 on host node-7 (since then), an earlier attempt of job"
    assert any(f"{note} slurm-77" in m for m in logs), logs
    for job, attempt in (("slurm-77", [0, 1]), ("slurm-78", [0, 0])):
        _plant(tmp_path / "run", host="node-7", pid=4242, since="then", job=job, attempt=attempt)
        with pytest.raises(PathError, match=r"pid 4242 on host node-7"):
            run_dirs.check(cfg)


def test_a_held_flock_is_never_taken_on_the_run_id_word(
    tmp_path: Path, elastic_restart: None
) -> None:
    """The earlier attempt still holds its flock (a live run, or a node whose lease has not
    ended): the restart waits LOCK_WAIT_S, says so, then refuses; the lock is unchanged."""
    cfg = _cfg(tmp_path)
    _plant(tmp_path / "ck", host="node-7", pid=4242, since="then", job="slurm-77", attempt=[0, 0])
    lock = tmp_path / "ck" / run_dirs.LOCK_FILE
    before = lock.read_bytes()
    held = os.open(lock, os.O_RDWR)
    fcntl.flock(held, fcntl.LOCK_EX)
    try:
        run_dirs.check(cfg)  # a dry run (a requeued job revalidating) leaves it to the run
        with captured_logs() as logs, pytest.raises(ResumeError) as err, run_dirs.claim(cfg):
            pass
    finally:
        os.close(held)
    assert "\n" not in str(err.value) and "pid 4242 on host node-7" in str(err.value)
    note = "waiting up to 0 s for pid 4242 on host node-7 (since then), an earlier attempt of job"
    assert any(f"{note} slurm-77" in m for m in logs), logs
    assert lock.read_bytes() == before


def test_a_live_run_on_this_host_is_refused_to_a_same_id_relaunch(
    tmp_path: Path, elastic_restart: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first launch runs here (this process, attempt 0, holding its locks); a second launch
    with the same TORCHELASTIC_RUN_ID and a higher restart count is refused, and when the flock
    does not reach the holder (some network filesystems), its running pid refuses it."""
    cfg = _cfg(tmp_path)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    with run_dirs.claim(cfg):
        first = (tmp_path / "ck" / run_dirs.LOCK_FILE).read_bytes()
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")
        with pytest.raises(PathError, match=rf"pid {os.getpid()} on host"), run_dirs.claim(cfg):
            pass
        with pytest.raises(PathError, match=rf"pid {os.getpid()} on host"):
            run_dirs.check(cfg)  # the dry run too: the holder runs here
        assert (tmp_path / "ck" / run_dirs.LOCK_FILE).read_bytes() == first
    live = subprocess.Popen(["sleep", "30"])
    try:
        _plant(tmp_path / "ck", host=socket.gethostname(), pid=live.pid,
               start=run_dirs._start_ticks(live.pid), since="now", job="slurm-77",
               attempt=[0, 0])  # fmt: skip
        with pytest.raises(ResumeError, match=rf"pid {live.pid} on host"):
            run_dirs.check(cfg)
        with pytest.raises(ResumeError, match=rf"pid {live.pid} on host"), run_dirs.claim(cfg):
            pass
    finally:
        live.kill()
        live.wait()


def test_a_released_flock_during_the_wait_is_inherited(
    tmp_path: Path, elastic_restart: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(run_dirs, "LOCK_WAIT_S", 30.0)
    cfg = _cfg(tmp_path)
    _plant(tmp_path / "ck", host="node-7", pid=4242, since="then", job="slurm-77", attempt=[0, 0])
    held = os.open(tmp_path / "ck" / run_dirs.LOCK_FILE, os.O_RDWR)
    fcntl.flock(held, fcntl.LOCK_EX)
    release = threading.Timer(0.5, os.close, (held,))
    release.start()
    with run_dirs.claim(cfg):
        mine = json.loads((tmp_path / "ck" / run_dirs.LOCK_FILE).read_text())
    release.join()
    assert mine["pid"] == os.getpid()


@pytest.mark.parametrize("where", ["run", "ck"])
@pytest.mark.parametrize("link", ["symbolic", "hard"])
def test_a_planted_lock_link_is_refused_and_its_target_unchanged(
    tmp_path: Path, where: str, link: str
) -> None:
    cfg = _cfg(tmp_path)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (tmp_path / where).mkdir()
    lock = tmp_path / where / run_dirs.LOCK_FILE
    if link == "symbolic":
        lock.symlink_to(victim)
    else:
        os.link(victim, lock)
    kind = PathError
    what = "output.dir" if where == "run" else "checkpoint.dir"
    word = "a symbolic link" if link == "symbolic" else "a hard link"
    for attempt in (lambda: run_dirs.check(cfg), lambda: run_dirs.claim(cfg).__enter__()):
        with pytest.raises(kind) as err:
            attempt()
        text = str(err.value)
        assert "\n" not in text and text.startswith(f"{what} {tmp_path / where}: the lock file")
        assert word in text and "nothing written through it" in text, text
    assert victim.read_text() == "precious\n"


def test_a_link_planted_at_a_durable_write_s_temp_name_is_not_followed(tmp_path: Path) -> None:
    from primus_v4.durable import write_durable

    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    target = tmp_path / "out" / "latest"
    target.parent.mkdir()
    (target.parent / f".latest.tmp.{os.getpid()}").symlink_to(victim)
    write_durable(target, "step_00000002\n")
    assert target.read_text() == "step_00000002\n" and not target.is_symlink()
    assert victim.read_text() == "precious\n"


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
