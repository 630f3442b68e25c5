"""Node-local pack cache: content key, atomic publish, checksummed manifest, one builder per node.

Layout of one entry, `<cache_dir>/pack-<key>/`:
    tokens.npy          uint32 [T]    every kept sample's tokens, in pack order
    supervised.npy      uint8         np.packbits of the per-token "is a target" flag [T]
    sample_offsets.npy  int64 [N+1]   token offset of each sample (pack order)
    pack_offsets.npy    int64 [P+1]   sample offset of each pack
    sample_rows.npy     int64 [N]     source row of each sample (for export and checks)
    manifest.json       key, key fields, stats, size + sha256 of every file, its own sha256
                        (written last)

An entry is written into `.tmp-pack-<key>-<host>-<pid>/`, fsynced, then renamed into place in one
step: a reader never sees a partial entry and a killed writer leaves only its temp dir (removed by
the next builder on that host). A manifest that does not match the files (truncation, bit rot,
an interrupted copy), its own checksum, or the key recomputed from this call's inputs makes the
entry invalid; the caller rebuilds it.

Trust: the default root `$TMPDIR/primus_v4-<uid>` has a name anyone can predict, so the cache and
lock dirs are created 0700 and refused when another user owns them or group or others may write
them (`require_private`): no one else can plant an entry whose manifest we would then believe.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from primus_v4.durable import fsync_dir, private_dir_problem
from primus_v4.errors import DataError, PathError, describe_os_error
from primus_v4.log import get_logger

log = get_logger(__name__)

# Part of the key: bump when the on-disk layout or the meaning of any array changes.
FORMAT_VERSION = "primus_v4.pack/1"
MANIFEST = "manifest.json"
CHECKSUM = "manifest_sha256"
ARRAY_FILES = ("tokens", "supervised", "sample_offsets", "pack_offsets", "sample_rows")
# A corpus with images (a model with a vision tower) has these too: each token's type (int8),
# each sample's images (offsets into `image_index`, which names a distinct image), and each
# distinct image's ViT grid and bf16 patches (stored as uint16 bits, [patches, 3 * 14 * 14]).
IMAGE_FILES = ("token_types", "sample_image_offsets", "image_index", "image_grids",
               "image_patch_offsets", "image_patches")  # fmt: skip


def array_names(manifest: dict[str, Any]) -> tuple[str, ...]:
    """The arrays of an entry: the text ones, and the image ones when it has images."""
    return ARRAY_FILES + (IMAGE_FILES if "token_types" in manifest["files"] else ())


class CacheInvalid(Exception):
    """An entry exists but cannot be trusted (the message says why); it is rebuilt."""


def _node_local_root() -> Path:
    """$PRIMUS_LOCAL_ROOT, else $TMPDIR/primus_v4-UID: the recipes export the same variable, so
    `primus-v4 pack`, `train` and the recipes share one default cache (<root>/packs)."""
    # Per user, on this node: home directories are often NFS (locks go stale across nodes there)
    # and a fixed name under /tmp would be shared between users.
    given = os.environ.get("PRIMUS_LOCAL_ROOT")
    if given:
        return Path(given).expanduser()
    return Path(os.environ.get("TMPDIR") or "/tmp") / f"primus_v4-{os.getuid()}"


def require_private(directory: Path, knob: str, what: str = "cache") -> None:
    """Create `directory` 0700 (with the node-local root above it, when under it) or refuse it:
    another user's, or writable by group or others. `what`: cache or lock."""
    root = _node_local_root().absolute()
    top = root if directory.absolute().is_relative_to(root) else directory
    problem = private_dir_problem(directory, top=top)
    if problem is not None:
        raise PathError(f"refusing the pack {what} dir {directory}: {problem}, so another user "
                        f"could plant {'entries' if what == 'cache' else 'locks'} there; remove "
                        f"it or point {knob} at a directory only you can write")  # fmt: skip


def default_cache_dir() -> Path:
    env = os.environ.get("PRIMUS_PACK_CACHE_DIR")
    return Path(env).expanduser() if env else _node_local_root() / "packs"


def default_lock_dir() -> Path:
    env = os.environ.get("PRIMUS_PACK_LOCK_DIR")
    return Path(env).expanduser() if env else _node_local_root() / "locks"


