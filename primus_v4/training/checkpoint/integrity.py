"""Checkpoint integrity: a manifest of every file's size and sha256, written when a checkpoint is
published and checked before it is trusted (resume, `primus-v4 inspect checkpoint --verify`).

A flipped byte or a truncated shard otherwise loads without complaint (or ends in a torch
traceback): DCP has no checksums of its own. Hashing is split over the ranks (file i on rank
i mod world), so a large checkpoint costs 1/world of the reading on each rank.

`problems` is the one verifier: resume, `primus-v4 export` and `inspect checkpoint` all trust a
checkpoint only when it is complete, of this model layout, holds its manifest (every checkpoint
of this layout was written with one, so a missing manifest is damage) and every file matches it.
Resume and export take the newest such checkpoint; an unusable newer one is reported by name and
skipped. `prune` (keep_last) deletes older checkpoints of the run only once a newer one is
published, and never the one just saved or the one `latest` names.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from primus_v4.durable import write_durable
from primus_v4.errors import CheckpointError
from primus_v4.log import get_logger

log = get_logger(__name__)

MANIFEST = "MANIFEST.json"
COMPLETE = "COMPLETE"
CONFIG_FILE = "config.yaml"
LATEST = "latest"
# Written after the manifest (COMPLETE marks the end of the publish), so not in it.
_UNLISTED = {MANIFEST, COMPLETE}
# What the model tensors of a checkpoint mean. 2: the released architecture (gate bias, tid2eid,
# compressor wkv + wgate, ...) with routed experts stored [E, out, in]. Checkpoints that record
# none were written before: experts [E, in, out] under the same names, some with the same
# shapes, so loading them would silently transpose experts. They are refused by name.
MODEL_LAYOUT = 2


def _group() -> Any:
    """torch.distributed while a process group is up, else None. Looked up, not imported: no
    group exists before torch.distributed is loaded, and `train --dry-run` lists checkpoint
    directories without loading torch."""
    dist = sys.modules.get("torch.distributed")
    return dist if dist is not None and dist.is_initialized() else None


def _rank_world() -> tuple[int, int]:
    if (dist := _group()) is not None:
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_gather(obj: Any) -> list[Any]:
    if (dist := _group()) is None:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _broadcast(obj: Any) -> Any:
    if (dist := _group()) is None:
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


def read_complete(path: Path) -> dict[str, Any]:
    """The COMPLETE marker's record (step, world size, model layout)."""
    try:
        info = json.loads((path / COMPLETE).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path / COMPLETE}: unreadable ({exc})") from None
    if not isinstance(info, dict):
        raise ValueError(f"{path / COMPLETE}: not a JSON object")
    return info


def layout_problem(path: Path, info: dict[str, Any]) -> str | None:
    """Why the model tensors of `path` cannot be read by this version (None: they can)."""
    layout = info.get("model_layout", 1)
    if layout == MODEL_LAYOUT:
        return None
    return (
        f"checkpoint {path} holds model layout {layout}; this primus_v4 reads layout "
        f"{MODEL_LAYOUT} (the released DeepSeek-V4 architecture, experts stored [E, out, in]), "
        "so it cannot be resumed or exported here. Start a new checkpoint.dir, from the released "
        "weights (model.pretrained) or from scratch"
    )


def _check(directory: Path, name: str, want: dict[str, Any]) -> str | None:
    path = directory / name
    if not path.is_file():
        return f"{path}: missing"
    size = path.stat().st_size
    if size != want["bytes"]:
        return f"{path}: truncated or resized ({size} bytes, the manifest says {want['bytes']})"
    try:
        digest = file_digest(path)["sha256"]
    except OSError as exc:
        return f"{path}: unreadable ({exc.strerror})"
    if digest != want["sha256"]:
        return f"{path}: corrupt (sha256 differs from the manifest)"
    return None


def _header(directory: Path, needs_config: bool) -> tuple[list[str], dict[str, Any]]:
    """(problems found without reading the data files, the manifest's files)."""
    if not is_complete(directory):
        return [f"{directory}: incomplete (no {COMPLETE} or .metadata: a save that did not "
                "finish)"], {}  # fmt: skip
    try:
        info = read_complete(directory)
        files = read_manifest(directory)
    except ValueError as exc:
        return [str(exc)], {}
    layout = layout_problem(directory, info)
    if layout is not None:
        return [layout], {}
    if files is None:
        # Every checkpoint that records its model layout was written with a manifest (manifests
        # came first), so a missing one means a damaged or partly copied checkpoint.
        return [f"{directory / MANIFEST}: missing (every checkpoint of layout {MODEL_LAYOUT} is "
                "written with one): the files cannot be checked"], {}  # fmt: skip
    unlisted = [n for n in _listed_files(directory) if n not in files]
    if unlisted:  # a file added after the save: the manifest does not vouch for the directory
        return [
            f"{directory / unlisted[0]}: not in {MANIFEST} ({len(unlisted)} file(s) the "
            "save did not write); remove what was added, or restore the checkpoint"
        ], {}
    if needs_config and CONFIG_FILE not in files:
        return [f"{directory}: stores no {CONFIG_FILE} of its own, so the run (and model) it "
                "holds is unknown"], {}  # fmt: skip
    return [], files


