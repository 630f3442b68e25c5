"""What a load read from a release, as digests: the record a resumed run compares with the one
its first start wrote, so a resume against another release (one tensor changed) is refused
instead of trained on.

While `recording_reads()` is open, every `CheckpointReader` created in it adds each stored byte
range it reads to the record: per stored tensor, the byte span read and a 128-bit digest of those
bytes (blake2b of each read chunk with its offset, XOR-combined, so the order in which threads
read the chunks does not matter and a chunk read twice counts once). Hashing costs about one pass
over the bytes read (~1 GB/s per core) and keeps nothing beyond the digests.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

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


class ReadRecord:
    """Digests of the stored bytes read, by stored tensor name (`tensors`)."""

    def __init__(self) -> None:
        self.reads: dict[str, TensorRead] = {}
        self._lock = threading.Lock()

    def add(self, name: str, shard: str, start: int, data: memoryview) -> None:
        """`data` was read from byte `start` of `shard`, inside stored tensor `name`."""
        end = start + len(data)
        h = hashlib.blake2b(start.to_bytes(8, "little"), digest_size=16)
        h.update(data)
        value = int.from_bytes(h.digest(), "little")
        with self._lock:
            read = self.reads.get(name)
            if read is None:
                read = self.reads[name] = TensorRead(shard=shard, lo=start, hi=end)
            if (start, end) in read.chunks:
                return
            read.chunks.add((start, end))
            read.lo, read.hi = min(read.lo, start), max(read.hi, end)
            read.digest ^= value

    @property
    def bytes(self) -> int:
        return sum(e - s for read in self.reads.values() for s, e in read.chunks)

    def as_json(self) -> dict[str, dict]:
        return {name: read.as_json() for name, read in sorted(self.reads.items())}


@contextlib.contextmanager
def recording_reads() -> Iterator[ReadRecord]:
    """Record the reads of every CheckpointReader created inside the block."""
    record = ReadRecord()
    _OPEN.append(record)
    try:
        yield record
    finally:
        _OPEN.remove(record)


def open_record() -> ReadRecord | None:
    """The innermost open record (a reader takes it when created)."""
    return _OPEN[-1] if _OPEN else None
