"""bf16 models compute what DeepSeek's release computes in float32, and round only at the end.

Each case feeds bf16 tensors and checks against the float64 (or float32) answer on the same bf16
values: discrete choices (indexer top-k, router top-k) must be the float32 choice exactly, on
inputs built so that a bf16 computation would choose differently; sums (mHC collapse and
write-back, MoE combine, compressor pooling) must be the exact answer rounded once to bf16; the
mixing saves no float32 copy of the streams for backward.

Legend: T = rows, K = streams or top-k, D = hidden, E = experts, H = heads, P = keys.
"""

from __future__ import annotations

import torch

from primus_v4.kernels.compressor_pool import compressor_pool_torch
from primus_v4.kernels.indexer_topk import indexer_topk_torch
from primus_v4.models.deepseek_v4 import DeepseekV4Config
from primus_v4.models.deepseek_v4.hyper_connection import HyperMixer
from primus_v4.models.deepseek_v4.layout import RowLayout
from primus_v4.models.deepseek_v4.moe import MoE, RoutingInputs, combine_experts
from primus_v4.models.deepseek_v4.stream_sums import mix

BF16 = torch.bfloat16


def _within_one_rounding(got: torch.Tensor, want: torch.Tensor) -> None:
    """got (bf16) is want rounded once: within half a bf16 ulp of want."""
    assert got.dtype == BF16
    want = want.detach().double()
    err = (got.detach().double() - want).abs()
    # Half an 8-bit ulp is at most 2^-8 relative; float32 sums of a few terms add ~1e-7.
    bound = want.abs() * 2**-8 + 1e-6 * want.abs().max()
    assert (err <= bound).all(), float((err / bound).max())


def _bf16(*shape: int, g: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * scale).to(BF16)


def test_indexer_topk_on_bf16_inputs_is_the_float32_selection() -> None:
    g = torch.Generator().manual_seed(0)
    t, h, d, p = 64, 4, 16, 40
    q, w, k = _bf16(t, h, d, g=g), _bf16(t, h, g=g), _bf16(p, d, g=g)
    lo, hi = torch.zeros(t, dtype=torch.long), torch.full((t,), p)
    args = dict(lo_T=lo, hi_T=hi, topk=8, chunk=16, scale=0.125)
    got = indexer_topk_torch(q, w, k, **args)
    want = indexer_topk_torch(q.float(), w.float(), k.float(), **args)
    # Scores rounded to bf16 (8 bits) would tie or swap near-equal keys in most rows.
    s = (torch.einsum("thd,pd->thp", q, k).relu() * w[..., None]).sum(1) * 0.125
    bf16_order = torch.sort(s.float(), dim=1, descending=True, stable=True).indices[:, :8]
    assert not torch.equal(bf16_order, want), "the case must be one bf16 scores get wrong"
    assert torch.equal(got, want)


def test_router_of_a_bf16_model_chooses_the_float32_experts() -> None:
    """Two experts whose logits differ by far less than a bf16 ulp of the logit: the float32
    gate keeps them apart, a bf16 matmul output would round them to one value."""
    cfg = DeepseekV4Config.preset("tiny", vocab_size=64, num_hash_layers=0)
    moe = MoE(cfg, layer_idx=0).to(BF16)
    e, dh = moe.router.weight.shape
    g = torch.Generator().manual_seed(0)
    x = _bf16(32, dh, g=g)
    with torch.no_grad():
        w = _bf16(e, dh, g=g, scale=0.02)
        w[1] = w[0]
        w[1, 0] += w[0, 0].abs().clamp(min=1e-2) * 2**-6  # expert 1 edges out expert 0 ...
        moe.router.weight.copy_(w)
        x[:, 0] = x[:, 0].abs() * 1e-2  # ... by a hair of the logit
    routing = RoutingInputs.build(
        torch.arange(32), RowLayout.from_cu_seqlens(torch.tensor([0, 32]), local_rows=32), None
    )
    expert_RK, weight_RK, _ = moe.router(x, routing)
    logits = x.double() @ moe.router.weight.double().t()
    want = torch.sqrt(torch.nn.functional.softplus(logits)).topk(cfg.moe_router_topk).indices
    bf16_logits = x @ moe.router.weight.t()
    assert (bf16_logits[:, 0] == bf16_logits[:, 1]).any(), "a bf16 gate must tie on this case"
    assert torch.equal(expert_RK.sort(1).values, want.sort(1).values)
    assert weight_RK.dtype == torch.float32


