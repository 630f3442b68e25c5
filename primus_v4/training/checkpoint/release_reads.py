"""The release a run started from, as it read it: a resumed run is checked against it.

A run from `model.pretrained` reads the release again when it resumes: the checkpoint holds the
trained weights, not what stayed as released (frozen Engram tables, the Engram token map from the
release's tokenizer, a base kept as released, a frozen LoRA base, a frozen image encoder). So that
a resume never pairs a checkpoint with another release, the first start of a run writes, per rank,
`<checkpoint.dir>/release_reads/rank<NNNNN>.json`: the sha256 of the release's config.json and
tokenizer files; per stored tensor the rank read (the text model's slice, a drafter it trains,
the image encoder a run with pictures attaches), the byte span and its digest
(checkpoint_formats/read_record.py); and, for every stored tensor that no rank read (a drafter
the run does not train, an image encoder a text-only run leaves: what an export carries byte for
byte), its digest whole, each rank digesting every world-th of them. Every tensor of the release
is so in some rank's record. A resume reads and digests the same way and compares every span and
every whole tensor that a record of the first start also holds (all of them in the same layout;
the overlap after a change of the parallel layout): one that differs is refused in one line naming
the tensor, before any step.

An export checks what it copies from the release byte for byte against the same records
(`check_stored`): every digest they hold of those tensors, whole or of a span a rank read, is
taken again from the release's bytes (a release reader reads a tensor's span in one positioned
read: a whole tensor, or a rank's rows of an Engram table, so one read of the span digests alike).

The record is the run's own: its directory is created, and the records are read, without
following a link planted there, and a record that is not a regular file, or not one this module
wrote, is refused in one line naming it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from primus_v4.checkpoint_formats.read_record import ReadRecord
from primus_v4.checkpoint_formats.sharded import CONFIG_FILE, tokenizer_files
from primus_v4.durable import write_durable
from primus_v4.errors import PathError, ResumeError
from primus_v4.log import get_logger
from primus_v4.training.run_dirs import refuse_link

log = get_logger(__name__)

RECORD_DIR = "release_reads"
STEP_RECORD = "release_reads.rank{:05d}.json"
"""A record as every checkpoint step carries it (in its manifest): a step copied to another
checkpoint.dir is checked against the release as a resume in place is."""
SPAN = {"shard": str, "lo": int, "hi": int, "digest": str}  # a tensor's entry, by field


def _record_path(root: Path, rank: int) -> Path:
    return root / RECORD_DIR / f"rank{rank:05d}.json"


def release_files(release: str | Path) -> dict[str, str]:
    """sha256 of the release's config.json and tokenizer files, by file name."""
    paths = [Path(release) / CONFIG_FILE, *tokenizer_files(release)]
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in paths if p.is_file()}


