"""Index-driven sparse attention with a learned sink: the torch reference (memory-efficient).

Legend: T = query rows, H = heads, D = head dim, N = rows of the key buffer, R = key ranges
per query, K = explicit key indices per query, C = query rows in a chunk, M = chunk candidates.

Each query t attends to the key-buffer rows in its ranges [lo[t, r], hi[t, r]) plus the explicit
rows idx[t, k] (-1 = no key), one softmax over all of them plus the sink logit (value 0). A query's
candidates must be distinct (a repeated row would count twice). The buffer row is both key and
value (single-latent MQA). Causality, windows, sample isolation and
top-k selection all live in the ranges and indices, so this op never sees a layout.

Memory: candidate keys are gathered per chunk of query rows ([C, M, D] + [C, H, M] at a time,
bounded by `chunk_elems`), and the backward recomputes them (flash-attention style: only q, kv
and the row log-sum-exp are saved), so activation memory is O(T * (H * D + R + K)).

Precision: scores, softmax, the weighted sum and every gradient are computed in float32 (at
least) whatever the input dtype, like a flash-attention kernel; outputs and gradients are cast
back to the input dtypes at the end. A bf16 softmax over hundreds of candidates would otherwise
lose several bits.
"""

from __future__ import annotations

import torch

CHUNK_ELEMS = 1 << 23  # ~32 MiB of float32 candidate keys per chunk: small peak, few python steps


