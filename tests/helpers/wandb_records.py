"""Reads a wandb offline run file (run-<id>.wandb) back: its records are protobuf messages in
LevelDB's log framing (32 KiB blocks; chunks of crc32, length, type), after a 7-byte header."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024
CHUNK_HEADER = 7  # crc32 (4), length (2), type (1)
FULL, LAST = 1, 4


def _payloads(data: bytes) -> Iterator[bytes]:
    assert data[:4] == b":W&B", "not a wandb run file"
    pos, pending = 7, b""
    while pos + CHUNK_HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < CHUNK_HEADER:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + CHUNK_HEADER])
        pending += data[pos + CHUNK_HEADER : pos + CHUNK_HEADER + length]
        pos += CHUNK_HEADER + length
        if kind in (FULL, LAST):
            yield pending
            pending = b""


def read_offline_run(run_dir: Path) -> dict[str, Any]:
    """{"history": [{key: value} per logged step], "config": {key: value}, "files": [path]}."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_dir.glob("run-*.wandb")
    out: dict[str, Any] = {"history": [], "config": {}, "files": []}
    for payload in _payloads(path.read_bytes()):
        record = pb.Record()
        record.ParseFromString(payload)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            out["history"].append(
                {
                    i.key or "/".join(i.nested_key): json.loads(i.value_json)
                    for i in record.history.item
                }
            )
        elif kind == "run":
            out["config"].update(
                {i.key: json.loads(i.value_json) for i in record.run.config.update}
            )
        elif kind == "files":
            out["files"] += [f.path for f in record.files.files]
    return out
