"""A family's geometry (geometry.py, torch-free) is its model config without megatron-core: the same
fields with the same defaults, the same values for every shipped preset, and the same one-line
error for a bad override, so `train --dry-run` (which reads the geometry) checks what a run checks.
"""

from __future__ import annotations

import dataclasses

import pytest

from primus_v4.config import load_config
from primus_v4.config.resolve import model_config
from primus_v4.errors import ConfigError
from primus_v4.models import FAMILIES, model_geometry, model_spec, presets


def _defaults(cls: type) -> dict[str, object]:
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_geometry_fields_are_the_configs_with_its_defaults(family: str) -> None:
    geometry = _defaults(model_geometry(family).config_class)
    config = _defaults(model_spec(family).config_class)
    assert geometry == {name: config[name] for name in geometry}
    assert model_geometry(family).preset_dir == model_spec(family).preset_dir


RECOMPUTE = {
    "none": [],
    "selective": ["model.recompute=selective"],
    "selective-moe": ["model.recompute=selective", "model.recompute_modules=[moe,layernorm]"],
    "full": ["model.recompute=full"],
}


@pytest.mark.parametrize("recompute", sorted(RECOMPUTE))
@pytest.mark.parametrize("preset", sorted(presets()))
def test_every_preset_reads_the_same_as_geometry_and_as_config(preset: str, recompute: str) -> None:
    cfg = load_config(overrides=[f"model.preset={preset}", *RECOMPUTE[recompute]])
    light, full = model_config(cfg, geometry=True), model_config(cfg)
    assert type(light).__name__.endswith("Geometry") and light.family == full.family
    for f in dataclasses.fields(light):
        assert getattr(light, f.name) == getattr(full, f.name), f.name
    spec = model_spec(full.family)
    assert model_geometry(full.family).cp_min_rows(light) == spec.cp_min_rows(full)
    assert [light.layer_kind(i) for i in range(light.num_layers)] == [
        full.layer_kind(i) for i in range(full.num_layers)
    ]


BAD = [
    ("tiny", "model.overrides={num_layers: 4}"),  # compress_ratios of 3
    ("tiny", "model.overrides={compress_ratios: [0, 4, 3]}"),
    ("tiny", "model.overrides={o_groups: 3}"),
    ("tiny", "model.overrides={qk_pos_emb_head_dim: 7}"),
    ("tiny", "model.overrides={moe_router_topk: 1}"),  # megatron-core: pre-softmax needed
    ("tiny", "model.overrides={moe_router_topk: 99}"),
    ("tiny", "model.overrides={num_query_groups: 2}"),
    ("tiny", "model.overrides={num_hash_layers: 9}"),
    ("tiny", "model.overrides={lm_head_rows: some}"),
    ("tiny", "model.overrides={hidden_size: 99999999}"),  # above its bound
    ("tiny_v41", "model.overrides={num_hash_layers: 1}"),
    ("tiny_v41", "model.overrides={kv_source_layer_ids: [2, 1]}"),
    ("tiny_v41", "model.overrides={engram_layer_ids: [1], engram_num_embeddings: []}"),
    ("tiny_v41", "model.overrides={candidate_source_layer_id: 0}"),
    ("tiny", "model.overrides={recompute_granularity: partial}"),
    ("tiny", "model.overrides={recompute_granularity: full}"),  # megatron-core: a method needed
    ("tiny", "model.overrides={recompute_granularity: full, recompute_method: zigzag}"),
    ("tiny", "model.overrides={recompute_granularity: block, recompute_method: block}"),
    ("tiny", "model.overrides={recompute_granularity: full, recompute_method: block}"),
    ("tiny", "model.overrides={recompute_granularity: selective, recompute_num_layers: 2}"),
    ("tiny", "model.overrides={recompute_granularity: selective, recompute_modules: [attn]}"),
    ("tiny_v41", "model.overrides={recompute_granularity: selective, recompute_modules: []}"),
]


@pytest.mark.parametrize(("preset", "item"), BAD)
def test_a_bad_override_fails_alike_as_geometry_and_as_config(preset: str, item: str) -> None:
    cfg = load_config(overrides=[f"model.preset={preset}", item])
    errors = []
    for geometry in (True, False):
        try:
            model = model_config(cfg, geometry=geometry)
        except ConfigError as exc:
            errors.append(str(exc))
        else:
            errors.append(f"accepted: {[getattr(model, k) for k in cfg.model.overrides]}")
    assert errors[0] == errors[1]
    assert not errors[0].startswith("accepted"), errors[0]


def test_what_the_geometry_does_not_hold_builds_the_config() -> None:
    """A megatron-core field the presets do not set: the model config itself (its checks are
    megatron-core's)."""
    items = ["model.overrides={moe_router_score_function: sigmoid}"]
    model = model_config(load_config(overrides=items), geometry=True)
    assert type(model).__name__ == "DeepseekV4Config", items