def cache_key(fields: dict[str, Any]) -> str:
    """sha256 over the canonical JSON of everything that changes pack content (first 20 hex)."""
    blob = json.dumps({"format_version": FORMAT_VERSION, **fields}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def entry_dir(cache_dir: Path, key: str) -> Path:
    return cache_dir / f"pack-{key}"


def lock_path(lock_dir: Path, cache_dir: Path, key: str) -> Path:
    # The cache dir is part of the name so unrelated cache dirs never wait on each other.
    where = hashlib.sha256(str(cache_dir.resolve()).encode()).hexdigest()[:8]
    return lock_dir / f"pack-{key}-{where}.lock"


def _host() -> str:
    return socket.gethostname().replace("/", "_").replace("-", "_") or "host"


def _temp_prefix(key: str) -> str:
    return f".tmp-pack-{key}-"


# How often a process waiting for another builder says that it still waits.
WAIT_NOTICE_S = 30.0


def _acquire(lock: Any, path: Path, *, timeout_s: float, key: str) -> bool:
    """Take `lock` within `timeout_s`, saying when it has to wait and then every WAIT_NOTICE_S
    (a silent wait of minutes looks like a hang); False on timeout."""
    from filelock import Timeout

    try:
        lock.acquire(timeout=0)
        return True
    except Timeout:
        pass
    start = time.monotonic()
    log.info("waiting for another process on this node building pack cache key %s (lock %s, up "
             "to %g s)", key, path, timeout_s)  # fmt: skip
    while (left := timeout_s - (time.monotonic() - start)) > 0:
        try:
            lock.acquire(timeout=min(WAIT_NOTICE_S, left))
            log.info("pack cache lock %s free after %.0f s", path, time.monotonic() - start)
            return True
        except Timeout:
            if timeout_s - (time.monotonic() - start) > 0:
                log.info("still waiting for pack cache lock %s (%.0f s of %g s)", path,
                         time.monotonic() - start, timeout_s)  # fmt: skip
    return False


@contextmanager
def node_lock(
    path: Path, *, timeout_s: float, key: str, timeout_knob: str = "--lock-timeout"
) -> Iterator[None]:
    """Hold the node-local build lock for `key`; a bounded wait with an actionable error."""
    from filelock import FileLock

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataError(
            f"cannot create the pack lock dir {path.parent}: {exc.strerror}; set "
            "PRIMUS_PACK_LOCK_DIR to a writable node-local directory"
        ) from exc
    lock = FileLock(str(path), timeout=timeout_s)
    if not _acquire(lock, path, timeout_s=timeout_s, key=key):
        raise DataError(
            f"waited {timeout_s:g} s for the pack cache lock {path} (another process on this "
            f"node is building key {key}). Let it finish and retry, pre-build with `primus-v4 "
            f"pack`, or raise {timeout_knob} (it must stay below the collective timeout)"
        )
    try:
        yield
    finally:
        lock.release()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _write_array(path: Path, array: np.ndarray) -> dict[str, Any]:
    with path.open("wb") as f:
        np.save(f, array, allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": path.stat().st_size, "sha256": _sha256(path)}


def remove_stale_temps(cache_dir: Path, key: str) -> None:
    """Remove temp dirs left by dead builders of `key` on this host (others may be alive)."""
    prefix = f"{_temp_prefix(key)}{_host()}-"
    for temp in cache_dir.glob(f"{prefix}*"):
        pid = temp.name[len(prefix) :]
        if pid.isdigit() and int(pid) != os.getpid() and _pid_alive(int(pid)):
            continue
        log.info("removing %s left by an interrupted build", temp)
        shutil.rmtree(temp, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def discard(entry: Path) -> None:
    """Move an invalid entry out of the way (atomically), then delete it."""
    if not entry.exists():
        return
    trash = entry.with_name(f".trash-{entry.name}-{_host()}-{os.getpid()}")
    os.replace(entry, trash)
    shutil.rmtree(trash, ignore_errors=True)


def publish(
    cache_dir: Path, key: str, arrays: dict[str, np.ndarray], manifest: dict[str, Any]
) -> Path:
    """Write arrays + manifest to a unique temp dir, fsync, rename into place; return the entry."""
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise describe_os_error(exc, "cannot create the pack cache dir") from exc
    temp = cache_dir / f"{_temp_prefix(key)}{_host()}-{os.getpid()}"
    shutil.rmtree(temp, ignore_errors=True)
    try:
        temp.mkdir()
        names = ARRAY_FILES + (IMAGE_FILES if "token_types" in arrays else ())
        files = {name: _write_array(temp / f"{name}.npy", arrays[name]) for name in names}
        complete = {**manifest, "key": key, "files": files}
        complete[CHECKSUM] = manifest_checksum(complete)
        body = json.dumps(complete, indent=2, sort_keys=True)
        with (temp / MANIFEST).open("w", encoding="utf-8") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(temp)
        final = entry_dir(cache_dir, key)
        try:
            os.rename(temp, final)
        except OSError as exc:
            # Another host sharing this dir published first (node-local locks cannot see it).
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            try:
                verify(final, key, manifest.get("key_fields"))
                log.info("cache entry %s appeared during the build; using it", final)
                shutil.rmtree(temp, ignore_errors=True)
                return final
            except CacheInvalid:
                discard(final)
                os.rename(temp, final)
        fsync_dir(cache_dir)
    except OSError as exc:
        error = describe_os_error(exc, "cannot write", where=temp)  # before the temp goes
        shutil.rmtree(temp, ignore_errors=True)
        message = f"pack cache {cache_dir}: {error}; removed the partial {temp.name}"
        raise type(error)(message) from exc
    except BaseException:  # Ctrl-C mid-write: the partial temp goes now, not at the next build
        shutil.rmtree(temp, ignore_errors=True)
        raise
    return final


def read_manifest(entry: Path) -> dict[str, Any]:
    return json.loads((entry / MANIFEST).read_text(encoding="utf-8"))


def manifest_checksum(manifest: dict[str, Any]) -> str:
    """sha256 of the manifest's canonical JSON without its own checksum field."""
    body = {k: v for k, v in manifest.items() if k != CHECKSUM}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


# Each manifest field a reader relies on, with its type (bool is not an int here).
_FIELDS: dict[str, type | tuple[type, ...]] = {
    "key": str, "format_version": str, "seq_length": int, "pad_id": int, "stats": dict,
    "key_fields": dict, "files": dict, CHECKSUM: str,
}  # fmt: skip


def _typed(value: Any, kind: type | tuple[type, ...]) -> bool:
    return isinstance(value, kind) and not isinstance(value, bool)


def check_manifest(manifest: Any, entry: Path) -> dict[str, Any]:
    """`manifest` if it is one this code wrote for `entry`'s key: every field present and of its
    type, its checksum matching, its key the hash of its own key fields (and seq_length theirs).
    A hand-edited or planted manifest fails here, before any of its values is used."""
    where = entry / MANIFEST
    if not isinstance(manifest, dict):
        raise CacheInvalid(f"{where}: a JSON {type(manifest).__name__}, not an object")
    for name, kind in _FIELDS.items():
        if not _typed(manifest.get(name), kind):
            got = type(manifest[name]).__name__ if name in manifest else "missing"
            raise CacheInvalid(f"{where}: field {name!r} is {got}, not {_type_name(kind)}")
    unknown = set(manifest["files"]) - set(ARRAY_FILES + IMAGE_FILES)
    if unknown:
        raise CacheInvalid(f"{where}: files {sorted(unknown)} are not arrays of a pack entry")
    for name in array_names(manifest):
        record = manifest["files"].get(name)
        if not (isinstance(record, dict) and _typed(record.get("bytes"), int)
                and isinstance(record.get("sha256"), str)):  # fmt: skip
            raise CacheInvalid(f"{where}: files.{name} is not {{bytes: int, sha256: str}}")
    if manifest_checksum(manifest) != manifest[CHECKSUM]:
        raise CacheInvalid(f"{where}: the manifest does not match its checksum (edited?)")
    key = entry.name.removeprefix("pack-")
    if manifest["key"] != key or cache_key(manifest["key_fields"]) != key:
        raise CacheInvalid(f"{where}: key {manifest['key']!r} is not the hash of its key fields "
                           f"or not the entry's name {key!r}")  # fmt: skip
    if manifest["seq_length"] != manifest["key_fields"].get("seq_length"):
        raise CacheInvalid(f"{where}: seq_length {manifest['seq_length']} differs from its key's")
    if not 0 <= manifest["pad_id"] < 2**32:
        raise CacheInvalid(f"{where}: pad_id {manifest['pad_id']} is not a token id")
    return manifest


def _type_name(kind: type | tuple[type, ...]) -> str:
    return " or ".join(k.__name__ for k in kind) if isinstance(kind, tuple) else kind.__name__


def verify(entry: Path, key: str, fields: dict[str, Any] | None = None) -> dict[str, Any]:
    """The entry's manifest if it is well formed and consistent (`check_manifest`), was built
    from `fields` (the key fields recomputed from this call's inputs, when given), and every
    file matches its recorded size and sha256."""
    try:
        manifest = read_manifest(entry)
    except FileNotFoundError:
        raise CacheInvalid(f"{entry} has no {MANIFEST}") from None
    except (OSError, ValueError) as exc:
        raise CacheInvalid(f"{entry / MANIFEST} is unreadable: {exc}") from None
    check_manifest(manifest, entry)
    if manifest["key"] != key or manifest["format_version"] != FORMAT_VERSION:
        raise CacheInvalid(f"{entry}: manifest key/version does not match {key}/{FORMAT_VERSION}")
    if fields is not None and manifest["key_fields"] != json.loads(json.dumps(fields)):
        raise CacheInvalid(f"{entry}: built from other inputs than this call's (key fields differ)")
    for name in array_names(manifest):
        path = entry / f"{name}.npy"
        expected = manifest["files"][name]
        try:
            size = path.stat().st_size
        except OSError:
            raise CacheInvalid(f"{path} is missing") from None
        if size != expected["bytes"]:
            raise CacheInvalid(f"{path}: {size} bytes, manifest says {expected['bytes']}")
        if _sha256(path) != expected["sha256"]:
            raise CacheInvalid(f"{path}: sha256 does not match the manifest")
    return manifest


def map_arrays(entry: Path, manifest: dict[str, Any]) -> dict[str, np.ndarray]:
    """Memory-map the entry's arrays read-only (pages load on first touch)."""
    return {
        name: np.load(entry / f"{name}.npy", mmap_mode="r", allow_pickle=False)
        for name in array_names(manifest)
    }


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
