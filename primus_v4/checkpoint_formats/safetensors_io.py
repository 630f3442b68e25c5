"""The safetensors file format, read by byte ranges and written as a stream.

A file is an 8-byte little-endian header length N, N bytes of JSON (`{name: {dtype, shape,
data_offsets}}`, optional `__metadata__`, may end in space padding), then the tensors' bytes
at their offsets. `read_header` parses and checks a header against the file size;
`ShardWriter` appends tensors one by one and writes the header last, into room reserved at the
start (padded with spaces, as the format allows), so a writer holds one tensor at a time and
files of any size stream straight from the tensors' memory.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from primus_v4.errors import CheckpointFormatError

_ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
    "F4": torch.float4_e2m1fn_x2,
}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items() if k != "F4"}


@dataclass(kw_only=True, frozen=True)
class StoredTensor:
    """One tensor as stored: its shard file, safetensors dtype, stored shape and where its bytes
    lie in the file."""

    shard: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the data in the shard file

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


_MAX_HEADER = 1 << 28  # safetensors headers are JSON of a few MB; more is a corrupt length


def read_header(path: Path) -> dict[str, StoredTensor]:
    """The tensors of one safetensors file, every byte range checked against the file's size
    (a truncated download fails here, before anything is read)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if length < 0 or length > min(size - 8, _MAX_HEADER):
            raise CheckpointFormatError(
                f"{path}: not a safetensors file or truncated ({size} bytes, header length "
                f"{length}); fetch the file again"
            )
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise CheckpointFormatError(f"{path}: unreadable safetensors header ({err})") from None
    out: dict[str, StoredTensor] = {}
    for name, info in header.items():
        if name != "__metadata__":
            out[name] = _stored_entry(path, name, info, 8 + length, size)
    return out


def _stored_entry(path: Path, name: str, info: dict, base: int, size: int) -> StoredTensor:
    dtype = _ST_DTYPES.get(info.get("dtype"))
    if dtype is None:
        raise CheckpointFormatError(f"{path}: '{name}' has unsupported dtype {info.get('dtype')}")
    shape = tuple(int(d) for d in info["shape"])
    if dtype == torch.float4_e2m1fn_x2:  # safetensors counts 4-bit values; torch pairs them
        shape = (*shape[:-1], shape[-1] // 2)
    begin, end = (int(x) for x in info["data_offsets"])
    stored = StoredTensor(shard=path.name, dtype=dtype, shape=shape, offset=base + begin)
    if end - begin != stored.nbytes:
        raise CheckpointFormatError(
            f"{path}: '{name}' {list(shape)} {info['dtype']} needs {stored.nbytes} bytes but its "
            f"data_offsets span {end - begin}; the file is corrupt"
        )
    if base + end > size:
        raise CheckpointFormatError(
            f"{path}: '{name}' ends at byte {base + end} but the file has {size} bytes: it is "
            "truncated (an incomplete download or copy); fetch it again"
        )
    return stored


def writable_bytes(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes as a writable buffer (no copy)."""
    return memoryview(t.view(torch.uint8).view(-1).numpy())


def readable_bytes(t: torch.Tensor) -> memoryview:
    """A CPU tensor's bytes in row-major order as a buffer (no copy when contiguous)."""
    t = t.detach().cpu().contiguous()
    return memoryview(t.view(torch.uint8).view(-1).numpy())


class ShardWriter:
    """One safetensors file written as a stream: `add` appends a tensor's bytes, `close` writes
    the header into the room reserved for it at the start. `fits` says whether one more entry
    stays within that room."""

    def __init__(self, path: Path, *, header_room: int) -> None:
        self.path = path
        self.room = header_room - header_room % 8  # keeps the data 8-byte aligned
        self._file = path.open("wb")
        self._file.seek(8 + self.room)
        self._entries: list[str] = ['"__metadata__":{"format":"pt"}']
        self._header_bytes = len(self._entries[0]) + 2  # the braces
        self.names: list[str] = []
        self.data_bytes = 0

    @staticmethod
    def _entry(name: str, t: torch.Tensor, begin: int) -> str:
        spec = {"dtype": _ST_NAMES[t.dtype], "shape": list(t.shape),
                "data_offsets": [begin, begin + t.numel() * t.element_size()]}  # fmt: skip
        return json.dumps(name) + ":" + json.dumps(spec, separators=(",", ":"))

    def fits(self, items: list[tuple[str, torch.Tensor]]) -> bool:
        """Whether the header entries of `items`, appended in order, stay within the room."""
        need, offset = self._header_bytes, self.data_bytes
        for name, t in items:
            need += len(self._entry(name, t, offset)) + 1
            offset += t.numel() * t.element_size()
        return need <= self.room

    def add(self, name: str, t: torch.Tensor) -> None:
        if t.dtype not in _ST_NAMES:
            raise CheckpointFormatError(f"'{name}': dtype {t.dtype} has no safetensors name")
        entry = self._entry(name, t, self.data_bytes)
        if self._header_bytes + len(entry) + 1 > self.room:
            raise CheckpointFormatError(
                f"{self.path}: header room {self.room} B is full at '{name}'"
            )
        self._file.write(readable_bytes(t))
        self._entries.append(entry)
        self._header_bytes += len(entry) + 1
        self.names.append(name)
        self.data_bytes += t.numel() * t.element_size()

    def close(self) -> None:
        header = ("{" + ",".join(self._entries) + "}").encode()
        self._file.seek(0)
        self._file.write(self.room.to_bytes(8, "little"))
        self._file.write(header + b" " * (self.room - len(header)))
        self._file.flush()
        os.fsync(self._file.fileno())  # on disk before the directory holding it is published
        self._file.close()

    def abort(self) -> None:
        self._file.close()
