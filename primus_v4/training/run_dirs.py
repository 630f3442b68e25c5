"""One writer per run: `train` holds an exclusive lock on its output.dir and its checkpoint.dir
for as long as it runs, and does not start over another run's outputs.

The lock is `.primus-v4.lock` in the directory: an flock held on it (released by the kernel when
the process dies) plus who holds it (host, pid, the process's start time) for the message a
second run prints. An flock that is free but names a process of this host that no longer runs is
a stale lock (a run killed with -9): it is taken over, and said so. One that names a process on
another host is refused unless that host's flock says otherwise: whether it still runs cannot be
checked from here, so the message names the file to delete when that run is gone. Under
torchrun's elastic agent a lock of an earlier attempt of the same job (same rendezvous id, fewer
restarts) is inherited once that attempt is proven gone: its flock released (rank 0 may now run
on another node), and, on this host, its process no longer running. The rendezvous id is never
proof on its own: while the earlier attempt's flock is held, the new attempt waits for it
(`LOCK_WAIT_S`, saying so) and then refuses, so a second launch with the same id never takes a
live run's directory.

The lock file is opened without following links: a symbolic link planted in its place, or a hard
link to another file, is refused in one line and nothing is written through it.

Another run's outputs are an output.dir holding a config.yaml or a metrics.jsonl: refused unless
this run continues that one (same checkpoint.dir, checkpoint.resume on) or
`output.overwrite=true`, which first removes the old run's metrics, plot and event files so none
of them is ever read beside the new run's. A run that stops before its first step is recorded
(a failed set-up, a first step that fails, Ctrl-C) removes what it wrote there (`FirstStep`), so
it is never another run's outputs to its own rerun.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import os
import shutil
import socket
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from primus_v4.config import RunConfig
from primus_v4.durable import link_problem
from primus_v4.errors import PathError, PrimusError, ResumeError
from primus_v4.log import get_logger

log = get_logger(__name__)

LOCK_FILE = ".primus-v4.lock"
LOCK_WAIT_S = 120.0  # an elastic restart waits this long for its earlier attempt's flock
RUN_MARKS = ("config.yaml", "metrics.jsonl")
# What a run writes into output.dir and reads back (summary, plot): removed on overwrite.
RUN_ARTIFACTS = ("metrics.jsonl", "loss.png", "tensorboard", "wandb", "mlruns", "tracker_run.json")


def absolute_dirs(cfg: RunConfig) -> RunConfig:
    """`cfg` with output.dir and checkpoint.dir absolute: what the run records (its config.yaml
    and each checkpoint's) names the same directories from wherever it is read."""
    out = str(Path(cfg.output.dir).expanduser().absolute())
    ck = cfg.checkpoint.dir
    ck = str(Path(ck).expanduser().absolute()) if ck else ck
    return dataclasses.replace(
        cfg,
        output=dataclasses.replace(cfg.output, dir=out),
        checkpoint=dataclasses.replace(cfg.checkpoint, dir=ck),
    )


def _start_ticks(pid: int) -> int | None:
    """The process's start time (clock ticks since boot): a reused pid has another one."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat.rpartition(")")[2].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _attempt() -> dict[str, Any]:
    """The elastic job this process belongs to and its attempt (SLURM requeues, then torchrun's
    restarts of the worker group); empty outside a torchrun rendezvous with an id."""
    job = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if job in ("", "none"):
        return {}
    counts = (os.environ.get(k, "0") or "0" for k in ("SLURM_RESTART_COUNT",
                                                      "TORCHELASTIC_RESTART_COUNT"))  # fmt: skip
    return {"job": job, "attempt": [int(c) if c.isdigit() else 0 for c in counts]}


def _earlier_attempt(holder: dict[str, Any] | None) -> bool:
    """Whether the holder is an earlier attempt of this process's elastic job."""
    mine = _attempt()
    theirs = (holder or {}).get("attempt")
    return (
        bool(mine)
        and holder is not None
        and holder.get("job") == mine["job"]
        and isinstance(theirs, list)
        and theirs < mine["attempt"]
    )


def _me() -> dict[str, Any]:
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "start": _start_ticks(pid),
            "since": time.strftime("%Y-%m-%d %H:%M:%S"), **_attempt()}  # fmt: skip


def _running(holder: dict[str, Any]) -> bool:
    """Whether the holder, a process of this host, still runs."""
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's live process
    start = holder.get("start")
    return start is None or _start_ticks(pid) in (None, start)


def refuse_link(path: Path, what: str) -> None:
    """A PathError in one line when writing at `path` could land on another file: a symbolic
    link, or a hard link to a file elsewhere, planted there (durable.link_problem)."""
    problem = link_problem(path)
    if problem is not None:
        raise PathError(f"{what} {path.parent}: {problem}; refused, nothing written through it: "
                        "remove it if it is not yours")  # fmt: skip


