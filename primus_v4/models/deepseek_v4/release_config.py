"""The release's config.json <-> DeepseekV4Config.

Keys that set the math map one-to-one (table `FIELDS`) or through a rule (compress_ratios,
rope_scaling, n_shared_experts, the fixed choices in `_REQUIRED`). Keys that do not change the
math (`IGNORED_KEYS`: provenance, serving and storage details) are ignored. Any other key is an
error: silently dropping a key that changes the math would load a different model.
"""

from __future__ import annotations

from typing import Any

from primus_v4.errors import ConfigError
from primus_v4.models.deepseek_v4.config import DeepseekV4Config

# release key -> our field (values copied as they are)
FIELDS = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_attention_heads",
    "head_dim": "kv_channels",
    "q_lora_rank": "q_lora_rank",
    "o_groups": "o_groups",
    "o_lora_rank": "o_lora_rank",
    "qk_rope_head_dim": "qk_pos_emb_head_dim",
    "n_routed_experts": "num_moe_experts",
    "num_experts_per_tok": "moe_router_topk",
    "moe_intermediate_size": "moe_ffn_hidden_size",
    "routed_scaling_factor": "moe_router_topk_scaling_factor",
    "num_hash_layers": "num_hash_layers",
    "swiglu_limit": "swiglu_limit",
    "sliding_window": "attn_sliding_window",
    "index_n_heads": "index_n_heads",
    "index_head_dim": "index_head_dim",
    "index_topk": "index_topk",
    "hc_mult": "hc_mult",
    "hc_sinkhorn_iters": "hc_sinkhorn_iters",
    "hc_eps": "hc_eps",
    "rms_norm_eps": "layernorm_epsilon",
    "rope_theta": "rotary_base",
    "compress_rope_theta": "compress_rope_theta",
    "num_nextn_predict_layers": "mtp_num_layers",
    "initializer_range": "init_method_std",
}
# Choices this model implements; another value changes the math and is refused.
_REQUIRED: dict[str, Any] = {
    "num_key_value_heads": 1,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "n_shared_experts": 1,
    "model_type": "deepseek_v4",
}
IGNORED_KEYS = frozenset(
    {
        "architectures",  # class name for loaders
        "transformers_version",  # provenance
        "torch_dtype",  # storage dtype; the loader dequantizes into the requested dtype
        "dtype",
        "quantization_config",  # storage format of the shards (FP8 blocks), read by the loader
        "expert_dtype",  # storage format of the routed experts (FP4)
        "use_cache",  # inference KV cache
        "bos_token_id",  # tokenizer ids (the tokenizer files carry them)
        "eos_token_id",
        "pad_token_id",
        "max_position_embeddings",  # serving limit; YaRN uses rope_scaling's own fields
        "attention_dropout",  # 0 in the release; no dropout in this trainer
        "router_aux_loss_coef",  # a training choice (model.moe_aux_loss_coeff), not the model
        "output_router_logits",
        "router_jitter_noise",
    }
)
_ROPE_KEYS = {
    "type",
    "rope_type",
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
}
RELEASE_DEFAULTS: dict[str, Any] = {"num_hash_layers": 3, "compress_rope_theta": 160000.0}


def _rope_fields(rope: dict | None) -> dict[str, Any]:
    if not rope:
        return {"rotary_scaling_factor": 1.0}
    unknown = sorted(set(rope) - _ROPE_KEYS)
    if unknown:
        raise ConfigError(
            f"config.json rope_scaling has keys {unknown} this model does not implement "
            "(no YaRN mscale: the release keeps unit-magnitude cos/sin)"
        )
    kind = rope.get("type", rope.get("rope_type", "yarn"))
    if kind != "yarn":
        raise ConfigError(f"config.json rope_scaling type {kind!r}: only 'yarn' is implemented")
    return {
        "rotary_scaling_factor": float(rope["factor"]),
        "original_max_position_embeddings": int(rope["original_max_position_embeddings"]),
        "beta_fast": float(rope.get("beta_fast", 32)),
        "beta_slow": float(rope.get("beta_slow", 1)),
    }


