"""The release's inference-time activation quantization, simulated (quantize then dequantize).

DeepSeek's V4.1 inference code stores the window KV as FP8 e4m3 (one power-of-two scale per 32
values, over all head dims), the compressed KV as FP4 e2m1 (one e4m3 scale per 16 values) and
the indexer's q and keys as FP4 e2m1 (one power-of-two scale per 32 values). With
`activation_fake_quant` the model rounds the same tensors the same way; gradients pass straight
through (the rounding is treated as the identity in backward).
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0
FP4_MAX = 6.0
# e2m1 magnitudes and the midpoints between them; at an exact midpoint the even code wins,
# which rounds up at the midpoints 0.75, 1.75 and 3.5 (odd index below).
_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_MIDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2(x)) for positive float32 x, exactly (exponent bits + any mantissa)."""
    bits = x.float().contiguous().view(torch.int32)
    exp = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exp << 23).view(torch.float32)


def _e2m1(v: torch.Tensor) -> torch.Tensor:
    mag = v.abs()
    mids = torch.tensor(_MIDS, dtype=v.dtype, device=v.device)
    tie_up = torch.tensor([i % 2 == 1 for i in range(len(_MIDS))], device=v.device)
    code = (mag[..., None] > mids).sum(-1) + ((mag[..., None] == mids) & tie_up).sum(-1)
    grid = torch.tensor(_GRID, dtype=v.dtype, device=v.device)
    return torch.copysign(grid[code], v)


def _straight_through(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x + (y.to(x.dtype) - x).detach()


def fp8_window(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    g = x.detach().float().unflatten(-1, (-1, block))
    s = _pow2_ceil(g.abs().amax(-1, keepdim=True).clamp_min(1e-4) / FP8_MAX)
    q = (g / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * s
    return _straight_through(x, q.flatten(-2))


def _fp4(x: torch.Tensor, block: int, e4m3_scale: bool) -> torch.Tensor:
    g = x.detach().float().unflatten(-1, (-1, block))
    amax = g.abs().amax(-1, keepdim=True)
    if e4m3_scale:
        s = (amax.clamp_min(FP4_MAX * 2**-9) / FP4_MAX).to(torch.float8_e4m3fn).float()
    else:
        s = _pow2_ceil(amax.clamp_min(FP4_MAX * 2**-126) / FP4_MAX)
    q = _e2m1((g / s).clamp(-FP4_MAX, FP4_MAX)) * s
    return _straight_through(x, q.flatten(-2))


def fp4_kv(x: torch.Tensor) -> torch.Tensor:
    """Compressed KV: FP4 per 16 values with e4m3 scales."""
    return _fp4(x, 16, e4m3_scale=True)


def fp4_index(x: torch.Tensor) -> torch.Tensor:
    """Indexer q / keys: FP4 per 32 values with power-of-two scales."""
    return _fp4(x, 32, e4m3_scale=False)
