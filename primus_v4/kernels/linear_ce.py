"""LM head + cross-entropy in row chunks: [S, vocab] logits never exist at once.

Legend: T = rows, D = hidden, V = vocab, C = rows per chunk.

The forward pass computes each chunk's logits, its summed masked CE and, when gradients are
needed, that chunk's gradients with respect to the hidden rows and the head weight; backward only
scales them by the incoming gradient. Peak extra memory is O(C x V) + one [V, D] gradient
buffer instead of O(T x V) logits (31.6 GB at 128k rows in bf16). Returns the masked SUM so the
trainer can normalize by a token count summed over micro-batches and ranks.

On CPU a bfloat16 / float16 head runs its GEMMs in float32 (`_gemm_weight`): oneDNN's
half-precision GEMM with the vocabulary as the reduced dimension is ~100x slower there than
float32 (16 s against 0.14 s for 256 rows x 129,280 x 64), and float32 accumulates no worse.
"""

from __future__ import annotations

from typing import Any

import torch


def _gemm_weight(w_VD: torch.Tensor) -> torch.Tensor:
    """The head weight the chunk GEMMs read: `w_VD`, or its float32 copy for a half-precision
    head on CPU (one copy per call, not per chunk)."""
    half = w_VD.dtype in (torch.bfloat16, torch.float16)
    return w_VD.float() if half and w_VD.device.type == "cpu" else w_VD


def _chunk_ce(
    h_CD: torch.Tensor,
    w_VD: torch.Tensor,
    labels_C: torch.Tensor,
    mask_C: torch.Tensor,
    *,
    need_grad: bool,
    w_gemm: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(summed masked CE, d loss / d logits or None) of one chunk of supervised rows.

    The logits are `w_VD`'s dtype (computed through `w_gemm`, `_gemm_weight(w_VD)`, when given);
    CE math in float32; one exp pass over the [C, V] buffer, reused in place for the softmax.
    """
    w_gemm = w_VD if w_gemm is None else w_gemm
    logits_CV = (h_CD.to(w_gemm.dtype) @ w_gemm.t()).to(w_VD.dtype).float()
    target_C = logits_CV.gather(1, labels_C[:, None]).squeeze(1)
    max_C = logits_CV.amax(dim=-1)
    probs_CV = logits_CV.sub_(max_C[:, None]).exp_()
    z_C = probs_CV.sum(-1)
    loss_sum = ((z_C.log() + max_C - target_C) * mask_C).sum()
    if not need_grad:
        return loss_sum, None
    grad_CV = probs_CV.div_(z_C[:, None])
    grad_CV.scatter_add_(1, labels_C[:, None], -torch.ones_like(z_C)[:, None])
    return loss_sum, grad_CV.mul_(mask_C[:, None])


class ChunkedLinearCE(torch.autograd.Function):
    """sum_t mask_t * CE(h_t @ W^T, label_t), chunked over the supervised rows (or all rows).

    Rows with mask 0 contribute exactly zero loss and gradient, so by default they are skipped.
    `all_rows` runs the head on every row anyway (masked to zero), which is what a conventional
    trainer computes: same result, cost proportional to the row count instead of the supervised
    count. It exists for cost comparisons against such trainers (benchmarks/bench_layouts.py).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        h_TD: torch.Tensor,
        w_VD: torch.Tensor,
        labels_T: torch.Tensor,
        mask_T: torch.Tensor,
        chunk: int,
        grad_enabled: bool,
        all_rows: bool,
    ) -> torch.Tensor:
        # needs_input_grad stays True under torch.no_grad: check the caller's grad mode too.
        need_h = grad_enabled and ctx.needs_input_grad[0]
        need_w = grad_enabled and ctx.needs_input_grad[1]
        # Unsupervised rows contribute exactly zero loss and gradient: skip them entirely unless
        # asked not to (their labels are clamped, so garbage there is never an invalid index).
        if all_rows:
            rows_N = torch.arange(mask_T.shape[0], device=mask_T.device)
        else:
            rows_N = torch.nonzero(mask_T != 0, as_tuple=False).flatten()
        mask_N = mask_T.index_select(0, rows_N).to(torch.float32)
        labels_N = labels_T.index_select(0, rows_N).clamp(0, w_VD.shape[0] - 1)
        h_ND = h_TD.index_select(0, rows_N)
        total = torch.zeros((), dtype=torch.float32, device=h_TD.device)
        grad_h = torch.zeros_like(h_TD) if need_h else None
        grad_w = (
            torch.zeros(w_VD.shape, dtype=torch.float32, device=w_VD.device) if need_w else None
        )
        w_gemm = _gemm_weight(w_VD)
        for lo in range(0, rows_N.numel(), chunk):
            hi = min(lo + chunk, rows_N.numel())
            loss_c, grad_CV = _chunk_ce(
                h_ND[lo:hi], w_VD, labels_N[lo:hi], mask_N[lo:hi],
                need_grad=need_h or need_w, w_gemm=w_gemm,
            )  # fmt: skip
            total += loss_c
            if grad_h is not None:
                grad_CD = grad_CV.to(w_VD.dtype).to(w_gemm.dtype) @ w_gemm
                grad_h.index_copy_(0, rows_N[lo:hi], grad_CD.to(h_TD.dtype))
            if grad_w is not None:
                grad_w += grad_CV.t() @ h_ND[lo:hi].float()
        ctx.save_for_backward(*(g if g is not None else torch.empty(0) for g in (grad_h, grad_w)))
        ctx.has = (grad_h is not None, grad_w is not None)
        ctx.w_dtype = w_VD.dtype
        return total

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):  # type: ignore[override]
        grad_h, grad_w = ctx.saved_tensors
        gh = grad_h * grad_out.to(grad_h.dtype) if ctx.has[0] else None
        gw = (grad_w * grad_out).to(ctx.w_dtype) if ctx.has[1] else None
        return gh, gw, None, None, None, None, None


def chunked_linear_ce(
    h_TD: torch.Tensor,
    w_VD: torch.Tensor,
    labels_T: torch.Tensor,
    mask_T: torch.Tensor,
    *,
    chunk: int,
    all_rows: bool = False,
) -> torch.Tensor:
    """Masked SUM of token cross-entropies of `h @ w^T` (float32 scalar)."""
    return ChunkedLinearCE.apply(
        h_TD, w_VD, labels_T, mask_T, chunk, torch.is_grad_enabled(), all_rows
    )


def full_linear_ce(
    h_TD: torch.Tensor, w_VD: torch.Tensor, labels_T: torch.Tensor, mask_T: torch.Tensor
) -> torch.Tensor:
    """Reference: the same masked sum with materialized logits (tests and small vocabularies)."""
    logits = (h_TD @ w_VD.t()).float()
    ce = torch.nn.functional.cross_entropy(
        logits, labels_T.clamp(0, w_VD.shape[0] - 1), reduction="none"
    )
    return torch.where(mask_T > 0, ce * mask_T, 0.0).sum()
