"""Tensors carried through an export unchanged: copied byte for byte from the source release.

A part of a release the run does not train (a speculative-decoding drafter) must reach the
export exactly as released: same names, safetensors dtypes, shapes and bytes. Nothing is
decoded: each tensor's byte range is copied from its source shard into a new shard.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from primus_v4.checkpoint_formats.safetensors_io import read_header
from primus_v4.checkpoint_formats.sharded import _weight_map
from primus_v4.errors import CheckpointFormatError

_CHUNK = 64 << 20  # bytes per copy step: a tensor of any size streams through this much memory


def copy_carried(source_dir: Path, out_dir: Path, names: Sequence[str]) -> dict[str, str]:
    """Copy the tensors `names` of the release at `source_dir` into new shards of `out_dir`
    (`carried-0000k-of-0000n.safetensors`, one per source shard holding any); returns their
    weight map (name -> shard file) for the output's index."""
    source_dir, out_dir = Path(source_dir), Path(out_dir)
    where = _weight_map(source_dir)
    missing = [n for n in names if n not in where]
    if missing:
        raise CheckpointFormatError(
            f"{source_dir}: has no tensor {missing[0]!r} ({len(missing)} carried tensors missing)"
        )
    by_shard: dict[str, list[str]] = {}
    for name in sorted(names):
        by_shard.setdefault(where[name], []).append(name)
    out: dict[str, str] = {}
    for k, (shard, group) in enumerate(sorted(by_shard.items()), start=1):
        target = f"carried-{k:05d}-of-{len(by_shard):05d}.safetensors"
        _copy_tensors(source_dir / shard, out_dir / target, group)
        out.update(dict.fromkeys(group, target))
    return out


def _copy_tensors(source: Path, target: Path, names: list[str]) -> None:
    read_header(source)  # every byte range checked against the file's size first
    with open(source, "rb") as src:
        length = int.from_bytes(src.read(8), "little")
        header = json.loads(src.read(length))
        entries, offset = {}, 0
        for name in names:
            info = header[name]
            begin, end = info["data_offsets"]
            entries[name] = {**info, "data_offsets": [offset, offset + end - begin]}
            offset += end - begin
        head = json.dumps(entries, separators=(",", ":")).encode()
        head += b" " * (-len(head) % 8)  # the format allows space padding; 8-aligned data
        with open(target, "wb") as dst:
            dst.write(len(head).to_bytes(8, "little") + head)
            for name in names:
                begin, end = header[name]["data_offsets"]
                src.seek(8 + length + begin)
                _copy_bytes(src, dst, end - begin)
            dst.flush()
            os.fsync(dst.fileno())


def _copy_bytes(src, dst, n: int) -> None:
    while n:
        chunk = src.read(min(n, _CHUNK))
        if not chunk:
            raise CheckpointFormatError(f"{src.name}: ended {n} bytes early while copying")
        dst.write(chunk)
        n -= len(chunk)
