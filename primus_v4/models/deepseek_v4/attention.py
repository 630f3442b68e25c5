"""DeepSeek-V4 attention: dense sliding window, HCA and CSA in one module, strictly per sample.

Legend: T = rows on this rank, Dh = hidden, H = heads, D = head dim (= kv_channels), Q = q_lora
rank, G = output groups, O = o_lora rank, W = sliding window, P = compact compressed windows of
the pack, K = indexer top-k, N = key-buffer rows (W - 1 boundary + T local + P compressed).

Math (docs/DESIGN.md section 5):
- q: hidden -> Q -> RMSNorm -> H x D, then a parameter-free RMS norm per head.
- kv: one latent hidden -> D -> RMSNorm, used as both key and value (single-KV-head MQA).
- RoPE (rope.py) on the last rope-dim channels of q and kv at `positions_T`; dense layers use
  `rotary_base`, CSA/HCA use `compress_rope_theta` with YaRN. Compressed keys are rotated at their
  window's first in-sample position g * ratio (compressor.py), packed or alone alike.
- Scores q.k / sqrt(D) over the query's candidate keys plus a learned per-head sink logit (value 0)
  in one softmax; the output's rope channels are rotated back by -position (values carry rotated
  keys); grouped low-rank output: H*D -> G groups of H*D/G -> O each -> G*O -> Dh.
Candidate keys (all in the query's own sample; the layout, not `positions_T`, defines samples):
- every kind: sliding window, the query row and the W-1 rows before it, clipped at its sample start;
- HCA (ratio 128): plus every complete ratio-128 window of its sample (non-overlap compressor);
- CSA (ratio 4): plus the top-k complete ratio-4 windows of its sample chosen by the indexer
  (overlap compressor; the indexer reads x and the q-LoRA latent detached and is frozen, see
  indexer.py).
Candidates are key-buffer row ranges and indices handed to the `sparse_attention` kernel, which
works in row chunks: no [T, T] tensor exists and memory is O(T * (W + K + visible pool)).
Context parallel: window keys of the previous rank arrive as `comm.left_rows(kv, W - 1)` (post-RoPE
rows; zeros at CP = 1, never visible across a sample start), pools are gathered by the compressor.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from primus_v4 import kernels
from primus_v4.errors import ConfigError
from primus_v4.models.common.kept_base import ReleaseWeight, frozen_grouped
from primus_v4.models.common.lora import base_value
from primus_v4.models.common.recompute import DiscardedPart, selected
from primus_v4.models.deepseek_v4.compressor import Compressor, build_window_plan
from primus_v4.models.deepseek_v4.config import LAYER_KINDS, DeepseekV4Config
from primus_v4.models.deepseek_v4.indexer import Indexer
from primus_v4.models.deepseek_v4.layout import RowLayout, require_layout
from primus_v4.models.deepseek_v4.norm import RMSNorm, rms_norm
from primus_v4.models.deepseek_v4.rope import RotaryEmbedding


class Attention(nn.Module):
    """[T, Dh] -> [T, Dh] for one decoder (or MTP) layer of kind dense / CSA / HCA."""

    def __init__(self, cfg: DeepseekV4Config, *, compress_ratio: int, layer_idx: int) -> None:
        super().__init__()
        if compress_ratio not in LAYER_KINDS:
            raise ConfigError(f"layer {layer_idx}: compress ratio {compress_ratio} not in 0/4/128")
        self.kind = LAYER_KINDS[compress_ratio]
        self.layer_idx, self.ratio = layer_idx, compress_ratio
        self.window = cfg.attn_sliding_window
        if self.window < 1:
            raise ConfigError(f"attn_sliding_window must be >= 1, got {self.window}")
        self._projections(cfg)
        d, dh = self.head_dim, cfg.hidden_size
        self.rope = RotaryEmbedding(cfg, compressed=compress_ratio > 0)
        self.compressor = self.indexer = None
        if compress_ratio:
            self.compressor = Compressor(
                dh,
                d,
                ratio=compress_ratio,
                overlap=self.kind == "csa",
                eps=self.eps,
                init_std=cfg.init_method_std,
            )
        if self.kind == "csa":
            self.indexer = Indexer(cfg, ratio=compress_ratio)
        for lin in (self.wq_a, self.wq_b, self.wkv, self.wo_b):
            nn.init.normal_(lin.weight, std=cfg.init_method_std)
        self.init_weights(cfg.init_method_std)
        self._attend = kernels.resolve("sparse_attention")
        self.recompute = selected(cfg)  # mla_up_proj / core_attn (recompute.py)

    def _projections(self, cfg: DeepseekV4Config) -> None:
        """q-LoRA, the KV latent, the grouped output projection and the sinks (every kind)."""
        h, d, dh = cfg.num_attention_heads, cfg.kv_channels, cfg.hidden_size
        self.n_heads, self.head_dim, self.eps = h, d, cfg.layernorm_epsilon
        self.scale = 1.0 / math.sqrt(d)
        self.wq_a = nn.Linear(dh, cfg.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(cfg.q_lora_rank, self.eps)
        self.wq_b = nn.Linear(cfg.q_lora_rank, h * d, bias=False)
        self.wkv = nn.Linear(dh, d, bias=False)
        self.kv_norm = RMSNorm(d, self.eps)
        g = self.n_groups = cfg.o_groups
        # 64 heads x 512 / 8 groups = 4096 inputs per group, each projected to o_lora_rank.
        self.wo_a = nn.Parameter(torch.empty(g, cfg.o_lora_rank, h * d // g))
        self.wo_b = nn.Linear(g * cfg.o_lora_rank, dh, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(h)) if cfg.attn_sink else None
        self.wo_a_lora: nn.Module | None = None  # LoRA on wo_a's groups (lora.py), when added
        self.wo_a_release: ReleaseWeight | None = None  # wo_a kept as released (common/kept_base)

    @torch.no_grad()
    def init_weights(self, std: float) -> None:
        """Parameters that are not nn.Linear/norm weights (the model inits those): the grouped
        output matrix N(0, std) and the sink logits 0 (the sink starts as one extra zero logit)."""
        nn.init.normal_(self.wo_a, std=std)
        if self.attn_sink is not None:
            nn.init.zeros_(self.attn_sink)

    def _check(self, x_TD: torch.Tensor, positions_T: torch.Tensor, layout: RowLayout) -> None:
        where = f"Attention(layer {self.layer_idx}, {self.kind})"
        if x_TD.dim() != 2 or x_TD.shape[0] != layout.local_rows:
            raise ValueError(
                f"{where}: x must be [T, hidden] with T = layout.local_rows = {layout.local_rows}, "
                f"got {tuple(x_TD.shape)} (the model squeezes the micro-batch of 1)"
            )
        if positions_T.shape != (layout.local_rows,):
            raise ValueError(f"{where}: positions must be [T], got {tuple(positions_T.shape)}")

    def _q_up(self, qr_TQ: torch.Tensor, positions_T: torch.Tensor) -> torch.Tensor:
        """Rotated q [T, H, D] from the q-LoRA latent (the `mla_up_proj` part)."""
        q_THD = self.wq_b(qr_TQ).view(qr_TQ.shape[0], self.n_heads, self.head_dim)
        return self.rope(rms_norm(q_THD, None, self.eps), positions_T)

    def _qkv(self, x_TD: torch.Tensor, positions_T: torch.Tensor):
        """Rotated q [T, H, D], rotated kv [T, D] and the q-LoRA latent qr [T, Q] (the indexer's
        query input)."""
        qr_TQ = self.q_norm(self.wq_a(x_TD))
        kv_TD = self.rope(self.kv_norm(self.wkv(x_TD)), positions_T)
        return self._q_up(qr_TQ, positions_T), kv_TD, qr_TQ

    def _window_ranges(self, layout: RowLayout) -> tuple[torch.Tensor, torch.Tensor]:
        """Key-buffer range [lo, hi) of each row's window: itself and W-1 rows back, own sample."""
        row_T = torch.arange(layout.local_rows, device=layout.seq_start_T.device)
        back = self.window - 1  # boundary rows precede the local rows in the key buffer
        lo_T = torch.maximum(row_T - back, layout.seq_start_T) + back
        return lo_T, row_T + 1 + back

    def _groups(self, o_THD: torch.Tensor, positions_T: torch.Tensor) -> torch.Tensor:
        """[G, T, H*D/G]: the rope channels rotated back by -position, split by output group."""
        o_THD = self.rope(o_THD, positions_T, inverse=True)
        return o_THD.reshape(o_THD.shape[0], self.n_groups, -1).transpose(0, 1).contiguous()

    def _core(self, q_THD, kv_ND, sink_H, lo_TR, hi_TR, idx_TK, positions_T) -> torch.Tensor:
        """Sparse attention, output split into groups (the `core_attn` part)."""
        o_THD = self._attend(q_THD, kv_ND, sink_H, lo_TR=lo_TR, hi_TR=hi_TR, idx_TK=idx_TK,
                             scale=self.scale)  # fmt: skip
        return self._groups(o_THD, positions_T)

    def _project(self, o_GTI: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Grouped low-rank output: each group's H*D/G channels -> o_lora, then all -> hidden;
        returns ([G, T, O] after the first map, [T, hidden])."""
        lora = self.wo_a_lora
        if lora is not None and lora.release_rounding is not None:  # quantization-aware LoRA
            w_GRI = lora.served(base_value(self, "wo_a")).to(o_GTI.dtype)
            y_GTR = torch.bmm(o_GTI, w_GRI.transpose(1, 2))
            return y_GTR, self.wo_b(y_GTR.transpose(0, 1).flatten(1))
        if self.wo_a_release is not None:
            y_GTR = frozen_grouped(o_GTI, self.wo_a_release)
        else:
            y_GTR = torch.bmm(o_GTI, self.wo_a.transpose(1, 2))
        if self.wo_a_lora is not None:
            y_GTR = y_GTR + self.wo_a_lora(o_GTI)
        return y_GTR, self.wo_b(y_GTR.transpose(0, 1).flatten(1))

    def _output(self, o_THD: torch.Tensor, positions_T: torch.Tensor) -> torch.Tensor:
        return self._project(self._groups(o_THD, positions_T))[1]

    def forward(
        self, x_TD: torch.Tensor, *, positions_T: torch.Tensor, layout: RowLayout
    ) -> torch.Tensor:
        layout = require_layout(layout, f"Attention(layer {self.layer_idx}, {self.kind})")
        self._check(x_TD, positions_T, layout)
        qr_TQ = self.q_norm(self.wq_a(x_TD))
        up = self._q_up
        if "mla_up_proj" in self.recompute:
            up = DiscardedPart(self._q_up, params=list(self.wq_b.parameters()))  # + adapters
        q_THD = up(qr_TQ, positions_T)
        kv_TD = self.rope(self.kv_norm(self.wkv(x_TD)), positions_T)
        parts = [layout.comm.left_rows(kv_TD, self.window - 1), kv_TD]
        lo_T, hi_T = self._window_ranges(layout)
        lo_TR, hi_TR, idx_TK = lo_T[:, None], hi_T[:, None], None
        if self.compressor is not None:
            plan = build_window_plan(layout, self.ratio, overlap=self.kind == "csa")
            parts.append(self.compressor(x_TD, layout=layout, rope=self.rope, plan=plan))
            off = self.window - 1 + layout.local_rows  # pool rows follow the local rows
            if self.indexer is None:  # HCA: the whole visible pool of the sample
                lo_TR = torch.stack((lo_T, plan.lo_T + off), 1)
                hi_TR = torch.stack((hi_T, plan.hi_T + off), 1)
            else:  # CSA: the indexer's top-k of the visible pool
                sel_TK = self.indexer(
                    x_TD, qr_TQ, positions_T=positions_T, layout=layout, rope=self.rope, plan=plan
                )
                idx_TK = torch.where(sel_TK >= 0, sel_TK + off, -1)
        core = DiscardedPart(self._core) if "core_attn" in self.recompute else self._core
        o_GTI = core(q_THD, torch.cat(parts, dim=0), self.attn_sink, lo_TR, hi_TR, idx_TK,
                     positions_T)  # fmt: skip
        y_GTR, out_TD = self._project(o_GTI)
        # Recompute q before the attention output (and its backward) needs it again.
        for part in (up, core):
            if isinstance(part, DiscardedPart):
                part.discard(after=y_GTR)
        return out_TD
