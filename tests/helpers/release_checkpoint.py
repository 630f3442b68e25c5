"""Tiny random checkpoints in the RELEASE layout (names, shapes, config.json keys), float32.

Every tensor is drawn to matter: norms 1 + noise, mHC scales/bases, sinks, compressor `ape`,
router `gate.bias` (large enough to change which experts win) and a random `tid2eid`. Used by
the HF-oracle tests and the round-trip tests; geometries differ in every width and in the
layer-kind / hash / MTP-kind pattern so nothing is tuned to one shape.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from primus_v4.models.deepseek_v4.release.state_dict_adapter import (
    config_from_release,
    release_tensors,
)

_ROPE = {
    "type": "yarn",
    "factor": 16,
    "original_max_position_embeddings": 65536,
    "beta_fast": 32,
    "beta_slow": 1,
}
_COMMON = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 384,
    "num_key_value_heads": 1,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "hidden_act": "silu",
    "n_shared_experts": 1,
    "tie_word_embeddings": False,
    "swiglu_limit": 10.0,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000,
    "compress_rope_theta": 160000,
    "rope_scaling": _ROPE,
    "num_nextn_predict_layers": 1,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "float32",
    "transformers_version": "4.57.1",
}
# Three geometries: dense/CSA/HCA layers, a hash layer, windows small enough that the compressed
# branches decide, index_topk below the number of visible ratio-4 keys. "c" has 2 indexer heads:
# a key scores exactly 0 when every head's ReLU is zero (1 in 4 keys), so many rows hold equal
# scores at the k-th place, which the selection must resolve as HF's torch.topk does.
GEOMETRIES = {
    "a": {
        **_COMMON,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "head_dim": 32,
        "qk_rope_head_dim": 8,
        "q_lora_rank": 32,
        "o_groups": 2,
        "o_lora_rank": 16,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "routed_scaling_factor": 1.5,
        "num_hash_layers": 1,
        "sliding_window": 8,
        "index_n_heads": 16,
        "index_head_dim": 16,
        "index_topk": 4,
        "hc_mult": 4,
        "compress_ratios": [0, 4, 128, 4, 0],
    },
    "b": {
        **_COMMON,
        "hidden_size": 48,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "head_dim": 64,
        "qk_rope_head_dim": 16,
        "q_lora_rank": 24,
        "o_groups": 1,
        "o_lora_rank": 24,
        "n_routed_experts": 6,
        "num_experts_per_tok": 3,
        "moe_intermediate_size": 16,
        "routed_scaling_factor": 2.5,
        "num_hash_layers": 2,
        "sliding_window": 16,
        "index_n_heads": 16,
        "index_head_dim": 32,
        "index_topk": 3,
        "hc_mult": 3,
        "compress_ratios": [4, 128, 0, 4, 4],
    },
    "c": {
        **_COMMON,
        "hidden_size": 32,
        "num_hidden_layers": 3,
        "num_attention_heads": 2,
        "head_dim": 32,
        "qk_rope_head_dim": 8,
        "q_lora_rank": 16,
        "o_groups": 1,
        "o_lora_rank": 16,
        "n_routed_experts": 5,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "routed_scaling_factor": 1.0,
        "num_hash_layers": 1,
        "sliding_window": 4,
        "index_n_heads": 2,
        "index_head_dim": 16,
        "index_topk": 5,
        "hc_mult": 2,
        "compress_ratios": [4, 4, 128, 4],
    },
}


# DeepSeek-V4-Flash's config.json keys, for name and shape tests on the meta device (DESIGN.md
# section 5; HF DeepseekV4Config defaults, which are the Flash release: 256 experts top-6, hidden
# 4096, 43 layers, routed_scaling_factor 1.5, index_topk 512; RoPE 10000 dense, 160000 + YaRN 16
# compressed; 1 MTP slot, dense).
FLASH_RATIOS = [0, 0] + [4, 128] * 20 + [4] + [0]
FLASH_CONFIG = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 129280,
    "hidden_size": 4096,
    "num_hidden_layers": 43,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 1024,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 6,
    "moe_intermediate_size": 2048,
    "routed_scaling_factor": 1.5,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "num_hash_layers": 3,
    "swiglu_limit": 10.0,
    "sliding_window": 128,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000,
    "compress_rope_theta": 160000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": 65536,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "num_nextn_predict_layers": 1,
    "compress_ratios": FLASH_RATIOS,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "expert_dtype": "fp4",
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
    "transformers_version": "4.57.1",
}


def _value(name: str, shape: tuple[int, ...], kind: str, cfg, gen: torch.Generator):
    """A random value for one release tensor, chosen so that the tensor matters."""
    randn = torch.randn(shape, generator=gen)
    leaf = name.rsplit(".", 1)[-1]
    if kind == "int64":  # tid2eid: top-k distinct experts per token id
        noise = torch.rand(cfg.vocab_size, cfg.num_moe_experts, generator=gen)
        return noise.topk(shape[1], dim=1).indices.to(torch.int64)
    if name.endswith("norm.weight"):
        return 1.0 + 0.2 * randn
    if leaf.endswith("_scale"):  # mHC group scales
        return 1.0 + 0.3 * randn
    if leaf.endswith("_base"):
        return 0.5 * randn
    if leaf.endswith("_fn"):
        return 0.3 * randn
    if leaf in ("attn_sink", "ape"):
        return randn
    if name.endswith("gate.bias"):
        return 0.3 * randn  # comparable to the score spread: changes which experts win
    if name == "embed.weight":
        return randn
    return randn / math.sqrt(shape[-1])  # linear weights: unit-variance outputs


def release_config(geometry: str) -> dict:
    return json.loads(json.dumps(GEOMETRIES[geometry]))


def random_release_tensors(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """Every logical release tensor of `config`, float32 (int64 for tid2eid)."""
    cfg = config_from_release(config)
    gen = torch.Generator().manual_seed(seed)
    return {
        n: _value(n, r.shape, r.kind, cfg, gen).contiguous()
        for n, r in release_tensors(cfg).items()
    }


def write_checkpoint(directory: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    """A single-file release directory (config.json + model.safetensors)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def make_checkpoint(directory: Path, geometry: str, seed: int) -> tuple[Path, dict, dict]:
    config = release_config(geometry)
    tensors = random_release_tensors(config, seed)
    return write_checkpoint(directory, config, tensors), config, tensors
