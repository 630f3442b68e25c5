"""primus-turbo adapters, on CPU: our ranges + indices become its top-k index format without
changing the op, and the adapters call its documented APIs (here stand-ins that implement the
documented contract in torch and check every constraint its kernels assert) so that the result
is the reference's. The probes check version and signature before auto may pick it.

Legend: T = queries, H = heads, D = head dim, N = key-buffer rows, W = converted candidates.
"""

from __future__ import annotations

import pytest
import torch
from packed_cases import dense_mask, packed_case

from primus_v4.kernels import turbo
from primus_v4.kernels.grouped_experts import grouped_experts_reference
from primus_v4.kernels.sparse_attention import sparse_attention_torch


def _case(seed: int, dim: int = 16, cp=(0, 1)):
    return packed_case(lengths=[1, 3, 9, 26, 5], window=20, topk=18, heads=3, dim=dim, cp=cp,
                       seed=seed)  # fmt: skip


@pytest.mark.parametrize("cp", [(0, 1), (1, 2)], ids=["whole", "cp-rank1"])
def test_index_format_keeps_every_candidate_once(cp) -> None:
    (q, kv, sink), kw = _case(0, cp=cp)
    idx = turbo.ranges_to_indices(kw["lo_TR"], kw["hi_TR"], kw["idx_TK"])
    assert idx.dtype == torch.int32 and idx.shape[1] % turbo.INDEX_MULTIPLE == 0
    n = kv.shape[0]
    got = torch.zeros(idx.shape[0], n, dtype=torch.long)
    rows, slots = (idx >= 0).nonzero(as_tuple=True)
    got.index_put_((rows, idx[rows, slots].long()), torch.ones_like(rows), accumulate=True)
    assert torch.equal(got.bool(), dense_mask(kw, n)) and int(got.max()) == 1  # once each
    assert bool(((idx == -1) | (idx >= 0)).all())
    # the op on the converted indices alone (empty ranges) is the op: float64, order only
    empty = kw["lo_TR"][:, :0]
    q, kv, sink = q.double(), kv.double(), sink.double()
    want = sparse_attention_torch(q, kv, sink, **kw)
    alone = {"lo_TR": empty, "hi_TR": empty, "idx_TK": idx.long(), "scale": kw["scale"]}
    torch.testing.assert_close(sparse_attention_torch(q, kv, sink, **alone), want, rtol=1e-12,
                               atol=1e-12)  # fmt: skip


def test_no_candidates_is_one_block_of_minus_one() -> None:
    lo = torch.zeros(3, 1, dtype=torch.long)
    idx = turbo.ranges_to_indices(lo, lo, None)
    assert idx.shape == (3, turbo.INDEX_MULTIPLE) and bool((idx == -1).all())


def _sparse_mla_contract(q, kv, topk_indices, attn_sink=None, kv_lora_rank=512, scale=None):
    """primus_turbo.pytorch.ops.attention.sparse_mla_func as documented, densely in torch, with
    the checks its kernels make (576 channels, int32 indices padded to a multiple of 32, a
    float32 sink, kv rows >= queries)."""
    t, h, d_qk = q.shape
    assert d_qk == turbo.MLA_QK_DIM and kv.shape[-1] == d_qk and kv.shape[0] >= t
    assert topk_indices.dtype == torch.int32 and topk_indices.shape[1] % 32 == 0
    assert attn_sink is None or attn_sink.dtype == torch.float32
    rows, slots = (topk_indices >= 0).nonzero(as_tuple=True)
    mask = torch.zeros(t, kv.shape[0], dtype=torch.bool)
    mask[rows, topk_indices[rows, slots].long()] = True
    s = torch.einsum("thd,nd->thn", q, kv) * scale
    s = s.masked_fill(~mask[:, None, :], float("-inf"))
    sink = (attn_sink if attn_sink is not None else q.new_full((h,), float("-inf"))).to(s.dtype)
    p = torch.cat((s, sink[None, :, None].expand(t, h, 1)), -1).softmax(-1)[..., :-1]
    return torch.einsum("thn,nd->thd", p, kv[:, :kv_lora_rank])


def _grouped_gemm_contract(a, b, group_lens, group_offs=None, trans_b=False, num_cu=None):
    """primus_turbo.pytorch.ops.grouped_gemm as documented: rows of group g times b[g] ([K, N],
    or [N, K] transposed with trans_b)."""
    assert group_lens.dtype == torch.int64 and int(group_lens.sum()) == a.shape[0]
    outs, start = [], 0
    for g, n in enumerate(group_lens.tolist()):
        w = b[g].t() if trans_b else b[g]
        outs.append(a[start : start + n] @ w)
        start += n
    return torch.cat(outs)


