"""Compressor pooling: a per-channel softmax gate over each window's rows, then a weighted sum.

Legend: P = pool slots, M = rows per window (ratio, or 2 * ratio with overlap), D = channels.
A gate of -inf removes a row from its window (the missing predecessor half of a sample's first
overlap window); every window keeps at least one finite row, so the softmax never sees all -inf.

Precision: softmax and weighted sum run in float32 whatever the input dtype, as in DeepSeek's
inference code ("compression need fp32"): a bf16 softmax over the window's rows would round every
weight to 8 bits, and the pooled keys feed attention and the indexer's top-k. Low-precision
inputs go through `_Float32Pool`, which saves them as they came and recomputes the softmax in
backward, so a bf16 model keeps bf16 activation memory; float32 inputs take the plain autograd
expression (bit for bit what they always computed).
"""

from __future__ import annotations

from typing import Any

import torch


def _weights_and_pool(kv_PMD: torch.Tensor, gate_PMD: torch.Tensor):
    w_PMD = gate_PMD.float().softmax(dim=1)
    return w_PMD, (kv_PMD.float() * w_PMD).sum(dim=1)


class _Float32Pool(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, kv_PMD: torch.Tensor, gate_PMD: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(kv_PMD, gate_PMD)
        return _weights_and_pool(kv_PMD, gate_PMD)[1].to(kv_PMD.dtype)

    @staticmethod
    def backward(ctx: Any, g_PD: torch.Tensor):  # type: ignore[override]
        kv_PMD, gate_PMD = ctx.saved_tensors
        w_PMD, y_PD = _weights_and_pool(kv_PMD, gate_PMD)
        g = g_PD.float()[:, None]
        # d y / d kv = w; d y / d gate = w (kv - y) (softmax over the rows, per channel).
        dkv = (g * w_PMD).to(kv_PMD.dtype)
        dgate = (g * w_PMD * (kv_PMD.float() - y_PD[:, None])).to(gate_PMD.dtype)
        return dkv, dgate


def compressor_pool_torch(kv_PMD: torch.Tensor, gate_PMD: torch.Tensor) -> torch.Tensor:
    """[P, M, D] values and gate logits -> [P, D] pooled keys, in kv's dtype."""
    if kv_PMD.dtype in (torch.float32, torch.float64):
        return (kv_PMD * gate_PMD.softmax(dim=1)).sum(dim=1)
    return _Float32Pool.apply(kv_PMD, gate_PMD)