def problems(directory: Path, *, collective: bool = False, needs_config: bool = False) -> list[str]:
    """Why checkpoint `directory` cannot be trusted, one line each ([] = intact): the one check
    that resume, export and `inspect checkpoint --verify` make. It must be complete, of this
    model layout and hold its manifest, and every file must match its size and sha256;
    `needs_config`: its own config.yaml must be among them. `collective`: rank 0 reads the
    marker and the manifest, every rank hashes its share of the files (call on all ranks)."""
    rank, world = _rank_world() if collective else (0, 1)
    if collective:
        header, files = _broadcast(_header(directory, needs_config) if rank == 0 else None)
    else:
        header, files = _header(directory, needs_config)
    if header:
        return header
    names = sorted(files)
    mine = [p for n in names[rank::world] if (p := _check(directory, n, files[n])) is not None]
    if collective:
        return [p for part in _all_gather(mine) for p in part]
    return mine


def verify(directory: Path, *, collective: bool = False) -> list[str]:
    """`problems` of one checkpoint dir (kept for callers that name it so)."""
    return problems(directory, collective=collective)


def quick_problems(directory: Path) -> list[str]:
    """`problems` without hashing the data files (marker, layout, manifest present)."""
    return _header(directory, needs_config=False)[0]


def is_complete(path: Path) -> bool:
    return (path / COMPLETE).is_file() and (path / ".metadata").is_file()


def complete_checkpoints(root: Path) -> list[Path]:
    """Published checkpoint dirs under `root`, oldest first (names carry the zero-padded step)."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step_*") if p.is_dir() and is_complete(p))


def newest_intact(root: str | Path, *, needs_config: bool = False) -> Path | None:
    """The newest complete checkpoint `problems` finds nothing wrong with; each unusable newer
    one is reported by name and skipped. None when `root` holds no complete checkpoint; a
    CheckpointError when it holds only unusable ones. Collective: rank 0 lists, every rank
    hashes its share."""
    root = Path(root)
    candidates = _broadcast(
        [str(p) for p in complete_checkpoints(root)] if _rank_world()[0] == 0 else None
    )
    skipped: list[str] = []
    for name in reversed(candidates):
        path = Path(name)
        found = problems(path, collective=True, needs_config=needs_config)
        if not found:
            if skipped:
                log.warning("using the previous intact checkpoint %s", path)
            return path
        skipped.append(f"{path.name} ({'; '.join(found)})")
        log.warning("skipping unusable checkpoint %s: %s", path, "; ".join(found))
    if skipped:
        raise CheckpointError(
            f"no usable checkpoint in {root}: {', '.join(skipped)}. Move them away to start "
            "from scratch, or use a new checkpoint.dir"
        )
    return None


def latest_named(root: Path) -> Path | None:
    """The checkpoint dir the `latest` pointer names (None without a readable pointer)."""
    try:
        name = (root / LATEST).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return root / name if name else None


def prune(root: str | Path, keep_last: int, *, newest: Path) -> list[Path]:
    """Delete the complete checkpoints older than the newest `keep_last` up to `newest` (the one
    this run just published); 0 keeps all. Never deleted: `newest`, whatever `latest` names, and
    every checkpoint past `newest` (one this run skipped as damaged is replaced when the run
    saves that step again, and is evidence until then). Rank 0 only. Returns what was deleted."""
    if keep_last <= 0 or _rank_world()[0] != 0:
        return []
    root = Path(root)
    protected = {newest.name, getattr(latest_named(root), "name", None)}
    lineage = [p for p in complete_checkpoints(root) if p.name <= newest.name]
    old = [p for p in lineage[:-keep_last] if p.name not in protected]
    for path in old:
        if path.is_symlink():  # its target is outside this run's checkpoint.dir: never touched
            target = os.readlink(path)
            path.unlink()
            log.info("removed the link %s (checkpoint.keep_last=%d); its target %s is left as it "
                     "was", path, keep_last, target)  # fmt: skip
            continue
        (path / COMPLETE).unlink(missing_ok=True)  # a crash midway leaves an incomplete dir
        shutil.rmtree(path, ignore_errors=True)
        log.info("deleted checkpoint %s (checkpoint.keep_last=%d)", path, keep_last)
    return old
