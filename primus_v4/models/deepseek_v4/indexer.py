"""Lightning indexer (CSA layers): picks, for every query, the top-k compressed keys to attend to.

Legend: T = rows on this rank, Dh = hidden, Q = q_lora rank, H = indexer heads, D = indexer head
dim, P = compact compressed windows of the pack, K = top-k.

- Queries: `wq_b` (Q -> H x D) applied to the attention's q-LoRA latent `qr = q_norm(wq_a(x))`
  (the release has no indexer `wq_a`), RoPE (the layer's compressed-theta YaRN rotary) at the
  row's in-sample position.
- Keys: the indexer's own overlap compressor (ratio 4, width D) with RoPE at the window's first
  position g * r (compressor.py).
- Scores: scale * sum_h w[t, h] * relu(q[t, h] . k[j]) with per-head weights w = hidden -> H and
  scale = H^-1/2 * D^-1/2, only over the query's own-sample complete windows; top-k as HF
  takes it for samples up to 4096 windows (one row over the sample, torch.topk: equal scores
  resolve as there), an exact chunked running top-k beyond (kernels/indexer_topk.py); -1 where
  a query has fewer than K visible keys.
  DeepSeek's inference code also applies a Hadamard rotation to q and k before simulating FP4
  quantization; the rotation is orthonormal, so without quantization the scores are unchanged
  and it is left out (as in HF transformers).
- Training: top-k is discrete and there is no distillation loss, so nothing could train the
  indexer; it reads detached inputs, runs without autograd, and its parameters are frozen
  (requires_grad False) so optimizers and DDP skip them.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from primus_v4 import kernels
from primus_v4.models.deepseek_v4.compressor import Compressor, WindowPlan, build_window_plan
from primus_v4.models.deepseek_v4.config import DeepseekV4Config
from primus_v4.models.deepseek_v4.layout import RowLayout, require_layout
from primus_v4.models.deepseek_v4.rope import RotaryEmbedding


class Indexer(nn.Module):
    """hidden [T, Dh] + q-LoRA latent [T, Q] -> selected compact window ids [T, K] (int64, -1 =
    none)."""

    def __init__(self, cfg: DeepseekV4Config, *, ratio: int) -> None:
        super().__init__()
        h, d = cfg.index_n_heads, cfg.index_head_dim
        if cfg.qk_pos_emb_head_dim > d:
            raise ValueError(f"index_head_dim {d} is narrower than the rope dim")
        self.n_heads, self.head_dim, self.ratio = h, d, ratio
        self.topk, self.chunk = cfg.index_topk, cfg.index_topk_chunk
        self.scale = 1.0 / math.sqrt(h * d)
        self.wq_b = nn.Linear(cfg.q_lora_rank, h * d, bias=False)
        self.weights_proj = nn.Linear(cfg.hidden_size, h, bias=False)
        self.compressor = Compressor(
            cfg.hidden_size,
            d,
            ratio=ratio,
            overlap=True,
            eps=cfg.layernorm_epsilon,
            init_std=cfg.init_method_std,
        )
        for lin in (self.wq_b, self.weights_proj):
            nn.init.normal_(lin.weight, std=cfg.init_method_std)
        self.requires_grad_(False)
        self._topk = kernels.resolve("indexer_topk")

    @torch.no_grad()
    def forward(
        self,
        x_TD: torch.Tensor,
        qr_TQ: torch.Tensor,
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
        q_THD = self.wq_b(qr_TQ.detach()).view(t, self.n_heads, self.head_dim)
        q_THD = rope(q_THD, positions_T)
        k_PD = self.compressor(x_TD, layout=layout, rope=rope, plan=plan)
        return self._topk(
            q_THD,
            self.weights_proj(x_TD),
            k_PD,
            lo_T=plan.lo_T,
            hi_T=plan.hi_T,
            end_T=plan.end_T,
            topk=self.topk,
            chunk=self.chunk,
            scale=self.scale,
        )
