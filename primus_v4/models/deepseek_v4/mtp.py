"""Multi-token prediction: per-depth shifted streams and the MTP depth module.

Legend: S = rows of the whole pack (global order), T = rows on this rank, D = hidden,
K = hc_mult streams.

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

from dataclasses import dataclass

import torch
from torch import nn

from primus_v4.models.deepseek_v4.block import Block, run_block
from primus_v4.models.deepseek_v4.config import DeepseekV4Config
from primus_v4.models.deepseek_v4.hyper_connection import HyperHead
from primus_v4.models.deepseek_v4.layout import RowLayout, require_layout
from primus_v4.models.deepseek_v4.moe import Dispatcher, RoutingInputs
from primus_v4.models.deepseek_v4.norm import RMSNorm
from primus_v4.models.deepseek_v4.recompute import DiscardedPart, selected

IGNORE_LABEL = -100


def shift_in_sample(
    x_S: torch.Tensor, cu_seqlens: torch.Tensor, k: int, fill: float | int | bool
) -> torch.Tensor:
    """out[t] = x[t + k] when row t + k lies in t's own segment, else `fill` (global order)."""
    s = x_S.shape[0]
    cu = cu_seqlens.to(device=x_S.device, dtype=torch.long)
    end_S = torch.repeat_interleave(cu[1:], cu[1:] - cu[:-1], output_size=s)
    src_S = torch.arange(s, device=x_S.device) + k
    inside_S = src_S < end_S
    shifted = x_S.index_select(0, src_S.clamp(max=s - 1))
    return torch.where(inside_S, shifted, torch.full_like(shifted, fill))


@dataclass(frozen=True, kw_only=True)
class MtpStreams:
    """Inputs and targets of one MTP depth, row-aligned with the main stream.

    input_ids: token t+k of the same sample (0 where that crosses the sample end; masked).
    labels:    label at t+k (the token t+k+1) or IGNORE_LABEL; None when no labels were given.
    loss_mask: loss_mask at t+k, 0 where t+k crosses the sample end or is padding.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor | None = None
    loss_mask: torch.Tensor | None = None

    def local_slice(self, start: int, stop: int) -> MtpStreams:
        """This CP rank's contiguous rows of globally shifted streams."""

        def cut(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[start:stop]

        return MtpStreams(
            input_ids=self.input_ids[start:stop],
            labels=cut(self.labels),
            loss_mask=cut(self.loss_mask),
        )


def mtp_streams(
    *,
    input_ids_S: torch.Tensor,
    cu_seqlens: torch.Tensor,
    depth: int,
    labels_S: torch.Tensor | None = None,
    loss_mask_S: torch.Tensor | None = None,
    padding_mask_S: torch.Tensor | None = None,
) -> MtpStreams:
    """Shift the GLOBAL streams of one pack for MTP depth `depth` (>= 1); see module docstring."""
    if depth < 1:
        raise ValueError(f"MTP depth is 1-based, got {depth}")
    ids = shift_in_sample(input_ids_S, cu_seqlens, depth, 0)
    if labels_S is None:
        return MtpStreams(input_ids=ids)
    labels = shift_in_sample(labels_S, cu_seqlens, depth, IGNORE_LABEL)
    base = loss_mask_S if loss_mask_S is not None else (labels_S != IGNORE_LABEL)
    mask = shift_in_sample(base.to(torch.float32), cu_seqlens, depth, 0.0)
    if padding_mask_S is not None:
        pad = shift_in_sample(padding_mask_S.bool(), cu_seqlens, depth, True)
        mask = torch.where(pad, 0.0, mask)
    return MtpStreams(input_ids=ids, labels=labels, loss_mask=mask)


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
