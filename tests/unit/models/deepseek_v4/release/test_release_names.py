"""The release name table: one-to-one with our state dict at the Flash geometry (meta device),
exact round trips for whole models and for pipeline-stage / expert-shard subsets, strict
config.json conversion and loader errors. That HF's conversion mapping implies the same names is
checked with the HF oracle in test_release_hf.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from release_checkpoint import (
    FLASH_CONFIG,
    GEOMETRIES,
    make_checkpoint,
    random_release_tensors,
    release_config,
)
from safetensors.torch import load_file, save_file

from primus_v4 import load_pretrained
from primus_v4.errors import ConfigError
from primus_v4.models.deepseek_v4 import DeepseekV4Config, DeepseekV4Model
from primus_v4.models.deepseek_v4.release import state_dict_adapter as rel
from primus_v4.models.deepseek_v4.release.config_json import FIELDS as RELEASE_FIELDS
from primus_v4.models.deepseek_v4.release.load import read_config


@pytest.fixture(scope="module")
def flash() -> DeepseekV4Config:
    return rel.config_from_release(FLASH_CONFIG)


def test_flash_config_is_the_preset(flash) -> None:
    preset = DeepseekV4Config.preset("deepseek_v4_flash")
    for field in (*RELEASE_FIELDS.values(), "compress_ratios", "mtp_compress_ratio"):
        assert getattr(flash, field) == getattr(preset, field), field
    assert flash.rotary_scaling_factor == 16.0 and flash.compress_rope_theta == 160000.0


def test_flash_release_names_map_one_to_one_onto_our_state(flash) -> None:
    with torch.device("meta"):
        model = DeepseekV4Model(flash)
    state = model.state_dict()
    table = rel.name_table(flash)
    assert set(state) == set(table)  # every parameter and persistent buffer, nothing else
    for name, t in state.items():
        assert tuple(t.shape) == table[name].shape, name
    names = rel.release_tensors(flash)
    owners = [n for e in table.values() for n in e.release_names()]
    assert len(owners) == len(set(owners)) == len(names)  # each release tensor has one owner
    # 43 layers x 256 experts x 3 + the rest; MTP: one block + 10 own tensors.
    assert sum(".experts." in n for n in names) == 44 * 256 * 3
    assert sum(n.endswith(".tid2eid") for n in names) == 3
    assert sum(n.endswith(".gate.bias") for n in names) == 44 - 3
    assert sum(".indexer.wq_b." in n for n in names) == 21  # CSA layers only; no indexer wq_a
    assert not any("indexer.wq_a" in n for n in names)


def test_stored_kinds_and_scales_at_flash(flash) -> None:
    stored = rel.stored_tensors(flash)
    assert stored["layers.2.attn.wq_a.weight"] == ((1024, 4096), torch.float8_e4m3fn)
    assert stored["layers.2.attn.wq_a.scale"] == ((8, 32), torch.float8_e8m0fnu)
    assert stored["layers.2.attn.wo_a.weight"] == ((8192, 4096), torch.float8_e4m3fn)
    assert stored["layers.5.ffn.experts.9.w2.weight"] == ((4096, 1024), torch.int8)
    assert stored["layers.5.ffn.experts.9.w2.scale"] == ((4096, 64), torch.float8_e8m0fnu)
    assert stored["layers.2.attn.indexer.wq_b.weight"] == ((8192, 1024), torch.float8_e4m3fn)
    assert stored["layers.3.attn.compressor.ape"] == ((128, 512), torch.float32)
    assert stored["layers.2.attn.compressor.wkv.weight"] == ((1024, 4096), torch.bfloat16)
    assert stored["layers.0.ffn.gate.tid2eid"] == ((129280, 6), torch.int64)
    assert stored["layers.9.ffn.gate.bias"] == ((256,), torch.float32)
    assert stored["mtp.0.e_proj.weight"] == ((4096, 4096), torch.float8_e4m3fn)
    assert stored["hc_head_fn"] == ((4, 16384), torch.float32)


def _tiny(geometry: str = "a", seed: int = 3):
    config = release_config(geometry)
    cfg = rel.config_from_release(config)
    return cfg, random_release_tensors(config, seed)


@pytest.mark.parametrize("geometry", ["a", "b"])
def test_build_then_export_is_the_identity(geometry) -> None:
    cfg, tensors = _tiny(geometry)
    shapes = {e.ours: e.shape for e in rel.name_table(cfg).values()}
    state = rel.build_state(cfg, shapes, tensors.__getitem__)
    out = dict(rel.to_release(cfg, state))
    assert out.keys() == tensors.keys()
    assert all(torch.equal(out[k], tensors[k]) for k in tensors)


def test_stage_and_expert_shard_subset_reads_only_its_tensors() -> None:
    cfg, tensors = _tiny("a")
    full = rel.build_state(
        cfg, {e.ours: e.shape for e in rel.name_table(cfg).values()}, tensors.get
    )
    keep = [k for k in full if k.startswith("layers.2.")]  # one pipeline stage: layer 2
    lo, hi = 2, 6  # this rank's experts
    shapes = {
        k: (hi - lo, *full[k].shape[1:]) if k.endswith(("w_gate_up", "w_down")) else full[k].shape
        for k in keep
    }
    asked: list[str] = []
    part = rel.build_state(
        cfg, shapes, lambda n: asked.append(n) or tensors[n], expert_range=(lo, hi)
    )
    assert sorted(asked) == sorted(rel.needed(cfg, keep, expert_range=(lo, hi)))
    assert all(n.startswith("layers.2.") for n in asked)
    experts = {int(n.split(".")[4]) for n in asked if ".experts." in n}
    assert experts == set(range(lo, hi))
    for k in keep:
        want = full[k][lo:hi] if k.endswith(("w_gate_up", "w_down")) else full[k]
        assert torch.equal(part[k], want), k
    filled = {k: torch.full(shapes[k], -7.0, dtype=part[k].dtype) for k in keep}
    rel.fill_state(cfg, filled, tensors.__getitem__, expert_range=(lo, hi))  # in place
    assert all(torch.equal(filled[k], part[k]) for k in keep)
    back = dict(rel.to_release(cfg, part, expert_range=(lo, hi)))
    assert sorted(back) == sorted(asked) and all(torch.equal(back[n], tensors[n]) for n in back)


def test_build_state_names_both_shapes_on_a_mismatch() -> None:
    cfg, tensors = _tiny("a")
    shapes = {"layers.1.attn.wq_a.weight": (32, 64)}
    bad = {**tensors, "layers.1.attn.wq_a.weight": torch.zeros(31, 64)}
    with pytest.raises(ValueError, match=r"layers\.1\.attn\.wq_a\.weight.*\(31, 64\).*\(32, 64\)"):
        rel.build_state(cfg, shapes, bad.__getitem__)


def test_config_json_keys_are_strict() -> None:
    config = release_config("a")
    with pytest.raises(ConfigError, match="sparse_mode"):
        rel.config_from_release({**config, "sparse_mode": 1})
    with pytest.raises(ConfigError, match="mscale"):
        rel.config_from_release({**config, "rope_scaling": {**config["rope_scaling"], "mscale": 1}})
    with pytest.raises(ConfigError, match="scoring_func"):
        rel.config_from_release({**config, "scoring_func": "softmax"})
    no_mtp = rel.config_from_release({**config, "num_nextn_predict_layers": 0})
    assert no_mtp.mtp_num_layers == 0 and no_mtp.compress_ratios == config["compress_ratios"][:-1]
    with pytest.raises(ConfigError, match="compress_ratios has 3 entries"):
        rel.config_from_release({**config, "compress_ratios": config["compress_ratios"][:3]})
    cfg = rel.config_from_release({**config, "transformers_version": "9.9", "use_cache": False})
    back = rel.config_to_release(cfg)
    assert back["compress_ratios"] == config["compress_ratios"]
    assert back["rope_scaling"]["factor"] == 16 and back["compress_rope_theta"] == 160000.0
    assert (
        rel.config_from_release(json.loads(json.dumps(back))).compress_ratios == cfg.compress_ratios
    )


def _hf_saved_config(config: dict) -> dict:
    """`config` as transformers' save_pretrained writes it (geometry "a": sliding, CSA, HCA,
    CSA; one hash layer), from its keys in transformers 5.2x."""
    out = {k: v for k, v in config.items() if k not in ("compress_ratios", "rope_scaling")}
    kinds = {0: "sliding_attention", 4: "compressed_sparse_attention",
             128: "heavily_compressed_attention"}  # fmt: skip
    layers = config["num_hidden_layers"]
    yarn = {**config["rope_scaling"], "rope_type": "yarn", "attention_factor": 1.0}
    return {
        **out,
        "layer_types": [kinds[r] for r in config["compress_ratios"][:layers]],
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        "mlp_layer_types": ["hash_moe"] * config["num_hash_layers"]
        + ["moe"] * (layers - config["num_hash_layers"]),
        "partial_rotary_factor": config["qk_rope_head_dim"] / config["head_dim"],
        "rope_parameters": {
            "main": {"rope_theta": 10000, "rope_type": "default"},
            "compress": {**yarn, "rope_theta": 160000},
        },
        "_name_or_path": "somewhere",
    }


def test_transformers_saved_config_keys_read_as_the_release_or_fail_by_name() -> None:
    config = release_config("a")
    hf = _hf_saved_config(config)
    got, want = rel.config_from_release(hf), rel.config_from_release(config)
    assert got.mtp_num_layers == 0  # transformers' model has no MTP and saves none
    for f in ("compress_ratios", "num_hash_layers", "rotary_base", "compress_rope_theta",
              "rotary_scaling_factor", "original_max_position_embeddings", "beta_fast",
              "beta_slow", "qk_pos_emb_head_dim", "hidden_size", "index_topk"):  # fmt: skip
        assert getattr(got, f) == getattr(want, f), f
    cases = {
        "mlp_layer_types must be": {"mlp_layer_types": ["moe", "hash_moe", "moe", "moe"]},
        "partial_rotary_factor 0.5": {"partial_rotary_factor": 0.5},
        r"layer_types \['full_attention'\]": {"layer_types": ["full_attention"] * 4},
        "layer_types must list": {"layer_types": hf["layer_types"][:3]},
        "attention_factor must be 1": {"rope_parameters": {
            **hf["rope_parameters"],
            "compress": {**hf["rope_parameters"]["compress"], "attention_factor": 0.7}}},
        "compress_rates has no rate": {"compress_rates": {"compressed_sparse_attention": 4}},
    }  # fmt: skip
    for message, change in cases.items():
        with pytest.raises(ConfigError, match=message):
            rel.config_from_release({**hf, **change})


def test_load_errors_name_unused_and_missing_tensors(tmp_path) -> None:
    path, _, _ = make_checkpoint(tmp_path / "ok", "a", 0)
    tensors = load_file(path / "model.safetensors")
    extra = {**tensors, "layers.1.attn.wq_c.weight": torch.zeros(2, 2)}
    extra.pop("layers.2.attn.compressor.ape")
    save_file(extra, path / "model.safetensors")
    with pytest.raises(ValueError) as err:
        load_pretrained(path, progress=False)
    msg = str(err.value)
    assert "missing from the checkpoint: layers.2.attn.compressor.ape" in msg
    assert "not used by the model: layers.1.attn.wq_c.weight [2, 2]" in msg
    # A tensor on the documented ignore list is skipped.
    tensors["mtp.0.head.weight"] = tensors["head.weight"].clone()
    save_file(tensors, path / "model.safetensors")
    model = load_pretrained(path, progress=False)
    assert torch.equal(model.layers[0].moe.router.tid2eid, tensors["layers.0.ffn.gate.tid2eid"])
    assert torch.equal(model.layers[1].moe.router.bias, tensors["layers.1.ffn.gate.bias"])


@pytest.mark.parametrize("geometry", sorted(GEOMETRIES))
def test_config_json_round_trip(geometry, tmp_path) -> None:
    path, config, _ = make_checkpoint(tmp_path, geometry, seed=0)
    cfg = read_config(path)
    assert cfg.num_layers == config["num_hidden_layers"]
    assert [*cfg.compress_ratios, cfg.mtp_compress_ratio] == config["compress_ratios"]
    assert cfg.compress_rope_theta == 160000.0 and cfg.rotary_scaling_factor == 16.0
    again = rel.config_from_release(rel.config_to_release(cfg))
    for f in ("hidden_size", "num_hash_layers", "index_topk", "hc_mult", "attn_sliding_window"):
        assert getattr(again, f) == getattr(cfg, f)
