"""Parameter counts by component, from a model built on the meta device (no memory used)."""

from __future__ import annotations

import torch

from primus_v4.models.deepseek_v4.config import DeepseekV4Config
from primus_v4.models.deepseek_v4.model import DeepseekV4Model

COMPONENTS = (
    "embedding",
    "attention",
    "compressor_indexer",
    "router",
    "experts",
    "shared",
    "mhc",
    "norms",
    "mtp",
    "head",
)


def component_of(name: str) -> str:
    """Bucket of a parameter name of DeepseekV4Model (MTP depths are one bucket of their own)."""
    if name.startswith("mtp."):
        return "mtp"
    if name.startswith("embedding."):
        return "embedding"
    if name.startswith(("lm_head.", "final_norm.")):
        return "head"
    if name.startswith("head_hc.") or "_mix." in name:
        return "mhc"
    if ".attn." in name:
        return "compressor_indexer" if ("compressor" in name or "indexer" in name) else "attention"
    if ".moe.router." in name:
        return "router"
    if ".moe.shared." in name:
        return "shared"
    if ".moe." in name:
        return "experts"
    if name.endswith("norm.weight"):
        return "norms"
    raise KeyError(f"parameter {name!r} has no component bucket; extend component_of")


def param_counts(cfg: DeepseekV4Config) -> dict[str, int]:
    """Parameters per component plus `total` and `active_per_token` (top-k of the routed experts
    in every layer incl. MTP; everything else counts fully). Built on the meta device."""
    with torch.device("meta"):
        model = DeepseekV4Model(cfg)
    counts = dict.fromkeys(COMPONENTS, 0)
    routed = 0
    for name, p in model.named_parameters():
        counts[component_of(name)] += p.numel()
        if ".moe.w_" in name:
            routed += p.numel()
    counts["total"] = sum(counts[c] for c in COMPONENTS)
    inactive = routed * (cfg.num_moe_experts - cfg.moe_router_topk) // cfg.num_moe_experts
    counts["active_per_token"] = counts["total"] - inactive
    return counts
