"""Release directory IO: sharded atomic writes, positioned chunked reads, byte counting, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from primus_v4.checkpoint_formats.fp8_fp4 import (
    dequantize_fp4,
    dequantize_fp8,
    quantize_fp4,
    quantize_fp8,
)
from primus_v4.checkpoint_formats.sharded import (
    INDEX_FILE,
    CheckpointFormatError,
    CheckpointReader,
    write_checkpoint,
)

KINDS = {
    "layers.0.attn.wq_a.weight": "fp8",
    "layers.0.attn.attn_sink": "fp32",
    "layers.0.attn_norm.weight": "bf16",
    "layers.0.ffn.experts.0.w1.weight": "fp4",
    "layers.0.ffn.experts.1.w1.weight": "fp4",
    "layers.0.ffn.gate.tid2eid": "int64",
}


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "layers.0.attn.wq_a.weight": torch.randn(200, 136, generator=g),
        "layers.0.attn.attn_sink": torch.randn(4, generator=g),
        "layers.0.attn_norm.weight": torch.randn(136, generator=g),
        "layers.0.ffn.experts.0.w1.weight": torch.randn(64, 96, generator=g),
        "layers.0.ffn.experts.1.w1.weight": torch.randn(64, 96, generator=g),
        "layers.0.ffn.gate.tid2eid": torch.randint(0, 8, (10, 2), generator=g),
    }


def test_bf16_export_reads_back_bit_identical_in_bounded_shards(tmp_path: Path) -> None:
    tensors = _tensors()
    out = tmp_path / "bf16"
    summary = write_checkpoint(out, tensors.items(), KINDS, {"model_type": "deepseek_v4"},
                            max_shard_bytes=60_000)  # fmt: skip
    index = json.loads((out / INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert summary.shards == len(shards) >= 2
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    for shard in shards:  # bounded: only a tensor larger than the bound alone may exceed it
        assert (out / shard).stat().st_size < 60_000 + 4096
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "deepseek_v4"
    with CheckpointReader(out) as reader:
        assert reader.names() == sorted(tensors)
        for name, t in tensors.items():
            kind = KINDS[name]
            stored = {"fp8": torch.bfloat16, "fp4": torch.bfloat16, "bf16": torch.bfloat16}
            want = t.to(stored.get(kind, t.dtype))
            got = reader.read(name)
            assert got.dtype == want.dtype and torch.equal(got, want), name
        assert reader.bytes_read == index["metadata"]["total_size"] == reader.total_bytes()
    assert not list(tmp_path.glob(".*partial*"))


def test_fp8_export_stores_the_release_layout_and_dequantizes(tmp_path: Path) -> None:
    tensors = _tensors(1)
    out = tmp_path / "fp8"
    write_checkpoint(out, tensors.items(), KINDS.__getitem__, {"model_type": "deepseek_v4"},
                  dtype="fp8")  # fmt: skip
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    assert config["quantization_config"]["scale_fmt"] == "ue8m0" and config["expert_dtype"] == "fp4"
    with CheckpointReader(out) as reader:
        assert "layers.0.attn.wq_a.scale" in reader.stored_names()
        assert "layers.0.attn.wq_a.scale" not in reader.names()
        assert reader.dtype("layers.0.attn.wq_a.weight") == torch.float8_e4m3fn
        assert reader.dtype("layers.0.ffn.experts.0.w1.weight") == torch.int8
        assert reader.shape("layers.0.ffn.experts.0.w1.weight") == (64, 96)  # logical, not 48
        assert reader.storage("layers.0.ffn.experts.0.w1.weight") == "fp4"
        wq = tensors["layers.0.attn.wq_a.weight"]
        got = reader.read("layers.0.attn.wq_a.weight", torch.float32)
        assert torch.equal(got, dequantize_fp8(*quantize_fp8(wq), torch.float32))
        w1 = tensors["layers.0.ffn.experts.1.w1.weight"]
        got = reader.read("layers.0.ffn.experts.1.w1.weight", torch.float32, shape=(64, 96))
        assert torch.equal(got, dequantize_fp4(*quantize_fp4(w1), torch.float32))
        # bytes: e4m3 1 B/value + 2x2 scales; fp4 0.5 B/value + one scale byte per 32
        assert reader.nbytes("layers.0.attn.wq_a.weight") == 200 * 136 + 2 * 2
        assert reader.nbytes("layers.0.ffn.experts.1.w1.weight") == 64 * 48 + 64 * 3
        before = reader.bytes_read
        reader.read("layers.0.ffn.experts.0.w1.weight")
        assert reader.bytes_read - before == 64 * 48 + 64 * 3


def test_reader_opens_a_single_file_checkpoint(tmp_path: Path) -> None:
    save_file({"a.weight": torch.ones(2, 3)}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text("{}")
    with CheckpointReader(tmp_path) as reader:
        assert reader.names() == ["a.weight"]
        assert torch.equal(reader.read("a.weight"), torch.ones(2, 3))


def test_reader_errors_name_what_and_where(tmp_path: Path) -> None:
    with pytest.raises(CheckpointFormatError, match="not a directory"):
        CheckpointReader(tmp_path / "nope")
    with pytest.raises(CheckpointFormatError, match=r"config.json: missing"):
        CheckpointReader(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointFormatError, match=r"neither model\.safetensors\.index\.json"):
        CheckpointReader(tmp_path)
    out = tmp_path / "ck"
    write_checkpoint(out, _tensors().items(), KINDS, {}, max_shard_bytes=60_000)
    with CheckpointReader(out) as reader:
        with pytest.raises(CheckpointFormatError, match=r"no tensor 'layers.9.x'"):
            reader.read("layers.9.x")
        with pytest.raises(CheckpointFormatError, match=r"'layers.0.attn_norm.weight' has shape "
                           r"\[136\] in the checkpoint but \[135\] in the model"):  # fmt: skip
            reader.read("layers.0.attn_norm.weight", shape=(135,))
    last = sorted(out.glob("model-*.safetensors"))[-1]
    last.unlink()
    with pytest.raises(
        CheckpointFormatError, match=rf"{last.name}: shard missing \(the index maps"
    ):
        CheckpointReader(out)


def test_write_is_atomic_and_refuses_to_overwrite(tmp_path: Path) -> None:
    def broken():
        yield "layers.0.attn_norm.weight", torch.ones(4)
        raise RuntimeError("source failed")

    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="source failed"):
        write_checkpoint(out, broken(), KINDS, {}, max_shard_bytes=1)
    assert not out.exists() and not list(tmp_path.iterdir())  # nothing half-written remains
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(CheckpointFormatError, match="exists and is not an empty directory"):
        write_checkpoint(out, _tensors().items(), KINDS, {})
    with pytest.raises(CheckpointFormatError, match="given twice"):
        twice = [("layers.0.attn_norm.weight", torch.ones(2))] * 2
        write_checkpoint(tmp_path / "t", twice, KINDS, {})
    with pytest.raises(
        CheckpointFormatError, match=r"only 2-D '.weight' tensors can be stored fp8"
    ):
        write_checkpoint(tmp_path / "u", [("x.bias", torch.ones(4))], {"x.bias": "fp8"}, {},
                      dtype="fp8")  # fmt: skip


def test_extra_files_travel_with_the_export(tmp_path: Path) -> None:
    tok = tmp_path / "tokenizer.json"
    tok.write_text('{"model": {}}')
    out = tmp_path / "out"
    write_checkpoint(out, _tensors().items(), KINDS, {}, extra_files=[tok])
    assert (out / "tokenizer.json").read_text() == tok.read_text()


def test_fp4_stored_as_float4_x2_reads_like_int8(tmp_path: Path) -> None:
    """DeepSeek's converter can store experts as float4_e2m1fn_x2 (safetensors "F4", whose
    header counts 4-bit values): same bytes, same shape and values as the int8 layout."""
    w = _tensors(2)["layers.0.ffn.experts.0.w1.weight"]
    q, scale = quantize_fp4(w)
    for kind, packed in (("i8", q), ("f4", q.view(torch.float4_e2m1fn_x2))):
        d = tmp_path / kind
        d.mkdir()
        save_file({"e.weight": packed, "e.scale": scale}, d / "model.safetensors")
        (d / "config.json").write_text("{}")
        with CheckpointReader(d) as reader:
            assert reader.storage("e.weight") == "fp4" and reader.shape("e.weight") == (64, 96)
            assert reader.nbytes("e.weight") == 64 * 48 + 64 * 3
            assert torch.equal(reader.read("e.weight", torch.float32),
                               dequantize_fp4(q, scale, torch.float32))  # fmt: skip


def test_read_into_decodes_in_chunks_bit_equal_to_a_whole_read(tmp_path: Path, monkeypatch) -> None:
    """Chunked decoding straight into the destination (fp8 chunks start on 128-row blocks, the
    last block row partial; fp4 any rows) gives the bits of one whole dequantization."""
    g = torch.Generator().manual_seed(3)
    tensors = {"a.weight": torch.randn(300, 256, generator=g),  # 3 block rows, the last 44 rows
               "b.weight": torch.randn(70, 64, generator=g),
               "n.weight": torch.randn(256, generator=g)}  # fmt: skip
    kinds = {"a.weight": "fp8", "b.weight": "fp4", "n.weight": "bf16"}
    out = tmp_path / "ck"
    write_checkpoint(out, tensors.items(), kinds, {}, dtype="fp8")
    want = {
        "a.weight": dequantize_fp8(*quantize_fp8(tensors["a.weight"]), torch.float32),
        "b.weight": dequantize_fp4(*quantize_fp4(tensors["b.weight"]), torch.float32),
        "n.weight": tensors["n.weight"].to(torch.bfloat16),
    }
    # a: 128-row chunks (b: 512 rows, one chunk); then b: 8-row chunks, the last one 6 rows
    for chunk in (256 * 128, 64 * 8):
        monkeypatch.setattr(CheckpointReader, "CHUNK", chunk)
        with CheckpointReader(out) as reader:
            for name, ref in want.items():
                dst = torch.full(ref.shape, float("nan"), dtype=ref.dtype)
                reader.read_into(name, dst, shape=ref.shape)
                assert torch.equal(dst, ref), (name, chunk)
            assert reader.bytes_read == reader.total_bytes()
            bf16 = torch.empty(300, 256, dtype=torch.bfloat16)  # decoded in bf16 directly
            reader.read_into("a.weight", bf16, shape=(300, 256))
            assert torch.equal(bf16, want["a.weight"].to(torch.bfloat16))


def test_truncated_or_mismatched_shards_are_refused_before_reading(tmp_path: Path) -> None:
    out = tmp_path / "ck"
    write_checkpoint(out, _tensors().items(), KINDS, {}, max_shard_bytes=60_000)
    shards = sorted(out.glob("model-*.safetensors"))
    data = shards[0].read_bytes()
    shards[0].write_bytes(data[:-10])
    truncated = rf"{shards[0].name}: '.*' ends at byte {len(data)} but the file has "
    with pytest.raises(
        CheckpointFormatError, match=truncated + rf"{len(data) - 10} bytes: it is trunc"
    ):
        CheckpointReader(out)
    shards[0].write_bytes(b"\x05")
    with pytest.raises(CheckpointFormatError, match="not a safetensors file or truncated"):
        CheckpointReader(out)
    shards[0].write_bytes(data)
    index = json.loads((out / INDEX_FILE).read_text())
    name = next(n for n, s in index["weight_map"].items() if s == shards[0].name)
    index["weight_map"][name] = shards[1].name
    (out / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(
        CheckpointFormatError, match=rf"the index maps '{name}' to this shard but it does not hold"
    ):
        CheckpointReader(out)


def test_streamed_shards_are_safetensors_files(tmp_path: Path) -> None:
    """The streaming writer's files read back through the safetensors library itself, every
    stored dtype included; a shard whose reserved header room fills up is closed early."""
    from safetensors import safe_open

    tensors = {f"layers.{i}.attn_norm.weight": torch.randn(3 + i) for i in range(40)}
    tensors |= _tensors(4)
    kinds = dict.fromkeys(tensors, "bf16") | KINDS
    out = tmp_path / "ck"
    summary = write_checkpoint(
        out, tensors.items(), kinds, {}, dtype="fp8", max_shard_bytes=2 << 20
    )
    # 36 KB of data is far below 2 MiB, but 49 header entries of ~100 B overflow the 2 KiB room
    assert summary.shards >= 2 and summary.tensors == len(tensors) + 3  # + 3 scales
    with CheckpointReader(out) as reader:
        for shard in sorted(out.glob("model-*.safetensors")):
            with safe_open(shard, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118
                    got, want = f.get_tensor(name), reader._raw(name)
                    assert got.dtype == want.dtype and torch.equal(
                        got.view(torch.uint8), want.view(torch.uint8)
                    ), name
    assert {d for d in (reader.dtype(n) for n in reader.stored_names())} == {
        torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.int8, torch.bfloat16, torch.float32,
        torch.int64,
    }  # fmt: skip


def test_concurrent_reads_equal_sequential_ones_and_raise_the_first_error(tmp_path: Path) -> None:
    out = tmp_path / "ck"
    tensors = _tensors(5)
    write_checkpoint(out, tensors.items(), KINDS, {}, dtype="fp8", max_shard_bytes=60_000)
    threads = torch.get_num_threads()
    with CheckpointReader(out) as one, CheckpointReader(out) as many:
        want = {n: one.read(n, torch.float32 if KINDS[n] != "int64" else None) for n in tensors}
        got = {n: torch.empty_like(t) for n, t in want.items()}
        done: list[int] = []
        with many.concurrent(3, progress=done.append) as read_into:
            for name, dst in got.items():
                read_into(name, dst, dst.shape)
        assert torch.get_num_threads() == threads  # restored after the block
        assert all(torch.equal(got[n], want[n]) for n in tensors) and len(done) == len(tensors)
        assert many.bytes_read == one.bytes_read == one.total_bytes()
        with (
            pytest.raises(CheckpointFormatError, match=r"'layers.0.attn_norm.weight' has shape"),
            many.concurrent(3) as read_into,
        ):
            for name, dst in got.items():
                shape = (1,) if name == "layers.0.attn_norm.weight" else dst.shape
                read_into(name, dst, shape)
        assert torch.get_num_threads() == threads
