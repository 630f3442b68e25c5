"""LoRA adapters on DeepSeek-V4.1's release modules; the base stays frozen.

The adapter kinds, their init and the merge are `models/common/lora.py`'s (DeepSeek-V4's
machinery). Targets use the V4.1 release's names inside a layer (`layers.N.attn.wq_a`,
`layers.N.ffn.shared_experts.w1`, `layers.N.engram.wkv`, ...):
  attn.wq_a / wq_b / wkv / wo_b       nn.Linear adapters
  attn.wo_a                           one adapter per output group
  attn.compressor.wkv / wgate         kv source layers only (wgate: ratio-2 sources); off by
                                      default
  ffn.shared_experts.w1 / w3 / w2     spans of the fused gate_up, and down
  ffn.experts.w1 / w3 / w2            routed experts, per expert or shared (grouped GEMMs)
  engram.wkv                          Engram layers only; off by default
  vision.wqkv / wo / w1 / w2          every ViT block's linears (`vision.blocks.N.attn.*`,
                                      `.mlp.*`; with bias, kept frozen); off by default
  aligner.w1 / w2                     the aligner's linears; off by default
A target on the image encoder makes the model hold those parts (`vision_train`), frozen as the
rest of the base.
The indexer (wq_b, weights_proj) and the index keys pick positions by top-k (no gradient passes
them), so they are no targets; the Engram tables, norms, mHC mixers and routers stay frozen.
"""

from __future__ import annotations

from torch import nn

from primus_v4.models.common import lora
from primus_v4.models.common.lora import LoraSpec
from primus_v4.models.deepseek_v4.lora import linear_targets as v4_linear_targets
from primus_v4.models.deepseek_v41.block import Block
from primus_v4.models.deepseek_v41.vision import Aligner, VisionBlock


def linear_targets(block: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """Release name -> (owner module, attribute) of the layer's nn.Linear targets (a decoder
    layer, a ViT block or the aligner)."""
    if isinstance(block, VisionBlock):
        return {"vision.wqkv": (block.attn, "wqkv"), "vision.wo": (block.attn, "wo"),
                "vision.w1": (block.mlp, "w1"), "vision.w2": (block.mlp, "w2")}  # fmt: skip
    if isinstance(block, Aligner):
        return {"aligner.w1": (block, "w1"), "aligner.w2": (block, "w2")}
    assert isinstance(block, Block)
    out = v4_linear_targets(block)
    compressor = block.attn.compressor
    if compressor is not None and compressor.wgate is None:  # ratio 1: no gate
        del out["compressor.wgate"]
    if block.engram is not None:
        out["engram.wkv"] = (block.engram, "wkv")
    return out


def apply_lora(model: nn.Module, spec: LoraSpec, *, seed: int) -> int:
    """Freeze `model` (a whole model or a rank's stage and expert shard, materialized) and add
    `spec`'s adapters to each layer it holds. Returns the adapter parameters added on this
    rank."""
    return lora.apply_lora(model, spec, seed=seed, layers=(Block, VisionBlock, Aligner),
                           linear_targets=linear_targets)  # fmt: skip


def add_adapters(module: nn.Module, section: object, *, seed: int) -> int:
    """LoRA from the run config's `model.lora` section (the spec's `add_adapters`)."""
    return apply_lora(module, LoraSpec.of(section), seed=seed)
