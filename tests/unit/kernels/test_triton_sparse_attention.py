"""Our Triton sparse attention against the torch reference, forward and backward, on random
packed layouts (packed_cases.py: uneven samples, windows clipped at sample starts, empty ranges,
-1 indices, tied keys, a CP rank's row split), in Triton's interpreter on CPU (the root conftest
sets TRITON_INTERPRET=1 without an accelerator) or compiled on a GPU.

Legend: T = queries, H = heads, D = head dim, N = key-buffer rows.

Tolerances. float32: 1e-5 of each tensor's largest value (the acceptance bound; only summation
order differs, measured ~3e-7). bf16: elementwise, twice the first-order rounding bound of the
places the kernel rounds, with u = 2^-9 (bf16's unit roundoff): p and ds become bf16 operands of
the second dot of each pair, delta = rowsum(do * out) reads the bf16 output, and every result is
stored in bf16. From float64 magnitudes on the same bf16 inputs (P, dS the exact softmax and
its gradient, e_delta = u sum |do| |out|):
  out  <= u |out| + u (P |V|)
  dq   <= u |dq| + scale (u |dS| + P e_delta) |K|
  dkv  <= u |dkv| + sum_t,h [scale (u |dS| + P e_delta)^T |q| + u P^T |do|]
  dsink <= u |dsink| + sum_t p_sink e_delta
plus 1e-5 of the tensor's scale for float32 accumulation. A bound from the terms' magnitudes
(not the result's) stays meaningful where a sum cancels, as the sink's gradient does.
"""

from __future__ import annotations

import pytest
import torch
import triton  # noqa: F401  (the test extra installs it: a missing triton fails, never skips)
from packed_cases import dense_mask, packed_case

from primus_v4 import kernels
from primus_v4.errors import ConfigError
from primus_v4.kernels.sparse_attention import sparse_attention_torch

U_BF16 = 2.0**-9
FP32_REL = 1e-5


@pytest.fixture(scope="module")
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _run(fn, args, kwargs, dtype, device, cot):
    ins = [a.to(device=device, dtype=dtype).requires_grad_(True) for a in args]
    kw = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    out = fn(*ins, **kw)
    out.backward(cot.to(device=device, dtype=out.dtype))
    return [t.detach().float().cpu() for t in (out, *(x.grad for x in ins))]


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp(min=1e-30))


def _triton(*args, **kwargs):
    return kernels.resolve("sparse_attention", "triton")(*args, **kwargs)


LAYOUTS = {
    # (lengths, CP (rank, size)): 1-row and shorter-than-window samples, a sample longer than
    # the window and a ratio; the second splits the pack over 2 ranks and is seen from rank 1,
    # whose first sample began on rank 0 (its windows reach into the boundary rows).
    "packed": ([1, 3, 9, 26, 5], (0, 1)),
    "cp-rank1": ([5, 30, 21, 2, 6], (1, 2)),
}


def _case(name: str, seed: int):
    lengths, cp = LAYOUTS[name]
    # window 20 and top-k 18 span two 16-row key blocks; 3 heads leave most of a head block idle
    return packed_case(lengths=lengths, window=20, topk=18, heads=3, dim=16, cp=cp, seed=seed)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_float32_matches_the_reference(name, device) -> None:
    args, kwargs = _case(name, seed=1)
    cot = torch.randn(args[0].shape, generator=torch.Generator().manual_seed(7))
    got = _run(_triton, args, kwargs, torch.float32, device, cot)
    want = _run(sparse_attention_torch, args, kwargs, torch.float32, torch.device("cpu"), cot)
    for label, g, w in zip(("out", "dq", "dkv", "dsink"), got, want, strict=True):
        assert _rel(g, w) <= FP32_REL, (label, _rel(g, w))