def _ratio_fields(d: dict, layers: int, mtp: int) -> dict[str, Any]:
    ratios = d.get("compress_ratios")
    if ratios is None:
        raise ConfigError("config.json has no compress_ratios (one per layer plus the MTP slots)")
    if len(ratios) < layers or (mtp and len(ratios) not in (layers, layers + mtp)):
        raise ConfigError(
            f"config.json compress_ratios has {len(ratios)} entries; expected num_hidden_layers "
            f"{layers} (+ {mtp} MTP slots)"
        )
    extra = set(ratios[layers:]) if mtp else set()  # slots of MTP depths not built: unused
    if len(extra) > 1:
        raise ConfigError(f"config.json MTP slots of compress_ratios differ: {ratios[layers:]}")
    return {
        "compress_ratios": list(ratios[:layers]),
        "mtp_compress_ratio": extra.pop() if extra else 0,
    }


def config_from_release(d: dict, *, source: str = "config.json", **overrides) -> DeepseekV4Config:
    """DeepseekV4Config from the release's config.json dict (see the module docstring).

    `overrides` are our own training fields (e.g. recompute) applied on top."""
    unknown = sorted(
        set(d) - set(FIELDS) - set(_REQUIRED) - IGNORED_KEYS - {"compress_ratios", "rope_scaling"}
    )
    if unknown:
        raise ConfigError(
            f"{source}: keys {unknown} are not understood; they may change the math, so the "
            "checkpoint is refused (see primus_v4/models/deepseek_v4/release_config.py)"
        )
    for key, value in _REQUIRED.items():
        if key in d and d[key] != value:
            raise ConfigError(f"{source}: {key} = {d[key]!r}; this model implements {value!r}")
    values = {ours: d.get(rel, RELEASE_DEFAULTS.get(rel)) for rel, ours in FIELDS.items()}
    values = {k: v for k, v in values.items() if v is not None}
    for k in ("compress_rope_theta", "rotary_base", "layernorm_epsilon", "hc_eps"):
        if k in values:
            values[k] = float(values[k])
    values["moe_shared_expert_intermediate_size"] = values.get("moe_ffn_hidden_size")
    values["ffn_hidden_size"] = 4 * values["hidden_size"]  # TransformerConfig placeholder
    values.update(_rope_fields(d.get("rope_scaling")))
    values.update(_ratio_fields(d, values["num_layers"], values.get("mtp_num_layers", 0)))
    values["num_query_groups"] = 1
    # Training choices the release does not state, as in the Flash/Pro presets.
    values.setdefault("moe_aux_loss_coeff", 0.001)
    values.setdefault("mtp_loss_scaling_factor", 0.1)
    if values.get("moe_router_topk") == 1:
        values["moe_router_pre_softmax"] = True  # megatron validation; the V4 router ignores it
    values.update(overrides)
    return DeepseekV4Config.from_dict(values, source=source)


def config_to_release(cfg: DeepseekV4Config) -> dict[str, Any]:
    """The release's config.json keys for `cfg` (bf16 storage; an FP8 writer adds
    `quantization_config` and `expert_dtype`)."""
    out: dict[str, Any] = {"architectures": ["DeepseekV4ForCausalLM"], **_REQUIRED}
    for rel, ours in FIELDS.items():
        out[rel] = getattr(cfg, ours)
    out["num_nextn_predict_layers"] = cfg.mtp_num_layers or 0
    out["compress_ratios"] = [*cfg.compress_ratios] + [cfg.mtp_compress_ratio] * (
        cfg.mtp_num_layers or 0
    )
    if cfg.rotary_scaling_factor > 1.0:
        out["rope_scaling"] = {
            "type": "yarn",
            "factor": cfg.rotary_scaling_factor,
            "original_max_position_embeddings": cfg.original_max_position_embeddings,
            "beta_fast": cfg.beta_fast,
            "beta_slow": cfg.beta_slow,
        }
    out.update(
        {
            "torch_dtype": "bfloat16",
            "bos_token_id": 0,
            "eos_token_id": 1,
            "max_position_embeddings": 1048576,
            "attention_dropout": 0.0,
            "use_cache": True,
        }
    )
    if not cfg.moe_shared_expert_intermediate_size:
        raise ConfigError("the release layout has one shared expert; this config has none")
    if cfg.moe_shared_expert_intermediate_size != cfg.moe_ffn_hidden_size:
        raise ConfigError(
            "the release's shared expert is moe_intermediate_size wide; this config's "
            f"moe_shared_expert_intermediate_size {cfg.moe_shared_expert_intermediate_size} differs"
        )
    if not cfg.attn_sink:
        raise ConfigError("the release layout always has attention sinks (attn_sink true)")
    return out
