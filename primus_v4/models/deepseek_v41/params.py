"""Parameter counts of a V4.1 model by component, from a meta-device build (no memory used)."""

from __future__ import annotations

import torch

from primus_v4.models.deepseek_v4.params import component_of
from primus_v4.models.deepseek_v41.config import DeepseekV41Config
from primus_v4.models.deepseek_v41.model import DeepseekV41Model


def param_counts(cfg: DeepseekV41Config) -> dict[str, int]:
    """Parameters per component (DeepSeek-V4's buckets plus `engram`), `total` and
    `active_per_token` (the top-k routed experts and the Engram rows one token reads)."""
    with torch.device("meta"):
        model = DeepseekV41Model(cfg)
    counts: dict[str, int] = {"engram": 0}
    routed = tables = 0
    for name, p in model.named_parameters():
        part = (
            "engram" if ".engram." in name else component_of(name.replace("index_keys", "indexer"))
        )
        counts[part] = counts.get(part, 0) + p.numel()
        routed += p.numel() if ".moe.w_" in name else 0
        tables += p.numel() if name.endswith(".engram.table") else 0
    counts["total"] = sum(counts.values())
    inactive = routed * (cfg.num_moe_experts - cfg.moe_router_topk) // cfg.num_moe_experts
    read = len(cfg.engram_layer_ids) * (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
    counts["active_per_token"] = counts["total"] - inactive - tables + read * cfg.engram_head_dim
    return counts
