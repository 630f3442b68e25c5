"""V4.1 attention: a sliding window plus the selected positions of a shared compressed cache.

Legend: T = rows of the pack, D = head dim, H = heads, Q = q-LoRA rank, P = pool positions,
K = index top-k, W = sliding window, N = key-buffer rows (W - 1 + T + P).

Math (docs/DESIGN.md section 13): q = wq_b(q_norm(wq_a(x))) with no per-head norm; window KV =
kv_norm(wkv(x)); RoPE on the last rope dims (layers with a compressed branch: compressed theta
with YaRN for q, window KV, compressed KV and index; window-only layers: base theta, no YaRN);
one softmax over the window rows, the selected compressed positions and the per-head sink;
inverse RoPE on the output; grouped `wo_a`, then `wo_b` (DeepSeek-V4's output path).
Sharing (`SharedCache`, handed from layer to layer in one forward): a kv source compresses its
own KV (and index keys); an index source selects top-k positions; every other layer with a
compressed branch reuses the latest source's cache and selection.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from primus_v4 import kernels
from primus_v4.models.common.recompute import DiscardedPart, selected
from primus_v4.models.deepseek_v4.attention import Attention as V4Attention
from primus_v4.models.deepseek_v4.layout import RowLayout, require_layout
from primus_v4.models.deepseek_v4.rope import RotaryEmbedding
from primus_v4.models.deepseek_v41 import fake_quant
from primus_v4.models.deepseek_v41.compressor import Compressor, IndexKeys, PoolPlan
from primus_v4.models.deepseek_v41.config import LAYER_KINDS, DeepseekV41Config
from primus_v4.models.deepseek_v41.indexer import Indexer


@dataclass(frozen=True, kw_only=True)
class SharedCache:
    """What one forward hands down the layers (every field per pack, all samples at once).

    plans: ratio -> PoolPlan; pool_kv_PD: the latest kv source's RoPE'd compressed KV;
    keys_PI: its index keys; selection_TK: the latest index source's pool indices (-1 = none);
    candidates_TB: the candidate source's kept blocks per row (-1 = none)."""

    plans: dict[int, PoolPlan]
    pool_kv_PD: torch.Tensor | None = None
    keys_PI: torch.Tensor | None = None
    selection_TK: torch.Tensor | None = None
    candidates_TB: torch.Tensor | None = None