def _chunk_columns(
    lo_CR: torch.Tensor, hi_CR: torch.Tensor, idx_CK: torch.Tensor | None, n_rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Buffer rows [C, M] of every candidate key of a chunk and whether each one exists."""
    cols, valid = [], []
    for r in range(lo_CR.shape[1]):
        lo, hi = lo_CR[:, r : r + 1], hi_CR[:, r : r + 1]
        width = int((hi - lo).max().clamp(min=0)) if lo.numel() else 0
        c = lo + torch.arange(width, device=lo.device)
        cols.append(c)
        valid.append(c < hi)
    if idx_CK is not None:
        cols.append(idx_CK)
        valid.append(idx_CK >= 0)
    col_CM = torch.cat(cols, dim=1).clamp(0, max(n_rows - 1, 0))
    return col_CM, torch.cat(valid, dim=1)


def _acc(x: torch.Tensor) -> torch.Tensor:
    """x in the accumulation dtype: float32, or float64 when x already is."""
    return x if x.dtype == torch.float64 else x.float()


def _chunk_probs(q_CHD, kv_ND, col_CM, valid_CM, sink_H, scale, lse_CH=None):
    k_CMD = _acc(kv_ND[col_CM])
    s_CHM = torch.einsum("chd,cmd->chm", _acc(q_CHD), k_CMD) * scale
    s_CHM = s_CHM.masked_fill(~valid_CM[:, None, :], float("-inf"))
    if lse_CH is None:
        sink_CH1 = _acc(sink_H).to(s_CHM.dtype)[None, :, None].expand(s_CHM.shape[0], -1, 1)
        lse_CH = torch.logsumexp(torch.cat((s_CHM, sink_CH1), dim=-1), dim=-1)
    return k_CMD, torch.exp(s_CHM - lse_CH[..., None]), lse_CH


class _SparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_THD, kv_ND, sink_H, lo_TR, hi_TR, idx_TK, scale, rows):
        out_THD = torch.empty_like(q_THD)
        lse_TH = torch.empty(q_THD.shape[:2], dtype=_acc(q_THD).dtype, device=q_THD.device)
        n = kv_ND.shape[0]
        for a in range(0, q_THD.shape[0], rows):
            b = a + rows
            idx = None if idx_TK is None else idx_TK[a:b]
            col, valid = _chunk_columns(lo_TR[a:b], hi_TR[a:b], idx, n)
            k_CMD, p_CHM, lse = _chunk_probs(q_THD[a:b], kv_ND, col, valid, sink_H, scale)
            out_THD[a:b] = torch.einsum("chm,cmd->chd", p_CHM, k_CMD).to(out_THD.dtype)
            lse_TH[a:b] = lse
        ctx.save_for_backward(q_THD, kv_ND, sink_H, lo_TR, hi_TR, idx_TK, lse_TH)
        ctx.scale, ctx.rows = scale, rows
        return out_THD

    @staticmethod
    def backward(ctx, dout_THD):
        q_THD, kv_ND, sink_H, lo_TR, hi_TR, idx_TK, lse_TH = ctx.saved_tensors
        scale, rows, n = ctx.scale, ctx.rows, kv_ND.shape[0]
        acc = lse_TH.dtype
        dq_THD = torch.zeros_like(q_THD)
        dkv_ND = torch.zeros(kv_ND.shape, dtype=acc, device=kv_ND.device)
        dsink_H = torch.zeros(sink_H.shape, dtype=acc, device=sink_H.device)
        for a in range(0, q_THD.shape[0], rows):
            b = a + rows
            idx = None if idx_TK is None else idx_TK[a:b]
            col, valid = _chunk_columns(lo_TR[a:b], hi_TR[a:b], idx, n)
            q, do, lse = _acc(q_THD[a:b]), _acc(dout_THD[a:b]), lse_TH[a:b]
            k_CMD, p_CHM, _ = _chunk_probs(q, kv_ND, col, valid, sink_H, scale, lse)
            dp_CHM = torch.einsum("chd,cmd->chm", do, k_CMD)
            # The d(lse)-term of the softmax backward, do . out = sum_m p_m dp_m (the sink's
            # value is 0), taken from the float32 probabilities rather than the rounded output:
            # dp - delta cancels, and a bf16 output would leave its rounding in every gradient.
            delta_CH = (p_CHM * dp_CHM).sum(-1)
            ds_CHM = p_CHM * (dp_CHM - delta_CH[..., None])
            dq_THD[a:b] = (torch.einsum("chm,cmd->chd", ds_CHM, k_CMD) * scale).to(dq_THD.dtype)
            # K and V are the same rows: their gradients add before the scatter.
            dk_CMD = torch.einsum("chm,chd->cmd", ds_CHM, q) * scale
            dk_CMD = dk_CMD + torch.einsum("chm,chd->cmd", p_CHM, do)
            dkv_ND.index_add_(0, col.flatten(), dk_CMD.flatten(0, 1))
            # The sink's value is 0, so its logit gradient is -p_sink * delta.
            dsink_H -= (torch.exp(_acc(sink_H)[None, :] - lse) * delta_CH).sum(0)
        dkv_ND, dsink_H = dkv_ND.to(kv_ND.dtype), dsink_H.to(sink_H.dtype)
        return dq_THD, dkv_ND, dsink_H, None, None, None, None, None


def sparse_attention_torch(
    q_THD: torch.Tensor,
    kv_ND: torch.Tensor,
    sink_H: torch.Tensor | None,
    *,
    lo_TR: torch.Tensor,
    hi_TR: torch.Tensor,
    idx_TK: torch.Tensor | None = None,
    scale: float,
    chunk_elems: int = CHUNK_ELEMS,
) -> torch.Tensor:
    """Softmax(q k^T * scale ++ sink) v over each query's candidate rows of `kv_ND` -> [T, H, D]."""
    t, h, d = q_THD.shape
    if sink_H is None:
        sink_H = q_THD.new_full((h,), float("-inf"))
    widths = int((hi_TR - lo_TR).amax(dim=0).clamp(min=0).sum()) if t else 0
    widths += 0 if idx_TK is None else idx_TK.shape[1]
    rows = max(1, chunk_elems // max(1, widths * (d + 3 * h)))
    return _SparseAttention.apply(q_THD, kv_ND, sink_H, lo_TR, hi_TR, idx_TK, scale, rows)


def _triton():
    # Imported on first use: Triton fixes at import whether kernels compile or are interpreted.
    from primus_v4.kernels import triton_sparse_attention

    return triton_sparse_attention


def sparse_attention_triton(q_THD, kv_ND, sink_H, **kwargs) -> torch.Tensor:
    """Our Triton kernels (kernels/triton_sparse_attention.py), same contract as the reference."""
    return _triton().sparse_attention_triton(q_THD, kv_ND, sink_H, **kwargs)


def triton_refuses(q_THD, kv_ND, sink_H, **kwargs) -> str | None:
    del sink_H, kwargs
    try:  # a triton too old for the kernels fails here, and auto moves on to the next backend
        module = _triton()
    except (ImportError, AttributeError, RuntimeError) as exc:
        return f"the Triton kernels do not build with this triton ({type(exc).__name__}: {exc})"
    return module.refuses(q_THD, kv_ND)
