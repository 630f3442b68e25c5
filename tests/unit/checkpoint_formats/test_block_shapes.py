"""The FP8 / FP4 codec with its block shape as data: DeepSeek-V4's FP8 128x128 and FP4 1x32,
DeepSeek-V4.1's FP8 32x32 (dense weights) and FP8 1x32 (Engram table rows), each quantized and
dequantized against a reference written here from the formats' definition, block by block:
amax -> the smallest power-of-two scale with amax / scale <= 448 (e4m3) or 6 (e2m1) -> codes
-> codes x scale. Every comparison is exact: the codec promises the reference's bits.

Legend: N = rows, K = columns of a weight; br x bc = the block.
"""

from __future__ import annotations

import math
import os
import shutil

import pytest
import torch

from primus_v4.checkpoint_formats import fp8_fp4
from primus_v4.checkpoint_formats.fp8_fp4 import (
    FP4_1X32,
    FP8_1X32,
    FP8_32X32,
    FP8_128X128,
    QuantFormat,
    dequantize,
    dequantize_fp4,
    dequantize_fp4_elementwise,
    dequantize_fp8,
    dequantize_fp8_into,
    fp4_error_bound,
    fp8_error_bound,
    quantize,
    quantize_fp4,
    quantize_fp8,
)

E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def nearest_e2m1(v: float) -> float:
    """The e2m1 value nearest v (|v| <= 6), a tie going to the even code (mantissa bit 0)."""
    a = abs(v)
    best = min(range(8), key=lambda i: (abs(a - E2M1_GRID[i]), i % 2))
    return math.copysign(E2M1_GRID[best], v)


