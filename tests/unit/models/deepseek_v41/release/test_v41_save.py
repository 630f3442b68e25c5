"""DeepSeek-V4.1 exports against the golden release: as released bit for bit, bf16 to the
decoded values rounded to bf16, the parts outside the text model carried byte for byte,
refusals in one line with nothing left behind."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from primus_v4.checkpoint_formats.sharded import INDEX_FILE
from primus_v4.errors import CheckpointFormatError
from primus_v4.models.deepseek_v41.release.save import save_release
from primus_v4.models.deepseek_v41.release.tensors import kind_of, not_text, read_tensors

RELEASE = Path(__file__).parents[4] / "fixtures" / "dsv41_golden" / "checkpoint"
STORED_TENSORS = 821  # the golden release's manifest: tensors (weights and scales) stored
BIAS_VL = 10  # one image-token router bias per layer: outside the text model, carried


def _stored(directory: Path) -> dict[str, torch.Tensor]:
    """Every stored tensor of a release directory, by the shards its index names."""
    index = json.loads((directory / INDEX_FILE).read_text())["weight_map"]
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index.values())):
        out.update(load_file(directory / shard))
    assert set(out) == set(index)
    return out


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    same_type = a.dtype == b.dtype and a.shape == b.shape
    return same_type and torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))


@pytest.fixture(scope="module")
def decoded() -> dict[str, torch.Tensor]:
    return read_tensors(RELEASE)


@pytest.fixture(scope="module")
def source() -> dict[str, torch.Tensor]:
    return _stored(RELEASE)


def test_fp8_export_of_the_decoded_release_is_bit_equal(
    decoded: dict, source: dict, tmp_path: Path
) -> None:
    export = save_release(decoded, RELEASE, tmp_path / "fp8", dtype="fp8")
    written = _stored(tmp_path / "fp8")
    assert len(source) == STORED_TENSORS and set(written) == set(source)
    unequal = [n for n in source if not _same_bytes(written[n], source[n])]
    assert unequal == []
    assert len(export.carried) == BIAS_VL
    assert all(n.endswith("gate.bias_vl") for n in export.carried)
    assert export.summary.tensors == STORED_TENSORS
    assert json.loads((tmp_path / "fp8" / "config.json").read_text()) == json.loads(
        (RELEASE / "config.json").read_text()
    )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "fp8" / name).read_bytes() == (RELEASE / name).read_bytes()
    assert [p.name for p in tmp_path.iterdir()] == ["fp8"]  # no temp dir left


def test_bf16_export_holds_the_values_rounded_to_bf16(decoded: dict, source: dict, tmp_path: Path):
    save_release(decoded, RELEASE, tmp_path / "bf16", dtype="bfloat16")
    written = _stored(tmp_path / "bf16")
    assert set(written) == set(decoded) | {n for n in source if not_text(n)}
    for name, values in decoded.items():
        want = torch.float32 if kind_of(name) == "fp32" else torch.bfloat16
        assert written[name].dtype == want, name
        assert torch.equal(written[name], values.to(want)), name
    assert all(_same_bytes(written[n], source[n]) for n in source if not_text(n))
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["text_config"] == json.loads((RELEASE / "config.json").read_text())["text_config"]


def _planted(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A copy of the release with tensors outside the text model added in a shard of their
    own: a DSpark stage's FP8 weight + e8m0 scale, a bf16 `mtp.0.foo`, a float32 `aligner.bar`."""
    release = tmp_path / "release"
    shutil.copytree(RELEASE, release)
    g = torch.Generator().manual_seed(0)
    planted = {
        "mtp.0.foo": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "aligner.bar": torch.randn(7, generator=g),
        "mtp.0.attn.wq_a.weight": torch.randn(32, 64, generator=g).to(torch.float8_e4m3fn),
        "mtp.0.attn.wq_a.scale": torch.randint(120, 130, (1, 2), dtype=torch.uint8, generator=g)
        .view(torch.float8_e8m0fnu),
    }  # fmt: skip
    save_file(planted, release / "model-extra.safetensors")
    index_file = release / INDEX_FILE
    index = json.loads(index_file.read_text())
    index["weight_map"].update(dict.fromkeys(planted, "model-extra.safetensors"))
    index_file.write_text(json.dumps(index))
    return release, planted


