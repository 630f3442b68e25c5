"""Index-driven sparse attention with a learned sink: our Triton kernels (forward and backward).

Legend: T = query rows, H = heads, D = head dim, N = rows of the key buffer, R = key ranges
per query, K = explicit key indices per query; BH / BN / BD = the head, key and channel blocks.

Same contract as `sparse_attention.sparse_attention_torch` (the reference that defines the op):
query t attends to the buffer rows of its ranges [lo[t, r], hi[t, r]) and its explicit rows
idx[t, k] (-1 = none), one softmax over them plus the sink logit (value 0); the row is both key
and value (single-latent MQA).

Forward: one program per (query row, head block). The key buffer is shared by all heads (MQA),
so a block of BN candidate rows is loaded once and scored against BH heads with one `tl.dot`
([BH, BD] x [BD, BN]); an online softmax (running max m, row_sum, accumulator acc, all float32)
walks the ranges BN rows at a time, then the explicit indices, then folds the sink in. It saves
only q, kv, out and the row log-sum-exp lse [T, H] (float32).
Backward: the same walk recomputes p = exp(s - lse) per block; dq accumulates in registers, and
each block's dkv = ds^T q * scale + p^T do (K = V, so the two terms add) is scattered into a
float32 [N, D] buffer with atomic adds (a key row is a candidate of many queries; with explicit
top-k indices there is no key-major order to reduce in). delta = rowsum(do * out) and the sink's
gradient -sum_t p_sink * delta are [T, H] elementwise work, done in torch around the kernel.

Precision: dot operands stay in the input dtype (bf16 / fp16 MFMA or tensor cores, float32
accumulate; float32 operands take IEEE float32 dots, never TF32), softmax statistics, accumulators,
lse and dkv are float32; p and ds are rounded to the input dtype only as operands of the second
dot of each pair (as flash attention does). delta uses the stored output, which for bf16 carries
its rounding (2^-9 relative); the bf16 bound in the tests accounts for it.

Triton decides at import whether its kernels compile or run in its interpreter
(TRITON_INTERPRET=1, numpy on CPU tensors), so this module is imported only when the triton
backend is first used (`sparse_attention.py` registers it without importing triton).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton
import triton.language as tl

from primus_v4.kernels.registry import TRITON_MAX_HEAD_DIM as MAX_HEAD_DIM

_knobs = getattr(triton, "knobs", None)  # triton >= 3.4; older ones read the variable directly
INTERPRET = (
    bool(_knobs.runtime.interpret)
    if _knobs is not None
    else os.environ.get("TRITON_INTERPRET", "0") == "1"
)
"""True when these kernels were built for the interpreter (they then take CPU tensors only)."""

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# What tl.max / tl.sum reduce with, called through tl.reduce directly: the same code compiled,
# and the interpreter skips the wrapper's jit call (it re-patches triton.language on every call
# of a nested jit function, ~5 ms each, more than the arithmetic of a key block).
_MAX = tl.standard._elementwise_max
_SUM = tl.standard._sum_combine


@triton.jit
def _fwd_kernel(
    Q, KV, Sink, Lo, Hi, Idx, Out, Lse,
    scale, H, D, N, R, K,
    stride_qt, stride_qh, stride_kv, stride_ot, stride_oh,
    HAS_SINK: tl.constexpr, ROUND_BF16: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    offs_n = tl.arange(0, BLOCK_N)
    q_ptrs = Q + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=mask_h[:, None] & mask_d[None, :], other=0.0)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    idx_row = Idx + t * K
    kv_cols = KV + offs_d[None, :]
    # Segments 0 .. R-1 are the ranges (positions are buffer rows), segment R the explicit
    # indices (positions index idx[t]); one loop body serves both, BN positions at a time.
    for seg in range(R + 1):
        is_idx = seg == R
        # Ranges are clipped to the buffer: rows outside it never load.
        start = tl.where(is_idx, 0, tl.maximum(tl.load(Lo + t * R + seg, mask=seg < R), 0))
        stop = tl.where(is_idx, K, tl.minimum(tl.load(Hi + t * R + seg, mask=seg < R), N))
        for j in range((tl.maximum(stop - start, 0) + BLOCK_N - 1) // BLOCK_N):
            pos = start + j * BLOCK_N + offs_n
            if is_idx:
                cols = tl.load(idx_row + pos, mask=pos < stop, other=-1)
                valid = (cols >= 0) & (cols < N)  # -1 and rows outside the buffer never load
            else:
                cols = pos
                valid = pos < stop
            k_ptrs = kv_cols + cols[:, None] * stride_kv
            k = tl.load(k_ptrs, mask=valid[:, None] & mask_d[None, :], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.reduce(s, 1, _MAX))
            # A row that has seen no candidate yet keeps m = -inf: shift by 0 there, not -inf.
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - shift)
            p = tl.exp(s - shift[:, None])
            row_sum = row_sum * alpha + tl.reduce(p, 1, _SUM)
            p_op = p.to(k.dtype)
            if ROUND_BF16:  # interpreter stand-in for the bf16 cast (see _work_dtype)
                bits = p.to(tl.uint32, bitcast=True)
                bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
                p_op = bits.to(tl.float32, bitcast=True)
            acc = acc * alpha[:, None] + tl.dot(p_op, k, input_precision="ieee")
            m = m_new
    if HAS_SINK:
        sink = tl.load(Sink + offs_h, mask=mask_h, other=float("-inf"))
        m_new = tl.maximum(m, sink)
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - shift)
        row_sum = row_sum * alpha + tl.exp(sink - shift)
        acc = acc * alpha[:, None]
        m = m_new
    # No candidate and no sink (row_sum = 0): output 0 and lse -inf, so backward gives zero grads.
    out = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]
    lse = tl.where(row_sum > 0, m + tl.log(tl.where(row_sum > 0, row_sum, 1.0)), float("-inf"))
    o_ptrs = Out + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=mask_h[:, None] & mask_d[None, :])
    tl.store(Lse + t * H + offs_h, lse, mask=mask_h)


@triton.jit
def _bwd_kernel(
    Q, KV, Lo, Hi, Idx, Lse, Delta, DO, DQ, DKV,
    scale, H, D, N, R, K,
    stride_qt, stride_qh, stride_kv, stride_ot, stride_oh,
    ROUND_BF16: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    offs_n = tl.arange(0, BLOCK_N)
    mask_hd = mask_h[:, None] & mask_d[None, :]
    q = tl.load(Q + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :], mask=mask_hd)
    do = tl.load(DO + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :], mask=mask_hd)
    lse = tl.load(Lse + t * H + offs_h, mask=mask_h, other=0.0)
    lse = tl.where(lse == float("-inf"), 0.0, lse)  # no candidates: every p below is exp(-inf)
    delta = tl.load(Delta + t * H + offs_h, mask=mask_h, other=0.0)
    dq = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    idx_row = Idx + t * K
    kv_cols = KV + offs_d[None, :]
    for seg in range(R + 1):  # the forward's walk
        is_idx = seg == R
        # Ranges are clipped to the buffer: rows outside it never load.
        start = tl.where(is_idx, 0, tl.maximum(tl.load(Lo + t * R + seg, mask=seg < R), 0))
        stop = tl.where(is_idx, K, tl.minimum(tl.load(Hi + t * R + seg, mask=seg < R), N))
        for j in range((tl.maximum(stop - start, 0) + BLOCK_N - 1) // BLOCK_N):
            pos = start + j * BLOCK_N + offs_n
            if is_idx:
                cols = tl.load(idx_row + pos, mask=pos < stop, other=-1)
                valid = (cols >= 0) & (cols < N)
            else:
                cols = pos
                valid = pos < stop
            k_ptrs = kv_cols + cols[:, None] * stride_kv
            k = tl.load(k_ptrs, mask=valid[:, None] & mask_d[None, :], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            p = tl.where(mask_h[:, None] & valid[None, :], tl.exp(s - lse[:, None]), 0.0)
            dp = tl.dot(do, tl.trans(k), input_precision="ieee")
            ds = p * (dp - delta[:, None])
            p_op = p.to(k.dtype)
            ds_op = ds.to(k.dtype)
            if ROUND_BF16:
                bits = p.to(tl.uint32, bitcast=True)
                bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
                p_op = bits.to(tl.float32, bitcast=True)
                bits = ds.to(tl.uint32, bitcast=True)
                bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
                ds_op = bits.to(tl.float32, bitcast=True)
            dq += tl.dot(ds_op, k, input_precision="ieee")
            # K and V are the same rows: both gradient terms land on one row.
            dk = tl.dot(tl.trans(ds_op), q, input_precision="ieee") * scale
            dk += tl.dot(tl.trans(p_op), do, input_precision="ieee")
            dkv_ptrs = DKV + cols[:, None] * D + offs_d[None, :]
            tl.atomic_add(dkv_ptrs, dk, mask=valid[:, None] & mask_d[None, :])
    dq_ptrs = DQ + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :]
    tl.store(dq_ptrs, (dq * scale).to(DQ.dtype.element_ty), mask=mask_hd)


def _blocks(h: int, d: int, device: torch.device) -> dict[str, Any]:
    """Block sizes: dots need every dim >= 16. BH 16 keeps [BH, D] float32 accumulators in
    registers at D = 512; BN 32 is a starting point for on-device tuning (bench_kernels.py)."""
    block_d = max(16, triton.next_power_of_2(d))
    block_n = 16 if device.type == "cpu" or block_d > 256 else 32
    return {"BLOCK_H": 16, "BLOCK_N": block_n, "BLOCK_D": block_d}


def _ranges(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.int64).contiguous()


def _work_dtype(dtype: torch.dtype) -> tuple[torch.dtype, bool]:
    """The dtype the kernels load and whether they emulate bf16 rounding of the dot operands.
    The interpreter's dot multiplies bf16 (held as uint16) as integers, and its float32 -> bf16
    cast truncates; so there bf16 runs on exact float32 copies, with p and ds rounded to bf16
    (nearest even, by bits) where the compiled kernel casts them: the same numbers either way,
    since bf16 x bf16 products are exact in float32 and accumulation is float32 in both."""
    if INTERPRET and dtype == torch.bfloat16:
        return torch.float32, True
    return dtype, False


class _TritonSparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q_THD, kv_ND, sink_H, lo_TR, hi_TR, idx_TK, scale):  # type: ignore[override]
        t, h, d = q_THD.shape
        work, round_bf16 = _work_dtype(q_THD.dtype)
        q, kv = q_THD.to(work).contiguous(), kv_ND.to(work).contiguous()
        lo, hi = _ranges(lo_TR), _ranges(hi_TR)
        idx = _ranges(idx_TK) if idx_TK is not None else lo.new_full((t, 0), -1)
        out = torch.empty_like(q)
        lse = torch.empty((t, h), dtype=torch.float32, device=q.device)
        sink = sink_H.float().contiguous() if sink_H is not None else lse.new_empty(1)
        blocks = _blocks(h, d, q.device)
        if t:
            grid = (t, triton.cdiv(h, blocks["BLOCK_H"]))
            _fwd_kernel[grid](
                q, kv, sink, lo, hi, idx, out, lse,
                float(scale), h, d, kv.shape[0], lo.shape[1], idx.shape[1],
                q.stride(0), q.stride(1), kv.stride(0), out.stride(0), out.stride(1),
                HAS_SINK=sink_H is not None, ROUND_BF16=round_bf16, **blocks,
            )  # fmt: skip
        out = out.to(q_THD.dtype)
        # The saved set: q, kv and out as they came (no copies on a device) and lse [T, H].
        ctx.save_for_backward(q_THD, kv_ND, sink_H, lo, hi, idx, out, lse)
        ctx.scale = float(scale)
        return out

    @staticmethod
    def backward(ctx: Any, dout_THD: torch.Tensor):  # type: ignore[override]
        q_THD, kv_ND, sink_H, lo, hi, idx, out, lse = ctx.saved_tensors
        t, h, d = q_THD.shape
        work, round_bf16 = _work_dtype(q_THD.dtype)
        q, kv = q_THD.to(work).contiguous(), kv_ND.to(work).contiguous()
        do = dout_THD.to(q_THD.dtype).to(work).contiguous()
        delta = (do.float() * out.float()).sum(-1)  # = sum_m p_m dp_m (the sink's value is 0)
        dq = torch.empty_like(q)
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        blocks = _blocks(h, d, q.device)
        if t:
            grid = (t, triton.cdiv(h, blocks["BLOCK_H"]))
            _bwd_kernel[grid](
                q, kv, lo, hi, idx, lse, delta, do, dq, dkv,
                ctx.scale, h, d, kv.shape[0], lo.shape[1], idx.shape[1],
                q.stride(0), q.stride(1), kv.stride(0), do.stride(0), do.stride(1),
                ROUND_BF16=round_bf16, **blocks,
            )  # fmt: skip
        dsink = None
        if sink_H is not None:
            # d lse / d sink = p_sink, and the sink carries no value: d sink = -sum p_sink delta.
            p_sink = torch.exp(sink_H.float()[None, :] - lse)
            dsink = (-(p_sink * delta).sum(0)).to(sink_H.dtype)
        return dq.to(q_THD.dtype), dkv.to(kv_ND.dtype), dsink, None, None, None, None


def sparse_attention_triton(
    q_THD: torch.Tensor,
    kv_ND: torch.Tensor,
    sink_H: torch.Tensor | None,
    *,
    lo_TR: torch.Tensor,
    hi_TR: torch.Tensor,
    idx_TK: torch.Tensor | None = None,
    scale: float,
) -> torch.Tensor:
    """Softmax(q k^T * scale ++ sink) v over each query's candidate rows of `kv_ND` -> [T, H, D]
    (the reference's contract; `accepts` says which calls this kernel takes)."""
    return _TritonSparseAttention.apply(q_THD, kv_ND, sink_H, lo_TR, hi_TR, idx_TK, scale)


def refuses(q_THD: torch.Tensor, kv_ND: torch.Tensor) -> str | None:
    """None when these kernels take a call on these tensors, else why not."""
    if q_THD.dtype not in DTYPES or kv_ND.dtype != q_THD.dtype:
        return f"dtypes {q_THD.dtype}/{kv_ND.dtype}: the kernel takes one of bf16, fp16, fp32"
    if q_THD.shape[-1] > MAX_HEAD_DIM:
        return f"head dim {q_THD.shape[-1]} > {MAX_HEAD_DIM}"
    on_cpu = q_THD.device.type == "cpu"
    if on_cpu and not INTERPRET:
        return "CPU tensors need the Triton interpreter (TRITON_INTERPRET=1 before first use)"
    if not on_cpu and INTERPRET:
        return "the kernels were built for the interpreter (TRITON_INTERPRET=1): CPU tensors only"
    return None
