"""DeepSeek-V4.1's image processor (primus_v4/data/images.py) against what DeepSeek's official
code computes (tests/fixtures/dsv41_vision_golden): the patches of every golden picture bit for
bit (shrunk, enlarged, padded, a second processor setting with the plain-resize path), the grid
plan of 78 image sizes under three settings (the release's included), the token types of a span,
and an unreadable picture named in one error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from primus_v4 import image_patches
from primus_v4.data.images import ImageGrid, plan_grid, span_types
from primus_v4.errors import DataError

GOLDEN = Path(__file__).resolve().parents[2] / "fixtures/dsv41_vision_golden"
# the official code's argument names -> the release vision_config's
ARGS = {"vision_patch_size": "patch_size", "vision_downsample_ratio": "downsample_ratio",
        "vision_max_n_token": "max_image_tokens", "vision_min_pixels": "min_pixels",
        "vision_max_wh_ratio": "max_wh_ratio"}  # fmt: skip


@pytest.fixture(scope="module")
def golden() -> dict[str, torch.Tensor]:
    return load_file(GOLDEN / "golden.safetensors")


@pytest.fixture(scope="module")
def manifest() -> dict:
    return json.loads((GOLDEN / "manifest.json").read_text())


def _config() -> dict:
    return json.loads((GOLDEN / "checkpoint" / "config.json").read_text())


def test_the_patches_of_every_golden_picture_are_the_release_s_bit_for_bit(
    golden, manifest
) -> None:
    config = _config()
    seen = 0
    for doc in manifest["docs"]:
        for k, image in enumerate(doc["images"]):
            patches, grid = image_patches(GOLDEN / image["file"], config)
            want = golden[f"doc{doc['doc']}.img{k}.patches"]
            assert grid == tuple(image["vit_grid_hw"]), image["file"]
            assert patches.dtype == torch.bfloat16 and patches.shape == want.shape
            assert torch.equal(patches.view(torch.int16), want.view(torch.int16)), image["file"]
            seen += 1
    assert seen == 4  # enlarged (img0), as is (img1), shrunk to fit (img2), padded (img3)


def test_the_plain_resize_path_of_a_wide_picture(golden, manifest) -> None:
    (case,) = manifest["processor_cases"]
    settings = {ARGS[k]: v for k, v in case["arg_overrides"].items()}
    grid = ImageGrid(**{**ImageGrid.of(_config()).__dict__, **settings})
    patches, hw = image_patches((GOLDEN / case["file"]).read_bytes(), grid)
    assert hw == tuple(case["grid_vit_h_vit_w_llm_h_llm_w"][:2])
    assert torch.equal(patches.view(torch.int16), golden["proc0.patches"].view(torch.int16))


def test_the_grid_plan_of_every_planner_case() -> None:
    cases = json.loads((GOLDEN / "planner_cases.json").read_text())
    grids = {name: ImageGrid(**{ARGS[k]: v for k, v in args.items()})
             for name, args in cases["args"].items()}  # fmt: skip
    for row in cases["rows"]:
        plan = plan_grid(*row["wh"], grids[row["args"]])
        got = [plan.llm_h, plan.llm_w, plan.height, plan.width]
        assert got == row["plan_image_grid"], row
        assert plan.span == row["span_len"] == len(span_types(plan.llm_h, plan.llm_w)), row
    assert len(cases["rows"]) == 78 and "release" in grids


def test_span_types_and_an_unreadable_picture(tmp_path: Path) -> None:
    assert span_types(2, 2) == [0, 1, 1, 2, 1, 1, 2, 3]
    bad = tmp_path / "photo.png"
    bad.write_bytes(b"not a picture")
    with pytest.raises(DataError, match=rf"image {bad}: cannot read it as a picture"):
        image_patches(bad, _config())
    with pytest.raises(DataError, match=r"image .*missing.png: cannot read it"):
        image_patches(tmp_path / "missing.png", _config())