def test_parts_outside_the_text_model_are_carried_byte_for_byte(
    decoded: dict, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    release, planted = _planted(tmp_path)
    logger = logging.getLogger("primus_v4")
    logger.addHandler(caplog.handler)
    try:
        export = save_release(decoded, release, tmp_path / "out", dtype="fp8")
    finally:
        logger.removeHandler(caplog.handler)
    written = _stored(tmp_path / "out")
    for name, tensor in planted.items():
        assert _same_bytes(written[name], tensor), name
    assert set(planted) <= set(export.carried)
    lines = [r.getMessage() for r in caplog.records if "carried byte for byte" in r.getMessage()]
    # grouped by part with counts, not every name (a real release carries ~2,800 tensors)
    counted = ": 14 tensors (aligner 1, ffn.gate.bias_vl 10, mtp.0 3)"
    assert len(lines) == 1 and lines[0].endswith(counted), lines
    assert len(written) == STORED_TENSORS + len(planted)


def test_a_tensor_of_the_wrong_shape_is_refused(decoded: dict, tmp_path: Path) -> None:
    name = "layers.4.attn.wq_b.weight"
    bad = dict(decoded) | {name: decoded[name][:-1]}
    with pytest.raises(CheckpointFormatError) as err:
        save_release(bad, RELEASE, tmp_path / "out")
    message = str(err.value)
    assert "\n" not in message and name in message and "[255, 64]" in message
    assert "[256, 64]" in message
    assert list(tmp_path.iterdir()) == []  # nothing written, no temp dir


def test_missing_and_unknown_tensors_are_refused(decoded: dict, tmp_path: Path):
    missing = {n: t for n, t in decoded.items() if n != "layers.9.attn.wo_a.weight"}
    for given in (missing, [missing]):  # a dict is checked up front, a stream at its end
        with pytest.raises(
            CheckpointFormatError, match=r"1 tensor\(s\) .*: layers\.9\.attn\.wo_a\."
        ):
            save_release(given, RELEASE, tmp_path / "a")
    unknown = dict(decoded) | {"layers.0.attn.wq_c.weight": torch.zeros(2, 2)}
    with pytest.raises(CheckpointFormatError, match=r"'layers\.0\.attn\.wq_c\.weight': the rel"):
        save_release(unknown, RELEASE, tmp_path / "b")
    assert list(tmp_path.iterdir()) == []


def test_a_release_stored_otherwise_is_refused(decoded: dict, tmp_path: Path) -> None:
    release = tmp_path / "release"
    shutil.copytree(RELEASE, release)
    shard = release / "model-00001-of-00002.safetensors"
    tensors = load_file(shard)
    tensors["layers.0.attn_norm.weight"] = tensors["layers.0.attn_norm.weight"].float()
    save_file(tensors, shard)
    expected = r"'layers\.0\.attn_norm\.weight' is stored fp32, the DeepSeek-V4\.1 release layout"
    with pytest.raises(CheckpointFormatError, match=expected):
        read_tensors(release)
    with pytest.raises(CheckpointFormatError, match=expected):
        save_release(decoded, release, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_save_pretrained_carries_frozen_placed_tables(source: dict, tmp_path: Path) -> None:
    """A model read by load_pretrained whose Engram tables were placed frozen (FP8 rows, no
    state-dict entry): its bf16 save carries the release's table bytes; saved beside another
    release, refused naming the tables."""
    from primus_v4 import save_pretrained
    from primus_v4.models.deepseek_v41.engram_placement import place_engram
    from primus_v4.models.deepseek_v41.release.load import load_pretrained

    model = load_pretrained(RELEASE, progress=False)
    placed = place_engram(model, placement="replicated", trainable=False)
    assert sorted(placed) == ["layers.1.engram", "layers.4.engram"]
    save_pretrained(model, tmp_path / "out", dtype="bfloat16")
    got = _stored(tmp_path / "out")
    for name in placed:
        for part in ("weight", "scale"):
            stored = f"{name}.embed.{part}"
            assert _same_bytes(got[stored], source[stored]), stored
    assert got["layers.1.engram.wkv.weight"].dtype == torch.bfloat16  # the rest as bf16
    other = tmp_path / "other"
    shutil.copytree(RELEASE, other)
    with pytest.raises(CheckpointFormatError, match=r"layers\.1\.engram\.embed\.weight.*placed"):
        save_pretrained(model, tmp_path / "out2", source=other)
    assert not (tmp_path / "out2").exists()
