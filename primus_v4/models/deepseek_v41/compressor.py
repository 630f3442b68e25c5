"""V4.1 compressed caches: per-sample pools of ratio 2 (gated pairs) or 1 (every row), and the
index keys derived from their latent.

Legend: T = rows of the pack, D = head dim, P = compressed positions of the pack, R = ratio,
N = samples (segments), I = index head dim.

A sample of length L starting at row c yields floor(L / R) positions; position j pools rows
c + jR .. c + jR + R - 1 and sits at in-sample position jR for RoPE. Query row t at in-sample
position u sees the sample's positions j < (u + 1) // R (complete groups only). The pools of all
samples are concatenated in sample order, so a row of the pack only ever indexes its own
sample's range [pool_start_T, pool_start_T + visible_T). Nothing here mixes samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from primus_v4.models.common.lora import float32_linear
from primus_v4.models.deepseek_v4.layout import RowLayout
from primus_v4.models.deepseek_v4.norm import RMSNorm


@dataclass(frozen=True, kw_only=True)
class PoolPlan:
    """Where every compressed position of one ratio comes from, and what each row sees.

    group_rows_PR: rows pooled into each position; pos_P: its in-sample RoPE position jR.
    seg_start_N, seg_len_N, pool_start_N, pool_len_N: per sample (segment) of the pack.
    pool_start_T, visible_T: per row, its sample's first pool index and how many it sees.
    """

    ratio: int
    group_rows_PR: torch.Tensor
    pos_P: torch.Tensor
    seg_start_N: torch.Tensor
    seg_len_N: torch.Tensor
    pool_start_N: torch.Tensor
    pool_len_N: torch.Tensor
    pool_start_T: torch.Tensor
    visible_T: torch.Tensor

    @classmethod
    def build(cls, layout: RowLayout, ratio: int, device: torch.device) -> PoolPlan:
        if layout.comm.size != 1:
            raise NotImplementedError(
                "DeepSeek-V4.1 compressed caches need the whole pack on one rank (CP size 1)"
            )
        cu = layout.cu_seqlens.to(device)
        start_N, len_N = cu[:-1], cu[1:] - cu[:-1]
        pool_len_N = len_N // ratio
        pool_start_N = torch.cumsum(pool_len_N, 0) - pool_len_N
        seg_P = torch.repeat_interleave(torch.arange(len(len_N), device=device), pool_len_N)
        j_P = torch.arange(int(pool_len_N.sum()), device=device) - pool_start_N[seg_P]
        first_P = start_N[seg_P] + j_P * ratio
        rows_T = torch.arange(layout.local_rows, device=device)
        seg_T = torch.searchsorted(cu, rows_T, right=True) - 1
        inpos_T = rows_T - start_N[seg_T]
        return cls(
            ratio=ratio,
            group_rows_PR=first_P[:, None] + torch.arange(ratio, device=device),
            pos_P=j_P * ratio,
            seg_start_N=start_N,
            seg_len_N=len_N,
            pool_start_N=pool_start_N,
            pool_len_N=pool_len_N,
            pool_start_T=pool_start_N[seg_T],
            visible_T=(inpos_T + 1) // ratio,
        )


class Compressor(nn.Module):
    """[T, hidden] -> pool latent [P, D] before RoPE (the index keys read it unrotated).

    Ratio 2: kv = wkv(x), score = wgate(x) in float32; softmax over each pair, per channel;
    weighted sum; RMSNorm. Ratio 1: RMSNorm(wkv(x)) of every row, no gate."""

    def __init__(self, hidden: int, head_dim: int, *, ratio: int, eps: float) -> None:
        super().__init__()
        self.ratio = ratio
        self.wkv = nn.Linear(hidden, head_dim, bias=False)
        self.wgate = nn.Linear(hidden, head_dim, bias=False) if ratio > 1 else None
        self.norm = RMSNorm(head_dim, eps)

    def forward(self, x_TD: torch.Tensor, plan: PoolPlan) -> torch.Tensor:
        if self.wgate is None:
            return self.norm(self.wkv(x_TD.index_select(0, plan.group_rows_PR[:, 0])))
        x32 = x_TD.float()
        kv_TD = float32_linear(self.wkv, x32)  # LoRA adapters (common/lora.py) included
        score_TD = float32_linear(self.wgate, x32)
        rows = plan.group_rows_PR
        kv_PRD, score_PRD = kv_TD[rows], score_TD[rows]
        pooled = (kv_PRD * score_PRD.softmax(dim=1)).sum(dim=1)
        return self.norm(pooled.to(x_TD.dtype))


class IndexKeys(nn.Module):
    """Index keys of a pool: RMSNorm(wk(latent)) [P, I], RoPE'd on the last rope dims at the
    position's jR (the attention's compressed RoPE)."""

    def __init__(self, head_dim: int, index_dim: int, *, eps: float) -> None:
        super().__init__()
        self.wk = nn.Linear(head_dim, index_dim, bias=False)
        self.k_norm = RMSNorm(index_dim, eps)

    def forward(self, latent_PD: torch.Tensor, rope: nn.Module, pos_P: torch.Tensor):
        return rope(self.k_norm(self.wk(latent_PD)), pos_P)
