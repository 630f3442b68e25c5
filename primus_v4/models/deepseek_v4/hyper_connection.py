"""mHC hyper-connections: K residual streams mixed per token around every sub-block.

Legend: T = rows, K = hc_mult streams, D = hidden.

Every op here is row-wise (nothing mixes tokens), so packing isolation is untouched by mHC.
A `HyperMixer` wraps one sub-block (attention or MoE): from the K streams it computes
  pre [K]   = sigmoid(.) + eps         weights collapsing the streams into the sub-block input,
  post [K]  = 2 * sigmoid(.)           how much of the sub-block output each stream receives,
  comb [K,K] = Sinkhorn(softmax(.) + eps)  a doubly-stochastic stream-to-stream residual mix,
all from one linear map of the RMS-normalized flattened streams (K*D -> (2+K)*K), each group with
its own learned scalar scale and a bias. `HyperHead` collapses the K streams once at the end.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from primus_v4.models.deepseek_v4.stream_sums import mix, weighted_sum


def _sinkhorn(logits_TKK: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    comb = torch.softmax(logits_TKK.float(), dim=-1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return comb


def sinkhorn(logits_TKK: torch.Tensor, *, iters: int, eps: float) -> torch.Tensor:
    """Doubly-stochastic projection: softmax over rows, then alternate column/row scaling.

    Kept in float32: K is tiny (4) and 20 alternating divisions lose bits quickly in bf16.
    Recomputed in backward: autograd would otherwise keep ~2 x iters [T, K, K] intermediates
    per mixer (40 x 8 MiB per mixer at 128k rows), the largest activation of the whole layer.
    """
    if torch.is_grad_enabled() and logits_TKK.requires_grad:
        return torch.utils.checkpoint.checkpoint(
            _sinkhorn, logits_TKK, iters, eps, use_reentrant=False
        )
    return _sinkhorn(logits_TKK, iters, eps)


def _rms_scale(x_TX: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / rms(x) per row [T, 1] in float32; applied after the linear map (a row scale commutes
    with it), so the normalized [T, K*D] copy is never materialized nor saved."""
    x32 = x_TX.float()
    return torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)


class _LowPrecisionProjection(torch.autograd.Function):
    """(x W^T) / rms(x) in float32 from bf16 streams, saving x as it came: the plain expression
    would save the float32 copy of the [T, K*D] streams (8 bytes per element where x has 2)."""

    @staticmethod
    def forward(ctx: Any, x_TX: torch.Tensor, w_NX: torch.Tensor, eps: float):  # type: ignore[override]
        x32 = x_TX.float()
        r_T1 = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x_TX, w_NX, r_T1)
        return F.linear(x32, w_NX.float()) * r_T1

    @staticmethod
    def backward(ctx: Any, g_TN: torch.Tensor):  # type: ignore[override]
        x_TX, w_NX, r_T1 = ctx.saved_tensors
        x32, w32 = x_TX.float(), w_NX.float()
        z_TN = F.linear(x32, w32)
        dz_TN = g_TN * r_T1
        # d r / d x = -r^3 x / X: the row scale's share of the input gradient.
        dr_T1 = (g_TN * z_TN).sum(-1, keepdim=True) * (-(r_T1**3) / x32.shape[-1])
        dx = dz_TN @ w32 + dr_T1 * x32
        dw = dz_TN.t() @ x32 if ctx.needs_input_grad[1] else None
        return dx.to(x_TX.dtype), None if dw is None else dw.to(w_NX.dtype), None


def _stream_logits(x_TKD: torch.Tensor, w_NX: torch.Tensor, eps: float) -> torch.Tensor:
    """[T, N] = (flat streams @ W^T) / rms(flat streams), float32 (mHC's coefficient logits)."""
    flat = x_TKD.reshape(x_TKD.shape[0], -1)
    if flat.dtype in (torch.float32, torch.float64):  # the expression float32 runs always used
        flat = flat.float()
        return F.linear(flat, w_NX.float()) * _rms_scale(flat, eps)
    return _LowPrecisionProjection.apply(flat, w_NX, eps)


