"""read_record: what a CheckpointReader reads inside `recording_reads()` is digested per stored
tensor, independent of the order in which chunks are read, a chunk read twice counted once, and
a changed byte changes the digest; readers outside the block record nothing."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from primus_v4.checkpoint_formats.read_record import ReadRecord, recording_reads
from primus_v4.checkpoint_formats.sharded import CheckpointReader


def _release(directory: Path, a: torch.Tensor) -> Path:
    directory.mkdir()
    (directory / "config.json").write_text("{}")
    save_file({"a": a, "b": torch.arange(6, dtype=torch.float32)}, directory / "model.safetensors")
    return directory


def test_reads_are_digested_per_tensor_and_only_inside_the_block(tmp_path: Path) -> None:
    a = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    release = _release(tmp_path / "r", a)
    with CheckpointReader(release) as reader:
        reader.read("a")  # outside: nothing recorded anywhere
    with recording_reads() as record, CheckpointReader(release) as reader:
        reader.read("a")
        reader.read("a")  # the same bytes again count once
    assert list(record.reads) == ["a"] and record.bytes == a.numel() * 4
    read = record.as_json()["a"]
    assert read["hi"] - read["lo"] == 48 and read["shard"] == "model.safetensors"
    changed = a.clone()
    changed[2, 3] += 1
    with recording_reads() as other, CheckpointReader(_release(tmp_path / "o", changed)) as r2:
        r2.read("a")
    assert other.as_json()["a"]["digest"] != read["digest"]
    assert {k: v for k, v in other.as_json()["a"].items() if k != "digest"} == {
        k: v for k, v in read.items() if k != "digest"
    }


def test_the_digest_does_not_depend_on_the_chunk_order() -> None:
    data = bytes(range(200))
    forward, backward = ReadRecord(), ReadRecord()
    for start in range(0, 200, 50):
        forward.add("t", "s", 1000 + start, memoryview(data[start : start + 50]))
    for start in reversed(range(0, 200, 50)):
        backward.add("t", "s", 1000 + start, memoryview(data[start : start + 50]))
    assert forward.as_json() == backward.as_json()
    assert forward.as_json()["t"]["lo"] == 1000 and forward.as_json()["t"]["hi"] == 1200
    shifted = ReadRecord()  # the same bytes at other offsets are other bytes of the file
    shifted.add("t", "s", 1001, memoryview(data))
    assert shifted.as_json()["t"]["digest"] != forward.as_json()["t"]["digest"]