def _live_here(holder: dict[str, Any] | None) -> bool:
    """The holder is a process of this host that still runs (never to be waited out)."""
    here = (holder or {}).get("host") in (None, socket.gethostname())
    return here and bool(holder) and _running(holder or {})


def _read_holder(fd: int) -> dict[str, Any] | None:
    os.lseek(fd, 0, os.SEEK_SET)
    raw = os.read(fd, 4096)
    if not raw.strip():
        return None
    try:
        holder = json.loads(raw)
    except ValueError:
        return {}  # cut short by a kill mid-write: nobody can be named
    return holder if isinstance(holder, dict) else {}


def _who(holder: dict[str, Any]) -> str:
    return (f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')} (since "
            f"{holder.get('since', '?')})")  # fmt: skip


def _in_use(what: str, directory: Path, holder: dict[str, Any] | None) -> PrimusError:
    kind = ResumeError if what == "checkpoint.dir" else PathError
    holder = holder or {}
    if holder.get("host", socket.gethostname()) != socket.gethostname():
        how = (f"; it cannot be checked from this host: if that run is gone, delete "
               f"{directory / LOCK_FILE}")  # fmt: skip
    else:
        how = f"; wait for it to finish or choose another {what}"
    return kind(f"{what} {directory} is in use by another run: {_who(holder)}{how}")


def _problem(what: str, directory: Path, fd: int) -> tuple[PrimusError | None, str | None]:
    """With the flock taken: (a refusal, None) or (None, a takeover note or None)."""
    holder = _read_holder(fd)
    if holder is None:
        return None, None
    this_host = holder.get("host") in (None, socket.gethostname())
    if this_host and holder and _running(holder):  # a filesystem whose flock misses the holder
        return _in_use(what, directory, holder), None
    if _earlier_attempt(holder):  # its flock is released: that attempt is gone
        return None, (f"{what} {directory}: inherited the lock of {_who(holder)}, an earlier "
                      f"attempt of job {holder['job']} that no longer holds it")  # fmt: skip
    if not this_host:
        return _in_use(what, directory, holder), None
    who = _who(holder) if holder else "an unreadable lock"
    return None, f"{what} {directory}: took over the stale lock of {who}, which no longer runs"


def _planted(what: str, path: Path, fd: int) -> PrimusError | None:
    """A refusal when the opened lock file is not a plain file of its own (a hard link to
    another file would be truncated through it)."""
    st = os.fstat(fd)
    if stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
        return None
    kind = "a hard link" if stat.S_ISREG(st.st_mode) else "not a regular file"
    return PathError(f"{what} {path.parent}: the lock file {path} is {kind} ({st.st_nlink} "
                     "names); refused, nothing written through it: remove it if it is not "
                     "yours")  # fmt: skip


