"""The release's config.json <-> DeepseekV4Config.

Keys that set the math map one-to-one (table `FIELDS`) or through a rule (compress_ratios,
rope_scaling, n_shared_experts, the fixed choices in `_REQUIRED`). Keys that do not change the
math (`IGNORED_KEYS`: provenance, serving and storage details) are ignored. Any other key is an
error: silently dropping a key that changes the math would load a different model.
"""

from __future__ import annotations

from typing import Any

from primus_v4.errors import ConfigError
from primus_v4.models.deepseek_v4.config import DeepseekV4Config, check_sizes

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
# checked when a config.json states them (transformers' own keys), absent from the release's
_NOT_RELEASED = ("mlp_bias",)
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
# DeepSeek-V4-Flash-0731: three DSpark draft stages replace the classic MTP block under the same
# `mtp.*` names. The drafter is not trained here; these keys (with the release's
# num_nextn_predict_layers and the compress_ratios slots past the backbone's layers) are kept
# as read and written back on export, beside its tensors copied byte for byte.
DSPARK_KEYS = (
    "dspark_block_size",
    "dspark_noise_token_id",
    "dspark_target_layer_ids",
    "dspark_markov_rank",
)


def _dspark_fields(d: dict, layers: int, source: str) -> dict[str, Any]:
    """The model fields of a release with a DSpark drafter: no classic MTP block, the
    release's drafter keys kept (`dspark`); {} for a release without one."""
    present = [k for k in DSPARK_KEYS if k in d]
    if not present:
        return {}
    missing = [k for k in DSPARK_KEYS if k not in d]
    if missing:
        raise ConfigError(f"{source}: DSpark keys {missing} are missing beside {present}")
    ratios = d.get("compress_ratios") or []
    kept = {k: d[k] for k in DSPARK_KEYS}
    kept["num_nextn_predict_layers"] = d.get("num_nextn_predict_layers", 0)
    kept["compress_ratios"] = list(ratios[layers:])  # the drafter's slots, as released
    return {"dspark": kept, "mtp_num_layers": 0, "compress_ratios": list(ratios[:layers])}


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


# transformers' DeepseekV4Config keys that a checkpoint saved by its `save_pretrained` holds
# instead of the release's (`hf_to_release` turns them into those), and generic
# PretrainedConfig keys that do not change the math.
HF_KEYS = frozenset(
    {"layer_types", "mlp_layer_types", "compress_rates", "rope_parameters", "partial_rotary_factor"}
)
_HF_GENERIC = frozenset(
    {
        "_name_or_path", "chunk_size_feed_forward", "id2label", "label2id",
        "is_encoder_decoder", "output_attentions", "output_hidden_states", "problem_type",
        "return_dict", "tie_encoder_decoder", "torchscript",
    }
)  # fmt: skip
_HF_LAYER_KINDS = frozenset(
    {"sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"}
)


def is_hf_config(d: dict) -> bool:
    """Whether a config.json was written by transformers' `save_pretrained` (its own keys)
    rather than in the release's keys."""
    return bool(HF_KEYS & set(d))


