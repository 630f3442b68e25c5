"""Presets: layer structure of Flash / Pro / 3-layer, and parameter counts on the meta device."""

from __future__ import annotations

import pytest

from primus_v4.models.deepseek_v4 import DeepseekV4Config, param_counts
from primus_v4.models.deepseek_v4.params import COMPONENTS


def _kinds(cfg: DeepseekV4Config) -> dict[str, int]:
    kinds = [cfg.layer_kind(i) for i in range(cfg.num_layers)]
    return {k: kinds.count(k) for k in ("dense", "csa", "hca")}


def test_flash_structure():
    cfg = DeepseekV4Config.preset("deepseek_v4_flash")
    assert cfg.num_layers == 43 and cfg.mtp_num_layers == 1
    assert _kinds(cfg) == {"dense": 2, "csa": 21, "hca": 20}
    assert cfg.compress_ratios[:4] == [0, 0, 4, 128] and cfg.compress_ratios[-1] == 4
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.kv_channels) == (4096, 64, 512)
    assert (cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size) == (256, 6, 2048)
    assert (cfg.hc_mult, cfg.vocab_size, cfg.index_topk) == (4, 129280, 512)


def test_pro_structure():
    cfg = DeepseekV4Config.preset("deepseek_v4_pro")
    assert cfg.num_layers == 61
    assert _kinds(cfg) == {"dense": 0, "csa": 30, "hca": 31}
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_moe_experts) == (7168, 128, 384)


def test_three_layer_structure():
    cfg = DeepseekV4Config.preset("deepseek_v4_3layer")
    assert cfg.compress_ratios == [0, 4, 128]
    assert (cfg.num_moe_experts, cfg.moe_router_topk, cfg.hidden_size) == (8, 1, 4096)


@pytest.mark.parametrize("name", ["deepseek_v4_flash", "deepseek_v4_pro", "tiny"])
def test_param_counts_on_meta(name):
    cfg = DeepseekV4Config.preset(name)
    counts = param_counts(cfg)
    assert counts["total"] == sum(counts[c] for c in COMPONENTS)
    for c in ("embedding", "attention", "compressor_indexer", "experts", "shared", "mhc", "head"):
        assert counts[c] > 0, c
    assert (counts["mtp"] > 0) == bool(cfg.mtp_num_layers)
    # Embedding and LM head are untied: vocab x hidden each (+ the final norm in head).
    assert counts["embedding"] == cfg.vocab_size * cfg.hidden_size
    assert counts["head"] == cfg.vocab_size * cfg.hidden_size + cfg.hidden_size
    # Routed experts: layers x experts x 3 matrices (gate, up, down) of hidden x ffn.
    per_layer = cfg.num_moe_experts * 3 * cfg.hidden_size * cfg.moe_ffn_hidden_size
    assert counts["experts"] == cfg.num_layers * per_layer
    assert counts["active_per_token"] < counts["total"]