def _open_lock(what: str, path: Path, flags: int) -> int:
    """The lock file opened without following a link; a planted link is refused."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise PathError(f"{what} {path.parent}: the lock file {path} is a symbolic link (to "
                        f"{os.readlink(path)}); refused, nothing written through it: remove "
                        "it if it is not yours") from None  # fmt: skip
    problem = _planted(what, path, fd)
    if problem is not None:
        os.close(fd)
        raise problem
    return fd


def _wait_for_earlier_attempt(what: str, path: Path, fd: int, holder: dict[str, Any]) -> bool:
    """Wait up to LOCK_WAIT_S for an earlier attempt of this job to release its flock; True
    when it did (the flock is then held here)."""
    log.warning("%s %s: waiting up to %.0f s for %s, an earlier attempt of job %s, to release "
                "its lock", what, path.parent, LOCK_WAIT_S, _who(holder),
                holder.get("job"))  # fmt: skip
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
        if time.monotonic() >= deadline:
            return False
        time.sleep(min(1.0, max(0.05, LOCK_WAIT_S / 20)))


def _open_locked(what: str, path: Path) -> int | None:
    """The lock file's descriptor with the flock held (None: it went away; try again)."""
    fd = _open_lock(what, path, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            os.close(fd)
            raise
        holder = _read_holder(fd)
        if not (_earlier_attempt(holder) and not _live_here(holder)
                and _wait_for_earlier_attempt(what, path, fd, holder)):  # fmt: skip
            os.close(fd)
            raise _in_use(what, path.parent, holder) from None
    try:
        same = os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        same = False
    if not same:  # the holder removed it while releasing: lock the file that is there now
        os.close(fd)
        return None
    return fd


@contextlib.contextmanager
def locked(what: str, directory: Path) -> Iterator[None]:
    """Hold `directory`'s lock (created with the directory) until the block ends."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_FILE
    fd = None
    while fd is None:
        fd = _open_locked(what, path)
    try:
        refusal, note = _problem(what, directory, fd)
        if refusal is not None:
            raise refusal
        if note is not None:
            log.warning(note)
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, (json.dumps(_me()) + "\n").encode())
        os.fsync(fd)
        try:
            yield
        finally:
            path.unlink(missing_ok=True)  # while still held: a waiter re-checks the inode
    finally:
        os.close(fd)


def lock_problem(what: str, directory: Path) -> PrimusError | None:
    """What `locked` would refuse, without creating anything (--dry-run)."""
    path = directory / LOCK_FILE
    try:
        fd = _open_lock(what, path, os.O_RDWR)
    except PrimusError as problem:
        return problem
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _read_holder(fd)
            # an earlier attempt of this job (a SLURM requeue revalidating): the run itself
            # waits for its flock (LOCK_WAIT_S) and decides; a dry run changes nothing
            if _earlier_attempt(holder) and not _live_here(holder):
                return None
            return _in_use(what, directory, holder)
        return _problem(what, directory, fd)[0]
    finally:
        os.close(fd)


def _recorded_checkpoint_dir(out: Path) -> str | None:
    """checkpoint.dir as the run in `out` recorded it, absolute (None: unknown or unset)."""
    try:
        saved = yaml.safe_load((out / "config.yaml").read_text())
        ck = saved["checkpoint"]["dir"]
    except (OSError, yaml.YAMLError, TypeError, KeyError, UnicodeDecodeError):
        return None
    return str(Path(ck).absolute()) if isinstance(ck, str) and ck else None


def foreign_output(cfg: RunConfig) -> PrimusError | None:
    """A refusal when output.dir holds another run's outputs (see the module docstring)."""
    out = Path(cfg.output.dir)
    marks = [name for name in RUN_MARKS if (out / name).exists()]
    if not marks or cfg.output.overwrite:
        return None
    ck = cfg.checkpoint.dir
    if ck and cfg.checkpoint.resume and _recorded_checkpoint_dir(out) == str(Path(ck).absolute()):
        return None  # this run continues the one that wrote them
    return PathError(
        f"output.dir {out} already holds another run's outputs ({', '.join(marks)}); this run "
        "would mix its metrics with theirs. Choose a new output.dir, or set "
        "output.overwrite=true to replace them"
    )


def _clear_artifacts(out: Path) -> None:
    gone = []
    for name in RUN_ARTIFACTS:
        path = out / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
        else:
            continue
        gone.append(name)
    if gone:
        log.warning("output.overwrite: removed the previous run's %s from %s", ", ".join(gone), out)


class FirstStep:
    """What output.dir held before this run wrote to it. A run that fails (or is interrupted)
    before its first step is recorded leaves nothing of its own behind: `undo` removes the
    run's marks and artifacts that were not there before, so the same command, rerun once the
    cause is fixed, is not refused as another run's outputs."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.before = {n for n in (*RUN_MARKS, *RUN_ARTIFACTS)
                       if (out / n).exists() or (out / n).is_symlink()}  # fmt: skip

    def undo(self) -> None:
        gone = []
        for name in dict.fromkeys((*RUN_MARKS, *RUN_ARTIFACTS)):
            path = self.out / name
            if name in self.before or not (path.exists() or path.is_symlink()):
                continue
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            gone.append(name)
        if gone:
            log.warning("the run stopped before its first step: removed its %s from %s, so a "
                        "rerun starts there afresh", ", ".join(gone), self.out)  # fmt: skip


def check(cfg: RunConfig) -> None:
    """What `claim` would refuse, changing nothing (--dry-run)."""
    for problem in (foreign_output(cfg), *(lock_problem(w, d) for w, d in _dirs(cfg))):
        if problem is not None:
            raise problem


def _dirs(cfg: RunConfig) -> list[tuple[str, Path]]:
    out = Path(cfg.output.dir).absolute()
    dirs = [("output.dir", out)]
    ck = Path(cfg.checkpoint.dir).absolute() if cfg.checkpoint.dir else None
    if ck is not None and ck.resolve() != out.resolve():  # one lock for one dir, links resolved
        dirs.append(("checkpoint.dir", ck))
    return dirs


@contextlib.contextmanager
def claim(cfg: RunConfig) -> Iterator[None]:
    """Lock the run's directories, refuse another run's outputs, clear them on overwrite."""
    with contextlib.ExitStack() as stack:
        for what, directory in _dirs(cfg):
            stack.enter_context(locked(what, directory))
        problem = foreign_output(cfg)
        if problem is not None:
            raise problem
        if cfg.output.overwrite:
            _clear_artifacts(Path(cfg.output.dir))
        yield
