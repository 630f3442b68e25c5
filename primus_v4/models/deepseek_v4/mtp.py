"""Multi-token prediction: per-depth shifted streams and the MTP depth module.

Legend: S = rows of the whole pack (global order), T = rows on this rank, D = hidden,
K = hc_mult streams. The shift itself is a rule of the packed rows (data/mtp_shift.py), shared
with the loss's token counts.

Depth k (1-based) at position t predicts the label k steps ahead in the same sample, i.e. the
token t+k+1, from the previous depth's hidden at t combined with the embedding of token t+k.
Shifts are done in GLOBAL pack order, never across a sample end:
  * CP = 1: the model calls `mtp_streams` on its own rows (they are the whole pack).
  * CP > 1: the caller (data loader / trainer) calls `mtp_streams` on the global pack before
    sharding, slices every returned stream with the same contiguous split as input_ids, and
    passes the per-rank slices as `mtp_inputs=`; a rank-local roll would read the wrong rows
    at rank boundaries, so the model refuses to shift by itself when comm.size > 1.
Each depth runs one hybrid layer with THE SAME RowLayout as the main stack and positions of the
current token (the shift changes which token is embedded, not where it sits).
"""

from __future__ import annotations

import torch
from torch import nn

from primus_v4.models.common.recompute import DiscardedPart, selected
from primus_v4.models.deepseek_v4.block import Block, run_block
from primus_v4.models.deepseek_v4.config import DeepseekV4Config
from primus_v4.models.deepseek_v4.hyper_connection import HyperHead
from primus_v4.models.deepseek_v4.layout import RowLayout, require_layout
from primus_v4.models.deepseek_v4.moe import Dispatcher, RoutingInputs
from primus_v4.models.deepseek_v4.norm import RMSNorm


class MTPDepth(nn.Module):
    """Streams h [T, K, D] + emb(t+k) -> e_proj(enorm(emb)) + h_proj(hnorm(h)) per stream -> one
    layer -> (streams for the next depth, own HyperHead + norm for the shared LM head).

    The input streams are the previous stage's K streams BEFORE any HyperHead collapse (the last
    decoder layer's for depth 1); the embedding projection is broadcast over the streams."""

    def __init__(
        self, cfg: DeepseekV4Config, *, depth: int, dispatcher: Dispatcher | None = None
    ) -> None:
        super().__init__()
        d, eps = cfg.hidden_size, cfg.layernorm_epsilon
        self.depth = depth
        self.enorm = RMSNorm(d, eps)
        self.hnorm = RMSNorm(d, eps)
        self.e_proj = nn.Linear(d, d, bias=False)
        self.h_proj = nn.Linear(d, d, bias=False)
        # Layer index after the decoder: never hash-routed, own compressor/indexer if any.
        self.block = Block(
            cfg,
            layer_idx=cfg.num_layers + depth - 1,
            compress_ratio=cfg.mtp_compress_ratio,
            dispatcher=dispatcher,
        )
        self.head_hc = HyperHead(hidden=d, k=cfg.hc_mult, eps=cfg.hc_eps, norm_eps=eps)
        self.final_norm = RMSNorm(d, eps)
        self.checkpoint = False  # set by the model (activation checkpointing)
        self.recompute_norms = "layernorm" in selected(cfg)

    def forward(
        self,
        h_TKD: torch.Tensor,
        emb_TD: torch.Tensor,
        *,
        positions_T: torch.Tensor,
        layout: RowLayout,
        routing: RoutingInputs,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns (streams for the next depth, normed hidden for the LM head, balance loss)."""
        layout = require_layout(layout, f"MTP depth {self.depth}")
        if self.recompute_norms:
            enorm = DiscardedPart(self.enorm, [self.enorm.weight])
            hnorm = DiscardedPart(self.hnorm, [self.hnorm.weight])
            e_TD, h_TKD = self.e_proj(enorm(emb_TD)), self.h_proj(hnorm(h_TKD))
            enorm.discard(after=e_TD)
            hnorm.discard(after=h_TKD)
        else:
            e_TD, h_TKD = self.e_proj(self.enorm(emb_TD)), self.h_proj(self.hnorm(h_TKD))
        x_TKD = e_TD.unsqueeze(1) + h_TKD
        x_TKD, aux = run_block(
            self.block,
            x_TKD,
            positions_T=positions_T,
            layout=layout,
            routing=routing,
            checkpoint=self.checkpoint,
        )
        return x_TKD, self.final_norm(self.head_hc(x_TKD)), aux
