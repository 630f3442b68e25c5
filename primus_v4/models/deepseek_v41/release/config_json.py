"""The V4.1 release's config.json (`model_type: deepseek_v41`, the text model under
`text_config`) <-> `DeepseekV41Config`.

Every key of the published release has a place: keys that describe the text backbone map one
to one onto our fields; keys whose value fixes math we build one way only are checked against
that value; keys of parts this model does not build (the DSpark stages, the vision tower) and
inference-only keys are accepted as they are. Any other key, at the top level or in
`text_config`, is an error, so a release whose math we do not know is never loaded silently.
An export writes the published release's layout (`release_config`: its keys, in its order, the
FP8 / FP4 `quantization_config` of 32 x 32 blocks with `expert_dtype` inside it), whatever the
layout of the release the model came from.

`compress_ratios` lists the backbone's `num_hidden_layers` ratios followed by one 0 per DSpark
draft stage (`num_nextn_predict_layers`), as V4's lists its MTP slot: the tail is checked and
left out of the backbone's config. Torch-free: `train --dry-run` and the presets read it.
"""

from __future__ import annotations

from typing import Any

from primus_v4.errors import CheckpointFormatError

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
    "attention_bias": False,  # no projection of V4.1 has a bias
}
# read by parts we do not build (DSpark stages, vision) or by inference only
PASSED = {
    "model_type", "max_position_embeddings", "dtype", "bos_token_id", "eos_token_id",
    "pad_token_id", "image_token_id", "torch_dtype",
}  # fmt: skip
# the DSpark draft stages (`mtp.*`; models/deepseek_v41/dspark.py): text_config key -> our field
DSPARK = {
    "num_nextn_predict_layers": "dspark_stages",
    "dspark_block_size": "dspark_block_size",
    "dspark_noise_token_id": "dspark_noise_token_id",
    "dspark_target_layer_ids": "dspark_target_layer_ids",
    "dspark_markov_rank": "dspark_markov_rank",
    "dspark_n_routed_experts": "dspark_n_routed_experts",
    "dspark_num_experts_per_tok": "dspark_num_experts_per_tok",
}
# keys beside `text_config` in a composite config.json: the vision tower's config and the image
# placeholder id belong to the vision path (its tensors stay in the release)
TOP_LEVEL = {
    "architectures", "model_type", "transformers_version", "dtype", "torch_dtype",
    "bos_token_id", "eos_token_id", "pad_token_id", "image_token_id", "tie_word_embeddings",
    "quantization_config", "text_config", "vision_config",
}  # fmt: skip
# the release's storage (release/tensors.py reads every tensor by its kind); a config.json
# naming another scheme is refused rather than decoded as this one
QUANTIZATION = {
    "quant_method": "fp8",
    "weight_block_size": [32, 32],
    "scale_fmt": "ue8m0",
    "expert_dtype": "fp4",
}
QUANTIZATION_PASSED = {"activation_scheme"}  # how inference quantizes activations
# what an FP8 export declares: the published release's `quantization_config`, key for key
QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "activation_scheme": "dynamic",
    "weight_block_size": [32, 32],
    "scale_fmt": "ue8m0",
    "expert_dtype": "fp4",
}
# The published release's config.json layout (DeepSeek-V4.1-Flash's, in its order): the keys an
# export writes, at the top level, in `text_config` and its `rope_scaling`. The model's keys take
# the model's values (`config_to_release`); the others the values of the release the model came
# from, else the published release's (`PUBLISHED`).
RELEASE_KEYS = (
    "architectures", "model_type", "dtype", "bos_token_id", "eos_token_id", "pad_token_id",
    "image_token_id", "quantization_config", "text_config", "vision_config",
)  # fmt: skip
RELEASE_TEXT_KEYS = (
    "model_type", "vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "qk_rope_head_dim", "q_lora_rank",
    "o_lora_rank", "o_groups", "hidden_act", "swiglu_limit", "rms_norm_eps", "attention_bias",
    "max_position_embeddings", "rope_theta", "rope_scaling", "n_routed_experts",
    "n_shared_experts", "num_experts_per_tok", "scoring_func", "topk_method", "norm_topk_prob",
    "routed_scaling_factor", "sliding_window", "compress_ratios", "compress_rope_theta",
    "kv_source_layer_ids", "index_source_layer_ids", "index_n_heads", "index_head_dim",
    "index_topk", "candidate_source_layer_id", "candidate_topk_blocks", "candidate_block_size",
    "hc_mult", "hc_sinkhorn_iters", "hc_eps", "engram_layer_ids", "engram_num_embeddings",
    "engram_max_ngram_size", "engram_vocab_size", "engram_n_heads", "engram_head_dim",
    "engram_pad_token_id", "engram_compressed_vocab_size", "num_nextn_predict_layers",
    "dspark_block_size", "dspark_noise_token_id", "dspark_target_layer_ids", "dspark_markov_rank",
    "dspark_n_routed_experts", "dspark_num_experts_per_tok",
)  # fmt: skip
RELEASE_ROPE_KEYS = ("rope_type", "factor", "beta_fast", "beta_slow",
                     "original_max_position_embeddings")  # fmt: skip