def _fake_lookup(module: str, name: str):
    table = {"sparse_mla_func": _sparse_mla_contract, "grouped_gemm": _grouped_gemm_contract}
    return table[name], None


def _grads(fn, tensors, cot, *rest, **kw):
    ins = [t.clone().requires_grad_(True) for t in tensors]
    out = fn(*ins, *rest, **kw)
    out.backward(cot)
    return [out.detach(), *(t.grad for t in ins)]


def test_sparse_attention_through_the_sparse_mla_contract(monkeypatch) -> None:
    monkeypatch.setattr(turbo, "_lookup", _fake_lookup)
    (q, kv, sink), kw = _case(1, dim=turbo.MLA_V_DIM)
    cot = torch.randn(q.shape, generator=torch.Generator().manual_seed(3))
    got = _grads(turbo.sparse_attention_turbo, (q, kv, sink), cot, **kw)
    want = _grads(sparse_attention_torch, (q, kv, sink), cot, **kw)
    for g, w in zip(got, want, strict=True):  # float32, summation order only
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5 * float(w.abs().max()))


def test_grouped_experts_through_the_grouped_gemm_contract(monkeypatch) -> None:
    monkeypatch.setattr(turbo, "_lookup", _fake_lookup)
    monkeypatch.delenv(turbo.FP8_ENV, raising=False)
    g = torch.Generator().manual_seed(0)
    counts = [4, 0, 9]
    x, w_gu, w_d = (torch.randn(*s, generator=g) for s in ((13, 16), (3, 16, 16), (3, 16, 8)))
    cot = torch.randn(13, 16, generator=g)

    def experts(fn):
        return lambda x, w_gu, w_d: fn(x, counts, w_gu, w_d, limit=1.0)

    got = _grads(experts(turbo.grouped_experts_turbo), (x, w_gu, w_d), cot)
    want = _grads(experts(grouped_experts_reference), (x, w_gu, w_d), cot)
    for a, b in zip(got, want, strict=True):  # same products: float32 order only
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_probes_check_install_device_version_and_signature(monkeypatch) -> None:
    assert turbo._probe(turbo.SPARSE_MLA, turbo.SPARSE_MLA_ARGS) in (
        "primus_turbo is not installed",
        "primus_turbo's kernels run on ROCm GPUs only",
    )
    monkeypatch.setattr(turbo, "turbo_importable", lambda: None)
    monkeypatch.setattr(turbo, "has_gpu", lambda: True)
    monkeypatch.setattr(torch.version, "hip", "6.4")
    monkeypatch.setattr(turbo, "_lookup", _fake_lookup)
    monkeypatch.setattr(turbo, "installed_version", lambda: (0, 4, 1))
    assert turbo._probe(turbo.SPARSE_MLA, turbo.SPARSE_MLA_ARGS) is None
    assert turbo._probe(turbo.GROUPED_GEMM, turbo.GROUPED_GEMM_ARGS) is None
    monkeypatch.setattr(turbo, "installed_version", lambda: (0, 4, 0))
    assert "older than 0.4.1" in turbo._probe(turbo.SPARSE_MLA, turbo.SPARSE_MLA_ARGS)
    monkeypatch.setattr(turbo, "installed_version", lambda: None)
    monkeypatch.setattr(turbo, "_lookup", lambda m, n: (lambda q, kv, indices: q, None))
    reason = turbo._probe(turbo.SPARSE_MLA, turbo.SPARSE_MLA_ARGS)
    assert "no argument(s) ['topk_indices', 'attn_sink', 'kv_lora_rank', 'scale']" in reason


def test_calls_its_kernels_cannot_take_are_refused() -> None:
    (q, kv, sink), kw = _case(2, dim=turbo.MLA_V_DIM)
    assert "bf16" in turbo.sparse_mla_refuses(q, kv, sink, **kw)
    q16, kv16 = q.bfloat16(), kv.bfloat16()
    assert "multiple of 32" in turbo.sparse_mla_refuses(q16, kv16, sink, **kw)  # 3 heads
    q32 = q16.repeat(1, 11, 1)[:, :32]
    assert "ROCm" in turbo.sparse_mla_refuses(q32, kv16, sink, **kw)  # CPU tensors
    x = torch.randn(4, 16)
    assert "bf16 / fp16" in turbo.grouped_gemm_refuses(x, [4], x[None], x.t()[None])
