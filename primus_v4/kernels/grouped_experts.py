"""Grouped routed experts: clamped SwiGLU over rows already sorted by expert.

Legend: M = routed rows (tokens x top-k, sorted by expert), D = hidden, F = expert ffn,
E = local experts.

The torch reference loops over experts with one matmul pair each (exact, no padding); a fused
grouped GEMM backend registers under the same op name (`registry.register`) and must match it.
Callers resolve the op once at construction (`registry.resolve(OP_NAME)`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from primus_v4.kernels.registry import register

OP_NAME = "grouped_experts"


def clamped_swiglu(gate_up_MF2: torch.Tensor, limit: float) -> torch.Tensor:
    """SiLU(min(gate, limit)) * clamp(up, -limit, limit); clamps bound bf16 activations."""
    gate, up = gate_up_MF2.chunk(2, dim=-1)
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)


def grouped_experts_reference(
    x_MD: torch.Tensor,
    tokens_per_expert_E: list[int],
    w_gate_up_EF2D: torch.Tensor,
    w_down_EDF: torch.Tensor,
    *,
    limit: float,
) -> torch.Tensor:
    """Rows [off_e, off_e + n_e) go through expert e; returns [M, D] in the same order. Weights
    are [E, out, in] (nn.Linear's layout): gate rows [0, F), up rows [F, 2F)."""
    outs = []
    offset = 0
    for e, n in enumerate(tokens_per_expert_E):
        if n == 0:
            continue
        rows = x_MD[offset : offset + n]
        outs.append(clamped_swiglu(rows @ w_gate_up_EF2D[e].t(), limit) @ w_down_EDF[e].t())
        offset += n
    if not outs:
        # Keep the expert weights in the graph so an empty batch still yields (zero) grads.
        return x_MD @ w_down_EDF.new_zeros(x_MD.shape[-1], x_MD.shape[-1]) + 0.0 * (
            w_gate_up_EF2D.sum() + w_down_EDF.sum()
        )
    return torch.cat(outs, dim=0)


register(OP_NAME, "torch", grouped_experts_reference)
