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
import torch.nn.functional as F
from torch import nn

from primus_v4.models.common.lora import float32_linear
from primus_v4.models.deepseek_v4.layout import RowLayout, SeqComm
from primus_v4.models.deepseek_v4.norm import RMSNorm


@dataclass(frozen=True, kw_only=True)
class PoolPlan:
    """Where every compressed position of one ratio comes from, and what each row sees.

    The pool is always the whole pack's, in sample order (so selections index the same positions
    on every layout); under context parallelism each rank pools the groups whose LAST row it
    holds (`group_rows_PR`, in rows of [halo rows from the previous rank ++ local rows]) and
    `gather` assembles the pack's pool from every rank's block.
    group_rows_PR: rows pooled into each of this rank's positions; pos_P: every position's
    in-sample RoPE position jR. pool_start_N, pool_len_N: per sample (segment), its pool range;
    seg_start_N, seg_len_N: its rows on this rank (local, clipped to [0, T)).
    pool_start_T, visible_T: per local row, its sample's first pool index and how many it sees.
    halo: rows taken from the previous rank (ratio - 1 under CP, else 0); slot_P: each
    position's row in the gathered [cp x T] blocks.
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
    comm: SeqComm
    halo: int
    slot_P: torch.Tensor

    @classmethod
    def build(cls, layout: RowLayout, ratio: int, device: torch.device) -> PoolPlan:
        comm, t, g0 = layout.comm, layout.local_rows, layout.global_start
        cu = layout.cu_seqlens.to(device)
        start_N, len_N = cu[:-1], cu[1:] - cu[:-1]
        pool_len_N = len_N // ratio
        pool_start_N = torch.cumsum(pool_len_N, 0) - pool_len_N
        seg_P = torch.repeat_interleave(torch.arange(len(len_N), device=device), pool_len_N)
        j_P = torch.arange(int(pool_len_N.sum()), device=device) - pool_start_N[seg_P]
        first_P = start_N[seg_P] + j_P * ratio
        last_P = first_P + ratio - 1  # a position belongs to the rank holding its last row
        owner_P = torch.div(last_P, t, rounding_mode="floor")
        slot_P = owner_P * t + torch.arange(len(last_P), device=device)
        slot_P -= torch.searchsorted(last_P, owner_P * t)
        mine = owner_P == comm.rank
        halo = ratio - 1 if comm.size > 1 else 0
        rows_T = g0 + torch.arange(t, device=device)
        seg_T = torch.searchsorted(cu, rows_T, right=True) - 1
        inpos_T = rows_T - start_N[seg_T]
        lo_N = (start_N - g0).clamp(0, t)
        return cls(
            ratio=ratio,
            group_rows_PR=(first_P[mine] - g0 + halo)[:, None] + torch.arange(ratio, device=device),
            pos_P=j_P * ratio,
            seg_start_N=lo_N,
            seg_len_N=(start_N + len_N - g0).clamp(0, t) - lo_N,
            pool_start_N=pool_start_N,
            pool_len_N=pool_len_N,
            pool_start_T=pool_start_N[seg_T],
            visible_T=(inpos_T + 1) // ratio,
            comm=comm,
            halo=halo,
            slot_P=slot_P,
        )

    def local_input(self, x_TX: torch.Tensor) -> torch.Tensor:
        """[halo rows of the previous rank ++ local rows]: what `group_rows_PR` indexes."""
        if not self.halo:
            return x_TX
        return torch.cat([self.comm.left_rows(x_TX, self.halo), x_TX])

    def gather(self, mine_PX: torch.Tensor) -> torch.Tensor:
        """This rank's positions -> the pack's pool (sample order); backward sums over ranks."""
        if self.comm.size == 1:
            return mine_PX
        t = len(self.visible_T)  # a rank owns at most T positions (one per last row)
        block = F.pad(mine_PX, (0, 0, 0, t - mine_PX.shape[0]))
        return self.comm.gather_rows(block).index_select(0, self.slot_P)


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
        return plan.gather(self._pool(plan.local_input(x_TD), plan.group_rows_PR))

    def _pool(self, x_TD: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        if self.wgate is None:
            return self.norm(self.wkv(x_TD.index_select(0, rows[:, 0])))
        x32 = x_TD.float()
        kv_TD = float32_linear(self.wkv, x32)  # LoRA adapters (common/lora.py) included
        score_TD = float32_linear(self.wgate, x32)
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
