"""What a load read from a release, as digests: the record a resumed run compares with the one
its first start wrote, so a resume against another release (one tensor changed) is refused
instead of trained on.

While `recording_reads()` is open, every `CheckpointReader` created in it adds each stored byte
range it reads to the record: per stored tensor, the byte span read and a 128-bit digest of those
bytes (blake2b of each read chunk with its offset, XOR-combined, so the order in which threads
read the chunks does not matter and a chunk read twice counts once). Hashing costs about one pass
over the bytes read (~1 GB/s per core) and keeps nothing beyond the digests.

A stored tensor that no rank reads (a drafter the run does not train, an image encoder a text-only
run leaves in the release: what an export carries byte for byte) is digested whole instead
(`carry`, `CheckpointReader.carry_into`): its bytes hashed as one chunk, a piece at a time, kept
apart from the reads (`carried`), since a tensor decoded in row chunks digests otherwise.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

_OPEN: list[ReadRecord] = []


@dataclass(kw_only=True)
class TensorRead:
    shard: str
    lo: int  # the first and one past the last byte read, in the shard file
    hi: int
    digest: int = 0
    chunks: set[tuple[int, int]] = field(default_factory=set)

    def as_json(self) -> dict:
        return {"shard": self.shard, "lo": self.lo, "hi": self.hi, "digest": f"{self.digest:032x}"}


def _hasher(start: int) -> Any:
    """The digest of a chunk that starts at byte `start` of its shard, before its bytes."""
    return hashlib.blake2b(start.to_bytes(8, "little"), digest_size=16)


def _value(h: Any) -> int:
    return int.from_bytes(h.digest(), "little")


def _as_json(reads: dict[str, TensorRead]) -> dict[str, dict]:
    return {name: read.as_json() for name, read in sorted(reads.items())}


class ReadRecord:
    """Digests of the stored bytes read, by stored tensor name (`reads`), and of the stored
    tensors digested whole because no rank reads them (`carried`)."""

    def __init__(self) -> None:
        self.reads: dict[str, TensorRead] = {}
        self.carried: dict[str, TensorRead] = {}
        self._lock = threading.Lock()

    def add(self, name: str, shard: str, start: int, data: memoryview) -> None:
        """`data` was read from byte `start` of `shard`, inside stored tensor `name`."""
        end = start + len(data)
        h = _hasher(start)
        h.update(data)
        value = _value(h)
        with self._lock:
            read = self.reads.get(name)
            if read is None:
                read = self.reads[name] = TensorRead(shard=shard, lo=start, hi=end)
            if (start, end) in read.chunks:
                return
            read.chunks.add((start, end))
            read.lo, read.hi = min(read.lo, start), max(read.hi, end)
            read.digest ^= value

    def carry(self, name: str, shard: str, start: int, pieces: Iterable[bytes]) -> None:
        """Stored tensor `name`, from byte `start` of `shard` on, given as its successive
        `pieces`, digested whole: what one read of all its bytes would add."""
        h, end = _hasher(start), start
        for data in pieces:
            h.update(data)
            end += len(data)
        with self._lock:
            self.carried[name] = TensorRead(shard=shard, lo=start, hi=end, digest=_value(h))

    @property
    def bytes(self) -> int:
        return sum(e - s for read in self.reads.values() for s, e in read.chunks)

    def as_json(self) -> dict[str, dict]:
        return _as_json(self.reads)

    def carried_json(self) -> dict[str, dict]:
        return _as_json(self.carried)


@contextlib.contextmanager
def recording_reads(record: ReadRecord | None = None) -> Iterator[ReadRecord]:
    """Record the reads of every CheckpointReader created inside the block (into `record`, to
    add to what an earlier block recorded; default a new one)."""
    record = ReadRecord() if record is None else record
    _OPEN.append(record)
    try:
        yield record
    finally:
        _OPEN.remove(record)


def open_record() -> ReadRecord | None:
    """The innermost open record (a reader takes it when created)."""
    return _OPEN[-1] if _OPEN else None
