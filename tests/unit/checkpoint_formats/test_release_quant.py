"""FP8 e4m3 / FP4 e2m1 with ue8m0 scales: exact dequantization against an independent decoder
written from the formats' bit layouts, and quantize -> dequantize within the stated bounds."""

from __future__ import annotations

import math
import os
import shutil

import pytest
import torch
from fp_reference import decode_e2m1, decode_e4m3, decode_e8m0

from primus_v4.checkpoint_formats.fp8_fp4 import (
    dequantize_fp4,
    dequantize_fp8,
    fp4_error_bound,
    fp8_error_bound,
    quantize_fp4,
    quantize_fp8,
)

# scale bytes incl. both ends of e8m0 (2^-127 subnormal in float32, 2^127 overflows x448)
EXTREME_SCALES = [0, 1, 2, 60, 100, 120, 127, 133, 150, 200, 253, 254]


def reference_fp8(codes: torch.Tensor, scale_bytes: torch.Tensor) -> torch.Tensor:
    """float64 [N, K] from e4m3 bytes [N, K] and e8m0 bytes [ceil(N/128), ceil(K/128)]."""
    n, k = codes.shape
    out = torch.empty(n, k, dtype=torch.float64)
    table = torch.tensor([decode_e4m3(b) for b in range(256)], dtype=torch.float64)
    for i in range(n):
        row_scale = torch.tensor([decode_e8m0(int(b)) for b in scale_bytes[i // 128]])
        out[i] = table[codes[i].long()] * row_scale.repeat_interleave(128)[:k]
    return out


def test_fp8_every_code_dequantizes_exactly_under_random_scales() -> None:
    g = torch.Generator().manual_seed(0)
    n, k = 256, 200  # K not a multiple of 128: the last column block is partial
    codes = torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8)
    codes[0] = torch.arange(k, dtype=torch.uint8)  # codes 0..199, then 200..255: all 256 appear
    codes[1, :56] = torch.arange(200, 256, dtype=torch.uint8)
    choice = torch.randint(0, len(EXTREME_SCALES), (2, 2), generator=g)
    scale_bytes = torch.tensor(EXTREME_SCALES, dtype=torch.uint8)[choice]
    ref = reference_fp8(codes, scale_bytes)
    weight = codes.view(torch.float8_e4m3fn)
    for scale in (scale_bytes.view(torch.float8_e8m0fnu), scale_bytes):
        for dtype in (torch.float32, torch.float64):
            got = dequantize_fp8(weight, scale, dtype)
            assert got.dtype == dtype
            # exact: every e4m3 x 2^e product is a float64; its float32 rounding is unique
            torch.testing.assert_close(got, ref.to(dtype), rtol=0, atol=0, equal_nan=True)


def test_fp8_dequantizes_to_bf16_like_float32_then_rounded() -> None:
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 256, (128, 384), generator=g, dtype=torch.uint8)
    scale_bytes = torch.randint(100, 150, (1, 3), generator=g, dtype=torch.uint8)
    ref = reference_fp8(codes, scale_bytes)
    got = dequantize_fp8(codes.view(torch.float8_e4m3fn), scale_bytes, torch.bfloat16)
    torch.testing.assert_close(got, ref.to(torch.bfloat16), rtol=0, atol=0, equal_nan=True)


def test_fp4_every_code_and_nibble_order_dequantize_exactly() -> None:
    g = torch.Generator().manual_seed(2)
    n, k = 16, 64
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    codes[0, :16] = torch.arange(16, dtype=torch.uint8)  # all 16 codes, each at even and odd
    codes[1, 1:17] = torch.arange(16, dtype=torch.uint8)
    # element 2j is the LOW nibble of byte j (DeepSeek's convert.py / kernel.py unpacking)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(torch.int8)
    choice = torch.randint(0, len(EXTREME_SCALES), (n, k // 32), generator=g)
    scale_bytes = torch.tensor(EXTREME_SCALES, dtype=torch.uint8)[choice]
    values = torch.tensor([decode_e2m1(c) for c in range(16)], dtype=torch.float64)
    scales = torch.tensor([[decode_e8m0(int(b)) for b in row] for row in scale_bytes])
    ref = values[codes.long()] * scales.repeat_interleave(32, dim=1)
    for weight in (packed, packed.view(torch.float4_e2m1fn_x2)):
        for dtype in (torch.float32, torch.float64):
            got = dequantize_fp4(weight, scale_bytes.view(torch.float8_e8m0fnu), dtype)
            torch.testing.assert_close(got, ref.to(dtype), rtol=0, atol=0)


def test_fp4_first_row_reads_the_e2m1_table_in_code_order() -> None:
    codes = torch.arange(32, dtype=torch.uint8).remainder(16).view(1, 32)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(torch.int8)
    unit = torch.tensor([[127]], dtype=torch.uint8)  # scale 2^0
    got = dequantize_fp4(packed, unit, torch.float32)[0, :16].tolist()
    assert got == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0,
                   -4.0, -6.0]  # fmt: skip


def _mixed_magnitudes(shape: tuple[int, int], seed: int) -> torch.Tensor:
    """Random weights whose magnitude varies by 2^+-20 across rows, with an all-zero row band."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g) * torch.exp2(
        torch.randint(-20, 20, (shape[0], 1), generator=g)
    )
    w[:3] = 0.0
    return w


@pytest.mark.parametrize("shape", [(256, 384), (200, 130)])
def test_fp8_quantization_error_within_bound(shape: tuple[int, int]) -> None:
    w = _mixed_magnitudes(shape, seed=3)
    q, scale = quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float8_e8m0fnu
    assert scale.shape == (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
    back = dequantize_fp8(q, scale, torch.float32)
    assert bool(((back - w).abs() <= fp8_error_bound(w)).all())
    assert torch.equal(back[:3], torch.zeros_like(back[:3]))
    # ue8m0 rounds the scale UP to a power of two: each block's max lands in (224, 448]
    blocks = torch.nn.functional.pad(q.float().abs(), (0, -shape[1] % 128, 0, -shape[0] % 128))
    amax = blocks.view(scale.shape[0], 128, scale.shape[1], 128).amax(dim=(1, 3))
    nonzero = amax > 0
    assert bool(((amax[nonzero] > 224) & (amax[nonzero] <= 448)).all())
    # values already on the grid survive a second round trip unchanged (idempotent projection)
    assert torch.equal(dequantize_fp8(*quantize_fp8(back), torch.float32), back)


def test_fp4_quantization_error_within_bound_and_idempotent() -> None:
    w = _mixed_magnitudes((64, 256), seed=4)
    q, scale = quantize_fp4(w)
    assert q.dtype == torch.int8 and q.shape == (64, 128) and scale.shape == (64, 8)
    back = dequantize_fp4(q, scale, torch.float32)
    assert bool(((back - w).abs() <= fp4_error_bound(w)).all())
    # typical error is far below the worst case: MXFP4 on Gaussian 32-blocks gives ~11% relative
    # RMS error (power-of-two scales up to 2x coarse); a wrong grid or nibble order gives > 50%
    rows = slice(3, None)
    rel = (back[rows] - w[rows]).norm() / w[rows].norm()
    assert rel < 0.15, rel
    # on-grid values survive a second round trip (a block whose max rounded down to 3 x scale
    # gets half the scale, where the same values are representable)
    assert torch.equal(dequantize_fp4(*quantize_fp4(back), torch.float32), back)


def test_fp4_rounds_to_nearest_with_ties_to_even_code() -> None:
    # one block with amax 6 (scale 2^0): ties 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 2.5 -> 2, 5 -> 4
    x = torch.tensor([[6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.3, -0.74, -5.1] + [0.0] * 21])
    back = dequantize_fp4(*quantize_fp4(x), torch.float32)[0, :11].tolist()
    assert back == [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.5, -0.5, -6.0]


def test_quantizers_name_bad_shapes() -> None:
    with pytest.raises(ValueError, match=r"multiple of 32, got \[4, 40\]"):
        quantize_fp4(torch.zeros(4, 40))
    with pytest.raises(ValueError, match=r"block scale of shape \[1, 2\]"):
        dequantize_fp8(
            torch.zeros(4, 130).to(torch.float8_e4m3fn), torch.zeros(1, 1), torch.float32
        )
    with pytest.raises(ValueError, match=r"scale of shape \[4, 2\]"):
        dequantize_fp4(torch.zeros(4, 32, dtype=torch.int8), torch.zeros(4, 1), torch.float32)


@pytest.fixture(params=["native", "native-portable", "torch"])
def bf16_path(request, monkeypatch) -> str:
    """Every bf16 quantizer: the C pass (native_quant.py; built here whenever a C compiler is
    present, and then it must build), its table variant for machines without SSE2, and the
    torch ops it stands in for."""
    from primus_v4.checkpoint_formats import native_quant

    if request.param == "torch":
        monkeypatch.setenv(native_quant.ENV_SWITCH, "0")
        assert native_quant.library() is None
        return request.param
    monkeypatch.delenv(native_quant.ENV_SWITCH, raising=False)
    compiler = os.environ.get("CC", "cc")
    if shutil.which(compiler) is None:
        pytest.skip("no C compiler here: the native quantizer is not built")
    if request.param == "native-portable":
        lib = native_quant._library(compiler, portable=True)
        monkeypatch.setattr(native_quant, "library", lambda: lib)
    assert native_quant.library() is not None, "quant_bf16.c did not build"
    return request.param


@pytest.mark.parametrize("seed", [0, 1])
def test_bf16_quantizers_give_the_float32_paths_bits(seed: int, bf16_path: str) -> None:
    """bf16 weights quantize by table lookup: the same codes and scales as quantizing their
    float32 values, for every finite bf16 bit pattern (zeros and subnormals included) in blocks
    of random magnitudes; a block with NaN or inf is refused on both paths."""
    g = torch.Generator().manual_seed(seed)
    patterns = torch.randperm(65536, generator=g).to(torch.int32).to(torch.uint16)
    w = patterns.view(torch.bfloat16).view(512, 128).clone()
    w[~torch.isfinite(w)] = 3.0  # a NaN or inf has no scale: refused (below)
    rows = torch.logspace(-35, 35, 512, dtype=torch.float64)[torch.randperm(512, generator=g)]
    w[::2] = (torch.randn(256, 128, generator=g, dtype=torch.float64) * rows[::2, None]).to(w.dtype)
    for quantize, shape in ((quantize_fp8, (512, 128)), (quantize_fp4, (2048, 32))):
        x = w.view(shape)
        fast, ref = quantize(x), quantize(x.float())
        for a, b in zip(fast, ref, strict=True):
            assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        for bad in (float("nan"), float("inf")):
            y = x.clone()
            y[5, 7] = bad
            for z in (y, y.float()):
                with pytest.raises(ValueError, match=r"1 quantization block\(s\) hold NaN or inf"):
                    quantize(z)


def test_block_scales_are_the_smallest_power_of_two_at_the_edges_of_e8m0() -> None:
    """Scale exponents against the definition (the smallest e with amax / limit <= 2^e, in
    exact arithmetic on the float32 quotient, clamped to [-127, 127]) for all-zero blocks
    (maxima clamped to float32's tiny, as the quantizers pass them), subnormal quotients on both
    sides of 2^-127, exact powers of two, their neighbours and 1.5x, and maxima near float32's
    top."""
    from primus_v4.checkpoint_formats.fp8_fp4 import _pow2_exponent

    tiny = torch.finfo(torch.float32).tiny
    edges = [0.0, 1e-45, tiny / 8, tiny / 2, tiny, 3.0, 448.0, 6.0, 1.0, 3e38]
    edges += [float(torch.nextafter(torch.tensor(v), torch.tensor(math.inf))) for v in edges]
    edges += [float(torch.nextafter(torch.tensor(v), torch.tensor(0.0))) for v in edges if v]
    for limit in (448.0, 6.0):
        amax = torch.tensor(
            edges + [limit * m * 2.0**e for e in range(-140, 119) for m in (1, 1.5)]
        )
        amax = torch.cat([amax, torch.rand(1000, generator=torch.Generator().manual_seed(2)) * 3])
        amax = amax.clamp_min(tiny)  # as the quantizers pass block maxima (all-zero blocks)
        got = _pow2_exponent(amax, limit).tolist()
        for a, e in zip(amax.tolist(), got, strict=True):
            q = float(torch.tensor(a, dtype=torch.float32) / limit)
            want = math.frexp(q)[1] - (math.frexp(q)[0] == 0.5)
            assert e == max(-127, min(127, want)), (a, limit, e, want)


@pytest.mark.parametrize("name", ["FP8_128X128", "FP4_1X32", "FP8_32X32", "FP8_1X32"])
def test_bf16_quantizers_shift_exponents_like_the_float32_division(
    name, monkeypatch, bf16_path: str
) -> None:
    """The bf16 fast path divides by 2^e by moving exponent fields. Small chunks: most hold
    only blocks whose scale is in the shifted range (every exponent from the lowest to 0, and
    both edges), with zeros, negative zeros and subnormals under every maximum, and all-zero
    blocks among them; the last chunks hold a scale above 1 or below the range. Codes and
    scales equal the float32 path's everywhere."""
    from primus_v4.checkpoint_formats import fp8_fp4 as rq

    fmt = getattr(rq, name)
    f = rq._bf16_format(fmt)
    br, bc = f.block_rows, f.block_cols
    k, block_rows = 4 * bc, 8 * br  # one chunk: 8 block rows of 4 blocks
    monkeypatch.setattr(rq, "QUANT_CHUNK", block_rows * k)
    g = torch.Generator().manual_seed(3)
    exps = list(range(f.lowest, 1))
    chunks = -(-len(exps) // 32) + 2  # 32 blocks a chunk, then the two mixed chunks
    nb = chunks * 32
    e = torch.tensor(exps * (nb // len(exps) + 1))[:nb]
    e = e[torch.randperm(nb, generator=g)]
    e[-64:-60] = torch.tensor([1, 5, f.lowest - 1, f.lowest - 2])  # outside: the last 2 chunks
    e[-60:] = torch.randint(f.lowest, 1, (60,), generator=g)
    # a maximum pattern with exponent e: ((pattern + carry) >> 7) - bias = e
    top = (e + f.bias) * 128 - f.carry + torch.randint(0, 128, (nb,), generator=g)
    lo, hi = f.pattern_range
    top[:4] = torch.tensor([lo, lo + 1, hi - 1, hi])  # the edges of the shifted range
    e[:4] = torch.tensor([f.lowest, f.lowest, 0, 0])
    per_block = br * bc
    mag = torch.randint(0, 1 << 15, (nb, per_block), generator=g) % (top[:, None] + 1)
    mag[torch.rand(nb, per_block, generator=g) < 0.1] = 0  # zeros (with either sign)
    mag[:, 0] = top
    mag[torch.rand(nb, generator=g) < 0.05] = 0  # all-zero blocks
    sign = torch.randint(0, 2, (nb, per_block), generator=g) << 15
    mag = mag[:, torch.randperm(per_block, generator=g)]
    patterns = (mag | sign).to(torch.int32).to(torch.uint16).view(torch.bfloat16)
    # blocks [nb, br * bc] -> [chunks, 8, br, 4, bc] (8 x 4 blocks a chunk) -> [N, K]
    w = patterns.view(chunks, 8, 4, br, bc).permute(0, 1, 3, 2, 4).reshape(-1, k).contiguous()
    assert int(torch.isfinite(w).all()) and w.shape[0] == chunks * block_rows
    fast, ref = rq.quantize(w, fmt=fmt), rq.quantize(w.float(), fmt=fmt)
    for a, b in zip(fast, ref, strict=True):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    scales = fast[1].view(torch.uint8).to(torch.int32) - 127
    blocks = w.view(chunks, 8, br, 4, bc).permute(0, 1, 3, 2, 4).reshape(nb, per_block)
    nonzero = blocks.ne(0).any(dim=1)
    assert torch.equal(scales.reshape(-1)[nonzero], e[nonzero].to(torch.int32))


def test_without_a_compiler_the_torch_ops_quantize_to_the_same_bits(monkeypatch) -> None:
    """A missing compiler is no error: the torch path gives the bits the C pass gives."""
    from primus_v4.checkpoint_formats import native_quant

    g = torch.Generator().manual_seed(5)
    w = (torch.randn(256, 256, generator=g) * 0.02).to(torch.bfloat16)
    w[3, :64] = 0.0
    w[130:, 40] = 1e4  # a scale above 1: the division path
    first = [quantize_fp4(w), quantize_fp8(w)]
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert native_quant.library() is None
    for (a, sa), (b, sb) in zip(first, [quantize_fp4(w), quantize_fp8(w)], strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        assert torch.equal(sa.view(torch.uint8), sb.view(torch.uint8))
