"""DeepSeek-V4.1's image encoder (models/deepseek_v41/vision.py) loaded from the golden tiny
release against DeepSeek's official code in float32 (tests/fixtures/dsv41_vision_golden): the
ViT's output and the aligner's image embeddings of every golden image, from the golden patches
and from our own processor's; a release without a tower or missing a tensor is named."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from primus_v4 import image_patches
from primus_v4.errors import CheckpointFormatError, ConfigError
from primus_v4.models.deepseek_v41.release.load import load_pretrained
from primus_v4.models.deepseek_v41.spec import SPEC
from primus_v4.models.deepseek_v41.vision import cells_of, load_image_encoder

GOLDEN = Path(__file__).resolve().parents[3] / "fixtures/dsv41_vision_golden"
ATOL = 1e-4  # the golden set's advice for a float32 port (measured below, quoted in the note)


@pytest.fixture(scope="module")
def golden() -> dict[str, torch.Tensor]:
    return load_file(GOLDEN / "golden.safetensors")


def test_vit_outputs_and_image_embeddings_equal_the_official_code(golden, capsys) -> None:
    torch.set_num_threads(1)  # the golden set's own setting: its sums in one order
    encoder = load_image_encoder(GOLDEN / "checkpoint")
    manifest = json.loads((GOLDEN / "manifest.json").read_text())
    config = json.loads((GOLDEN / "checkpoint" / "config.json").read_text())
    worst = {"vit_out": 0.0, "embeds": 0.0}
    for doc in manifest["docs"]:
        for k, image in enumerate(doc["images"]):
            key = f"doc{doc['doc']}.img{k}"
            grid = tuple(image["vit_grid_hw"])
            ours, ours_grid = image_patches(GOLDEN / image["file"], config)
            assert ours_grid == grid and torch.equal(ours, golden[f"{key}.patches"])
            with torch.no_grad():
                vit = encoder.vision(golden[f"{key}.patches"], grid)
                embeds = encoder.encode_image(ours, grid)
            assert embeds.shape == (cells_of(grid, 3), 128) == golden[f"{key}.embeds"].shape
            worst["vit_out"] = max(
                worst["vit_out"], float((vit - golden[f"{key}.vit_out"]).abs().max())
            )
            worst["embeds"] = max(
                worst["embeds"], float((embeds - golden[f"{key}.embeds"]).abs().max())
            )
    print(f"image encoder vs the official code, max |difference|: {worst}")
    assert all(v <= ATOL for v in worst.values()), worst
    assert encoder.image_start.abs().sum() > 0  # the span vectors are the release's


@pytest.mark.parametrize("vision", ["frozen", "aligner", "all"])
def test_the_model_s_encode_image_equals_the_official_code_and_trains_its_parts(
    golden, vision: str
) -> None:
    """`model.encode_image` with the parts each `vision_train` holds in the model (loaded from
    the release) and the rest attached as the trainer attaches them: the golden embeddings, and
    gradients reach exactly the trained parts."""
    torch.set_num_threads(1)
    model = load_pretrained(GOLDEN / "checkpoint", progress=False, vision=vision)
    SPEC.attach_images(model, GOLDEN / "checkpoint", device="cpu")
    manifest = json.loads((GOLDEN / "manifest.json").read_text())
    worst = 0.0
    for doc in manifest["docs"]:
        for k, image in enumerate(doc["images"]):
            key = f"doc{doc['doc']}.img{k}"
            embeds = model.encode_image(golden[f"{key}.patches"], tuple(image["vit_grid_hw"]))
            worst = max(worst, float((embeds - golden[f"{key}.embeds"]).abs().max()))
            assert embeds.requires_grad == (vision != "frozen")
            if embeds.requires_grad:
                embeds.square().sum().backward()
    print(f"model.encode_image (vision_train={vision}) vs the official code: {worst}")
    assert worst <= ATOL
    grads = {n for n, p in model.named_parameters() if p.grad is not None}
    want = {"frozen": set(), "aligner": {"aligner.w1.weight", "aligner.w1.bias",
                                         "aligner.w2.weight", "aligner.w2.bias"}}  # fmt: skip
    if vision == "all":
        assert {n for n in grads if n.startswith("vision.")} and "aligner.w1.weight" in grads
    else:
        assert grads == want[vision]
    attached = model.__dict__["image_encoder"]
    assert attached is None or all(p.grad is None for p in attached.parameters())


def test_a_loaded_release_encodes_pictures_without_more_set_up(golden) -> None:
    """`primus_v4.load_pretrained(release)` then `model.encode_image(patches, (h, w))`: the
    frozen encoder is read from the release on first use (not before: a text-only use never
    reads it), in the model's dtype."""
    import primus_v4

    torch.set_num_threads(1)
    model = primus_v4.load_pretrained(GOLDEN / "checkpoint", progress=False)
    assert model.__dict__["image_encoder"] is None
    doc = json.loads((GOLDEN / "manifest.json").read_text())["docs"][0]
    grid = tuple(doc["images"][0]["vit_grid_hw"])
    key = f"doc{doc['doc']}.img0"
    with torch.no_grad():
        embeds = model.encode_image(golden[f"{key}.patches"], grid)
    assert float((embeds - golden[f"{key}.embeds"]).abs().max()) <= ATOL
    assert model.__dict__["image_encoder"] is not None
    unsourced = primus_v4.load_pretrained(GOLDEN / "checkpoint", progress=False)
    del unsourced.release_source  # a model that does not know its release: said, not guessed
    with pytest.raises(ConfigError, match="the model has no image encoder to encode pictures"):
        unsourced.encode_image(golden[f"{key}.patches"], grid)
    bf16 = primus_v4.load_pretrained(GOLDEN / "checkpoint", progress=False, dtype=torch.bfloat16)
    assert bf16.encode_image(golden[f"{key}.patches"], grid).dtype == torch.bfloat16
    assert bf16._image_part("vision").norm.weight.dtype == torch.bfloat16


def test_a_release_without_a_tower_or_a_tensor_is_named(tmp_path: Path) -> None:
    release = tmp_path / "release"
    shutil.copytree(GOLDEN / "checkpoint", release)
    config = json.loads((release / "config.json").read_text())
    without = {k: v for k, v in config.items() if k != "vision_config"}
    (release / "config.json").write_text(json.dumps(without))
    with pytest.raises(CheckpointFormatError, match=r"config\.json has no vision_config"):
        load_image_encoder(release)
    (release / "config.json").write_text(json.dumps(config))
    index = json.loads((release / "model.safetensors.index.json").read_text())
    del index["weight_map"]["aligner.w2.bias"]
    (release / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointFormatError, match=r"\['aligner.w2.bias'\] are missing"):
        load_image_encoder(release)
