"""V4.1 indexer: top-k compressed positions per query, with the optional two-level candidates.

Legend: T = rows of the pack, Q = q-LoRA rank, H = index heads, I = index head dim,
P = pool positions of one sample, K = index top-k, B = candidate blocks kept, C = row chunk.

score(t, p) = sum_h relu(q_th . k_p) * w_th, w = weights_proj(x) * I^-0.5 * H^-0.5, over the
query's own sample's visible positions p < visible_t (others -inf). The candidate source keeps,
per query, the `candidate_topk_blocks` blocks of `candidate_block_size` positions with the highest
max score (always the block of its newest position); a later index source masks scores outside
them. top-k takes min(K, P) entries of the sample's row, as the release's prefill does for a
document alone (same row, same ties), and drops those not visible. Selection is discrete: it runs
without autograd (the indexer gets no gradient, as in the release's training).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from primus_v4.models.deepseek_v41.compressor import PoolPlan
from primus_v4.models.deepseek_v41.fake_quant import fp4_index

SCORE_ELEMS = 1 << 22  # [C, H, P] float32 scores per chunk of query rows: ~16 MiB


class Indexer(nn.Module):
    """The query side (every index source) and, on kv sources, the index-key projection."""

    def __init__(self, *, hidden: int, q_lora: int, heads: int, dim: int, topk: int) -> None:
        super().__init__()
        self.heads, self.dim, self.topk = heads, dim, topk
        self.wq_b = nn.Linear(q_lora, heads * dim, bias=False)
        self.weights_proj = nn.Linear(hidden, heads, bias=False)

    @torch.no_grad()
    def select(
        self,
        x_TD: torch.Tensor,
        qr_TQ: torch.Tensor,
        keys_PI: torch.Tensor,
        *,
        plan: PoolPlan,
        rope: nn.Module,
        positions_T: torch.Tensor,
        candidates: tuple[torch.Tensor, int] | None,
        make_candidates: tuple[int, int] | None,
        fake_quant: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(pool indices [T, K] (-1 = none), candidate blocks [T, B] or None).

        candidates: (blocks [T, B] from the candidate source, block size) to restrict to;
        make_candidates: (blocks kept, block size) when this layer is the candidate source."""
        t = x_TD.shape[0]
        q_THI = self.wq_b(qr_TQ).view(t, self.heads, self.dim)
        q_THI = rope(q_THI, positions_T).float()
        if fake_quant:
            q_THI = fp4_index(q_THI)
        w_TH = self.weights_proj(x_TD).float() * (self.dim**-0.5 * self.heads**-0.5)
        keys = keys_PI.float()
        sel_TK = torch.full((t, self.topk), -1, dtype=torch.long, device=x_TD.device)
        cand_TB = None
        if make_candidates is not None:
            cand_TB = torch.full((t, make_candidates[0]), -1, dtype=torch.long, device=x_TD.device)
        for s in range(len(plan.seg_len_N)):
            n_pool = int(plan.pool_len_N[s])
            if n_pool == 0:
                continue
            c0, c1 = int(plan.seg_start_N[s]), int(plan.seg_start_N[s] + plan.seg_len_N[s])
            p0 = int(plan.pool_start_N[s])
            k_PI = keys[p0 : p0 + n_pool]
            step = max(1, SCORE_ELEMS // (self.heads * n_pool))
            for a in range(c0, c1, step):
                b = min(a + step, c1)
                score = torch.einsum("chi,pi->chp", q_THI[a:b], k_PI).relu_()
                score_CP = (score * w_TH[a:b, :, None]).sum(1)
                vis_C = plan.visible_T[a:b]
                hidden = torch.arange(n_pool, device=x_TD.device) >= vis_C[:, None]
                score_CP = score_CP.masked_fill(hidden, float("-inf"))
                if make_candidates is not None:
                    cand_TB[a:b] = candidate_blocks(score_CP, vis_C, *make_candidates)
                elif candidates is not None:
                    keep = candidate_mask(candidates[0][a:b], candidates[1], n_pool)
                    score_CP = score_CP.masked_fill(~keep, float("-inf"))
                k = min(self.topk, n_pool)
                idx_CK = score_CP.topk(k, dim=-1, sorted=False).indices.sort(dim=-1).values
                sel_TK[a:b, :k] = torch.where(idx_CK < vis_C[:, None], idx_CK + p0, -1)
        return sel_TK, cand_TB


def candidate_blocks(score_CP: torch.Tensor, visible_C: torch.Tensor, kept: int, size: int):
    """Level one: block ids [C, B] (-1 = none) with the highest max score; the block holding the
    newest visible position always kept; unreachable (-inf) blocks never."""
    width = score_CP.shape[-1]
    blocks = F.pad(score_CP, (0, -width % size), value=float("-inf"))
    blocks = blocks.unflatten(-1, (-1, size)).amax(dim=-1)
    n = blocks.shape[-1]
    last_C = torch.div(visible_C - 1, size, rounding_mode="floor")
    newest = torch.arange(n, device=score_CP.device) == last_C[:, None]
    blocks = blocks.masked_fill(newest, float("inf"))
    top = blocks.topk(min(kept, n), dim=-1)
    ids = torch.where(top.values > float("-inf"), top.indices, -1)
    if ids.shape[1] < kept:
        ids = F.pad(ids, (0, kept - ids.shape[1]), value=-1)
    return ids


def candidate_mask(blocks_CB: torch.Tensor, size: int, width: int) -> torch.Tensor:
    """[C, width] True at the positions of the kept blocks."""
    n = -(-width // size)
    keep = torch.zeros(blocks_CB.shape[0], n + 1, dtype=torch.bool, device=blocks_CB.device)
    keep.scatter_(1, torch.where(blocks_CB >= 0, blocks_CB, n), True)
    return keep[:, :n].repeat_interleave(size, dim=-1)[:, :width]