# the published values of the keys that are not the model's
PUBLISHED = {
    "architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
    "dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
    "image_token_id": 129264,
}  # fmt: skip
PUBLISHED_TEXT = {"max_position_embeddings": 1048576}


def text_config(d: dict[str, Any], source: str) -> dict[str, Any]:
    """The text model's keys of a V4.1 config.json (composite or already the text part); the
    keys beside `text_config` are checked."""
    if "text_config" not in d:
        if d.get("model_type") == "deepseek_v41":  # the composite's type, not the text part's
            raise CheckpointFormatError(
                f"{source}: no text_config: a DeepSeek-V4.1 config.json (model_type "
                "deepseek_v41) holds the text model's keys under text_config"
            )
        return d
    text = d["text_config"]
    if not isinstance(text, dict):
        raise CheckpointFormatError(f"{source}: text_config must be an object")
    unknown = sorted(set(d) - TOP_LEVEL)
    if unknown:
        raise CheckpointFormatError(f"{source}: unknown config.json key {unknown[0]!r}")
    if d.get("tie_word_embeddings", False) is not False:
        raise CheckpointFormatError(
            f"{source}: tie_word_embeddings = {d['tie_word_embeddings']!r}; DeepSeek-V4.1's "
            "embedding and head are separate tensors"
        )
    _check_quantization(d.get("quantization_config"), source)
    return text


def _check_quantization(q: Any, source: str) -> None:
    if q is None:  # a bf16 export writes none
        return
    if not isinstance(q, dict):
        raise CheckpointFormatError(f"{source}: quantization_config must be an object")
    for key, value in q.items():
        if key in QUANTIZATION_PASSED:
            continue
        if key not in QUANTIZATION:
            raise CheckpointFormatError(f"{source}: unknown quantization_config key {key!r}")
        if value != QUANTIZATION[key]:
            raise CheckpointFormatError(
                f"{source}: quantization_config.{key} = {value!r}; the DeepSeek-V4.1 release "
                f"stores {QUANTIZATION[key]!r}"
            )


def backbone_ratios(text: dict[str, Any], source: str) -> list[int]:
    """The backbone's compress ratios: `compress_ratios` without the DSpark stages' tail (one 0
    per `num_nextn_predict_layers`), which is checked."""
    ratios = text.get("compress_ratios")
    if not isinstance(ratios, list):
        raise CheckpointFormatError(f"{source}: text_config.compress_ratios must be a list")
    stages = text.get("num_nextn_predict_layers", 0)
    layers = text.get("num_hidden_layers", len(ratios) - stages)
    if len(ratios) != layers + stages:
        raise CheckpointFormatError(
            f"{source}: text_config.compress_ratios has {len(ratios)} entries; the release "
            f"lists num_hidden_layers ({layers}) backbone ratios then one 0 per DSpark draft "
            f"stage (num_nextn_predict_layers {stages}): {layers + stages} expected"
        )
    tail = ratios[layers:]
    if any(r != 0 for r in tail):
        bad = next(i for i, r in enumerate(tail) if r != 0)
        raise CheckpointFormatError(
            f"{source}: text_config.compress_ratios[{layers + bad}] = {tail[bad]!r}: the entries "
            f"after the {layers} backbone layers are the DSpark draft stages' and must be 0 "
            f"(window-only attention); got tail {tail}"
        )
    return ratios[:layers]


