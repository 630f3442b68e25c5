"""The image encoder's sizes (a `vision_config`: blocks, width, heads, MLP, patch and aligner
cell sides) are bounded at 16x DeepSeek-V4.1-Flash's and must be integers >= 1, in a model
config, an override and a release's config.json (test_v41_published_config.py), before the
encoder is allocated; the dry run refuses them in one line naming the field, its value and the
bound. Before the bound, `hidden_size` 2**30 passed the dry run and the run failed (exit 70) at
a 2.5 TB allocation after packing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from primus_v4.errors import ConfigError, ExitCode
from primus_v4.models.deepseek_v41.geometry import (
    VISION_REQUIRED,
    VISION_SIZE_BOUNDS,
    DeepseekV41Geometry,
    check_vision_sizes,
)

REPO = Path(__file__).resolve().parents[4]
FLASH = json.loads(
    (REPO / "primus_v4/configs/models/releases/deepseek_v41_flash/config.json").read_text()
)["vision_config"]


@pytest.mark.parametrize("key", list(VISION_SIZE_BOUNDS))
def test_a_size_above_its_bound_is_refused_by_the_model_config(key: str) -> None:
    bound = VISION_SIZE_BOUNDS[key]
    DeepseekV41Geometry.preset("tiny_v41", vision_config={**FLASH, key: bound})
    with pytest.raises(ConfigError) as err:
        DeepseekV41Geometry.preset("tiny_v41", vision_config={**FLASH, key: bound + 1})
    assert str(err.value) == (
        f"model config: vision_config.{key}={bound + 1} is above its bound {bound} (about 16x "
        "DeepSeek-V4.1-Flash's; a size this large is a typo or not this model)"
    )


@pytest.mark.parametrize("value", ["1024", 1024.0, True, 0, -16, None])
@pytest.mark.parametrize("key", ["hidden_size", "patch_size"])
def test_a_size_of_the_wrong_kind_is_refused(key: str, value: object) -> None:
    with pytest.raises(ConfigError) as err:
        DeepseekV41Geometry.preset("tiny_v41", vision_config={**FLASH, key: value})
    want = f"model config: vision_config.{key} must be an integer >= 1, got {value!r}"
    assert str(err.value) == want


@pytest.mark.parametrize("key", ["hidden_size", "patch_size"])
def test_the_tower_sizes_are_required_and_the_patch_side_defaults(key: str) -> None:
    vision = {k: v for k, v in FLASH.items() if k != key}
    if key not in VISION_REQUIRED:
        check_vision_sizes(vision)
        return
    with pytest.raises(ConfigError, match=f"model config: vision_config has no {key} "):
        check_vision_sizes(vision)


def test_a_vision_config_is_a_mapping_and_an_empty_one_is_no_encoder() -> None:
    with pytest.raises(ConfigError, match="vision_config must be a mapping, got 5"):
        DeepseekV41Geometry.preset("tiny_v41", vision_config=5)
    assert DeepseekV41Geometry.preset("tiny_v41", vision_config={}).vision_config == {}


@pytest.mark.parametrize(
    "override",
    [f"model.overrides.vision_config.hidden_size={2**30}",  # the override is the whole mapping
     "model.overrides.vision_config=" + json.dumps({**FLASH, "hidden_size": 2**30})],
)  # fmt: skip
def test_an_override_above_its_bound_is_one_line_from_the_dry_run(
    override: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    from primus_v4.cli import main

    monkeypatch.chdir(tmp_path)
    code = main(["train", "--dry-run", "--set", "model.preset=deepseek_v41_flash", "--set",
                 override, "--set", f"output.dir={tmp_path / 'o'}"])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert code == ExitCode.CONFIG and "\n" not in err, err
    assert f"vision_config.hidden_size={2**30} is above its bound 16384" in err, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("width", "heads"), [(1000, 16), (1024, 200), (1032, 8)])
def test_a_width_its_heads_do_not_split_is_refused_before_the_encoder_is_built(
    width: int, heads: int
) -> None:
    """The encoder's 2-D rotary needs a head dim that is a multiple of 4: refused in the model
    config (the dry run) and when an encoder is read from a release, never a ValueError (exit
    70) at the build."""
    from primus_v4.models.deepseek_v41.vision import VisionSizes

    vision = {**FLASH, "hidden_size": width, "num_attention_heads": heads}
    message = (f"vision_config.hidden_size {width} over num_attention_heads {heads} must give a "
               "head dim that is a multiple of 4")  # fmt: skip
    with pytest.raises(ConfigError, match=message):
        DeepseekV41Geometry.preset("tiny_v41", vision_config=vision)
    with pytest.raises(ConfigError, match=f"^config.json: {message}"):
        VisionSizes.of({"vision_config": vision, "hidden_size": 64})
    assert VisionSizes.of({"vision_config": FLASH, "hidden_size": 64}).width == 1024
