"""Crash-safe file publishing shared by the pack cache and checkpoints: data is fsynced before
it is renamed into place, and the rename itself is fsynced through the parent directory, so a
reader sees either the old state or the complete new one. `writable_problem` is the one check
that a directory can take new files (run preflight, `pack`, `export --out`).

Writable means a file can be created there now: in the directory itself when it exists, else in
its nearest existing parent (where it will be created). The probe file is removed at once and no
directory is created, so a failed check leaves nothing behind. The probe (not `os.access`) also
catches read-only mounts and holds for root, for whom permission bits do not apply."""

from __future__ import annotations

import glob
import os
import shutil
import stat
import tempfile
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import IO


def fsync_dir(path: Path) -> None:
    """Persist a directory's entries (a rename is durable only once its directory is synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def link_problem(path: str | Path) -> str | None:
    """Why writing at `path` could land on another file (None when it cannot): a symbolic link
    stands there, or a file with more than one name (a hard link planted to a file elsewhere)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symbolic link (to {os.readlink(path)})"
    if not stat.S_ISDIR(st.st_mode) and st.st_nlink > 1:
        return f"{path} is a hard link ({st.st_nlink} names)"
    return None


def open_own(path: Path, *, append: bool) -> IO[str]:
    """`path` opened for writing text (appending, or truncated) without following a link: a
    symbolic link there fails (ELOOP), and a file with more than one name raises
    FileExistsError before anything is truncated. Callers check `link_problem` first to say why
    in one line; this closes the window between that check and the open."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(path, flags | (os.O_APPEND if append else 0), 0o666)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            raise FileExistsError(f"{path} is not a file of its own ({st.st_nlink} names)")
        if not append:
            os.ftruncate(fd, 0)
        return os.fdopen(fd, "a" if append else "w")
    except BaseException:
        os.close(fd)
        raise


def write_durable(path: Path, text: str | bytes) -> None:
    """Write `text` to a temp file unique to this process, fsync it, then os.replace it over
    `path`. The temp file is created new (`O_EXCL | O_NOFOLLOW`: whatever stands at its name,
    a planted link included, is removed, never written through), and the rename replaces a link
    at `path` itself rather than its target."""
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        tmp.unlink(missing_ok=True)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        with os.fdopen(os.open(tmp, flags, 0o666), "wb" if isinstance(text, bytes) else "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk leaves neither a partial file nor the temp
        raise
    fsync_dir(path.parent)


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def writable_problem(path: str | Path) -> str | None:
    """Why no file can be created in directory `path` (None when one can)."""
    path = Path(path).expanduser().absolute()
    base = _nearest_existing(path)
    if not base.is_dir():
        what = "exists and is not a directory" if base == path else f"is under the file {base}"
        return f"{path} {what}"
    try:
        fd, probe = tempfile.mkstemp(prefix=".primus-v4-write-probe-", dir=base)
    except OSError as exc:
        where = "" if base == path else f" (it would be created in {base})"
        return f"{path} is not writable{where}: {exc.strerror}"
    os.close(fd)
    os.unlink(probe)
    return None


def overlap_problem(output: str | Path, inputs: Mapping[str, str | Path | None]) -> str | None:
    """Why writing `output` would overwrite or mix with one of `inputs` ({name: path}; links
    resolved): the same path, inside an input directory, or holding an input. None when apart
    (an input that does not exist here, e.g. `synthetic` or a hub name, cannot be hit)."""
    out = Path(output).expanduser().resolve()
    for name, given in inputs.items():
        if given is None or not Path(given).expanduser().exists():
            continue
        path = Path(given).expanduser().resolve()
        if out == path:
            return f"it is {name} {given}"
        if out.is_relative_to(path):
            return f"it is inside {name} {given}"
        if path.is_relative_to(out):
            return f"{name} {given} is inside it"
    return None


def new_file_mode() -> int:
    """The mode `open(path, "w")` gives a new file under this process's umask (0644 under 022)."""
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


def partial_path(target: Path) -> Path:
    """A temp name beside `target` for building it (renamed into place when complete); the pid
    in it tells a later command whether its writer still runs (`remove_stale`)."""
    return target.parent / f".{target.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _writer_runs(name: str, prefix: str) -> bool:
    pid = name[len(prefix) :].partition("-")[0]
    if not pid.isdigit() or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale(directory: Path, prefix: str) -> list[str]:
    """Remove what a killed writer left in `directory` (entries named `prefix<pid>...` whose
    process no longer runs; a name without a pid, from an older version, counts as left);
    returns their names."""
    removed = []
    for path in sorted(directory.glob(f"{glob.escape(prefix)}*")) if directory.is_dir() else []:
        if _writer_runs(path.name, prefix):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path.name)
    return removed


def _unsafe(path: Path, st: os.stat_result) -> str | None:
    if st.st_uid != os.getuid():
        return f"{path} is owned by uid {st.st_uid}, not by this user (uid {os.getuid()})"
    if st.st_mode & 0o022:
        return f"{path} is writable by group or others (mode {st.st_mode & 0o777:o})"
    return None


def private_dir_problem(path: str | Path, *, top: str | Path | None = None) -> str | None:
    """Create directory `path` (and the ones from `top` down to it) with mode 0700 where missing;
    why it cannot be trusted with files this process will load back (None when it can): a
    directory from `top` (default `path` itself) down to `path` that another user owns, or that
    group or others may write, where someone else could plant or swap what we read back.
    A directory that cannot be created is left to `writable_problem` to explain."""
    path = Path(path).expanduser().absolute()
    top = Path(top).expanduser().absolute() if top is not None else path
    chain = [path, *(p for p in path.parents if p.is_relative_to(top))]
    for directory in reversed(chain):
        try:
            directory.parent.mkdir(parents=True, exist_ok=True)
            directory.mkdir(mode=0o700, exist_ok=True)
            st = os.stat(directory)
        except OSError:
            return None
        problem = _unsafe(directory, st)
        if problem is not None:
            return problem
    return None


def trusted_file_problem(path: str | Path) -> str | None:
    """Why a file this process is about to load as code cannot be trusted (None when it can)."""
    if os.path.islink(path) or not os.path.isfile(path):
        return f"{path} is not a regular file"
    return _unsafe(Path(path), os.stat(path))
