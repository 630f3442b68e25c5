"""Chunked linear + cross-entropy equals the materialized-logits CE, in value and gradients.

Legend: T = rows, D = hidden, V = vocab.
"""

from __future__ import annotations

import pytest
import torch

from primus_v4.kernels.linear_ce import chunked_linear_ce, full_linear_ce


def _inputs(t: int = 37, d: int = 16, v: int = 50):
    torch.manual_seed(0)
    h = torch.randn(t, d, requires_grad=True)
    w = torch.randn(v, d, requires_grad=True)
    labels = torch.randint(0, v, (t,))
    mask = (torch.rand(t) > 0.3).float()
    labels[mask == 0] = -100  # ignored labels must never be read as ids
    return h, w, labels, mask


@pytest.mark.parametrize("chunk", [1, 8, 37, 1000])
def test_chunked_equals_full_value_and_grads(chunk):
    h, w, labels, mask = _inputs()
    ref = full_linear_ce(h, w, labels, mask)
    g_h, g_w = torch.autograd.grad(ref * 0.7, (h, w))
    got = chunked_linear_ce(h, w, labels, mask, chunk=chunk)
    c_h, c_w = torch.autograd.grad(got * 0.7, (h, w))
    # float32 logsumexp / GEMM summed in different chunk orders.
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(c_h, g_h, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(c_w, g_w, rtol=1e-5, atol=1e-6)


def test_fractional_mask_weights_match():
    h, w, labels, _ = _inputs()
    labels = labels.clamp(min=0)
    mask = torch.rand(h.shape[0])
    ref = full_linear_ce(h, w, labels, mask)
    got = chunked_linear_ce(h, w, labels, mask, chunk=5)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-5)  # fp32 chunk order


def test_all_masked_gives_zero_loss_and_finite_zero_grads():
    h, w, labels, mask = _inputs()
    got = chunked_linear_ce(h, w, labels, torch.zeros_like(mask), chunk=8)
    got.backward()
    assert got.item() == 0.0
    for g in (h.grad, w.grad):
        assert torch.isfinite(g).all() and g.abs().sum() == 0


def test_only_weight_grad_requested():
    h, w, labels, mask = _inputs()
    h = h.detach()
    got = chunked_linear_ce(h, w, labels, mask, chunk=8)
    (g_w,) = torch.autograd.grad(got, (w,))
    (r_w,) = torch.autograd.grad(full_linear_ce(h, w, labels, mask), (w,))
    torch.testing.assert_close(g_w, r_w, rtol=1e-5, atol=1e-6)  # fp32 chunk order


def test_no_grad_mode_returns_the_same_value():
    h, w, labels, mask = _inputs()
    with torch.no_grad():
        got = chunked_linear_ce(h, w, labels, mask, chunk=8)
    assert got.grad_fn is None
    torch.testing.assert_close(got, full_linear_ce(h, w, labels, mask), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("chunk", [1, 8, 1000])
def test_all_rows_head_equals_supervised_rows_head(chunk, ce_rows):
    """all_rows runs the head on every row (a conventional trainer's cost), same value and grads."""
    h, w, labels, mask = _inputs()
    got = {}
    for all_rows in (False, True):
        ce_rows.clear()
        value = chunked_linear_ce(h, w, labels, mask, chunk=chunk, all_rows=all_rows)
        got[all_rows] = (value, *torch.autograd.grad(value * 0.7, (h, w)))
        assert sum(ce_rows) == (h.shape[0] if all_rows else int((mask != 0).sum()))
    for a, b in zip(got[False], got[True], strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)  # fp32 chunk order


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_head_on_cpu_gives_half_precision_logits(dtype):
    """On CPU the GEMMs of a bf16/fp16 head run in float32 (oneDNN's half GEMM is ~100x slower
    there); the logits are still rounded to the head's dtype, as a half GEMM's would be."""
    h32, w32, labels, mask = _inputs(t=29, d=24, v=300)
    h = h32.detach().to(dtype).requires_grad_()
    w = w32.detach().to(dtype).requires_grad_()
    logits = (h.float() @ w.float().t()).to(dtype).float()  # the head's rounding of each logit
    keep = mask > 0
    ref = torch.nn.functional.cross_entropy(logits[keep], labels[keep], reduction="sum")
    r_h, r_w = torch.autograd.grad(ref, (h, w))
    got = chunked_linear_ce(h, w, labels, mask, chunk=8)
    g_h, g_w = torch.autograd.grad(got, (h, w))
    assert got.dtype == torch.float32
    # the same float32 logits in another chunk order; grads then rounded to the input's dtype
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-4)
    assert g_h.dtype == h.dtype and g_w.dtype == w.dtype
    torch.testing.assert_close(g_h.float(), r_h.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(g_w.float(), r_w.float(), rtol=2e-2, atol=2e-2)
