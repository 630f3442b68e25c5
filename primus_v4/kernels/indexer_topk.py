"""Lightning-indexer scores and an exact chunked running top-k: the torch reference.

Legend: T = query rows, H = indexer heads, D = indexer head dim, P = compressed keys, K = top-k,
C = query rows in one chunk, J = key columns in one step.

score[t, j] = scale * sum_h w[t, h] * relu(q[t, h] . k[j]), defined only for lo[t] <= j < hi[t]
(the query's own-sample visible keys; everything else is -inf and never selected). Order is
(score descending, key index ascending). To make that order tie-free and cheap, each candidate
becomes one int64 key: the float32 score mapped to an order-preserving int32 in the high half,
(2^32 - 1 - index) in the low half. Keys are scored `chunk` columns at a time and the running
top-k is `topk(running ++ step)`; unique keys make this exactly the one-shot top-k, ties included.
Missing slots (fewer visible keys than K) are index -1. Selection runs without autograd.
"""

from __future__ import annotations

import torch

ROW_ELEMS = 1 << 22  # query rows per chunk x heads x key columns per step (~16 MiB float32)
# A row chunk scores the union of its rows' key ranges, which spans every sample the chunk
# touches; few rows keep that rectangle close to the visible keys (cost ~ sum of visible keys).
ROWS_MAX = 256


LOW = (1 << 32) - 1


def _ordered_int(v: torch.Tensor) -> torch.Tensor:
    """float32 -> int64 with the same order (-0.0 and +0.0 map to one value)."""
    bits = (v.float() + 0.0).view(torch.int32)
    return torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(torch.long)


NEG_INF_KEY = int(_ordered_int(torch.tensor([float("-inf")])))


@torch.no_grad()
def indexer_topk_torch(
    q_THD: torch.Tensor,
    w_TH: torch.Tensor,
    k_PD: torch.Tensor,
    *,
    lo_T: torch.Tensor,
    hi_T: torch.Tensor,
    topk: int,
    chunk: int,
    scale: float,
    row_elems: int = ROW_ELEMS,
) -> torch.Tensor:
    """Indices [T, topk] (int64) of each query's best visible keys, best first, -1 padded."""
    t, h, _ = q_THD.shape
    idx_TK = torch.full((t, topk), -1, dtype=torch.long, device=q_THD.device)
    if t == 0 or topk == 0 or k_PD.shape[0] == 0:
        return idx_TK
    chunk = max(1, min(chunk, k_PD.shape[0]))  # no step is wider than the pool
    rows = max(1, min(ROWS_MAX, row_elems // (h * chunk)))
    for a in range(0, t, rows):
        lo, hi = lo_T[a : a + rows, None], hi_T[a : a + rows, None]
        # Scores in float32 whatever the input dtype (as HF computes them): a bf16 product and
        # head sum would round scores to 8 bits, and near-equal keys would then swap places in
        # the top-k by rounding alone. Row chunks keep the float32 copies small.
        q_XD = q_THD[a : a + rows].flatten(0, 1).float()
        w = w_TH[a : a + rows, :, None].float() * scale
        run_CK = torch.full((w.shape[0], topk), torch.iinfo(torch.long).min, device=w.device)
        for c0 in range(int(lo.min()), int(hi.max()), chunk):
            c1 = min(c0 + chunk, int(hi.max()))
            cols_J = torch.arange(c0, c1, device=q_XD.device)
            s_CHJ = (q_XD @ k_PD[c0:c1].float().T).view(w.shape[0], h, -1).relu_()
            s_CJ = (s_CHJ * w).sum(1)
            s_CJ = s_CJ.masked_fill((cols_J < lo) | (cols_J >= hi), float("-inf"))
            key_CJ = (_ordered_int(s_CJ) << 32) | (LOW - cols_J)
            run_CK = torch.cat((run_CK, key_CJ), 1).topk(topk, dim=1, sorted=True).values
        col_CK = LOW - (run_CK & LOW)
        idx_TK[a : a + rows] = col_CK.masked_fill((run_CK >> 32) <= NEG_INF_KEY, -1)
    return idx_TK
