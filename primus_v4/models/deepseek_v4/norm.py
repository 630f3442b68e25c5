"""RMS norms used around every sub-block (learned scale) and inside mHC (parameter-free).

Legend: T = rows, D = hidden.

Memory: torch's CPU `F.rms_norm` on a bf16 input upcasts inside autograd and saves two float32
copies (x and x * rstd: 8 bytes per element where the input has 2). `rms_norm` saves the input as
it came and the float32 per-row rstd, and recomputes the rest in backward. float32 and float64
inputs take `F.rms_norm` itself, bit for bit what they always computed.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

EXACT = (torch.float32, torch.float64)


def _rstd(x32: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)


class _LowPrecisionRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, eps: float):  # type: ignore[override]
        x32 = x.float()
        rstd = _rstd(x32, eps)
        y = x32 * rstd
        if weight is not None:
            y = y * weight.float()
        ctx.save_for_backward(x, weight, rstd)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):  # type: ignore[override]
        x, weight, rstd = ctx.saved_tensors
        x32, g32 = x.float(), g.float()
        n_hat = x32 * rstd
        dw = None
        if weight is not None:
            if ctx.needs_input_grad[1]:
                dw = (g32 * n_hat).flatten(0, -2).sum(0).to(weight.dtype)
            g32 = g32 * weight.float()
        # d/dx of x * rstd(x): rstd * (g - n_hat * mean(g * n_hat)).
        dx = rstd * (g32 - n_hat * (g32 * n_hat).mean(-1, keepdim=True))
        return dx.to(x.dtype), dw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMS norm over the last dim (times `weight` when given), computed in float32."""
    if x.dtype in EXACT:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return _LowPrecisionRMSNorm.apply(x, weight, eps)


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Parameter-free RMS normalization over the last dim, computed in float32."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm with a learned per-channel scale (initialized to one by `init_weights`)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        return rms_norm(x_TD, self.weight, self.eps)

    def init_weights(self, std: float) -> None:
        del std  # a norm starts as the identity scale whatever the weight std
        nn.init.ones_(self.weight)
