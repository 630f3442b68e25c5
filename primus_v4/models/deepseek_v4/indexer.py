"""Lightning indexer (CSA layers): picks, for every query, the top-k compressed keys to attend to.

Legend: T = rows on this rank, Dh = hidden, H = indexer heads, D = indexer head dim, P = compact
compressed windows of the pack, K = top-k.

- Queries: own low-rank projection hidden -> D -> H x D (not shared with the attention's q-LoRA),
  RoPE at the row's in-sample position, then the normalized Hadamard rotation.
- Keys: the indexer's own overlap compressor (ratio 4, width D) with RoPE at the window's first
  position g * r and the same Hadamard rotation (compressor.py).
- Scores: scale * sum_h w[t, h] * relu(q[t, h] . k[j]) with per-head weights w = hidden -> H and
  scale = H^-1/2 * D^-1/2, only over the query's own-sample complete windows; exact chunked
  running top-k (kernels/indexer_topk.py); -1 where a query has fewer than K visible keys.
- Training: top-k is discrete and there is no distillation loss, so nothing could train the
  indexer; it reads `x.detach()`, runs without autograd, and its parameters are frozen
  (requires_grad False) so optimizers and DDP skip them.
- Checkpoint note: DeepSeek-V3.2's public indexer projects its query from the attention's q-LoRA
  latent and uses non-interleaved RoPE; if V4 checkpoints do the same, the weight adapter (and this
  projection) must follow. Packing isolation does not depend on that choice.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from primus_v4 import kernels
from primus_v4.models.deepseek_v4.compressor import Compressor, WindowPlan, build_window_plan
from primus_v4.models.deepseek_v4.config import DeepseekV4Config
from primus_v4.models.deepseek_v4.layout import RowLayout, require_layout
from primus_v4.models.deepseek_v4.rope import RotaryEmbedding, hadamard_matrix


class Indexer(nn.Module):
    """hidden [T, Dh] -> selected compact window ids [T, K] (int64, -1 = none)."""

    def __init__(self, cfg: DeepseekV4Config, *, ratio: int) -> None:
        super().__init__()
        h, d = cfg.index_n_heads, cfg.index_head_dim
        if cfg.qk_pos_emb_head_dim > d:
            raise ValueError(f"index_head_dim {d} is narrower than the rope dim")
        self.n_heads, self.head_dim, self.ratio = h, d, ratio
        self.topk, self.chunk = cfg.index_topk, cfg.index_topk_chunk
        self.scale = 1.0 / math.sqrt(h * d)
        self.wq_a = nn.Linear(cfg.hidden_size, d, bias=False)
        self.wq_b = nn.Linear(d, h * d, bias=False)
        self.weights_proj = nn.Linear(cfg.hidden_size, h, bias=False)
        self.compressor = Compressor(
            cfg.hidden_size,
            d,
            ratio=ratio,
            overlap=True,
            rotate=True,
            eps=cfg.layernorm_epsilon,
            init_std=cfg.init_method_std,
        )
        self.register_buffer("hadamard", hadamard_matrix(d), persistent=False)
        for lin in (self.wq_a, self.wq_b, self.weights_proj):
            nn.init.normal_(lin.weight, std=cfg.init_method_std)
        self.requires_grad_(False)
        self._topk = kernels.resolve("indexer_topk")

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Recompute the rotation in place (after `to_empty` from the meta device)."""
        with torch.device("cpu"):
            self.hadamard.copy_(hadamard_matrix(self.head_dim))

    @torch.no_grad()
    def forward(
        self,
        x_TD: torch.Tensor,
        *,
        positions_T: torch.Tensor,
        layout: RowLayout,
        rope: RotaryEmbedding,
        plan: WindowPlan | None = None,
    ) -> torch.Tensor:
        layout = require_layout(layout, "Indexer")
        if plan is None:
            plan = build_window_plan(layout, self.ratio, overlap=True)
        x_TD = x_TD.detach()
        t = x_TD.shape[0]
        q_THD = self.wq_b(self.wq_a(x_TD)).view(t, self.n_heads, self.head_dim)
        q_THD = rope(q_THD, positions_T) @ self.hadamard
        k_PD = self.compressor(x_TD, layout=layout, rope=rope, plan=plan)
        return self._topk(
            q_THD,
            self.weights_proj(x_TD),
            k_PD,
            lo_T=plan.lo_T,
            hi_T=plan.hi_T,
            topk=self.topk,
            chunk=self.chunk,
            scale=self.scale,
        )