class Attention(V4Attention):
    """[T, hidden] -> [T, hidden] for one V4.1 layer; returns the updated `SharedCache`.

    Reuses DeepSeek-V4's window ranges, sparse-attention core, inverse RoPE and grouped output
    projection (and so its LoRA and kept-base hooks); its own constructor builds the V4.1 parts,
    since V4's builds V4's compressor and indexer kinds."""

    def __init__(self, cfg: DeepseekV41Config, *, layer_idx: int) -> None:
        nn.Module.__init__(self)
        ratio = cfg.compress_ratios[layer_idx]
        self.kind, self.layer_idx, self.ratio = LAYER_KINDS[ratio], layer_idx, ratio
        self.window = cfg.attn_sliding_window
        self._projections(cfg)
        d, dh = self.head_dim, cfg.hidden_size
        self.rope = RotaryEmbedding(cfg, compressed=ratio > 0)
        self.kv_source = layer_idx in cfg.kv_source_layer_ids
        self.compressor = self.index_keys = self.indexer = None
        if self.kv_source:
            self.compressor = Compressor(dh, d, ratio=ratio, eps=self.eps)
            self.index_keys = IndexKeys(d, cfg.index_head_dim, eps=self.eps)
        if layer_idx in cfg.index_source_layer_ids:
            self.indexer = Indexer(
                hidden=dh,
                q_lora=cfg.q_lora_rank,
                heads=cfg.index_n_heads,
                dim=cfg.index_head_dim,
                topk=cfg.index_topk,
            )
        cand = cfg.candidate_source_layer_id
        self.make_candidates = None
        if layer_idx == cand:
            self.make_candidates = (cfg.candidate_topk_blocks, cfg.candidate_block_size)
        self.use_candidates = self.indexer is not None and 0 <= cand < layer_idx
        self.block_size = cfg.candidate_block_size
        self.fake_quant = cfg.activation_fake_quant
        self._attend = kernels.resolve("sparse_attention")
        self.recompute = selected(cfg)

    def _q_up(self, qr_TQ: torch.Tensor, positions_T: torch.Tensor) -> torch.Tensor:
        """Rotated q [T, H, D] from the q-LoRA latent: no per-head norm in V4.1."""
        q_THD = self.wq_b(qr_TQ).view(qr_TQ.shape[0], self.n_heads, self.head_dim)
        return self.rope(q_THD, positions_T)

    def _compressed(
        self,
        x_TD: torch.Tensor,
        qr_TQ: torch.Tensor,
        positions_T: torch.Tensor,
        shared: SharedCache,
    ) -> SharedCache:
        """The layer's shared cache after its own compression and selection (if a source)."""
        plan = shared.plans[self.ratio]
        if self.compressor is not None:
            latent_PD = self.compressor(x_TD, plan)
            with torch.no_grad():
                keys = self.index_keys(latent_PD, self.rope, plan.pos_P)
                keys = fake_quant.fp4_index(keys) if self.fake_quant else keys
            pool = self.rope(latent_PD, plan.pos_P)
            pool = fake_quant.fp4_kv(pool) if self.fake_quant else pool
            shared = replace(shared, pool_kv_PD=pool, keys_PI=keys)
        if self.indexer is not None:
            sel_TK, cand_TB = self.indexer.select(
                x_TD,
                qr_TQ,
                shared.keys_PI,
                plan=plan,
                rope=self.rope,
                positions_T=positions_T,
                candidates=(shared.candidates_TB, self.block_size) if self.use_candidates else None,
                make_candidates=self.make_candidates,
                fake_quant=self.fake_quant,
            )
            shared = replace(shared, selection_TK=sel_TK)
            if cand_TB is not None:
                shared = replace(shared, candidates_TB=cand_TB)
        return shared

    def forward(  # type: ignore[override]
        self,
        x_TD: torch.Tensor,
        *,
        positions_T: torch.Tensor,
        layout: RowLayout,
        shared: SharedCache,
    ) -> tuple[torch.Tensor, SharedCache]:
        layout = require_layout(layout, f"Attention(layer {self.layer_idx}, {self.kind})")
        self._check(x_TD, positions_T, layout)
        qr_TQ = self.q_norm(self.wq_a(x_TD))
        up = self._q_up
        if "mla_up_proj" in self.recompute:
            up = DiscardedPart(self._q_up, params=list(self.wq_b.parameters()))
        q_THD = up(qr_TQ, positions_T)
        kv_TD = self.rope(self.kv_norm(self.wkv(x_TD)), positions_T)
        if self.fake_quant:
            kv_TD = fake_quant.fp8_window(kv_TD)
        parts = [layout.comm.left_rows(kv_TD, self.window - 1), kv_TD]
        lo_T, hi_T = self._window_ranges(layout)
        idx_TK = None
        if self.ratio:
            shared = self._compressed(x_TD, qr_TQ, positions_T, shared)
            parts.append(shared.pool_kv_PD)
            off = self.window - 1 + layout.local_rows  # pool rows follow the local rows
            sel_TK = shared.selection_TK
            idx_TK = torch.where(sel_TK >= 0, sel_TK + off, -1)
        core = DiscardedPart(self._core) if "core_attn" in self.recompute else self._core
        o_GTI = core(q_THD, torch.cat(parts, dim=0), self.attn_sink, lo_T[:, None], hi_T[:, None],
                     idx_TK, positions_T)  # fmt: skip
        y_GTR, out_TD = self._project(o_GTI)
        for part in (up, core):
            if isinstance(part, DiscardedPart):
                part.discard(after=y_GTR)
        return out_TD, shared
