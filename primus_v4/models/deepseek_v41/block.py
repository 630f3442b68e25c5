"""One V4.1 layer: optional Engram write, then single-pass mHC around attention and MoE.

Legend: T = rows, K = hc_mult streams, D = hidden, C = Engram hash columns.

Single pass (the release's Block): each sub-block computes (pre, post, comb) from its own input
streams but collapses them with the PREVIOUS sub-block's pre: the attention with the previous
layer's FFN pre (one-hot [1, 0, ..., 0] before the first layer), the FFN with this layer's
attention pre. The layer returns its FFN pre for the next one (the last collapses the model).
"""

from __future__ import annotations

import torch
from torch import nn

from primus_v4.models.common.recompute import DiscardedPart, checkpointed, selected
from primus_v4.models.deepseek_v4.block import _mixer
from primus_v4.models.deepseek_v4.layout import RowLayout, require_layout
from primus_v4.models.deepseek_v4.moe import Dispatcher, MoE, RoutingInputs
from primus_v4.models.deepseek_v4.norm import RMSNorm
from primus_v4.models.deepseek_v41.attention import Attention, SharedCache
from primus_v4.models.deepseek_v41.config import DeepseekV41Config
from primus_v4.models.deepseek_v41.engram import Engram


class Block(nn.Module):
    def __init__(
        self, cfg: DeepseekV41Config, *, layer_idx: int, dispatcher: Dispatcher | None = None
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.compress_ratio = cfg.compress_ratios[layer_idx]
        self.engram = None
        if layer_idx in cfg.engram_layer_ids:
            rows = cfg.engram_num_embeddings[cfg.engram_layer_ids.index(layer_idx)]
            self.engram = Engram(cfg, rows=rows)
        self.attn_mix = _mixer(cfg)
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.layernorm_epsilon)
        self.attn = Attention(cfg, layer_idx=layer_idx)
        self.ffn_mix = _mixer(cfg)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.layernorm_epsilon)
        self.moe = MoE(cfg, layer_idx=layer_idx, dispatcher=dispatcher)
        self.recompute = selected(cfg)  # layernorm / moe (models/common/recompute.py)
        # set by DeepseekV41Model.draft: {layer: the mean over the streams of this layer's input}
        self.capture: dict[int, torch.Tensor] | None = None

    def _attn_input(self, x_TKD: torch.Tensor, pre_TK: torch.Tensor) -> torch.Tensor:
        return self.attn_norm(self.attn_mix.collapse(x_TKD, pre_TK))

    def _ffn_input(self, x_TKD: torch.Tensor, pre_TK: torch.Tensor) -> torch.Tensor:
        return self.ffn_norm(self.ffn_mix.collapse(x_TKD, pre_TK))

    def forward(
        self,
        x_TKD: torch.Tensor,
        pre_TK: torch.Tensor,
        *,
        positions_T: torch.Tensor,
        layout: RowLayout,
        routing: RoutingInputs,
        shared: SharedCache,
        engram_rows_TC: torch.Tensor | None,
        engram_mask_T: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, SharedCache, torch.Tensor]:
        """Returns (streams, this layer's FFN pre, the shared cache, MoE balance loss)."""
        layout = require_layout(layout, f"decoder layer {self.layer_idx}")
        if self.engram is not None:
            x_TKD = self.engram(x_TKD, engram_rows_TC, engram_mask_T)
        if self.capture is not None:  # what the DSpark drafter reads (dspark.py)
            self.capture[self.layer_idx] = x_TKD.mean(dim=1)
        norms = "layernorm" in self.recompute
        attn_in, ffn_in = self._attn_input, self._ffn_input
        if norms:
            attn_in = DiscardedPart(self._attn_input, [self.attn_norm.weight])
            ffn_in = DiscardedPart(self._ffn_input, [self.ffn_norm.weight])
        attn_pre, post, comb = self.attn_mix.coefficients(x_TKD)
        h_TD, shared = self.attn(
            attn_in(x_TKD, pre_TK), positions_T=positions_T, layout=layout, shared=shared
        )
        if norms:
            attn_in.discard(after=h_TD)
        x_TKD = self.attn_mix.write_back(x_TKD, h_TD, post, comb)
        ffn_pre, post, comb = self.ffn_mix.coefficients(x_TKD)
        moe = (lambda x, r: checkpointed(self.moe, x, r)) if "moe" in self.recompute else self.moe
        h_TD, aux = moe(ffn_in(x_TKD, attn_pre), routing)
        if norms:
            ffn_in.discard(after=(h_TD, aux))
        return self.ffn_mix.write_back(x_TKD, h_TD, post, comb), ffn_pre, shared, aux
