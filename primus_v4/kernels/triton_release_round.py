"""`release_round` in Triton (the contract and the arithmetic: release_round.py): one program
per block (per 64 rows of a column block when blocks are one row long, each row scaled on its
own), the same integer steps as the torch reference on the block's float32 bits.

Triton decides at import whether its kernels compile or run in its interpreter
(TRITON_INTERPRET=1, numpy on CPU tensors), so this module is imported only on first use.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROWS_AT_ONCE = 64  # blocks of one row: a program takes this many rows of one column block


@triton.jit
def _round_kernel(
    x_ptr,
    out_ptr,
    n_rows,
    n_cols,
    block_rows,
    block_cols,
    LIMIT: tl.constexpr,
    IS_FP8: tl.constexpr,
    ROWWISE: tl.constexpr,
    BR: tl.constexpr,
    BC: tl.constexpr,
):
    r = tl.arange(0, BR)
    c = tl.arange(0, BC)
    rows = tl.program_id(0) * block_rows + r
    cols = tl.program_id(1) * block_cols + c
    mask = (r[:, None] < block_rows) & (c[None, :] < block_cols)
    mask = mask & (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    offsets = rows[:, None].to(tl.int64) * n_cols + cols[None, :]
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if ROWWISE:  # blocks of one row: each of the program's rows on its own
        amax = tl.max(tl.abs(x), axis=1)[:, None]
    else:
        amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
    amax = tl.maximum(amax, 1.1754943508222875e-38)
    q_bits = tl.math.div_rn(amax, LIMIT).to(tl.int32, bitcast=True)
    biased = q_bits >> 23
    normal = biased - 127 + ((q_bits & 0x7FFFFF) != 0).to(tl.int32)
    subnormal = tl.where(q_bits > (1 << 22), -126, -127)
    e = tl.where(biased == 0, subnormal, normal)
    e = tl.minimum(tl.maximum(e, -127), 127)
    s = tl.where(e >= -126, (e + 127) << 23, 1 << 22).to(tl.float32, bitcast=True)
    v = tl.math.div_rn(x, s)
    v = tl.minimum(tl.maximum(v, -LIMIT), LIMIT)
    bits = v.to(tl.int32, bitcast=True)
    sign = bits & -2147483648
    mag = bits & 0x7FFFFFFF
    a = mag.to(tl.float32, bitcast=True)
    if IS_FP8:
        lsb = (mag >> 20) & 1
        rounded = ((mag + 0x7FFFF + lsb) & -1048576).to(tl.float32, bitcast=True)
        small = ((a * 512.0 + 8388608.0) - 8388608.0) * 0.001953125
        a = tl.where(a >= 0.015625, rounded, small)
    else:
        lsb = (mag >> 22) & 1
        rounded = ((mag + 0x1FFFFF + lsb) & -4194304).to(tl.float32, bitcast=True)
        small = ((a * 2.0 + 8388608.0) - 8388608.0) * 0.5
        a = tl.where(a >= 1.0, rounded, small)
    out = (a.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True) * s
    tl.store(out_ptr + offsets, out, mask=mask)


def release_round(
    x: torch.Tensor, *, limit: float, fp8: bool, block_rows: int, block_cols: int
) -> torch.Tensor:
    """The kernel on finite `x` [N, K] (release_round.py checks and dispatches)."""
    x = x.detach().contiguous()
    n, k = x.shape
    out = torch.empty(n, k, dtype=torch.float32, device=x.device)
    if x.numel() == 0:
        return out
    rowwise = block_rows == 1
    rows = ROWS_AT_ONCE if rowwise else block_rows  # the rows one program holds
    grid = (triton.cdiv(n, rows), triton.cdiv(k, block_cols))
    _round_kernel[grid](
        x, out, n, k, rows, block_cols,
        LIMIT=limit, IS_FP8=fp8, ROWWISE=rowwise,
        BR=triton.next_power_of_2(rows), BC=triton.next_power_of_2(block_cols),
    )  # fmt: skip
    return out