def hf_to_release(d: dict, *, source: str = "config.json") -> dict:
    """The release's config.json keys for a transformers-saved DeepSeek-V4 config:
    `layer_types` + `compress_rates` -> `compress_ratios` (sliding 0), `mlp_layer_types` (the
    'hash_moe' layers first) -> `num_hash_layers`, `rope_parameters` {'main', 'compress'} ->
    `rope_theta`, `compress_rope_theta`, `rope_scaling` (YaRN, no attention factor), and
    `partial_rotary_factor` checked against qk_rope_head_dim / head_dim. transformers'
    DeepseekV4ForCausalLM has no MTP and saves none, so `num_nextn_predict_layers` becomes 0."""

    def bad(msg: str) -> ConfigError:
        return ConfigError(f"{source} (a transformers-saved config): {msg}")

    out = {k: v for k, v in d.items() if k not in HF_KEYS and k not in _HF_GENERIC}
    layers = d.get("num_hidden_layers")
    kinds = d.get("layer_types")
    rates = d.get("compress_rates") or {}
    if not isinstance(kinds, list) or len(kinds) != layers:
        raise bad(f"layer_types must list num_hidden_layers ({layers}) layer kinds, got {kinds!r}")
    unknown = sorted(set(kinds) - _HF_LAYER_KINDS)
    if unknown:
        raise bad(
            f"layer_types {unknown} are not DeepSeek-V4 layer kinds {sorted(_HF_LAYER_KINDS)}"
        )
    missing = sorted({k for k in kinds if k != "sliding_attention"} - set(rates))
    if missing:
        raise bad(f"compress_rates has no rate for {missing}")
    out["compress_ratios"] = [0 if k == "sliding_attention" else int(rates[k]) for k in kinds]
    mlp = d.get("mlp_layer_types")
    if mlp is not None:
        hashed = sum(1 for m in mlp if m == "hash_moe")
        if len(mlp) != layers or set(mlp) - {"hash_moe", "moe"} or mlp[hashed:].count("hash_moe"):
            raise bad(
                f"mlp_layer_types must be num_hidden_layers of 'hash_moe' then 'moe', got {mlp}"
            )
        out["num_hash_layers"] = hashed
    rope = d.get("rope_parameters")
    if rope is not None:
        main, comp = rope.get("main") or {}, rope.get("compress") or {}
        if main.get("rope_type", "default") != "default":
            raise bad(f"rope_parameters.main is {main.get('rope_type')!r}; the release's dense "
                      "layers use plain RoPE")  # fmt: skip
        if float(comp.get("attention_factor", 1.0)) != 1.0:
            raise bad("rope_parameters.compress.attention_factor must be 1 (the release keeps "
                      "unit-magnitude cos/sin)")  # fmt: skip
        out["rope_theta"] = main.get("rope_theta", d.get("rope_theta"))
        out["compress_rope_theta"] = comp.get("rope_theta", d.get("compress_rope_theta"))
        out.pop("rope_scaling", None)
        if comp.get("rope_type", comp.get("type")) == "yarn":
            out["rope_scaling"] = {"type": "yarn", "factor": comp["factor"],
                                   "original_max_position_embeddings":
                                       comp["original_max_position_embeddings"],
                                   "beta_fast": comp.get("beta_fast", 32),
                                   "beta_slow": comp.get("beta_slow", 1)}  # fmt: skip
        elif comp.get("rope_type", comp.get("type", "default")) != "default":
            raise bad(f"rope_parameters.compress is {comp.get('rope_type')!r}: only YaRN or none")
    factor = d.get("partial_rotary_factor")
    if factor is not None and abs(factor * d["head_dim"] - d["qk_rope_head_dim"]) > 1e-6:
        raise bad(f"partial_rotary_factor {factor} x head_dim {d['head_dim']} is not "
                  f"qk_rope_head_dim {d['qk_rope_head_dim']}")  # fmt: skip
    out["num_nextn_predict_layers"] = 0
    return out


def config_from_release(d: dict, *, source: str = "config.json", **overrides) -> DeepseekV4Config:
    """DeepseekV4Config from the release's config.json dict (see the module docstring); a
    transformers-saved config.json (its own keys) is translated first (`hf_to_release`).

    `overrides` are our own training fields (e.g. recompute) applied on top."""
    ours_to_release = {ours: rel for rel, ours in FIELDS.items()}
    check_sizes({ours: d.get(rel) for rel, ours in FIELDS.items()}, source=source,
                names=ours_to_release)  # fmt: skip
    if is_hf_config(d):
        d = hf_to_release(d, source=source)
    known = {"compress_ratios", "rope_scaling", *DSPARK_KEYS}
    unknown = sorted(set(d) - set(FIELDS) - set(_REQUIRED) - IGNORED_KEYS - known)
    if unknown:
        raise ConfigError(
            f"{source}: keys {unknown} are not understood; they may change the math, so the "
            "checkpoint is refused (see primus_v4/models/deepseek_v4/release/config_json.py)"
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
    dspark = _dspark_fields(d, values["num_layers"], source)
    if not dspark:
        values.update(_ratio_fields(d, values["num_layers"], values.get("mtp_num_layers", 0)))
    elif overrides.get("mtp_num_layers"):
        raise ConfigError(
            f"{source}: the release's mtp.* tensors are a DSpark drafter, not a classic MTP "
            "block, so mtp_num_layers must stay 0 (the drafter is carried unchanged)"
        )
    values.update(dspark)
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
    out: dict[str, Any] = {"architectures": ["DeepseekV4ForCausalLM"]}
    out.update({k: v for k, v in _REQUIRED.items() if k not in _NOT_RELEASED})
    for rel, ours in FIELDS.items():
        out[rel] = getattr(cfg, ours)
    out["num_nextn_predict_layers"] = cfg.mtp_num_layers or 0
    out["compress_ratios"] = [*cfg.compress_ratios] + [cfg.mtp_compress_ratio] * (
        cfg.mtp_num_layers or 0
    )
    if cfg.dspark:  # the drafter's keys and slots, as the release declared them
        out.update({k: v for k, v in cfg.dspark.items() if k != "compress_ratios"})
        out["compress_ratios"] = [*cfg.compress_ratios, *cfg.dspark["compress_ratios"]]
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