def _read_anywhere(names: set[str]) -> set[str]:
    """The stored tensors any rank read (`names`: this rank's; all of them with no process
    group)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return names
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, sorted(names))
    return names.union(*every)


def carry_unread(record: ReadRecord, reader: Any, *, rank: int, world: int) -> int:
    """Digest whole into `record.carried` this rank's share of the stored tensors of the release
    `reader` opens that no rank read: every `world`-th of them in name order, from the `rank`-th
    on (a collective when a process group is up: every rank calls it). Returns how many."""
    unread = sorted(set(reader.stored_names()) - _read_anywhere(set(record.reads)))
    for name in unread[rank::world]:
        reader.carry_into(record, name)
    return len(unread[rank::world])


def _own_dir(root: Path) -> Path:
    """`root`/release_reads, created where missing; a link or a non-directory standing there is
    refused (PathError, one line), never followed."""
    directory = root / RECORD_DIR
    refuse_link(directory, "checkpoint.dir")
    root.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):  # ours from an earlier start, or planted since
        os.mkdir(directory)  # the check: the second check tells
    refuse_link(directory, "checkpoint.dir")
    if not stat.S_ISDIR(os.lstat(directory).st_mode):
        raise PathError(f"checkpoint.dir {root}: {directory} is not a directory; refused, "
                        "nothing written in it: remove it if it is not yours")  # fmt: skip
    return directory


def save(root: Path, *, rank: int, world: int, release: str | Path, record: ReadRecord) -> Path:
    """Write this rank's record of a first start (rank 0 also removes records of ranks past
    `world`, left by an earlier run in this checkpoint.dir)."""
    directory = _own_dir(root)
    path = _record_path(root, rank)
    if rank == 0:
        for old in directory.glob("rank*.json"):
            number = old.stem.removeprefix("rank")
            if number.isdigit() and int(number) >= world:
                old.unlink(missing_ok=True)
    body = {"release": str(release), "files": release_files(release),
            "tensors": record.as_json(), "carried": record.carried_json()}  # fmt: skip
    write_durable(path, json.dumps(body, indent=1) + "\n")
    log.info("model.pretrained=%s: %d tensors read and %d unread tensors digested whole, "
             "recorded in %s", release, len(record.reads), len(record.carried), path)  # fmt: skip
    return path


def _kind(path: Path, mode: int) -> str | None:
    """What `path` is when it is not a regular file (None when it is one)."""
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISLNK(mode):
        return f"a symbolic link (to {os.readlink(path)})"
    kinds = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket",
             stat.S_IFCHR: "a device", stat.S_IFBLK: "a device"}  # fmt: skip
    return kinds.get(stat.S_IFMT(mode), "not a regular file")


def _refused(path: Path, what: str) -> ResumeError:
    return ResumeError(
        f"{path}: not a record of the release this run started from ({what}); resume with the "
        "record the run's first start wrote, or start a new run in another checkpoint.dir"
    )


def _read_text(path: Path) -> str:
    """A record's text, never through a link nor from anything but a regular file (a FIFO
    would block the open until a writer came)."""
    try:
        kind = _kind(path, os.lstat(path).st_mode)
        if kind is None:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
            with os.fdopen(fd, "rb") as f:
                kind = _kind(path, os.fstat(f.fileno()).st_mode)  # swapped since the lstat
                if kind is None:
                    return f.read().decode()
    except (OSError, ValueError) as err:
        raise _refused(path, f"unreadable: {err}") from None
    raise _refused(path, f"it is {kind}")


def _check_spans(path: Path, body: dict[str, Any], key: str) -> None:
    """`body[key]`: {stored tensor: span}, each span checked field by field."""
    spans = body[key]
    if not isinstance(spans, dict):
        raise _refused(path, f"'{key}' is not an object")
    for name, span in spans.items():
        if not isinstance(span, dict):
            raise _refused(path, f"'{key}' entry '{name}' is not an object")
        for field, kind in SPAN.items():
            if not isinstance(span.get(field), kind) or isinstance(span.get(field), bool):
                raise _refused(path, f"'{key}' entry '{name}' has no {kind.__name__} '{field}'")


def _parsed(path: Path) -> dict[str, Any]:
    try:
        body = json.loads(_read_text(path))
    except ValueError as err:
        raise _refused(path, f"not JSON: {err}") from None
    if not isinstance(body, dict):
        raise _refused(path, f"a JSON {type(body).__name__}, not an object")
    for key in ("files", "tensors"):
        if key not in body:
            raise _refused(path, f"no '{key}'")
    files = body["files"]
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
        raise _refused(path, "'files' is not an object of digests")
    body.setdefault("carried", {})  # a record written before unread tensors were digested
    for key in ("tensors", "carried"):
        _check_spans(path, body, key)
    return body


def _in_step(step: Path | None) -> list[Path]:
    if step is None:
        return []
    return sorted(p for p in step.glob(STEP_RECORD.replace("{:05d}", "*")) if _rank_of(p) >= 0)


def _rank_of(path: Path) -> int:
    """The first start's rank a record file is of (-1: not a record's name)."""
    number = path.name.removesuffix(".json").rpartition("rank")[2]
    return int(number) if number.isdigit() else -1


def _recorded(root: Path, step: Path | None = None) -> list[tuple[Path, dict[str, Any]]]:
    """The records of the run's first start: those the resumed checkpoint `step` carries, else
    those in `root`/release_reads (a step saved before steps carried them)."""
    carried = _in_step(step)
    if carried:
        return [(path, _parsed(path)) for path in carried]
    directory = root / RECORD_DIR
    try:
        mode = os.lstat(directory).st_mode
    except FileNotFoundError:
        return []
    if not stat.S_ISDIR(mode):
        raise ResumeError(f"checkpoint.dir {root}: {directory} is {_kind(directory, mode)}, not "
                          "the run's own record of its release; refused, nothing read through "
                          "it")  # fmt: skip
    return [(path, _parsed(path)) for path in sorted(directory.glob("rank*.json"))]


def _compare(
    release: str | Path, recorded: list[tuple[Path, dict[str, Any]]], key: str, ours: dict
) -> int:
    """Compare this rank's spans `ours` with those under `key` of every record; returns how
    many a record also holds."""
    spans = {}
    for path, rec in recorded:
        for name, read in rec[key].items():
            spans[name, read["shard"], read["lo"], read["hi"]] = (read["digest"], path, rec)
    compared = 0
    for name, read in sorted(ours.items()):
        seen = spans.get((name, read["shard"], read["lo"], read["hi"]))
        if seen is None:
            continue
        compared += 1
        if seen[0] != read["digest"]:
            raise ResumeError(
                f"model.pretrained={release}: tensor '{name}' (bytes {read['lo']}-{read['hi']} "
                f"of {read['shard']}) differs from the release this run started from "
                f"({seen[2].get('release')}, recorded in {seen[1]}); resume with that release, "
                "or start a new run in another checkpoint.dir"
            )
    return compared


def verify(root: Path, *, release: str | Path, record: ReadRecord, step: Path | None = None) -> int:
    """Raise ResumeError naming the first file or tensor of `release` that differs from what
    the run's first start read or digested whole (the records the resumed `step` carries, else
    those of `root`); returns how many tensors were compared."""
    recorded = _recorded(root, step)
    if not recorded:
        where = step if step is not None else root / RECORD_DIR
        log.warning("%s: no record of the release this run started from (a checkpoint of an "
                    "older version); model.pretrained=%s is read unchecked", where,
                    release)  # fmt: skip
        return 0
    first, body = recorded[0]
    files = release_files(release)
    for name, digest in body["files"].items():
        if files.get(name) != digest:
            how = "is missing" if name not in files else "differs"
            raise ResumeError(
                f"model.pretrained={release}: {name} {how} from the release this run started "
                f"from ({body.get('release')}, recorded in {first}); resume with that release, "
                "or start a new run in another checkpoint.dir"
            )
    read = _compare(release, recorded, "tensors", record.as_json())
    whole = _compare(release, recorded, "carried", record.carried_json())
    log.info("model.pretrained=%s: %d of %d tensors digested whole and %d of %d tensor reads "
             "match the release this run started from (%s)", release, whole, len(record.carried),
             read, len(record.reads), recorded[0][0].parent)  # fmt: skip
    return read + whole


def step_files(root: Path, *, rank: int, world: int, step: Path | None = None) -> dict[str, str]:
    """{file name: text}: the records this rank writes into every checkpoint it saves, so that
    each step carries all of them: those of the first start's ranks i with i % `world` ==
    `rank`, from the resumed `step` (else `root`/release_reads, where a first start wrote its
    own). Empty when there is no record (a run of an older version, or no model.pretrained)."""
    if step is None:  # a first start: this rank's own record, just written
        paths = [_record_path(root, rank)]
    else:
        paths = [path for path, _ in _recorded(root, step)]
    return {STEP_RECORD.format(_rank_of(p)): _read_text(p) for p in paths
            if _rank_of(p) % world == rank and os.path.lexists(p)}  # fmt: skip


def records(root: Path, step: Path | None = None) -> list[tuple[Path, dict[str, Any]]]:
    """The records of a run's first start, each with its file, as a resume reads them: those
    its checkpoint `step` carries, else those in `root`/release_reads; empty when there are
    none (a checkpoint of an older version, or a run from no release)."""
    return _recorded(root, step)


@dataclass(kw_only=True, frozen=True)
class Changed:
    """A stored tensor of a release whose bytes are not those a record holds the digest of."""

    tensor: str
    span: dict[str, Any]
    """the record's entry: the bytes [lo, hi) of shard digested, and their digest"""
    record: Path
    release: str | None
    """the release the run's first start read, as the record names it"""


