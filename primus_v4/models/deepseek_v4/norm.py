"""RMS norms used around every sub-block (learned scale) and inside mHC (parameter-free).

Legend: T = rows, D = hidden.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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
        # torch's fused rms_norm saves only the input and the per-row rstd for backward.
        return F.rms_norm(x_TD, (x_TD.shape[-1],), self.weight, self.eps)

    def init_weights(self, std: float) -> None:
        del std  # a norm starts as the identity scale whatever the weight std
        nn.init.ones_(self.weight)