def test_mhc_collapse_and_write_back_round_once_and_save_no_float32_copy() -> None:
    g = torch.Generator().manual_seed(0)
    t, k, d = 8, 4, 64
    mixer = HyperMixer(hidden=d, k=k, sinkhorn_iters=20, eps=1e-6, norm_eps=1e-6)
    mixer.init_weights(0.5)
    x = _bf16(t, k, d, g=g).requires_grad_(True)
    out = _bf16(t, d, g=g).requires_grad_(True)
    pre, post, comb = mixer.coefficients(x)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda s: saved.append(s) or s, lambda s: s):
        y = mixer.write_back(x, out, post, comb)
        h = mixer.collapse(x, pre)
    pre64, post64, comb64 = (c.detach().double() for c in (pre, post, comb))
    _within_one_rounding(h, torch.einsum("tk,tkd->td", pre64, x.detach().double()))
    want = torch.einsum("tij,tid->tjd", comb64, x.detach().double())
    _within_one_rounding(y, want + post64[..., None] * out.detach().double()[:, None])
    # The mixing saves its bf16 inputs themselves, no float32 copy of the streams.
    big = [s for s in saved if s.numel() >= t * d]
    assert big and all(s.dtype == BF16 for s in big), [(s.dtype, s.shape) for s in big]
    (y.float().sum() + h.float().sum()).backward()
    assert x.grad.dtype == BF16 and out.grad.dtype == BF16
    assert mixer.proj.weight.grad.dtype == torch.float32


def test_mix_gradients_are_the_float64_gradients_rounded_once() -> None:
    g = torch.Generator().manual_seed(1)
    t, k, d = 6, 4, 32
    w = torch.rand(t, k, k, generator=g).requires_grad_(True)
    p = torch.rand(t, k, generator=g).requires_grad_(True)
    x, f = _bf16(t, k, d, g=g).requires_grad_(True), _bf16(t, d, g=g).requires_grad_(True)
    gy = _bf16(t, k, d, g=g)
    mix(w, x, p_TJ=p, f_TD=f).backward(gy)
    ins64 = [v.detach().double().requires_grad_(True) for v in (w, x, p, f)]
    w64, x64, p64, f64 = ins64
    y64 = torch.einsum("tij,tid->tjd", w64, x64) + p64[..., None] * f64[:, None]
    y64.backward(gy.double())
    for got, ref in zip((x.grad, f.grad), (x64.grad, f64.grad), strict=True):
        _within_one_rounding(got, ref)
    for got, ref in zip((w.grad, p.grad), (w64.grad, p64.grad), strict=True):
        torch.testing.assert_close(got.double(), ref, rtol=1e-6, atol=1e-6)  # float32 sums


def test_moe_combine_weights_experts_in_float32() -> None:
    g = torch.Generator().manual_seed(2)
    r, k, d = 16, 2, 64
    y, wt = _bf16(r, k, d, g=g), torch.rand(r, k, generator=g) * 1.5
    got = combine_experts(y, wt)
    assert got.dtype == torch.float32
    want = torch.einsum("rkd,rk->rd", y.double(), wt.double())
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)  # float32 sum of 2


def test_compressor_pool_softmax_and_sum_in_float32() -> None:
    g = torch.Generator().manual_seed(3)
    kv, gate = _bf16(10, 8, 32, g=g), _bf16(10, 8, 32, g=g, scale=3.0)
    gate[0, :4] = float("-inf")  # a missing overlap half drops out of the softmax
    kv[0, :4] = 0.0  # (its kv rows are zeros, as the compressor builds them)
    kv, gate = kv.requires_grad_(True), gate.requires_grad_(True)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda s: saved.append(s) or s, lambda s: s):
        got = compressor_pool_torch(kv, gate)
    assert saved and all(s.dtype == BF16 for s in saved)  # no float32 copies kept for backward
    ins64 = [v.detach().double().requires_grad_(True) for v in (kv, gate)]
    want = (ins64[0] * ins64[1].softmax(dim=1)).sum(1)
    _within_one_rounding(got, want)
    gy = _bf16(10, 32, g=g)
    got.backward(gy)
    want.backward(gy.double())
    _within_one_rounding(kv.grad, ins64[0].grad)
    _within_one_rounding(gate.grad, ins64[1].grad)