def _float64_truth(args, kwargs, cot):
    """Exact softmax attention and its gradients in float64, with the magnitudes the bf16
    bound is made of (see the module docstring)."""
    q, kv, sink = (a.double() for a in args)
    do, scale = cot.double(), kwargs["scale"]
    mask = dense_mask(kwargs, kv.shape[0])[:, None, :]
    s = torch.einsum("thd,nd->thn", q, kv) * scale
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(torch.cat((s, sink[None, :, None].expand(s.shape[0], -1, 1)), -1), -1)
    p = torch.exp(s - lse[..., None])
    p_sink = torch.exp(sink[None, :] - lse)
    out = torch.einsum("thn,nd->thd", p, kv)
    delta = (do * out).sum(-1)
    ds = p * (torch.einsum("thd,nd->thn", do, kv) - delta[..., None])
    dq = torch.einsum("thn,nd->thd", ds, kv) * scale
    dkv = torch.einsum("thn,thd->nd", ds, q) * scale + torch.einsum("thn,thd->nd", p, do)
    dsink = -(p_sink * delta).sum(0)
    u = U_BF16
    e_delta = u * (do.abs() * out.abs()).sum(-1)
    e_ds = u * ds.abs() + p * e_delta[..., None]
    bounds = [
        u * out.abs() + u * torch.einsum("thn,nd->thd", p, kv.abs()),
        u * dq.abs() + scale * torch.einsum("thn,nd->thd", e_ds, kv.abs()),
        u * dkv.abs()
        + scale * torch.einsum("thn,thd->nd", e_ds, q.abs())
        + u * torch.einsum("thn,thd->nd", p, do.abs()),
        u * dsink.abs() + (p_sink * e_delta).sum(0),
    ]
    return [out, dq, dkv, dsink], bounds


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_bf16_within_the_rounding_bound(name, device) -> None:
    args, kwargs = _case(name, seed=2)
    args = tuple(a.bfloat16().float() for a in args)  # the bf16 inputs, exactly
    cot = torch.randn(args[0].shape, generator=torch.Generator().manual_seed(8)).bfloat16()
    got = _run(_triton, args, kwargs, torch.bfloat16, device, cot)
    truth, bounds = _float64_truth(args, kwargs, cot.float())
    for label, g, w, b in zip(("out", "dq", "dkv", "dsink"), got, truth, bounds, strict=True):
        limit = 2 * b + FP32_REL * w.abs().max()
        excess = (g.double() - w).abs() - limit
        assert (excess <= 0).all(), (label, float(excess.max()), float(w.abs().max()))


def test_no_sink_no_indices_and_empty_rows(device) -> None:
    """Without a sink and without explicit indices; rows whose every range is empty output 0
    with zero gradients (the reference's softmax over nothing would be NaN there)."""
    args, kwargs = _case("packed", seed=3)
    q, kv, _ = args
    kwargs = {**kwargs, "idx_TK": None}
    kwargs["hi_TR"] = kwargs["hi_TR"].clone()
    empty = torch.arange(q.shape[0]) % 5 == 0
    kwargs["hi_TR"][empty] = kwargs["lo_TR"][empty]
    cot = torch.randn(q.shape, generator=torch.Generator().manual_seed(9))
    ins = [x.to(device).clone().requires_grad_(True) for x in (q, kv)]
    kw = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    out = _triton(ins[0], ins[1], None, **kw)
    out.backward(cot.to(device))
    assert torch.equal(out[empty.to(device)].cpu(), torch.zeros_like(out[empty.to(device)].cpu()))
    assert torch.equal(ins[0].grad[empty.to(device)].abs().sum().cpu(), torch.tensor(0.0))
    live = ~empty
    ref_in = [x.clone().requires_grad_(True) for x in (q[live], kv)]
    ref_kw = {**kwargs, "lo_TR": kwargs["lo_TR"][live], "hi_TR": kwargs["hi_TR"][live]}
    ref = sparse_attention_torch(ref_in[0], ref_in[1], None, **ref_kw)
    ref.backward(cot[live])
    assert _rel(out[live.to(device)].detach().cpu(), ref.detach()) <= FP32_REL
    assert _rel(ins[0].grad[live.to(device)].cpu(), ref_in[0].grad) <= FP32_REL
    assert _rel(ins[1].grad.cpu(), ref_in[1].grad) <= FP32_REL


def test_registry_refuses_what_the_kernel_cannot_take(device) -> None:
    args, kwargs = _case("packed", seed=4)
    q, kv, sink = (a.double() for a in args)  # float64: the reference only
    with pytest.raises(ConfigError, match=r"refuses this call.*float64"):
        _triton(q, kv, sink, **kwargs)
    if device.type == "cpu":  # auto keeps the reference on CPU, whatever the interpreter says
        assert kernels.choose("sparse_attention").order == ("torch",)
