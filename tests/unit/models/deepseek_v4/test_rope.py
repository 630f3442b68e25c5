"""RoPE: partial interleaved rotation, relative-position property, inverse, YaRN, Hadamard.

Legend: T = rows, H = heads, D = channels, R = rotary channels.
"""

from __future__ import annotations

import torch

from primus_v4.models.deepseek_v4.config import DeepseekV4Config
from primus_v4.models.deepseek_v4.rope import RotaryEmbedding, rope_inv_freq


def _cfg(**kw) -> DeepseekV4Config:
    return DeepseekV4Config.preset("tiny", **kw)


def test_only_last_rope_channels_rotate_and_inverse_undoes() -> None:
    rope = RotaryEmbedding(_cfg(), compressed=False)
    x_THD = torch.randn(6, 2, 32)
    pos_T = torch.tensor([0, 1, 5, 17, 300, 65535])
    y = rope(x_THD, pos_T)
    assert torch.equal(y[..., :-8], x_THD[..., :-8])
    assert torch.equal(y[0], x_THD[0])  # position 0 is the identity
    torch.testing.assert_close(rope(y, pos_T, inverse=True), x_THD, rtol=0, atol=1e-5)  # f32 trig


def test_scores_depend_only_on_relative_position() -> None:
    rope = RotaryEmbedding(_cfg(), compressed=True)
    q, k = torch.randn(1, 32).double(), torch.randn(1, 32).double()
    rope = rope.double()
    s1 = (rope(q, torch.tensor([10])) * rope(k, torch.tensor([3]))).sum()
    s2 = (rope(q, torch.tensor([107])) * rope(k, torch.tensor([100]))).sum()
    torch.testing.assert_close(s1, s2, rtol=0, atol=1e-5)  # angles are float32 products


def test_interleaved_pairs() -> None:
    rope = RotaryEmbedding(_cfg(qk_pos_emb_head_dim=2, kv_channels=4), compressed=False)
    x = torch.tensor([[5.0, 7.0, 1.0, 0.0]])
    y = rope(x, torch.tensor([1]))  # theta_0 = 1 rad for the single pair (2, 3)
    c, s = torch.cos(torch.tensor(1.0)), torch.sin(torch.tensor(1.0))
    torch.testing.assert_close(y, torch.tensor([[5.0, 7.0, c, s]]))


def test_yarn_keeps_high_and_scales_low_frequencies() -> None:
    plain = rope_inv_freq(64, 40000.0)
    yarn = rope_inv_freq(64, 40000.0, yarn_factor=4.0, original_max_pos=65536)
    torch.testing.assert_close(yarn[0], plain[0])
    torch.testing.assert_close(yarn[-1], plain[-1] / 4)
    assert torch.all(yarn <= plain + 1e-12)
    assert torch.equal(rope_inv_freq(64, 40000.0, yarn_factor=1.0), plain)
