"""Partial interleaved rotary embedding (RoPE).

Legend: T = rows, X = any middle dims (heads), D = channels, R = rotary channels (the last R of D).

Conventions (fixed here, used by attention, compressor and indexer):
- RoPE rotates only the last R = `qk_pos_emb_head_dim` channels; pairs are interleaved
  (channel 2k with 2k+1 of that block), the first D - R channels pass through.
- Dense layers use theta = `rotary_base` without YaRN; compressed layers (CSA, HCA, and the CSA
  indexer) use theta = `compress_rope_theta` with YaRN frequency interpolation. No YaRN mscale is
  folded into the softmax scale (it stays 1/sqrt(head_dim)).
- Angles are `position * inv_freq` in float32 from integer positions, so the same position gives
  bit-identical rotations whether a sample is packed or alone.
- The inverse rotation (angle -position) undoes the rotation on the attention output, whose values
  carry the keys' rotated channels because K and V are one latent.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from primus_v4.models.deepseek_v4.config import DeepseekV4Config


def _yarn_correction_dim(rotations: float, dim: int, base: float, max_pos: int) -> float:
    # Channel index whose wavelength completes `rotations` turns over the original context.
    return dim * math.log(max_pos / (rotations * 2 * math.pi)) / (2 * math.log(base))


def rope_inv_freq(
    dim: int,
    base: float,
    *,
    yarn_factor: float = 1.0,
    original_max_pos: int = 65536,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
) -> torch.Tensor:
    """Inverse frequencies [dim/2] (float32), YaRN-interpolated when `yarn_factor` > 1.

    YaRN keeps high-frequency pairs (more than `beta_fast` turns over the original context) as
    they are, divides low-frequency pairs (fewer than `beta_slow` turns) by the factor, and ramps
    linearly in between (the DeepSeek-V3/V4 formulation).
    """
    # float32 throughout, as the release computes them (bit-for-bit the same frequencies).
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if yarn_factor > 1.0:
        low = max(math.floor(_yarn_correction_dim(beta_fast, dim, base, original_max_pos)), 0)
        high = min(math.ceil(_yarn_correction_dim(beta_slow, dim, base, original_max_pos)), dim - 1)
        if low == high:
            high += 0.001  # avoid a zero-width ramp (the release's choice)
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        freqs = freqs / yarn_factor * ramp + freqs * (1 - ramp)
    return freqs


class RotaryEmbedding(nn.Module):
    """RoPE on the last `rope_dim` channels; `compressed` selects the per-layer theta and YaRN."""

    inv_freq: torch.Tensor

    def __init__(self, cfg: DeepseekV4Config, *, compressed: bool) -> None:
        super().__init__()
        self.rope_dim = cfg.qk_pos_emb_head_dim
        self._cfg, self._compressed = cfg, compressed
        # Derived from the config, so not saved in checkpoints.
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def _inv_freq(self) -> torch.Tensor:
        cfg = self._cfg
        if self._compressed:
            inv = rope_inv_freq(
                self.rope_dim,
                cfg.compress_rope_theta,
                yarn_factor=cfg.rotary_scaling_factor,
                original_max_pos=cfg.original_max_position_embeddings,
                beta_fast=cfg.beta_fast,
                beta_slow=cfg.beta_slow,
            )
        else:
            inv = rope_inv_freq(self.rope_dim, cfg.rotary_base)
        return inv

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Recompute the frequencies in place (after `to_empty` from the meta device)."""
        with torch.device("cpu"):
            self.inv_freq.copy_(self._inv_freq())

    def forward(
        self, x_TXD: torch.Tensor, positions_T: torch.Tensor, *, inverse: bool = False
    ) -> torch.Tensor:
        """Rotate x (any middle dims) by angle +-position * inv_freq, pairs interleaved."""
        r = self.rope_dim
        if r == 0:
            return x_TXD
        angle_TR2 = positions_T.to(torch.float32)[:, None] * self.inv_freq[None, :]
        shape = (angle_TR2.shape[0],) + (1,) * (x_TXD.dim() - 2) + (r // 2,)
        cos = angle_TR2.cos().view(shape).to(x_TXD.dtype)
        sin = angle_TR2.sin().view(shape).to(x_TXD.dtype)
        if inverse:
            sin = -sin
        x_pass, x_rot = x_TXD[..., :-r], x_TXD[..., -r:]
        pairs = x_rot.unflatten(-1, (r // 2, 2))
        x0, x1 = pairs[..., 0], pairs[..., 1]
        rot = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)
        return torch.cat((x_pass, rot), dim=-1)
