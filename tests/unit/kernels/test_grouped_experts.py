"""Grouped experts: torch's grouped_mm backend equals the per-expert reference, and its probe
refuses what grouped_mm cannot take (dtype, 16-byte alignment), loudly when asked for explicitly.

Legend: M = expert-sorted rows, D = hidden, F = expert ffn, E = experts.
"""

from __future__ import annotations

import pytest
import torch

from primus_v4 import kernels
from primus_v4.errors import ConfigError
from primus_v4.kernels.grouped_experts import grouped_experts_reference

COUNTS = [5, 0, 11, 1, 7]  # an expert without rows, one with a single row


def _inputs(d: int, f: int, counts: list[int], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(counts), d, generator=g)
    # std 0.5 puts some gate / up activations past the clamp, so the clamp is in the graph
    w_gate_up = 0.5 * torch.randn(len(counts), 2 * f, d, generator=g)
    w_down = 0.2 * torch.randn(len(counts), d, f, generator=g)
    return x, w_gate_up, w_down


def _run(fn, tensors, counts, dtype):
    ins = [t.to(dtype).clone().requires_grad_(True) for t in tensors]
    y = fn(ins[0], counts, ins[1], ins[2], limit=10.0)
    cot = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    y.backward(cot)
    return [y.detach(), *(t.grad for t in ins)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("counts", [COUNTS, [0, 0, 0]], ids=["uneven", "no-rows"])
def test_grouped_mm_equals_the_reference(counts, dtype) -> None:
    # Same products, another GEMM kernel: float32 sums of 16 terms may round differently
    # (measured 1 ulp, 2e-7 relative), bf16 outputs one bf16 rounding at most (measured equal).
    tol = 1e-6 if dtype == torch.float32 else 2.0**-8
    tensors = _inputs(16, 8, counts)
    got = _run(kernels.resolve("grouped_experts", "grouped_mm"), tensors, counts, dtype)
    want = _run(grouped_experts_reference, tensors, counts, dtype)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        if w.numel():  # no rows: [0, D] out and all-zero weight grads
            assert float((g - w).abs().max()) <= tol * float(w.abs().max().clamp(min=1e-30))


def test_a_strided_upstream_gradient_is_taken() -> None:
    # `.sum()` hands back a stride-0 gradient, which grouped_mm's backward rejects on its own.
    x, w_gu, w_d = (t.requires_grad_(True) for t in _inputs(16, 8, COUNTS))
    kernels.resolve("grouped_experts", "grouped_mm")(
        x, COUNTS, w_gu, w_d, limit=10.0
    ).sum().backward()
    ref = [t.detach().clone().requires_grad_(True) for t in (x, w_gu, w_d)]
    grouped_experts_reference(ref[0], COUNTS, ref[1], ref[2], limit=10.0).sum().backward()
    for got, want in zip((x, w_gu, w_d), ref, strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-6, atol=1e-6)  # as above


@pytest.mark.parametrize(
    ("d", "f", "dtype", "why"),
    [
        (6, 8, torch.float32, "hidden 6 x 4 bytes"),  # rows of 24 bytes
        (16, 4, torch.bfloat16, "expert ffn 4 x 2 bytes"),
        (16, 8, torch.float64, "not torch.float64"),
    ],
)
def test_the_probe_refuses_what_grouped_mm_cannot_take(d, f, dtype, why) -> None:
    x, w_gu, w_d = (t.to(dtype) for t in _inputs(d, f, COUNTS))
    explicit = kernels.resolve("grouped_experts", "grouped_mm")
    with pytest.raises(ConfigError, match=f"refuses this call: .*{why}"):
        explicit(x, COUNTS, w_gu, w_d, limit=10.0)
    # the reference itself takes these calls
    assert grouped_experts_reference(x, COUNTS, w_gu, w_d, limit=10.0).shape == x.shape


def test_auto_keeps_the_reference_on_cpu() -> None:
    choice = kernels.choose("grouped_experts", "auto")
    assert choice.order == ("torch",)
    assert "CPU" in choice.refused["grouped_mm"]
