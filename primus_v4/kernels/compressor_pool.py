"""Compressor pooling: a per-channel softmax gate over each window's rows, then a weighted sum.

Legend: P = pool slots, M = rows per window (ratio, or 2 * ratio with overlap), D = channels.
A gate of -inf removes a row from its window (the missing predecessor half of a sample's first
overlap window); every window keeps at least one finite row, so the softmax never sees all -inf.
"""

from __future__ import annotations

import torch


def compressor_pool_torch(kv_PMD: torch.Tensor, gate_PMD: torch.Tensor) -> torch.Tensor:
    """[P, M, D] values and gate logits -> [P, D] pooled keys (autograd through torch ops)."""
    return (kv_PMD * gate_PMD.softmax(dim=1)).sum(dim=1)