def lift_streams(x_TD: torch.Tensor, k: int) -> torch.Tensor:
    """Enter mHC: every stream starts as a copy of the embedding."""
    return x_TD.unsqueeze(1).expand(-1, k, -1).contiguous()


class HyperMixer(nn.Module):
    """Collapse K streams into one sub-block input, and write the sub-block output back."""

    def __init__(self, *, hidden: int, k: int, sinkhorn_iters: int, eps: float, norm_eps: float):
        super().__init__()
        self.k, self.iters, self.eps, self.norm_eps = k, sinkhorn_iters, eps, norm_eps
        # float32 weights: the mixing coefficients feed a 20-step Sinkhorn and gate every residual.
        self.proj = nn.Linear(k * hidden, (2 + k) * k, bias=False, dtype=torch.float32)
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))  # pre, post, comb groups
        self.bias = nn.Parameter(torch.zeros((2 + k) * k, dtype=torch.float32))

    def init_weights(self, std: float) -> None:
        nn.init.normal_(self.proj.weight, std=std)
        nn.init.ones_(self.scale)
        # Zero bias: pre = 1/2, post = 1, comb = uniform 1/K mixing at init (scaled by the tiny
        # projection noise); the residual stays well conditioned from the first step.
        nn.init.zeros_(self.bias)

    def coefficients(self, x_TKD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        k = self.k
        t = x_TKD.shape[0]
        # Weights cast to float32 here too, so a model cast to bf16 still mixes in float32.
        mix = _stream_logits(x_TKD, self.proj.weight, self.norm_eps)
        sc = self.scale.float()
        scale = torch.cat([sc[0].expand(k), sc[1].expand(k), sc[2].expand(k * k)])
        mix = mix * scale + self.bias.float()
        pre_TK = torch.sigmoid(mix[:, :k]) + self.eps
        post_TK = 2.0 * torch.sigmoid(mix[:, k : 2 * k])
        comb_TKK = sinkhorn(mix[:, 2 * k :].reshape(t, k, k), iters=self.iters, eps=self.eps)
        return pre_TK, post_TK, comb_TKK

    def collapse(self, x_TKD: torch.Tensor, pre_TK: torch.Tensor) -> torch.Tensor:
        """sum_k pre_k x_k in float32, rounded once to the streams' dtype (as the release's
        hc_pre): bf16 weights and a bf16 sum would each add a rounding to every sub-block input."""
        return weighted_sum(pre_TK, x_TKD)

    def write_back(
        self,
        x_TKD: torch.Tensor,
        out_TD: torch.Tensor,
        post_TK: torch.Tensor,
        comb_TKK: torch.Tensor,
    ) -> torch.Tensor:
        """y_j = post_j * out + sum_i comb[i, j] * x_i: the release sums over comb's FIRST index
        (comb transposed); Sinkhorn's matrix is not symmetric, so the direction matters."""
        # float32 mixing, rounded once to the streams' dtype (the release's hc_post): comb and
        # post stay float32 (Sinkhorn's matrix rounded to bf16 is no longer doubly stochastic).
        return mix(comb_TKK, x_TKD, p_TJ=post_TK, f_TD=out_TD)


class HyperHead(nn.Module):
    """Final collapse of the K streams into one hidden row (sigmoid weights, no Sinkhorn)."""

    def __init__(self, *, hidden: int, k: int, eps: float, norm_eps: float) -> None:
        super().__init__()
        self.k, self.eps, self.norm_eps = k, eps, norm_eps
        self.proj = nn.Linear(k * hidden, k, bias=False, dtype=torch.float32)
        self.scale = nn.Parameter(torch.ones(1, dtype=torch.float32))
        self.bias = nn.Parameter(torch.zeros(k, dtype=torch.float32))

    def init_weights(self, std: float) -> None:
        nn.init.normal_(self.proj.weight, std=std)
        nn.init.ones_(self.scale)
        nn.init.zeros_(self.bias)

    def forward(self, x_TKD: torch.Tensor) -> torch.Tensor:
        logits_TK = _stream_logits(x_TKD, self.proj.weight, self.norm_eps)
        logits_TK = logits_TK * self.scale.float()
        w_TK = torch.sigmoid(logits_TK + self.bias.float()) + self.eps
        return weighted_sum(w_TK, x_TKD)