def reference(w: torch.Tensor, fmt: QuantFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """(dequantized float64 [N, K], scale exponents [ceil(N/br), ceil(K/bc)]) of `w`, one
    block at a time in float64 (where x / 2^e is exact)."""
    n, k = w.shape
    br, bc = fmt.block_rows, fmt.block_cols
    limit = 448.0 if fmt.kind == "fp8" else 6.0
    w64 = w.double()
    out = torch.empty(n, k, dtype=torch.float64)
    exps = torch.empty(-(-n // br), -(-k // bc), dtype=torch.int32)
    for bi, i in enumerate(range(0, n, br)):
        for bj, j in enumerate(range(0, k, bc)):
            block = w64[i : i + br, j : j + bc]
            amax = float(block.abs().max())
            if amax == 0:
                e = -127  # any scale gives zeros; the release stores the smallest
            else:
                mantissa, exponent = math.frexp(amax / limit)
                e = max(-127, min(127, exponent - (mantissa == 0.5)))
            scaled = block / 2.0**e
            if fmt.kind == "fp8":
                codes = scaled.clamp(-448, 448).to(torch.float8_e4m3fn).double()
            else:
                codes = scaled.clone().apply_(nearest_e2m1)
            out[i : i + br, j : j + bc] = codes * 2.0**e
            exps[bi, bj] = e
    return out, exps


def weights(shape: tuple[int, int], seed: int) -> torch.Tensor:
    """Gaussian values whose magnitude changes by up to 2^+-12 from row to row and column to
    column (so blocks of every shape see different scales), with one all-zero row."""
    g = torch.Generator().manual_seed(seed)
    n, k = shape
    rows = torch.exp2(torch.randint(-12, 12, (n, 1), generator=g).float())
    cols = torch.exp2(torch.randint(-4, 4, (1, k), generator=g).float())
    w = torch.randn(n, k, generator=g) * rows * cols
    w[n // 2] = 0.0
    return w


CASES = [
    # (format, shape): whole blocks, and (where the format allows) shapes that end mid-block
    (FP8_128X128, (256, 384)),
    (FP8_128X128, (200, 256)),  # a partial last block row
    (FP8_128X128, (200, 130)),  # and a partial last block column
    (FP8_32X32, (64, 96)),
    (FP8_32X32, (70, 96)),
    (FP8_32X32, (70, 100)),
    (FP8_1X32, (6, 256)),  # an Engram table: [rows, 256], a scale per 32 values of a row
    (FP8_1X32, (5, 100)),
    (FP4_1X32, (8, 64)),
    (FP4_1X32, (5, 96)),  # FP4 needs K in whole blocks; any N
]
IDS = [f"{fmt.shape}-{n}x{k}" for fmt, (n, k) in CASES]


@pytest.fixture(params=["native", "torch"])
def quant_path(request, monkeypatch) -> str:
    """bf16 quantizes by the C pass (native_quant.py, where a compiler is present) or by the
    torch ops it stands in for: both are checked."""
    from primus_v4.checkpoint_formats import native_quant

    if request.param == "torch":
        monkeypatch.setenv(native_quant.ENV_SWITCH, "0")
        return request.param
    monkeypatch.delenv(native_quant.ENV_SWITCH, raising=False)
    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler here: the native quantizer is not built")
    assert native_quant.library() is not None, "quant_bf16.c did not build"
    return request.param


@pytest.mark.parametrize(("fmt", "shape"), CASES, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_round_trip_equals_the_reference(fmt, shape, dtype, quant_path) -> None:
    w = weights(shape, seed=sum(shape)).to(dtype)
    want, exps = reference(w.float(), fmt)
    q, scale = quantize(w, fmt=fmt)
    n, k = shape
    assert scale.dtype == torch.float8_e8m0fnu and tuple(scale.shape) == fmt.scale_shape(n, k)
    assert torch.equal(scale.view(torch.uint8).to(torch.int32) - 127, exps)
    if fmt.kind == "fp8":
        assert q.dtype == torch.float8_e4m3fn and q.shape == shape
    else:
        assert q.dtype == torch.int8 and q.shape == (n, k // 2)
    for out_dtype in (torch.float32, torch.float64, torch.bfloat16):
        got = dequantize(q, scale, out_dtype, fmt=fmt)
        # exact: a code times a power of two is a float32 (and a bf16: <= 4 significant bits)
        assert torch.equal(got, want.to(out_dtype)), out_dtype
    bound = fp8_error_bound(w, fmt=fmt) if fmt.kind == "fp8" else fp4_error_bound(w, fmt=fmt)
    # the codec's stated per-element bound (3 / 1 mantissa bits, scale <= 2 amax / limit)
    assert bool(((want - w.double()).abs() <= bound.double()).all())


@pytest.mark.parametrize(("fmt", "shape"), CASES, ids=IDS)
def test_every_decoder_gives_the_same_bits(fmt, shape) -> None:
    """The byte-table paths (`_into`, on row slices that start on a block row too) and the
    elementwise / block-view paths decode to the same values."""
    w = weights(shape, seed=7)
    q, scale = quantize(w, fmt=fmt)
    full = dequantize(q, scale, torch.float32, fmt=fmt)
    n, k = shape
    r0 = fmt.block_rows if n > fmt.block_rows else 0
    rows = slice(r0, n)
    s_rows = slice(r0 // fmt.block_rows, None)
    out = torch.empty(n - r0, k)
    if fmt.kind == "fp8":
        dequantize_fp8_into(q[rows].view(torch.uint8), scale[s_rows], out, fmt=fmt)
        view = fp8_fp4._dequantize_fp8_blocks(q, scale, torch.float32, fmt)
    else:
        fp8_fp4.dequantize_fp4_into(q[rows], scale[s_rows], out, fmt=fmt)
        view = dequantize_fp4_elementwise(q, scale, torch.float32, fmt=fmt)
    assert torch.equal(out, full[rows])
    assert torch.equal(view, full)
    # older checkpoints' float scales multiply after the lookup: the same values
    floats = fp8_fp4.e8m0_to_float(scale)
    assert torch.equal(dequantize(q, floats, torch.float32, fmt=fmt), full)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_default_block_is_v4s_bit_for_bit(dtype) -> None:
    for shape in ((256, 384), (200, 130)):
        w = weights(shape, seed=11).to(dtype)
        q, s = quantize_fp8(w)
        q_v4, s_v4 = quantize_fp8(w, fmt=FP8_128X128)
        assert torch.equal(q.view(torch.uint8), q_v4.view(torch.uint8))
        assert torch.equal(s.view(torch.uint8), s_v4.view(torch.uint8))
        back = dequantize_fp8(q, s, torch.float32)
        assert torch.equal(back, dequantize_fp8(q, s, torch.float32, fmt=FP8_128X128))
        assert torch.equal(fp8_error_bound(w), fp8_error_bound(w, fmt=FP8_128X128))
    w = weights((64, 96), seed=12).to(dtype)
    q, s = quantize_fp4(w)
    q_v4, s_v4 = quantize_fp4(w, fmt=FP4_1X32)
    assert torch.equal(q, q_v4) and torch.equal(s.view(torch.uint8), s_v4.view(torch.uint8))
    assert torch.equal(
        dequantize_fp4(q, s, torch.float32), dequantize(q, s, torch.float32, fmt=FP4_1X32)
    )
    assert torch.equal(fp4_error_bound(w), fp4_error_bound(w, fmt=FP4_1X32))


def test_a_wrong_scale_shape_names_the_block() -> None:
    w = torch.zeros(64, 96).to(torch.float8_e4m3fn)
    v4_scale = torch.zeros(1, 1, dtype=torch.uint8)  # V4's 128x128 grid for this weight
    with pytest.raises(ValueError, match=r"block scale of shape \[2, 3\] \(32x32 blocks\)"):
        dequantize_fp8(w, v4_scale, torch.float32, fmt=FP8_32X32)
    with pytest.raises(ValueError, match=r"block scale of shape \[1, 1\] \(128x128 blocks\)"):
        dequantize_fp8(w, torch.zeros(2, 3, dtype=torch.uint8), torch.float32)
    with pytest.raises(ValueError, match=r"block scale of shape \[64, 3\] \(1x32 blocks\)"):
        dequantize_fp8(w, torch.zeros(2, 3, dtype=torch.uint8), torch.float32, fmt=FP8_1X32)
    with pytest.raises(ValueError, match=r"multiple of 32, got \[4, 40\] \(1x32 blocks\)"):
        quantize_fp4(torch.zeros(4, 40))
    with pytest.raises(ValueError, match="fp4-1x32 stores FP4 codes, not FP8"):
        quantize_fp8(torch.zeros(4, 64), fmt=FP4_1X32)
    with pytest.raises(ValueError, match="even column count"):
        QuantFormat(name="odd", kind="fp4", block_rows=1, block_cols=15)
