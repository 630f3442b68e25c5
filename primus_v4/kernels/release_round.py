"""`release_round`: a weight as a release stores it, decoded: the op of quantization-aware
training (`train.quant_aware: release`, models/common/quant_aware.py).

Contract: `x` [N, K] (any float dtype) -> float32 [N, K]: each block of `block_rows x
block_cols` values (blocks start at row 0 and column 0 and may hang over the edges) gets the
ue8m0 scale 2^e with e the smallest integer such that amax / 2^e <= limit (448 for FP8 e4m3, 6 for
FP4 e2m1; amax floored at float32's smallest normal; e clamped to [-127, 127]), each value
x / 2^e is clamped to +-limit and rounded to the nearest e4m3 / e2m1 value (ties to even), and
the result is that value times 2^e. A block holding NaN or inf is an error. That is the release
writer's quantizer followed by the loader's decoder (checkpoint_formats/fp8_fp4.py `quantize`,
`dequantize`), bit for bit: tests/unit/kernels/test_release_round.py checks both backends
against them.

Both backends compute it the same way: the scale exponent from the bits of the float32 quotient
amax / limit, as the writer reads them (e = E + (mantissa != 0) for a normal quotient, -126
above 2^-127 and -127 below for a subnormal one); the rounding on the float32 bits of |v|:
- FP8 e4m3 normals (|v| >= 2^-6): 3 mantissa bits, ties to even (add 0x7FFFF + the kept lsb,
  clear the 20 dropped bits); subnormals: multiples of 2^-9, by the float32 round-to-nearest-even
  of |v| * 2^9 + 2^23;
- FP4 e2m1 normals (|v| >= 1): 1 mantissa bit; subnormals: multiples of 0.5;
then the sign bit put back (a negative value that rounds to zero stays -0.0, as the e4m3 / e2m1
code holds it) and the product with 2^e (exact). The torch reference runs on the weight's device;
the Triton backend (`triton_release_round.py`, imported on first use) is one program per block.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from primus_v4.kernels.registry import interpreting

OP_NAME = "release_round"
KINDS = ("fp8", "fp4")
LIMITS = {"fp8": 448.0, "fp4": 6.0}
MAX_BLOCK = 128 * 128  # values one Triton program holds
FLOAT32_TINY = torch.finfo(torch.float32).tiny


def check_finite(x: torch.Tensor) -> None:
    if not bool(torch.isfinite(x).all()):
        bad = int((~torch.isfinite(x)).sum())
        raise ValueError(f"release_round: {bad} value(s) are NaN or inf; a block holding them "
                         "has no scale")  # fmt: skip


def release_round_torch(
    x: torch.Tensor, *, kind: str, block_rows: int, block_cols: int
) -> torch.Tensor:
    """The reference (the module docstring), on `x`'s device."""
    check_finite(x)
    limit = LIMITS[kind]
    n, k = x.shape
    br, bc = block_rows, block_cols
    w = F.pad(x.detach().float(), (0, -k % bc, 0, -n % br))
    w = w.view(w.shape[0] // br, br, w.shape[1] // bc, bc)
    q = (w.abs().amax(dim=(1, 3)).clamp_min(FLOAT32_TINY) / limit).view(torch.int32)
    biased = q >> 23
    normal = biased - 127 + (q & 0x7FFFFF).ne(0).to(torch.int32)
    subnormal = torch.where(q > 1 << 22, -126, -127).to(torch.int32)
    e = torch.where(biased == 0, subnormal, normal).clamp_(-127, 127)
    s = torch.where(e >= -126, (e + 127) << 23, 1 << 22).view(torch.float32)[:, None, :, None]
    bits = (w / s).clamp_(-limit, limit).view(torch.int32)
    sign, mag = bits & -(2**31), bits & 0x7FFFFFFF
    a = mag.view(torch.float32)
    if kind == "fp8":
        kept = ((mag + 0x7FFFF + ((mag >> 20) & 1)) & -(2**20)).view(torch.float32)
        small = ((a * 512.0 + 8388608.0) - 8388608.0) * 0.001953125
        a = torch.where(a >= 0.015625, kept, small)
    else:
        kept = ((mag + 0x1FFFFF + ((mag >> 22) & 1)) & -(2**22)).view(torch.float32)
        small = ((a * 2.0 + 8388608.0) - 8388608.0) * 0.5
        a = torch.where(a >= 1.0, kept, small)
    out = (a.view(torch.int32) | sign).view(torch.float32) * s
    return out.reshape(w.shape[0] * br, w.shape[2] * bc)[:n, :k].contiguous()


def release_round_triton(
    x: torch.Tensor, *, kind: str, block_rows: int, block_cols: int
) -> torch.Tensor:
    from primus_v4.kernels import triton_release_round

    check_finite(x)
    return triton_release_round.release_round(
        x, limit=LIMITS[kind], fp8=kind == "fp8", block_rows=block_rows, block_cols=block_cols
    )


def triton_refuses(x: torch.Tensor, **kw: Any) -> str | None:
    """None when the Triton kernel takes this call, else why not."""
    if x.ndim != 2:
        return f"takes a 2-D weight, got {x.ndim}-D"
    if kw.get("kind") not in KINDS:
        return f"kind {kw.get('kind')!r} is not one of {KINDS}"
    if kw["block_rows"] * kw["block_cols"] > MAX_BLOCK:
        return f"blocks of more than {MAX_BLOCK} values"
    if interpreting() != (x.device.type == "cpu"):
        where = "the interpreter takes CPU tensors" if interpreting() else "needs a GPU tensor"
        return f"{where}, got {x.device}"
    return None
