"""Crash-safe file publishing shared by the pack cache and checkpoints: data is fsynced before
it is renamed into place, and the rename itself is fsynced through the parent directory, so a
reader sees either the old state or the complete new one."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Persist a directory's entries (a rename is durable only once its directory is synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: Path, text: str) -> None:
    """Write `text` to a temp file unique to this process, fsync it, then os.replace it over
    `path`."""
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
