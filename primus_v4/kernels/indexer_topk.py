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

Samples with at most `SAMPLE_ROW_MAX` windows (given `end_T`, one past the sample's last window)
select differently, as HF transformers and DeepSeek's inference code do: each query scores one
row over all of its sample's windows (those past its visible end -inf) and takes `torch.topk` of
min(K, windows). Which of several equal scores is kept is up to torch.topk's algorithm
(not the lowest index), and equal scores are common: a key whose every head's ReLU is zero
scores exactly 0 (probability 2^-H per key). The same row into the same comparison-based
selection keeps the same keys, so a sample's picks, and its logits, match HF's for the sample
alone, packed or not. Longer samples take the running top-k above (memory bounded by
`row_elems`, not by the sample): equal scores there go to the lowest index.
"""

from __future__ import annotations

import itertools

import torch

ROW_ELEMS = 1 << 22  # query rows per chunk x heads x key columns per step (~16 MiB float32)
# A row chunk scores the union of its rows' key ranges, which spans every sample the chunk
# touches; few rows keep that rectangle close to the visible keys (cost ~ sum of visible keys).
ROWS_MAX = 256
SAMPLE_ROW_MAX = 4096  # windows: samples up to this long select over one row (see above)


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
    end_T: torch.Tensor | None = None,
) -> torch.Tensor:
    """Indices [T, topk] (int64) of each query's best visible keys, best first, -1 padded.
    `end_T` (one past each query's sample's last window) turns on the per-sample rows for
    samples of at most SAMPLE_ROW_MAX windows (see the module docstring)."""
    t, h, _ = q_THD.shape
    idx_TK = torch.full((t, topk), -1, dtype=torch.long, device=q_THD.device)
    if t == 0 or topk == 0 or k_PD.shape[0] == 0:
        return idx_TK
    if end_T is not None:
        short_T = end_T - lo_T <= SAMPLE_ROW_MAX
        _sample_rows(q_THD, w_TH, k_PD, lo_T, hi_T, end_T, short_T, idx_TK, scale, row_elems)
        if bool(short_T.all()):
            return idx_TK
        if bool(short_T.any()):  # the long samples' rows alone, by the running top-k
            rows_R = (~short_T).nonzero().flatten()
            idx_TK[rows_R] = indexer_topk_torch(
                q_THD[rows_R], w_TH[rows_R], k_PD, lo_T=lo_T[rows_R], hi_T=hi_T[rows_R],
                topk=topk, chunk=chunk, scale=scale, row_elems=row_elems,
            )  # fmt: skip
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


def _sample_rows(
    q_THD: torch.Tensor,
    w_TH: torch.Tensor,
    k_PD: torch.Tensor,
    lo_T: torch.Tensor,
    hi_T: torch.Tensor,
    end_T: torch.Tensor,
    short_T: torch.Tensor,
    idx_TK: torch.Tensor,
    scale: float,
    row_elems: int,
) -> None:
    """Fill `idx_TK` for the `short_T` rows: per sample (a run of rows with one window range),
    one score row per query over the sample's windows [lo, end), torch.topk of min(K, end -
    lo) of it, -inf picks (past the visible end) -> -1. Query rows go `row_elems` at a time."""
    t, h, _ = q_THD.shape
    topk = idx_TK.shape[1]
    # runs of rows sharing a sample: its rows are contiguous (a THD pack, or a CP rank's slice)
    start_T = torch.ones(t, dtype=torch.bool, device=lo_T.device)
    start_T[1:] = (lo_T[1:] != lo_T[:-1]) | (end_T[1:] != end_T[:-1])
    starts = [*start_T.nonzero().flatten().tolist(), t]
    for r0, r1 in itertools.pairwise(starts):
        lo, end = int(lo_T[r0]), int(end_T[r0])
        n = end - lo
        if n <= 0 or not bool(short_T[r0]):
            continue
        k_ND = k_PD[lo:end].float()
        cols_N = torch.arange(n, device=q_THD.device)
        step = max(1, row_elems // (h * n))
        for a in range(r0, r1, step):
            b = min(r1, a + step)
            s_XN = q_THD[a:b].flatten(0, 1).float() @ k_ND.T
            s_RN = (s_XN.view(b - a, h, n).relu_() * (w_TH[a:b, :, None].float() * scale)).sum(1)
            s_RN.masked_fill_(cols_N >= (hi_T[a:b, None] - lo), float("-inf"))
            v_RK, i_RK = s_RN.topk(min(topk, n), dim=1)
            idx_TK[a:b, : v_RK.shape[1]] = torch.where(v_RK == float("-inf"), -1, i_RK + lo)
