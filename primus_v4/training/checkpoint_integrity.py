"""Checkpoint integrity: a manifest of every file's size and sha256, written when a checkpoint is
published and checked before it is trusted (resume, `primus-v4 inspect checkpoint --verify`).

A flipped byte or a truncated shard otherwise loads without complaint (or ends in a torch
traceback): DCP has no checksums of its own. Hashing is split over the ranks (file i on rank
i mod world), so a large checkpoint costs 1/world of the reading on each rank.

Resume takes the newest complete checkpoint whose files all match; a damaged one is reported by
file and skipped for the previous complete one. `keep_last` deletes older complete checkpoints,
only once a newer one is published.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist

from primus_v4.durable import write_durable
from primus_v4.errors import PrimusError
from primus_v4.log import get_logger

log = get_logger(__name__)

MANIFEST = "MANIFEST.json"
# Written after the manifest (COMPLETE marks the end of the publish), so not in it.
_UNLISTED = {MANIFEST, "COMPLETE"}


def _rank_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_gather(obj: Any) -> list[Any]:
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _broadcast(obj: Any) -> Any:
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def file_digest(path: Path) -> dict[str, Any]:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return {"bytes": path.stat().st_size, "sha256": h.hexdigest()}


def _listed_files(directory: Path) -> list[str]:
    return sorted(
        p.relative_to(directory).as_posix()
        for p in directory.rglob("*")
        if p.is_file() and p.name not in _UNLISTED and not p.name.startswith(".tmp")
    )


def checksums(directory: Path) -> dict[str, dict[str, Any]]:
    """{file: {bytes, sha256}} of every file in `directory`; collective over all ranks."""
    rank, world = _rank_world()
    names = _broadcast(_listed_files(directory) if rank == 0 else None)
    mine = {name: file_digest(directory / name) for name in names[rank::world]}
    return {k: v for part in _all_gather(mine) for k, v in part.items()}


def write_manifest(directory: Path, files: dict[str, dict[str, Any]]) -> None:
    write_durable(directory / MANIFEST, json.dumps({"files": files}, indent=1) + "\n")


def read_manifest(directory: Path) -> dict[str, dict[str, Any]] | None:
    try:
        return json.loads((directory / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"{directory / MANIFEST} is unreadable: {exc}") from None


def _check(directory: Path, name: str, want: dict[str, Any]) -> str | None:
    path = directory / name
    if not path.is_file():
        return f"{path}: missing"
    size = path.stat().st_size
    if size != want["bytes"]:
        return f"{path}: truncated or resized ({size} bytes, the manifest says {want['bytes']})"
    if file_digest(path)["sha256"] != want["sha256"]:
        return f"{path}: corrupt (sha256 differs from the manifest)"
    return None


def verify(directory: Path, *, collective: bool = False) -> list[str]:
    """Problems of one checkpoint dir, one line per bad file ([] = intact). `collective`: every
    rank checks its share of the files (call on all ranks)."""
    rank, world = _rank_world() if collective else (0, 1)
    try:
        files = read_manifest(directory)
    except ValueError as exc:
        files, problems = {}, [str(exc)]
    else:
        problems = [] if files is not None else [f"{directory / MANIFEST}: missing (no checksums)"]
    names = sorted(files or {})
    mine = [p for n in names[rank::world] if (p := _check(directory, n, files[n])) is not None]
    if collective:
        return problems + [p for part in _all_gather(mine) for p in part]
    return problems + mine


def is_complete(path: Path) -> bool:
    return (path / "COMPLETE").is_file() and (path / ".metadata").is_file()


def complete_checkpoints(root: Path) -> list[Path]:
    """Published checkpoint dirs under `root`, oldest first (names carry the zero-padded step)."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step_*") if p.is_dir() and is_complete(p))


def newest_intact(root: str | Path) -> Path | None:
    """The newest complete checkpoint whose files match its manifest; damaged newer ones are
    reported by file and skipped. Collective: rank 0 lists, every rank hashes its share."""
    root = Path(root)
    candidates = _broadcast(
        [str(p) for p in complete_checkpoints(root)] if _rank_world()[0] == 0 else None
    )
    skipped = []
    for name in reversed(candidates):
        path = Path(name)
        problems = verify(path, collective=True)
        if not problems:
            if skipped:
                log.warning("resuming from the previous intact checkpoint %s", path)
            return path
        if problems == [f"{path / MANIFEST}: missing (no checksums)"]:
            log.warning("checkpoint %s has no checksums (older format); loading unverified", path)
            return path
        skipped.append(path.name)
        log.warning("skipping damaged checkpoint %s: %s", path, "; ".join(problems))
    if skipped:
        raise PrimusError(
            f"every checkpoint in {root} is damaged ({', '.join(skipped)}; see the warnings "
            "above): move them away to start from scratch, or set checkpoint.resume=false"
        )
    return None


def prune(root: str | Path, keep_last: int) -> list[Path]:
    """Delete complete checkpoints older than the newest `keep_last` (0 keeps all); rank 0 only,
    called after a publish. Returns what was deleted."""
    if keep_last <= 0 or _rank_world()[0] != 0:
        return []
    old = complete_checkpoints(Path(root))[:-keep_last]
    for path in old:
        (path / "COMPLETE").unlink(missing_ok=True)  # a crash midway leaves an incomplete dir
        shutil.rmtree(path, ignore_errors=True)
        log.info("deleted checkpoint %s (checkpoint.keep_last=%d)", path, keep_last)
    return old