def fields_from_release(d: dict[str, Any], *, source: str = "config.json") -> dict[str, Any]:
    """Our model config fields of a release config.json dict (torch-free); raises naming any
    key or value we do not build."""
    text = text_config(d, source)
    values: dict[str, Any] = {}
    for key, value in text.items():
        if key == "compress_ratios":
            values["compress_ratios"] = backbone_ratios(text, source)
        elif key in FIELDS:
            values[FIELDS[key]] = value
        elif key in DSPARK:
            values[DSPARK[key]] = value
        elif key == "rope_scaling":
            values.update(_rope_fields(value, source))
        elif key in FIXED:
            if value != FIXED[key]:
                raise CheckpointFormatError(
                    f"{source}: text_config.{key} = {value!r}; DeepSeek-V4.1 is built with "
                    f"{FIXED[key]!r} only"
                )
        elif key not in PASSED:
            raise CheckpointFormatError(f"{source}: unknown text_config key {key!r}")
    if text is not d and "vision_config" in d:  # the image encoder's sizes (vision.py)
        if not isinstance(d["vision_config"], dict):
            raise CheckpointFormatError(f"{source}: vision_config must be an object")
        values["vision_config"] = d["vision_config"]
    values["moe_shared_expert_intermediate_size"] = values.get("moe_ffn_hidden_size")
    values.setdefault("num_query_groups", 1)
    return values


def _rope_fields(value: Any, source: str) -> dict[str, Any]:
    if isinstance(value, dict) and "type" in value and "rope_type" not in value:
        value = {"rope_type": value["type"], **{k: v for k, v in value.items() if k != "type"}}
    if not isinstance(value, dict) or value.get("rope_type", "yarn") != "yarn":
        got = value.get("rope_type") if isinstance(value, dict) else value
        raise CheckpointFormatError(
            f"{source}: rope_scaling.rope_type {got!r}; DeepSeek-V4.1 uses 'yarn'"
        )
    unknown = sorted(set(value) - set(ROPE_FIELDS) - {"rope_type"})
    if unknown:
        raise CheckpointFormatError(f"{source}: unknown rope_scaling key {unknown[0]!r}")
    return {field: value[k] for k, field in ROPE_FIELDS.items() if k in value}


def config_to_release(cfg: Any) -> dict[str, Any]:
    """The text_config keys of a DeepseekV41Config (the inverse of `fields_from_release`; the
    config class imports this module, so it is not named here)."""
    out: dict[str, Any] = {"model_type": "deepseek_v41_text"}
    out.update({key: getattr(cfg, field) for key, field in FIELDS.items()})
    out["rope_scaling"] = {"rope_type": "yarn"}
    out["rope_scaling"].update({k: getattr(cfg, f) for k, f in ROPE_FIELDS.items()})
    out.update(FIXED)
    if cfg.dspark_stages:  # and compress_ratios' tail: one window-only 0 per draft stage
        out.update({key: getattr(cfg, field) for key, field in DSPARK.items()})
        out["compress_ratios"] = [*cfg.compress_ratios, *[0] * cfg.dspark_stages]
    return out


def _laid_out(keys: tuple[str, ...], *sources: dict[str, Any]) -> dict[str, Any]:
    """`keys` in order, each with its value in the first of `sources` that has it (a key none
    has is left out)."""
    out: dict[str, Any] = {}
    for key in keys:
        source = next((s for s in sources if key in s), None)
        if source is not None:
            out[key] = source[key]
    return out


def release_config(
    cfg: Any, *, given: dict[str, Any] | None = None, drafter: bool = True
) -> dict[str, Any]:
    """The config.json of an export of `cfg` in the published release's layout (`RELEASE_KEYS`,
    ...), as an FP8 export writes it (a bf16 export's writer drops `quantization_config`): the
    model's keys with the model's values; the others as the release `given` (the config.json
    the model came from) has them, else as published; `vision_config` (the image encoder's,
    as its release states it) and `image_token_id` only for a model with an image encoder, the
    DSpark keys only with `drafter` (the shards hold its stages, or the release the model came
    from declares them). A key outside the layout (a tool's provenance) is not written."""
    given = given or {}
    text, text_keys = config_to_release(cfg), RELEASE_TEXT_KEYS
    if not drafter:  # no stages: neither their keys nor their slots of compress_ratios
        text_keys = tuple(k for k in text_keys if k not in DSPARK)
        text["compress_ratios"] = list(cfg.compress_ratios)
    text["rope_scaling"] = _laid_out(RELEASE_ROPE_KEYS, text["rope_scaling"])
    given_text = given.get("text_config", given)
    ours: dict[str, Any] = {
        "quantization_config": dict(QUANTIZATION_CONFIG),
        "text_config": _laid_out(text_keys, text, given_text, PUBLISHED_TEXT),
    }
    vision = cfg.vision_config or given.get("vision_config")
    keys = RELEASE_KEYS
    if vision:
        ours["vision_config"] = dict(vision)
    else:
        keys = tuple(k for k in RELEASE_KEYS if k not in ("image_token_id", "vision_config"))
    return _laid_out(keys, ours, given, PUBLISHED)