@dataclass(kw_only=True, frozen=True)
class StoredCheck:
    """What `check_stored` found."""

    compared: int
    """tensors of which the records hold a digest, each taken again"""
    unrecorded: list[str]
    """tensors of which no record holds a digest (a record of an older version)"""
    changed: Changed | None
    """the first tensor (by name) whose bytes differ; None when every digest matches"""


PIECE = 1 << 24  # bytes read at a time while digesting, as `CheckpointReader.carry_into` reads


def _span_digest(directory: Path, span: dict[str, Any]) -> str:
    """The digest of bytes [lo, hi) of `span`'s shard in `directory`, as one read of them
    digests it (read_record.py); a file that ends before `hi` digests the bytes it has."""
    fd = os.open(directory / span["shard"], os.O_RDONLY | os.O_CLOEXEC)

    def pieces() -> Iterator[bytes]:
        at = span["lo"]
        while at < span["hi"]:
            data = os.pread(fd, min(PIECE, span["hi"] - at), at)
            if not data:
                return
            at += len(data)
            yield data

    try:
        record = ReadRecord()
        record.carry("", span["shard"], span["lo"], pieces())
        return record.carried_json()[""]["digest"]
    finally:
        os.close(fd)


def check_stored(
    reader: Any,
    recorded: list[tuple[Path, dict[str, Any]]],
    names: Iterable[str],
    *,
    workers: int = 1,
) -> StoredCheck:
    """Compare the stored tensors `names` of the release `reader` opens (a `CheckpointReader`
    under the names its run recorded) with every digest the records `recorded` hold of them:
    whole (`carried`: the tensors no rank read) and of each span a rank read. Each distinct span
    is read once, `workers` at a time; a tensor stored in another shard than recorded differs."""
    wanted = set(names)
    spans: dict[tuple[str, str, int, int], list[tuple[Path, dict[str, Any]]]] = {}
    for path, body in recorded:
        for key in ("carried", "tensors"):
            for name, span in body[key].items():
                if name in wanted:
                    at = (name, span["shard"], span["lo"], span["hi"])
                    spans.setdefault(at, []).append((path, span))
    keys = sorted(spans)

    def digest(key: tuple[str, str, int, int]) -> str | None:
        name, shard, lo, hi = key
        if reader.shard_of(name) != shard:
            return None
        return _span_digest(Path(reader.directory), {"shard": shard, "lo": lo, "hi": hi})

    changed = None
    with ThreadPoolExecutor(max(1, workers), thread_name_prefix="release-digest") as pool:
        for key, ours in zip(keys, pool.map(digest, keys), strict=True):
            unlike = [(path, span) for path, span in spans[key] if span["digest"] != ours]
            if unlike:
                path, span = unlike[0]
                bodies = dict(recorded)
                changed = Changed(tensor=key[0], span=span, record=path,
                                  release=bodies[path].get("release"))  # fmt: skip
                pool.shutdown(cancel_futures=True)
                break
    seen = {name for name, *_ in keys}
    return StoredCheck(compared=len(seen), unrecorded=sorted(wanted - seen), changed=changed)
