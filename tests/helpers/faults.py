"""Fault injection for the failure tests: a disk that fills up, a directory that cannot be
written, a file that cannot be read, whether or not the tests run as root.

A full disk is a tmpfs of a few hundred KiB mounted for the test when this process may mount
one (root, and a container that allows it); otherwise `limited_writes` makes the writes of a
child process fail past a size with RLIMIT_FSIZE (EFBIG, "File too large"), the same path in
the code. `kind()` says which one a run used, so a test report can name it."""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import signal
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path


def _mount(kind: str, where: Path, options: str) -> bool:
    # PRIMUS_TEST_NO_MOUNT=1 runs the fallbacks a machine without mount rights takes
    if os.geteuid() != 0 or os.environ.get("PRIMUS_TEST_NO_MOUNT", "0") != "0":
        return False
    where.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["mount", "-t", kind, "-o", options, kind, str(where)],
                          capture_output=True, text=True, check=False)  # fmt: skip
    return proc.returncode == 0


def _umount(where: Path) -> None:
    subprocess.run(["umount", "-l", str(where)], capture_output=True, check=False)


@contextlib.contextmanager
def small_disk(where: Path, size_bytes: int) -> Iterator[Path | None]:
    """`where` on a tmpfs of `size_bytes`, or None when no tmpfs can be mounted here."""
    name = f"tmpfs-{uuid.uuid4().hex[:6]}"
    mounted = _mount("tmpfs", where / name, f"size={size_bytes},mode=0777")
    try:
        yield where / name if mounted else None
    finally:
        if mounted:
            _umount(where / name)


@contextlib.contextmanager
def read_only_dir(where: Path) -> Iterator[Path]:
    """A place no file can be created in: a read-only tmpfs as root (permission bits do not
    stop root), mode 0555 for a normal user, and for root without mount rights a regular file
    (nothing can be created under it: ENOTDIR)."""
    target = where / f"ro-{uuid.uuid4().hex[:6]}"
    if _mount("tmpfs", target, "ro,size=64k"):
        try:
            yield target
        finally:
            _umount(target)
        return
    if os.geteuid() == 0:
        target.write_text("")
        try:
            yield target
        finally:
            target.unlink()
        return
    target.mkdir(parents=True)
    target.chmod(0o555)
    try:
        yield target
    finally:
        target.chmod(0o755)


def limited_writes(max_bytes: int) -> Callable[[], None]:
    """A `preexec_fn`: the child's files cannot grow past `max_bytes` (writes fail with EFBIG
    instead of killing it with SIGXFSZ)."""

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes, resource.RLIM_INFINITY))

    return limit


def can_mount() -> bool:
    """Whether `small_disk` mounts a real tmpfs here (else RLIMIT_FSIZE stands in)."""
    probe = Path(os.environ.get("TMPDIR", "/tmp")) / f".mount-probe-{os.getpid()}"
    with small_disk(probe, 1 << 16) as disk:
        ok = disk is not None
    with contextlib.suppress(OSError):
        for child in probe.iterdir():
            child.rmdir()
        probe.rmdir()
    return ok


def kind() -> str:
    return "tmpfs (mounted)" if can_mount() else "RLIMIT_FSIZE (EFBIG past a size)"


@contextlib.contextmanager
def unreadable(path: Path) -> Iterator[str]:
    """`path` cannot be opened (EACCES). Mode 000 for a normal user; root reads through
    permission bits, so there every open of `path` (builtins.open, io.open, os.open) fails with
    the same PermissionError the kernel would give. Yields how it was done, for the report."""
    import builtins
    import errno
    import io

    target = os.path.realpath(path)
    if os.geteuid() != 0:
        mode = path.stat().st_mode
        path.chmod(0)
        try:
            yield "mode 000"
        finally:
            path.chmod(mode)
        return
    real_open, real_os_open = builtins.open, os.open

    def denied(file: object) -> bool:
        return isinstance(file, (str, bytes, os.PathLike)) and os.path.realpath(file) == target

    def fake_open(file, *args, **kwargs):  # type: ignore[no-untyped-def]
        if denied(file):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_open(file, *args, **kwargs)

    def fake_os_open(file, *args, **kwargs):  # type: ignore[no-untyped-def]
        if denied(file):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_os_open(file, *args, **kwargs)

    builtins.open, io.open, os.open = fake_open, fake_open, fake_os_open  # type: ignore[assignment]
    try:
        yield "open() patched to raise EACCES (root ignores mode 000)"
    finally:
        builtins.open, io.open, os.open = real_open, real_open, real_os_open  # type: ignore[assignment]


@contextlib.contextmanager
def captured_logs(name: str = "primus_v4") -> Iterator[list[str]]:
    """The log messages of logger `name` and below (the package's logger does not propagate to
    the root one: no caplog). A command that sets up logging replaces the package logger's
    handlers: name a module's logger to capture through it."""
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
