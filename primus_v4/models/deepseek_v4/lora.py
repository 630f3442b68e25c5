"""LoRA adapters on DeepSeek-V4's release modules; the base stays frozen.

The adapter kinds, their init and the merge are `models/common/lora.py`'s. Targets use the
release's names inside a layer (`attn.wq_a`, `ffn.shared_experts.w1`, `ffn.experts.w2`, ...):
the nn.Linear targets are wq_a, wq_b, wkv, wo_b, the attention compressor's wkv / wgate and the
shared expert's w1 / w3 (spans of its fused gate_up) and w2; wo_a and the routed experts get
the grouped and expert adapters.
"""

from __future__ import annotations

from torch import nn

from primus_v4.errors import ConfigError
from primus_v4.models.common import lora
from primus_v4.models.common.lora import LoraSpec, adapter_names, merged_weights
from primus_v4.models.deepseek_v4.block import Block

__all__ = ["LoraSpec", "adapter_names", "apply_lora", "merged_weights"]


def linear_targets(block: Block) -> dict[str, tuple[nn.Module, str]]:
    """Release name -> (owner module, attribute) of the block's nn.Linear targets."""
    attn, moe = block.attn, block.moe
    out: dict[str, tuple[nn.Module, str]] = {n: (attn, n) for n in ("wq_a", "wq_b", "wkv", "wo_b")}
    if attn.compressor is not None:
        out["compressor.wkv"] = (attn.compressor, "wkv")
        out["compressor.wgate"] = (attn.compressor, "wgate")
    if moe.shared is not None:
        out["shared_experts.w1"] = (moe.shared, "gate_up")
        out["shared_experts.w3"] = (moe.shared, "gate_up")
        out["shared_experts.w2"] = (moe.shared, "down")
    return out


def apply_lora(model: nn.Module, spec: LoraSpec, *, seed: int) -> int:
    """Freeze `model` (a whole model or a rank's stage and expert shard, materialized) and add
    `spec`'s adapters to each layer and MTP block it holds. Returns the adapter parameters
    added on this rank."""
    if "engram.wkv" in spec.targets:
        raise ConfigError("model.lora.targets: engram.wkv: DeepSeek-V4 has no Engram")
    return lora.apply_lora(model, spec, seed=seed, layers=(Block,), linear_targets=linear_targets)
