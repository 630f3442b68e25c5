"""Weighted sums over a small axis (mHC streams, a token's top-k experts) accumulated in float32.

Legend: T = rows, I = inputs summed over (K streams or top-k experts), J = outputs, D = hidden.

    y[t, j, :] = sum_i w[t, i, j] x[t, i, :]  (+ p[t, j] f[t, :])

DeepSeek's inference code computes its mHC collapse (hc_pre), write-back (hc_post) and MoE
combine in float32 from float32 coefficients and rounds the result once to the activation dtype.
With bf16 streams, casting the coefficients to bf16 first (HF's choice) rounds every Sinkhorn /
routing weight to 8 bits and every partial sum again; this module follows the release.

Memory: a plain `torch.einsum(w, x.float())` would save the float32 copy of x for backward, twice
the bytes of the bf16 streams per mixer. `_Float32Mix` saves x as it came (the tensor autograd
keeps anyway) and upcasts again in backward, so bf16 activation memory is unchanged. float32
and float64 inputs take the plain autograd expression: bit for bit what they always computed.
"""

from __future__ import annotations

from typing import Any

import torch

EXACT = (torch.float32, torch.float64)  # dtypes that need no float32 upcast


class _Float32Mix(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, w_TIJ, x_TID, p_TJ, f_TD, out_dtype):  # type: ignore[override]
        y_TJD = torch.einsum("tij,tid->tjd", w_TIJ.float(), x_TID.float())
        if p_TJ is not None:
            y_TJD = y_TJD + p_TJ.float().unsqueeze(-1) * f_TD.float().unsqueeze(1)
        ctx.save_for_backward(w_TIJ, x_TID, p_TJ, f_TD)
        return y_TJD.to(out_dtype)

    @staticmethod
    def backward(ctx: Any, g_TJD: torch.Tensor):  # type: ignore[override]
        w_TIJ, x_TID, p_TJ, f_TD = ctx.saved_tensors
        need = ctx.needs_input_grad
        g = g_TJD.float()
        dw = torch.einsum("tjd,tid->tij", g, x_TID.float()).to(w_TIJ.dtype) if need[0] else None
        dx = torch.einsum("tij,tjd->tid", w_TIJ.float(), g).to(x_TID.dtype) if need[1] else None
        dp = df = None
        if p_TJ is not None and need[2]:
            dp = torch.einsum("tjd,td->tj", g, f_TD.float()).to(p_TJ.dtype)
        if p_TJ is not None and need[3]:
            df = torch.einsum("tj,tjd->td", p_TJ.float(), g).to(f_TD.dtype)
        return dw, dx, dp, df, None


def mix(
    w_TIJ: torch.Tensor,
    x_TID: torch.Tensor,
    *,
    p_TJ: torch.Tensor | None = None,
    f_TD: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """[T, J, D] = sum_i w[t, i, j] x[t, i] (+ p[t, j] f[t]) in float32, returned in
    `out_dtype` (default x's dtype)."""
    out_dtype = out_dtype or x_TID.dtype
    if x_TID.dtype in EXACT and (f_TD is None or f_TD.dtype in EXACT):
        dt = x_TID.dtype
        y_TJD = torch.einsum("tij,tid->tjd", w_TIJ.to(dt), x_TID)
        if p_TJ is not None:
            y_TJD = y_TJD + p_TJ.to(dt).unsqueeze(-1) * f_TD.unsqueeze(1)
        return y_TJD.to(out_dtype)
    return _Float32Mix.apply(w_TIJ, x_TID, p_TJ, f_TD, out_dtype)


def weighted_sum(
    w_TI: torch.Tensor, x_TID: torch.Tensor, *, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """[T, D] = sum_i w[t, i] x[t, i] in float32, returned in `out_dtype` (default x's)."""
    if x_TID.dtype in EXACT:  # the expression float32 runs always used
        return torch.einsum("ti,tid->td", w_TI.to(x_TID.dtype), x_TID).to(out_dtype or x_TID.dtype)
    return mix(w_TI.unsqueeze(-1), x_TID, out_dtype=out_dtype)[:, 0]


class _Float32Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x_TD: torch.Tensor, w_ED: torch.Tensor):  # type: ignore[override]
        ctx.save_for_backward(x_TD, w_ED)
        return x_TD.float() @ w_ED.float().t()

    @staticmethod
    def backward(ctx: Any, g_TE: torch.Tensor):  # type: ignore[override]
        x_TD, w_ED = ctx.saved_tensors
        need = ctx.needs_input_grad
        dx = (g_TE @ w_ED.float()).to(x_TD.dtype) if need[0] else None
        dw = (g_TE.t() @ x_TD.float()).to(w_ED.dtype) if need[1] else None
        return dx, dw


def float32_linear(x_TD: torch.Tensor, w_ED: torch.Tensor) -> torch.Tensor:
    """x @ w^T in float32 (the router's logits). bf16 inputs are saved as they came: the plain
    `x.float() @ w.float().t()` would keep float32 copies of both for backward."""
    if x_TD.dtype in EXACT and w_ED.dtype in EXACT:
        return x_TD.float() @ w_ED.float().t()  # the expression float32 runs always used
    return _Float32Linear.apply(x_TD, w_ED)
