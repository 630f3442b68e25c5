"""User-facing errors: the CLI prints their message (what, where, what to do) as one line on
stderr, without a traceback, and exits with the error's kind as its status (`ExitCode`), so a
script or a scheduler can tell a bad config from a full disk or a damaged checkpoint."""

from __future__ import annotations

import errno
import os
from enum import IntEnum


class ExitCode(IntEnum):
    """Exit status of `primus-v4` (and of the recipes in run_scripts/), one per kind of failure."""

    OK = 0
    VERIFY_FAILED = 1  # `inspect ... --verify` found a damaged checkpoint or cache entry
    USAGE = 2  # the command line itself (argparse): an unknown option, a missing argument
    CONFIG = 3  # a config file, key or value; a recipe knob
    DATA = 4  # a corpus, tokenizer or pack cache
    CHECKPOINT = 5  # a training checkpoint: missing, damaged, of another layout
    RESUME = 6  # a checkpoint dir this run may not continue or write into
    PRETRAINED = 7  # a release directory (model.pretrained): missing or damaged files
    PATH = 8  # a path that cannot be read, created or written, or an output that exists
    DISK_FULL = 9  # no space left (or over quota, or over the file size limit)
    DIVERGED = 10  # a non-finite loss or gradient with train.nan_policy=error
    RUN = 11  # the run cannot start on this setup (parallel layout, process groups)
    OVER_MEMORY = 12  # `inspect memory`: a pipeline stage plans more than the device holds
    INTERNAL = 70  # an unexpected exception: a bug (PRIMUS_V4_TRACEBACK=1 shows where)
    INTERRUPTED = 130  # Ctrl-C
    SIGNAL_BASE = 128  # + N: stopped by signal N before a checkpoint was saved


class PrimusError(Exception):
    """Bad input or an impossible setting; the message names what was wrong and where."""

    exit_code = ExitCode.RUN


class UsageError(PrimusError):
    """Command-line options that cannot go together (argparse checks each one alone)."""

    exit_code = ExitCode.USAGE


class ConfigError(PrimusError):
    """A config file, key or value that cannot be used."""

    exit_code = ExitCode.CONFIG


class DataError(PrimusError):
    """A corpus, tokenizer or pack cache that cannot be used."""

    exit_code = ExitCode.DATA


class CheckpointError(PrimusError):
    """A training checkpoint that cannot be read: missing, damaged, or of another layout."""

    exit_code = ExitCode.CHECKPOINT


class ResumeError(PrimusError):
    """This run may not continue from (or write into) the checkpoint dir it was given."""

    exit_code = ExitCode.RESUME


class Interrupted(PrimusError):
    """Ctrl-C stopped the command; the message says what was cleaned up and where to go on."""

    exit_code = ExitCode.INTERRUPTED


class OverMemoryError(PrimusError):
    """`inspect memory`: a pipeline stage plans more device memory than the device has."""

    exit_code = ExitCode.OVER_MEMORY


class PathError(PrimusError):
    """A path that cannot be read, created or written, or an output that already exists."""

    exit_code = ExitCode.PATH


class DiskFullError(PathError):
    """A write ran out of space (ENOSPC, EDQUOT) or over the file size limit (EFBIG)."""

    exit_code = ExitCode.DISK_FULL


class CheckpointFormatError(PrimusError, ValueError):
    """A checkpoint directory or one of its tensors is not what the reader or caller expects."""

    exit_code = ExitCode.PRETRAINED


DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


def os_error_cause(exc: BaseException) -> OSError | None:
    """The OSError behind `exc` (itself, or one in its cause / context chain), else None."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, OSError) and current.errno is not None:
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def is_disk_full(exc: BaseException) -> bool:
    """True when `exc` comes from a full disk: an ENOSPC / EDQUOT / EFBIG in its chain, or a
    message that says so (torch's file writers raise RuntimeError with the C library's text)."""
    cause = os_error_cause(exc)
    if cause is not None:
        return cause.errno in DISK_FULL_ERRNOS
    text = str(exc).lower()
    return any(s in text for s in ("no space left", "disk quota", "file too large"))


# Below this much free space, a write that failed without an errno (numpy reports a short write
# as "N requested and M written", torch's zip writer as "unexpected pos") failed because the disk
# is full.
NEARLY_FULL_BYTES = 4 << 20


def nearly_full(path: str | os.PathLike) -> bool:
    """Whether the filesystem holding `path` (or its nearest existing parent) is about full."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    try:
        stats = os.statvfs(probe)
    except OSError:
        return False
    return stats.f_bavail * stats.f_frsize < NEARLY_FULL_BYTES


def over_size_limit(path: str | os.PathLike) -> bool:
    """Whether a file at `path` (or under it) reached this process's RLIMIT_FSIZE (ulimit -f),
    which fails further writes with EFBIG, or with no errno at all in numpy's short writes."""
    import resource

    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit == resource.RLIM_INFINITY:
        return False
    root = os.fspath(path)
    if os.path.isfile(root):
        return os.path.getsize(root) >= limit
    for base, _, files in os.walk(root):
        if any(os.path.getsize(os.path.join(base, f)) >= limit for f in files):
            return True
    return False


def describe_os_error(
    exc: OSError, action: str = "cannot use", where: str | os.PathLike | None = None
) -> PathError:
    """One PathError (DiskFullError for a full disk) naming the path and the reason; `where`
    names the file when the error does not (a failed write on an open file)."""
    path = exc.filename if exc.filename is not None else where
    reason = exc.strerror or str(exc)
    name = errno.errorcode.get(exc.errno or 0, "")
    what = f"{action} {path if path is not None else 'a file'}: {reason}" + (
        f" ({name})" if name else ""
    )
    full = exc.errno in DISK_FULL_ERRNOS or (
        exc.errno is None and path is not None and (nearly_full(path) or over_size_limit(path))
    )
    if full:
        return DiskFullError(f"{what}; free space there or choose another directory")
    return PathError(f"{what}; check the path and its permissions")
