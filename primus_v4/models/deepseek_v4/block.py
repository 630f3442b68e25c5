"""One decoder layer: mHC around attention and around MoE.

Legend: T = rows on this rank, K = hc_mult streams, D = hidden.

  x_TKD -> attn_mix.collapse -> attn_norm -> Attention(layout) -> attn_mix.write_back
        -> ffn_mix.collapse  -> ffn_norm  -> MoE(routing)       -> ffn_mix.write_back
The layout is a required keyword all the way down: a layer can never run without it.
"""

from __future__ import annotations

import torch
from torch import nn

from primus_v4.models.common.recompute import DiscardedPart, checkpointed, selected
from primus_v4.models.deepseek_v4.attention import Attention
from primus_v4.models.deepseek_v4.config import DeepseekV4Config
from primus_v4.models.deepseek_v4.hyper_connection import HyperMixer
from primus_v4.models.deepseek_v4.layout import RowLayout, require_layout
from primus_v4.models.deepseek_v4.moe import Dispatcher, MoE, RoutingInputs
from primus_v4.models.deepseek_v4.norm import RMSNorm


def _mixer(cfg: DeepseekV4Config) -> HyperMixer:
    return HyperMixer(
        hidden=cfg.hidden_size,
        k=cfg.hc_mult,
        sinkhorn_iters=cfg.hc_sinkhorn_iters,
        eps=cfg.hc_eps,
        norm_eps=cfg.layernorm_epsilon,
    )


class Block(nn.Module):
    """A hybrid layer whose attention kind is set by its compress ratio (0 / 4 / 128)."""

    def __init__(
        self,
        cfg: DeepseekV4Config,
        *,
        layer_idx: int,
        compress_ratio: int,
        dispatcher: Dispatcher | None = None,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.compress_ratio = compress_ratio
        self.attn_mix = _mixer(cfg)
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.layernorm_epsilon)
        self.attn = Attention(cfg, compress_ratio=compress_ratio, layer_idx=layer_idx)
        self.ffn_mix = _mixer(cfg)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.layernorm_epsilon)
        self.moe = MoE(cfg, layer_idx=layer_idx, dispatcher=dispatcher)
        self.recompute = selected(cfg)  # layernorm / moe (recompute.py)

    def _attn_input(self, x_TKD: torch.Tensor, pre_TK: torch.Tensor) -> torch.Tensor:
        return self.attn_norm(self.attn_mix.collapse(x_TKD, pre_TK))

    def _ffn_input(self, x_TKD: torch.Tensor, pre_TK: torch.Tensor) -> torch.Tensor:
        return self.ffn_norm(self.ffn_mix.collapse(x_TKD, pre_TK))

    def forward(
        self,
        x_TKD: torch.Tensor,
        *,
        positions_T: torch.Tensor,
        layout: RowLayout,
        routing: RoutingInputs,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (new streams, this layer's MoE balance loss)."""
        layout = require_layout(layout, f"decoder layer {self.layer_idx}")
        norms = "layernorm" in self.recompute
        pre, post, comb = self.attn_mix.coefficients(x_TKD)
        part = (
            DiscardedPart(self._attn_input, [self.attn_norm.weight]) if norms else self._attn_input
        )
        h_TD = self.attn(part(x_TKD, pre), positions_T=positions_T, layout=layout)
        if norms:
            part.discard(after=h_TD)
        x_TKD = self.attn_mix.write_back(x_TKD, h_TD, post, comb)
        pre, post, comb = self.ffn_mix.coefficients(x_TKD)
        part = DiscardedPart(self._ffn_input, [self.ffn_norm.weight]) if norms else self._ffn_input
        moe = (lambda x, r: checkpointed(self.moe, x, r)) if "moe" in self.recompute else self.moe
        h_TD, aux = moe(part(x_TKD, pre), routing)
        if norms:
            part.discard(after=(h_TD, aux))  # the balance loss reaches the router by itself
        return self.ffn_mix.write_back(x_TKD, h_TD, post, comb), aux


def run_block(
    block: Block,
    x_TKD: torch.Tensor,
    *,
    positions_T: torch.Tensor,
    layout: RowLayout,
    routing: RoutingInputs,
    checkpoint: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Call a layer, optionally recomputing it in backward; the layout rides along either way."""
    if checkpoint and torch.is_grad_enabled():
        # Non-reentrant checkpoint forwards keyword arguments as given, so the recomputed
        # forward sees the same layout object (the bug class where recompute dropped it).
        return torch.utils.checkpoint.checkpoint(
            block,
            x_TKD,
            positions_T=positions_T,
            layout=layout,
            routing=routing,
            use_reentrant=False,
        )
    return block(x_TKD, positions_T=positions_T, layout=layout, routing=routing)
