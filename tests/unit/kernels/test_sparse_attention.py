"""Sparse attention kernel seam: chunked reference == dense masked softmax; registry errors.

Legend: T = queries, H = heads, D = head dim, N = key-buffer rows, K = explicit indices.
"""

from __future__ import annotations

import pytest
import torch

from primus_v4 import kernels
from primus_v4.errors import ConfigError
from primus_v4.kernels.sparse_attention import sparse_attention_torch


def _dense_reference(q_THD, kv_ND, sink_H, lo_TR, hi_TR, idx_TK, scale):
    t, n = q_THD.shape[0], kv_ND.shape[0]
    col_N = torch.arange(n)
    mask_TN = torch.zeros(t, n, dtype=torch.bool)
    for r in range(lo_TR.shape[1]):
        mask_TN |= (col_N >= lo_TR[:, r : r + 1]) & (col_N < hi_TR[:, r : r + 1])
    if idx_TK is not None:
        for k in range(idx_TK.shape[1]):
            sel = idx_TK[:, k] >= 0
            mask_TN[sel, idx_TK[sel, k]] = True
    s_THN = torch.einsum("thd,nd->thn", q_THD, kv_ND) * scale
    s_THN = s_THN.masked_fill(~mask_TN[:, None, :], float("-inf"))
    s_THN1 = torch.cat((s_THN, sink_H[None, :, None].expand(t, -1, 1)), dim=-1)
    p_THN = s_THN1.softmax(-1)[..., :n]
    return torch.einsum("thn,nd->thd", p_THN, kv_ND)


def _case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    t, h, d, n = 37, 3, 8, 100
    q = torch.randn(t, h, d, generator=g, dtype=torch.float64)
    kv = torch.randn(n, d, generator=g, dtype=torch.float64)
    sink = torch.randn(h, generator=g, dtype=torch.float64)
    # Candidates are distinct by contract: ranges in [0, 41) and [50, 62), indices in [75, 100).
    row = torch.arange(t)
    lo = torch.stack((row, 50 + row % 7), 1)
    hi = torch.stack((row + 1 + row % 4, 50 + row % 12), 1)  # second range sometimes empty
    idx = torch.stack([75 + torch.randperm(25, generator=g)[:5] for _ in range(t)])
    idx[:, 0] = -1
    idx[::3, 2] = -1
    return q, kv, sink, lo, hi, idx


@pytest.mark.parametrize("chunk_elems", [1, 500, 1 << 20])  # 1 row per chunk .. one chunk
def test_matches_dense_masked_softmax_values_and_grads(chunk_elems: int) -> None:
    q, kv, sink, lo, hi, idx = _case()
    ins = [x.clone().requires_grad_(True) for x in (q, kv, sink)]
    ref_ins = [x.clone().requires_grad_(True) for x in (q, kv, sink)]
    out = sparse_attention_torch(
        *ins, lo_TR=lo, hi_TR=hi, idx_TK=idx, scale=0.3, chunk_elems=chunk_elems
    )
    ref = _dense_reference(*ref_ins, lo, hi, idx, 0.3)
    g = torch.randn_like(out)
    (out * g).sum().backward()
    (ref * g).sum().backward()
    # float64 on both sides: only summation order differs.
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(ins, ref_ins, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12)


def test_no_sink_and_no_indices() -> None:
    q, kv, _, lo, hi, _ = _case(1)
    out = sparse_attention_torch(q, kv, None, lo_TR=lo, hi_TR=hi, scale=1.0)
    ref = _dense_reference(q, kv, torch.full((3,), float("-inf"), dtype=q.dtype), lo, hi, None, 1.0)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)  # float64, order only


def test_registry_errors_are_clear(monkeypatch: pytest.MonkeyPatch) -> None:
    assert kernels.resolve("sparse_attention", "torch") is sparse_attention_torch
    with pytest.raises(ConfigError, match="unknown kernel backend"):
        kernels.resolve("sparse_attention", "cudnn")
    with pytest.raises(ConfigError, match="unknown kernel op"):
        kernels.resolve("no_such_op")
    with pytest.raises(ConfigError, match="cannot run"):
        kernels.resolve("indexer_topk", "primus_turbo")
    monkeypatch.setenv("PRIMUS_V4_KERNEL_BACKEND", "auto")
    assert kernels.resolve("compressor_pool") is not None


def test_bf16_inputs_get_float32_math() -> None:
    """bf16 in, bf16 out, but nothing rounds to bf16 before the end: output and gradients are
    the float64 answer on the same inputs up to the final bf16 rounding."""
    g = torch.Generator().manual_seed(1)
    t, h, d, n = 16, 4, 64, 1024  # one softmax over 1024 candidates + the sink
    q, kv, sink = (
        torch.randn(*shape, generator=g).to(torch.bfloat16) for shape in ((t, h, d), (n, d), (h,))
    )
    lo = torch.zeros(t, 1, dtype=torch.long)
    hi = torch.full((t, 1), n)
    ins = [x.clone().requires_grad_(True) for x in (q, kv, sink)]
    ref_ins = [x.double().requires_grad_(True) for x in (q, kv, sink)]
    out = sparse_attention_torch(*ins, lo_TR=lo, hi_TR=hi, scale=d**-0.5)
    ref = _dense_reference(*ref_ins, lo, hi, None, d**-0.5)
    grad_out = torch.randn(out.shape, generator=g).to(torch.bfloat16)
    (out.float() * grad_out.float()).sum().backward()
    (ref * grad_out.double()).sum().backward()
    assert out.dtype == torch.bfloat16
    assert all(x.grad.dtype == torch.bfloat16 for x in ins)
    for got, want in zip(
        [out, *(x.grad for x in ins)], [ref, *(x.grad for x in ref_ins)], strict=True
    ):
        # bf16 keeps 8 significant bits: the final rounding is within 2^-8 relative.
        err = (got.double() - want.detach()).abs()
        bound = want.detach().abs() * 2**-8 + 1e-5 * want.detach().abs().max()
        assert (err <= bound).all(), float((err - bound).max())
