"""The V4.1 release's config.json (`model_type: deepseek_v41`, the text model under
`text_config`) <-> `DeepseekV41Config`.

Keys that describe the text backbone map one to one; keys of parts this model does not build
(vision, DSpark drafting) and inference-only keys are accepted as they are; any other key is an
error, so a release whose math we do not know is never loaded silently.
"""

from __future__ import annotations

from typing import Any

from primus_v4.errors import CheckpointFormatError
from primus_v4.models.deepseek_v41.config import DeepseekV41Config

# text_config key -> our field
FIELDS = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "moe_intermediate_size": "moe_ffn_hidden_size",
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_attention_heads",
    "head_dim": "kv_channels",
    "qk_rope_head_dim": "qk_pos_emb_head_dim",
    "q_lora_rank": "q_lora_rank",
    "o_lora_rank": "o_lora_rank",
    "o_groups": "o_groups",
    "swiglu_limit": "swiglu_limit",
    "rms_norm_eps": "layernorm_epsilon",
    "rope_theta": "rotary_base",
    "compress_rope_theta": "compress_rope_theta",
    "n_routed_experts": "num_moe_experts",
    "num_experts_per_tok": "moe_router_topk",
    "routed_scaling_factor": "moe_router_topk_scaling_factor",
    "sliding_window": "attn_sliding_window",
    "compress_ratios": "compress_ratios",
    "kv_source_layer_ids": "kv_source_layer_ids",
    "index_source_layer_ids": "index_source_layer_ids",
    "index_n_heads": "index_n_heads",
    "index_head_dim": "index_head_dim",
    "index_topk": "index_topk",
    "candidate_source_layer_id": "candidate_source_layer_id",
    "candidate_topk_blocks": "candidate_topk_blocks",
    "candidate_block_size": "candidate_block_size",
    "hc_mult": "hc_mult",
    "hc_sinkhorn_iters": "hc_sinkhorn_iters",
    "hc_eps": "hc_eps",
    "engram_layer_ids": "engram_layer_ids",
    "engram_num_embeddings": "engram_num_embeddings",
    "engram_max_ngram_size": "engram_max_ngram_size",
    "engram_vocab_size": "engram_vocab_size",
    "engram_n_heads": "engram_n_heads",
    "engram_head_dim": "engram_head_dim",
    "engram_pad_token_id": "engram_pad_token_id",
    "engram_compressed_vocab_size": "engram_compressed_vocab_size",
}
ROPE_FIELDS = {
    "factor": "rotary_scaling_factor",
    "beta_fast": "beta_fast",
    "beta_slow": "beta_slow",
    "original_max_position_embeddings": "original_max_position_embeddings",
}
# the math these fix is the only one we build; other values are refused
FIXED = {
    "num_key_value_heads": 1,
    "hidden_act": "silu",
    "n_shared_experts": 1,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "tie_word_embeddings": False,
}
# read by parts we do not build (DSpark stages, vision) or by inference only
PASSED = {
    "model_type", "max_position_embeddings", "num_nextn_predict_layers", "dspark_block_size",
    "dspark_noise_token_id", "dspark_target_layer_ids", "dspark_markov_rank",
    "dspark_n_routed_experts", "dspark_num_experts_per_tok", "dtype", "bos_token_id",
    "eos_token_id", "pad_token_id", "image_token_id", "torch_dtype",
}  # fmt: skip


def text_config(d: dict[str, Any], source: str) -> dict[str, Any]:
    """The text model's keys of a V4.1 config.json (composite or already the text part)."""
    text = d.get("text_config", d)
    if not isinstance(text, dict):
        raise CheckpointFormatError(f"{source}: text_config must be an object")
    return text


def config_from_release(d: dict[str, Any], *, source: str = "config.json", **overrides):
    """DeepseekV41Config from a release config.json dict; `overrides` set training fields."""
    text = text_config(d, source)
    values: dict[str, Any] = {}
    for key, value in text.items():
        if key in FIELDS:
            values[FIELDS[key]] = value
        elif key == "rope_scaling":
            if value.get("rope_type", "yarn") != "yarn":
                raise CheckpointFormatError(
                    f"{source}: rope_scaling.rope_type {value.get('rope_type')!r}; "
                    "DeepSeek-V4.1 uses 'yarn'"
                )
            for k, field in ROPE_FIELDS.items():
                if k in value:
                    values[field] = value[k]
        elif key in FIXED:
            if value != FIXED[key]:
                raise CheckpointFormatError(
                    f"{source}: text_config.{key} = {value!r}; DeepSeek-V4.1 is built with "
                    f"{FIXED[key]!r} only"
                )
        elif key not in PASSED:
            raise CheckpointFormatError(f"{source}: unknown text_config key {key!r}")
    values["moe_shared_expert_intermediate_size"] = values.get("moe_ffn_hidden_size")
    values.setdefault("num_query_groups", 1)
    values.update(overrides)
    return DeepseekV41Config(**values)


def config_to_release(cfg: DeepseekV41Config) -> dict[str, Any]:
    """The text_config keys of `cfg` (the inverse of `config_from_release`)."""
    out: dict[str, Any] = {"model_type": "deepseek_v41_text"}
    out.update({key: getattr(cfg, field) for key, field in FIELDS.items()})
    out["rope_scaling"] = {"rope_type": "yarn"}
    out["rope_scaling"].update({k: getattr(cfg, f) for k, f in ROPE_FIELDS.items()})
    out.update(FIXED)
    return out
