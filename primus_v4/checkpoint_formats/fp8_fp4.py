"""DeepSeek's storage formats: FP8 e4m3 and FP4 e2m1 codes with ue8m0 block scales.

Legend: N = output rows, K = input columns of a linear weight `[N, K]`; a format's block is
`block_rows x block_cols` values sharing one scale (`QuantFormat`).
- FP8: `weight` float8_e4m3fn `[N, K]`, `scale` e8m0 `[ceil(N/br), ceil(K/bc)]`,
  value = e4m3(weight) * 2^(scale_byte - 127). Blocks may hang over the edges.
- FP4: `weight` int8 `[N, K/2]`, two e2m1 codes per byte (low nibble = even column, high nibble
  = odd column, as DeepSeek's inference/convert.py and kernel.py unpack them), `scale` e8m0
  `[ceil(N/br), K/bc]` (K a multiple of bc: whole blocks along a row).
The releases' blocks:
- DeepSeek-V4: FP8 dense weights in 128x128 blocks (`FP8_128X128`, every function's default),
  FP4 routed experts one scale per 32 inputs (`FP4_1X32`, the FP4 default);
- DeepSeek-V4.1: FP8 dense weights in 32x32 blocks (`FP8_32X32`), FP4 routed experts as V4,
  Engram tables FP8 `[rows, 256]` with one scale per 32 values of a row (`FP8_1X32`).
Dequantization is exact: an e4m3 or e2m1 value times a power of two is representable in float32
(and float64) unless the product leaves the format's range (scales near 2^127 overflow to inf).
Quantization snaps scales up to powers of two (ue8m0) like the release, so
|x / scale| <= 448 (FP8) or 6 (FP4) and the error per element is bounded by
`fp8_error_bound` / `fp4_error_bound` below.
"""

from __future__ import annotations

import functools
import math
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from primus_v4.checkpoint_formats import native_quant

FP8_MAX = 448.0
FP4_MAX = 6.0
E8M0_BIAS = 127
# e2m1 codes 0..15: sign bit 3, exponent bits 2..1, mantissa bit 0 (bias 1; code 1 is subnormal)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_VALUES += tuple(-v for v in FP4_VALUES)


@dataclass(frozen=True, kw_only=True)
class QuantFormat:
    """One stored format: the element codes (`kind`: FP8 e4m3 or FP4 e2m1) and the block of
    `block_rows x block_cols` values that share one ue8m0 scale. Hashable, so the per-format
    constants of the bf16 quantizer are cached by it."""

    name: str
    kind: Literal["fp8", "fp4"]
    block_rows: int
    block_cols: int

    def __post_init__(self) -> None:
        if self.kind not in ("fp8", "fp4"):
            raise ValueError(f"{self.name}: kind must be 'fp8' or 'fp4', got {self.kind!r}")
        if self.block_rows < 1 or self.block_cols < 1:
            raise ValueError(f"{self.name}: a block needs >= 1 row and column, got {self.shape}")
        if self.kind == "fp4" and self.block_cols % 2:
            # the decoder gathers a byte's two codes with one scale
            raise ValueError(f"{self.name}: FP4 blocks need an even column count, got {self.shape}")

    @property
    def shape(self) -> str:
        """The block as error messages name it, e.g. `128x128`."""
        return f"{self.block_rows}x{self.block_cols}"

    @property
    def limit(self) -> float:
        """The largest code magnitude: what a block's maximum is scaled to at most."""
        return FP8_MAX if self.kind == "fp8" else FP4_MAX

    def scale_shape(self, n: int, k: int) -> tuple[int, int]:
        """The scale tensor's shape for a weight of `n x k` values (FP4: K unpacked)."""
        return -(-n // self.block_rows), -(-k // self.block_cols)


FP8_128X128 = QuantFormat(name="fp8-128x128", kind="fp8", block_rows=128, block_cols=128)
FP4_1X32 = QuantFormat(name="fp4-1x32", kind="fp4", block_rows=1, block_cols=32)
FP8_32X32 = QuantFormat(name="fp8-32x32", kind="fp8", block_rows=32, block_cols=32)
FP8_1X32 = QuantFormat(name="fp8-1x32", kind="fp8", block_rows=1, block_cols=32)
# V4's blocks by their old names (callers that size V4 tensors)
FP8_BLOCK = FP8_128X128.block_rows
FP4_BLOCK = FP4_1X32.block_cols


def _require(fmt: QuantFormat, kind: str) -> None:
    if fmt.kind != kind:
        raise ValueError(f"{fmt.name} stores {fmt.kind.upper()} codes, not {kind.upper()}")


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """Scale tensor -> float32 powers of two. e8m0 bytes (float8_e8m0fnu or uint8) are built
    bit-exactly (byte << 23 is 2^(byte-127); byte 0 is the subnormal 2^-127; 255 is NaN);
    float scales (older FP8 checkpoints) pass through."""
    if scale.dtype not in (torch.float8_e8m0fnu, torch.uint8):
        return scale.to(torch.float32)
    byte = scale.view(torch.uint8).to(torch.int32)
    bits = torch.where(byte == 0, torch.tensor(1 << 22, dtype=torch.int32), byte << 23)
    out = bits.view(torch.float32)
    return torch.where(byte == 255, torch.tensor(float("nan")), out)


def float_to_e8m0(exponent: torch.Tensor) -> torch.Tensor:
    """Integer exponents in [-127, 127] -> float8_e8m0fnu scale bytes."""
    return (exponent.to(torch.int32) + E8M0_BIAS).to(torch.uint8).view(torch.float8_e8m0fnu)


def _block_view(x: torch.Tensor, br: int, bc: int) -> tuple[torch.Tensor, int, int]:
    """Zero-pad `[N, K]` up to whole blocks and view it as `[N/br, br, K/bc, bc]`."""
    n, k = x.shape
    pn, pk = -n % br, -k % bc
    if pn or pk:
        x = F.pad(x, (0, pk, 0, pn))
    return x.view((n + pn) // br, br, (k + pk) // bc, bc), n, k


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where to multiply: e4m3 / e2m1 values and power-of-two scales are exact in bf16, fp32 and
    fp64, and one multiply rounds the exact product once, so computing straight in the target
    gives the same bits as float32-then-cast at a third of the memory traffic for bf16. Other
    targets (fp16: too little exponent range for 2^+-127) go through float32."""
    return dtype if dtype in (torch.bfloat16, torch.float32, torch.float64) else torch.float32


def dequantize_fp8(
    weight: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype,
    *,
    fmt: QuantFormat = FP8_128X128,
) -> torch.Tensor:
    """FP8 e4m3 `[N, K]` with `fmt.scale_shape(N, K)` block scales -> `dtype` `[N, K]`."""
    n, k = weight.shape
    _check_fp8(weight.shape, scale, fmt=fmt)
    work = work_dtype(dtype)
    if k % fmt.block_cols == 0 and work == dtype and weight.device.type == "cpu":
        out = torch.empty(n, k, dtype=dtype)
        dequantize_fp8_into(weight, scale, out, fmt=fmt)
        return out
    return _dequantize_fp8_blocks(weight, scale, dtype, fmt)


def _dequantize_fp8_blocks(
    weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, fmt: QuantFormat
) -> torch.Tensor:
    """`dequantize_fp8` by a multiply over a padded block view: any shape, any device."""
    n, k = weight.shape
    br, bc = fmt.block_rows, fmt.block_cols
    nb, kb = fmt.scale_shape(n, k)
    work = work_dtype(dtype)
    w, _, _ = _block_view(weight.to(work), br, bc)
    w = w * e8m0_to_float(scale).to(work)[:, None, :, None]
    return w.reshape(nb * br, kb * bc)[:n, :k].to(dtype)


def _check_fp8(
    shape: torch.Size | tuple[int, ...], scale: torch.Tensor, *, fmt: QuantFormat = FP8_128X128
) -> None:
    _require(fmt, "fp8")
    n, k = shape
    nb, kb = fmt.scale_shape(n, k)
    if tuple(scale.shape) != (nb, kb):
        raise ValueError(
            f"FP8 weight [{n}, {k}] needs a block scale of shape [{nb}, {kb}] ({fmt.shape} "
            f"blocks), got {list(scale.shape)}"
        )


def _by_block(
    t: torch.Tensor, s: torch.Tensor, br: int, bc: int, op: Callable[..., torch.Tensor]
) -> None:
    """`op(block view of t, its scale broadcast)` in place over a contiguous `[N, C]` (C a
    multiple of bc) with `s` `[ceil(N/br), C/bc]`; a last, partial block row on its own (a
    row slice may end inside a block)."""
    n, c = t.shape
    full = n // br * br
    if full:
        op(t[:full].view(full // br, br, c // bc, bc), s[: full // br, None, :, None])
    if full < n:
        op(t[full:].view(n - full, c // bc, bc), s[-1][None, :, None])


def dequantize_fp8_into(
    weight: torch.Tensor,
    scale: torch.Tensor,
    out: torch.Tensor,
    index: torch.Tensor | None = None,
    *,
    fmt: QuantFormat = FP8_128X128,
) -> None:
    """`dequantize_fp8` written into `out` (contiguous CPU, bf16 / fp32 / fp64; `weight` may be
    the uint8 bytes). Rows may be a slice of a larger weight that starts on a block row:
    `scale` holds the slice's block rows. `index` (int32, >= N*K elements) is scratch a caller
    can reuse across tensors. K not a multiple of the block's columns decodes by the block view
    instead (the same bits).

    One gather per byte from a table of every (scale, e4m3 byte) product (`_scaled_table`;
    torch's CPU cast from float8 is scalar code, ~6x slower), indexed by `byte + 256 x scale
    byte` built over a broadcast view of the block scales, written straight into `out`.
    e4m3 values times powers of two are exact in the work dtypes, so this is bit-equal to
    float32-then-cast. Float scales (older checkpoints) multiply after the gather instead."""
    n, k = out.shape
    _check_fp8(out.shape, scale, fmt=fmt)
    br, bc = fmt.block_rows, fmt.block_cols
    if k % bc:  # a partial column block breaks the per-row block view
        out.copy_(_dequantize_fp8_blocks(weight.view(torch.float8_e4m3fn), scale, out.dtype, fmt))
        return
    if scale.dtype in (torch.float8_e8m0fnu, torch.uint8):
        idx = _index_of(weight, index)
        shift = scale.view(torch.uint8).to(torch.int32) << 8
        _by_block(idx.view(n, k), shift, br, bc, torch.Tensor.add_)
        torch.index_select(_scaled_table("fp8", out.dtype), 0, idx, out=out.view(-1))
        return
    torch.index_select(_fp8_table(out.dtype), 0, _index_of(weight, index), out=out.view(-1))
    _by_block(out, e8m0_to_float(scale).to(out.dtype), br, bc, torch.Tensor.mul_)


@functools.cache
def _scaled_table(fmt: str, work: torch.dtype) -> torch.Tensor:
    """[65536]: entry `scale_byte * 256 + byte` is the stored byte's value (fp8: one e4m3;
    fp4: the pair of e2m1 nibbles, as one word) times the e8m0 scale, multiplied in `work`
    exactly as the scale-after-decode path does (so the same bits, NaN scale 255 included)."""
    scales = e8m0_to_float(torch.arange(256, dtype=torch.uint8)).to(work)
    if fmt == "fp8":
        return (scales[:, None] * _fp8_table(work)[None, :]).reshape(-1)
    values = scales[:, None, None] * _fp4_pair_table(work)[None]  # [scale, byte, 2]
    return values.contiguous().view(_fp4_pair_words(work).dtype).reshape(-1)


def _index_of(weight: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """The weight's bytes widened to int32 lookup indices (into `index` when given)."""
    flat = weight.contiguous().view(torch.uint8).view(-1)
    if index is None:
        return flat.to(torch.int32)
    idx = index[: flat.numel()]
    idx.copy_(flat)
    return idx


@functools.cache
def _fp8_table(work: torch.dtype) -> torch.Tensor:
    """[256]: every e4m3 byte's value in `work`, converted by torch's own cast (so a lookup
    gives the same bits as `.to(work)`, NaN codes included)."""
    return torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(work)


@functools.cache
def _fp4_pair_table(work: torch.dtype) -> torch.Tensor:
    """[256, 2]: byte -> (value of its low nibble, value of its high nibble)."""
    values = torch.tensor(FP4_VALUES, dtype=work)
    byte = torch.arange(256)
    return torch.stack([values[byte & 0xF], values[byte >> 4]], dim=1)


def _check_fp4(
    shape: torch.Size | tuple[int, ...], scale: torch.Tensor, *, fmt: QuantFormat = FP4_1X32
) -> None:
    _require(fmt, "fp4")
    n, half = shape
    k = 2 * half
    nb, kb = fmt.scale_shape(n, k)
    if k % fmt.block_cols or tuple(scale.shape) != (nb, kb):
        raise ValueError(
            f"FP4 weight [{n}, {half}] packed ({k} input columns) needs a scale of shape "
            f"[{nb}, {k // fmt.block_cols}] ({fmt.shape} blocks, K a multiple of "
            f"{fmt.block_cols}), got {list(scale.shape)}"
        )


def dequantize_fp4(
    weight: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype,
    *,
    fmt: QuantFormat = FP4_1X32,
) -> torch.Tensor:
    """FP4 e2m1 packed `[N, K/2]` (int8 or float4_e2m1fn_x2) with `fmt.scale_shape(N, K)` scales
    -> `[N, K]`."""
    n, half = weight.shape
    _check_fp4(weight.shape, scale, fmt=fmt)
    work = work_dtype(dtype)
    if weight.device.type != "cpu":
        return dequantize_fp4_elementwise(weight, scale, work, fmt=fmt).to(dtype)
    out = torch.empty(n, 2 * half, dtype=work, device=weight.device)
    dequantize_fp4_into(weight, scale, out, fmt=fmt)
    return out.to(dtype)


def dequantize_fp4_elementwise(
    weight: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype,
    *,
    fmt: QuantFormat = FP4_1X32,
) -> torch.Tensor:
    """`dequantize_fp4` by elementwise ops on the weight's own device (accelerators: the CPU
    path's byte tables live on the host). Each nibble's value times its power-of-two scale is
    exact in bf16 / fp32 / fp64, so the bits equal the table path's."""
    n, half = weight.shape
    _check_fp4(weight.shape, scale, fmt=fmt)
    byte = weight.contiguous().view(torch.uint8)
    codes = torch.stack((byte & 0xF, byte >> 4), dim=-1).view(n, 2 * half).long()
    values = torch.tensor(FP4_VALUES, dtype=dtype, device=weight.device)[codes]
    s = e8m0_to_float(scale).to(dtype)
    if fmt.block_rows > 1:  # a scale row per value row (the last block may be partial)
        s = s.repeat_interleave(fmt.block_rows, dim=0)[:n]
    scaled = values.view(n, -1, fmt.block_cols) * s[:, :, None]
    return scaled.view(n, 2 * half)


def dequantize_fp4_into(
    weight: torch.Tensor,
    scale: torch.Tensor,
    out: torch.Tensor,
    index: torch.Tensor | None = None,
    *,
    fmt: QuantFormat = FP4_1X32,
) -> None:
    """`dequantize_fp4` written into `out` (`[N, K]`, contiguous; any rows of a weight that
    start on a block row, with their scale rows). `index` (int32, >= N*K/2 elements) is
    reusable scratch.

    One gather per byte decodes both nibbles and applies the scale: a table of every (scale,
    byte) pair of values (`_scaled_table`, each pair one 4- or 8-byte word), indexed by `byte +
    256 x scale byte` over a broadcast view (a block's bc inputs are bc/2 bytes of a row),
    written straight into `out`. A multiply by 2^e rounds the exact product once, so the table
    holds the bits of any other order. Float scales or float64 multiply after the gather."""
    n, k = out.shape
    _check_fp4((n, k // 2), scale, fmt=fmt)
    br, bc = fmt.block_rows, fmt.block_cols
    idx = _index_of(weight, index)
    pairs = _fp4_pair_words(out.dtype)
    if pairs is not None and scale.dtype in (torch.float8_e8m0fnu, torch.uint8):
        shift = scale.view(torch.uint8).to(torch.int32) << 8
        _by_block(idx.view(n, k // 2), shift, br, bc // 2, torch.Tensor.add_)
        words = out.view(pairs.dtype).view(-1)
        torch.index_select(_scaled_table("fp4", out.dtype), 0, idx, out=words)
        return
    if pairs is not None:
        torch.index_select(pairs, 0, idx, out=out.view(pairs.dtype).view(-1))
    else:  # a pair wider than 8 bytes (float64): gather rows of two
        out.view(-1, 2).copy_(F.embedding(idx, _fp4_pair_table(out.dtype)))
    _by_block(out, e8m0_to_float(scale).to(out.dtype), br, bc, torch.Tensor.mul_)


@functools.cache
def _fp4_pair_words(work: torch.dtype) -> torch.Tensor | None:
    """`_fp4_pair_table` with each (low, high) pair viewed as one int32 / int64 word (None when
    a pair does not fit 8 bytes), so the decode is a 1-D index_select."""
    word = {2: torch.int32, 4: torch.int64}.get(work.itemsize)
    return None if word is None else _fp4_pair_table(work).contiguous().view(word).view(-1)


def _pow2_exponent(amax: torch.Tensor, limit: float) -> torch.Tensor:
    """Smallest e with amax / 2^e <= limit (ue8m0 rounds scales up), clamped to e8m0's range.
    A block holding NaN or inf has no scale: it raises (a weight like that would be stored
    clamped or as garbage, silently).

    Read off the bits of the float32 quotient q = amax / limit (frexp and ldexp cost more than
    the rest of a quantization): a normal q = 2^E x 1.f needs E, plus 1 unless f is 0; a
    subnormal q needs -126 above 2^-127 (mantissa field > 2^22) and -127 (the clamp) below."""
    if not bool(torch.isfinite(amax).all()):
        raise ValueError(f"{_count_nonfinite(amax)} quantization block(s) hold NaN or inf values")
    bits = (amax.to(torch.float32) / limit).view(torch.int32)
    biased = bits >> 23
    normal = biased - 127 + (bits & 0x7FFFFF).ne(0).to(torch.int32)
    subnormal = torch.where(bits > 1 << 22, -126, -127).to(torch.int32)
    return torch.where(biased == 0, subnormal, normal).clamp_(-E8M0_BIAS, E8M0_BIAS)


def _count_nonfinite(amax: torch.Tensor) -> int:
    return int((~torch.isfinite(amax)).sum())


def _bf16_fast(weight: torch.Tensor) -> bool:
    """bf16 on CPU quantizes by table lookup (`_quantize_bf16`); other inputs by arithmetic."""
    return weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.ndim == 2


@functools.cache
def _bf16_code_table(kind: str) -> torch.Tensor:
    """[65536] uint8: the code of every bf16 bit pattern, made by the float32 path itself
    (clamp, then e4m3 cast or `_fp4_codes`), so a lookup gives its bits by construction."""
    x = torch.arange(65536, dtype=torch.int32).to(torch.uint16).view(torch.bfloat16).float()
    if kind == "fp8":
        return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return _fp4_codes(x.clamp(-FP4_MAX, FP4_MAX))


QUANT_CHUNK = 1 << 19  # elements per step of the bf16 quantizers (scratch: 2 x 2 MiB, in cache)
_SCRATCH = threading.local()


@dataclass(frozen=True, kw_only=True)
class _Bf16Format:
    """What `_quantize_bf16` needs of a format. `limit` = (1 + L/128) x 2^P is a bf16 value, so
    for a bf16 block maximum with pattern p (sign cleared: exponent field E, mantissa m) the
    smallest e with max <= limit x 2^e is E - 127 - P, plus 1 when m > L: that is
    ((p + 127 - L) >> 7) - (127 + P), a carry doing the comparison."""

    block_rows: int
    block_cols: int
    limit: float
    lowest: int  # the lowest e the bit shift handles (zeros and subnormals stay code 0)

    @functools.cached_property
    def carry(self) -> int:
        return 127 - (int(torch.tensor(self.limit, dtype=torch.bfloat16).view(torch.int16)) & 0x7F)

    @functools.cached_property
    def bias(self) -> int:
        return 127 + math.floor(math.log2(self.limit))

    @functools.cached_property
    def pattern_range(self) -> tuple[int, int]:
        """(smallest, largest) maximum pattern whose exponent is in [lowest, 0]."""
        e = ((torch.arange(0x7F80) + self.carry) >> 7) - self.bias
        ok = torch.nonzero((e >= self.lowest) & (e <= 0)).view(-1)
        return int(ok[0]), int(ok[-1])


# `_Bf16Format.lowest` per code kind: it depends on the codes (the smallest code's half), not
# on the block
_LOWEST = {"fp8": -116, "fp4": -124}


@functools.cache
def _bf16_format(fmt: QuantFormat) -> _Bf16Format:
    return _Bf16Format(
        block_rows=fmt.block_rows,
        block_cols=fmt.block_cols,
        limit=fmt.limit,
        lowest=_LOWEST[fmt.kind],
    )


def _scratch(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """This thread's buffers of >= n elements (int32 index, int32 magnitude, uint8 codes, int16
    pairs), kept between calls: fresh pages for every chunk would cost a fault each."""
    bufs = getattr(_SCRATCH, "bufs", None)
    if bufs is None or bufs[0].numel() < n:
        size = max(n, QUANT_CHUNK)
        bufs = (
            torch.empty(size, dtype=torch.int32),
            torch.empty(size, dtype=torch.int32),
            torch.empty(size, dtype=torch.uint8),
            torch.empty(size // 2 + 1, dtype=torch.int16),
        )
        _SCRATCH.bufs = bufs
    return bufs


def _quantize_bf16(w: torch.Tensor, fmt: QuantFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_fp8` / `quantize_fp4` of a contiguous bf16 `[N, K]` (N, K multiples of the
    block): as one C pass per block (native_quant.py) when a compiler is at hand, else by row
    chunks of torch integer operations on the bf16 bit patterns; both bit-equal to the float32
    path (tested over every bf16 pattern). The algorithm:
    - block maxima: the patterns without their sign bit order like the magnitudes, so an int32
      max over them is the block's largest |x|, and its exponent follows by a carry
      (`_Bf16Format`);
    - x / 2^e, for e in [lowest, 0]: the pattern plus -e << 7 (the exponent field moves,
      nothing rounds). Zeros and subnormals then land far below the smallest code's half (the
      lowest exponent sees to it), so they keep code 0 with their sign, as the division gives
      them, and an all-zero block takes the lowest shift. A chunk with another block outside
      that range (a scale above 1 or below 2^lowest) divides in bf16 (exact: a power of two);
    - the code: one gather from the table of every bf16 pattern's code (`_bf16_code_table`),
      then FP4 packs two codes per byte."""
    f = _bf16_format(fmt)
    kind = fmt.kind
    table = _bf16_code_table(kind)
    native = native_quant.quantize(
        w,
        kind,
        block_rows=f.block_rows,
        block_cols=f.block_cols,
        carry=f.carry,
        bias=f.bias,
        lowest=f.lowest,
        table=table,
    )  # the same algorithm as one C pass, when a compiler is at hand (native_quant.py)
    if native is not None:
        out, exponent, bad = native
        if bad:
            raise ValueError(f"{bad} quantization block(s) hold NaN or inf values")
    else:
        out, exponent = _quantize_bf16_torch(w, f, kind, table)
    q = out.view(torch.float8_e4m3fn) if kind == "fp8" else out.view(torch.int8)
    return q, float_to_e8m0(exponent)


def _quantize_bf16_torch(
    w: torch.Tensor, f: _Bf16Format, kind: str, table: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_quantize_bf16`'s torch path, by row chunks: (uint8 codes, int32 block exponents)."""
    n, k = w.shape
    br, bc = f.block_rows, f.block_cols
    lo_pattern, hi_pattern = f.pattern_range
    exponent = torch.empty(n // br, k // bc, dtype=torch.int32)
    out = torch.empty(n, k if kind == "fp8" else k // 2, dtype=torch.uint8)
    step = max(1, QUANT_CHUNK // (k * br)) * br
    idx_buf, mag_buf, code_buf, pair_buf = _scratch(step * k)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        rows, c = r1 - r0, (r1 - r0) * k
        shape = (rows // br, br, k // bc, bc)  # blocks of a chunk
        idx = idx_buf[:c]
        idx.copy_(w[r0:r1].view(torch.uint16).view(-1))  # a copy_ widens fastest
        mag = torch.bitwise_and(idx, 0x7FFF, out=mag_buf[:c]).view(shape)
        top = mag.amax(dim=(1, 3))  # the largest magnitude pattern per block
        low, high = (int(v) for v in torch.aminmax(top))
        if high >= 0x7F80:  # exponent field all ones: inf or NaN
            raise ValueError(
                f"{_count_bad_blocks(w, br, bc)} quantization block(s) hold NaN or inf values"
            )
        if low == 0 and high:  # all-zero blocks take any shift: the others decide
            low = int(torch.where(top == 0, high, top).min())
        shift = lo_pattern <= low and high <= hi_pattern
        e = top.add_(f.carry).bitwise_right_shift_(7).sub_(f.bias).clamp_(-E8M0_BIAS, E8M0_BIAS)
        exponent[r0 // br : r1 // br] = e
        if shift:
            down = e.neg_().clamp_(max=-f.lowest).bitwise_left_shift_(7)
            idx.view(shape).add_(down[:, None, :, None])
        else:
            inverse = torch.ldexp(torch.ones_like(e, dtype=torch.float32), -e).to(torch.bfloat16)
            scaled = w[r0:r1].view(shape) * inverse[:, None, :, None]
            idx.copy_(scaled.view(torch.uint16).view(-1))
        if kind == "fp8":
            torch.index_select(table, 0, idx, out=out[r0:r1].view(-1))
            continue
        codes = torch.index_select(table, 0, idx, out=code_buf[:c])
        if sys.byteorder == "little":  # a pair of codes is one int16, the even one low
            pair = codes.view(torch.int16)
            packed = torch.bitwise_right_shift(pair, 4, out=pair_buf[: c // 2]).bitwise_or_(pair)
            out[r0:r1].view(-1).copy_(packed)  # the cast keeps the low byte
        else:
            codes = codes.view(rows, k)
            out[r0:r1] = torch.bitwise_or(codes[:, 0::2], codes[:, 1::2] << 4)
    return out, exponent


def _count_bad_blocks(w: torch.Tensor, br: int, bc: int) -> int:
    n, k = w.shape
    finite = torch.isfinite(w).view(n // br, br, k // bc, bc).all(dim=3).all(dim=1)
    return int((~finite).sum())


def quantize_fp8(
    weight: torch.Tensor, *, fmt: QuantFormat = FP8_128X128
) -> tuple[torch.Tensor, torch.Tensor]:
    """`[N, K]` -> (float8_e4m3fn `[N, K]`, e8m0 `fmt.scale_shape(N, K)`)."""
    _require(fmt, "fp8")
    n, k = weight.shape
    br, bc = fmt.block_rows, fmt.block_cols
    if _bf16_fast(weight) and n % br == 0 and k % bc == 0:
        return _quantize_bf16(weight.detach().contiguous(), fmt)
    w = weight.detach().to(torch.float32, memory_format=torch.contiguous_format).contiguous()
    w, n, k = _block_view(w, br, bc)
    amax = w.abs().amax(dim=(1, 3)).clamp_min(torch.finfo(torch.float32).tiny)
    exponent = _pow2_exponent(amax, FP8_MAX)
    s = torch.ldexp(torch.ones_like(amax), exponent)
    q = (w / s[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    q = q.reshape(w.shape[0] * br, w.shape[2] * bc)[:n, :k].contiguous()
    return q, float_to_e8m0(exponent)


def _fp4_boundaries() -> torch.Tensor:
    """Rounding boundaries between neighbouring e2m1 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6.

    bucketize sends a value equal to a boundary down; ties must go to the even code, which is
    up at 0.75, 1.75 and 3.5 (odd codes below them), so those boundaries move to the float just
    below: a value equal to the midpoint is then above it, anything smaller is not.
    """
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    up = torch.tensor([False, True, False, True, False, True, False])
    return torch.where(up, torch.nextafter(mids, torch.zeros(())), mids)


def _fp4_codes(x: torch.Tensor) -> torch.Tensor:
    """float32 values already in [-6, 6] -> e2m1 codes (uint8), nearest, ties to even code.

    The magnitude code is the number of boundaries strictly below |x| (what bucketize returns),
    counted by seven compares into a byte: several times faster than bucketize's binary search
    on CPU, and no int32 codes."""
    a = x.abs()
    bounds = _fp4_boundaries().tolist()
    code = torch.gt(a, bounds[0]).view(torch.uint8)
    for bound in bounds[1:]:
        code += a > bound
    return code.bitwise_or_(torch.signbit(x).view(torch.uint8) << 3)


def quantize_fp4(
    weight: torch.Tensor, *, fmt: QuantFormat = FP4_1X32
) -> tuple[torch.Tensor, torch.Tensor]:
    """`[N, K]` (K a multiple of the block's columns) -> (int8 `[N, K/2]` packed e2m1, e8m0
    `fmt.scale_shape(N, K)`)."""
    _require(fmt, "fp4")
    n, k = weight.shape
    br, bc = fmt.block_rows, fmt.block_cols
    if k % bc:
        raise ValueError(
            f"FP4 needs the input dimension to be a multiple of {bc}, got [{n}, {k}] "
            f"({fmt.shape} blocks)"
        )
    if _bf16_fast(weight) and n % br == 0:
        return _quantize_bf16(weight.detach().contiguous(), fmt)
    w = weight.detach().to(torch.float32, memory_format=torch.contiguous_format).contiguous()
    w, n, k = _block_view(w, br, bc)
    amax = w.abs().amax(dim=(1, 3)).clamp_min(torch.finfo(torch.float32).tiny)
    exponent = _pow2_exponent(amax, FP4_MAX)
    s = torch.ldexp(torch.ones_like(amax), exponent)
    codes = _fp4_codes((w / s[:, None, :, None]).clamp_(-FP4_MAX, FP4_MAX))
    codes = codes.view(w.shape[0] * br, k)[:n].view(n, k // 2, 2)
    packed = torch.bitwise_or(codes[..., 0], codes[..., 1] << 4)  # low nibble = even column
    return packed.view(torch.int8), float_to_e8m0(exponent)


def quantize(weight: torch.Tensor, *, fmt: QuantFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_fp8` or `quantize_fp4`, as `fmt.kind` says."""
    if fmt.kind == "fp8":
        return quantize_fp8(weight, fmt=fmt)
    return quantize_fp4(weight, fmt=fmt)


def dequantize(
    weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, *, fmt: QuantFormat
) -> torch.Tensor:
    """`dequantize_fp8` or `dequantize_fp4`, as `fmt.kind` says."""
    if fmt.kind == "fp8":
        return dequantize_fp8(weight, scale, dtype, fmt=fmt)
    return dequantize_fp4(weight, scale, dtype, fmt=fmt)


def _block_scales(weight: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """Each value's block scale as the quantizers choose it (`[N, K]` float32)."""
    w, n, k = _block_view(weight.detach().to(torch.float32), fmt.block_rows, fmt.block_cols)
    amax = w.abs().amax(dim=(1, 3))
    scale = torch.ldexp(torch.ones_like(amax), _pow2_exponent(amax.clamp_min(1e-38), fmt.limit))
    return scale[:, None, :, None].expand_as(w).reshape(w.shape[0] * w.shape[1], -1)[:n, :k]


def fp8_error_bound(weight: torch.Tensor, *, fmt: QuantFormat = FP8_128X128) -> torch.Tensor:
    """Per-element bound on |dequant(quant(w)) - w|: e4m3 keeps 3 mantissa bits, so a normal
    value rounds by at most 2^-4 of itself; below e4m3's smallest normal (2^-6 x scale) the
    spacing is 2^-9 x scale, half of it absolute. scale <= 2 amax / 448 (ue8m0 rounds up)."""
    _require(fmt, "fp8")
    return weight.detach().abs().float() * 2.0**-4 + _block_scales(weight, fmt) * 2.0**-10


def fp4_error_bound(weight: torch.Tensor, *, fmt: QuantFormat = FP4_1X32) -> torch.Tensor:
    """Per-element bound for FP4: e2m1 keeps 1 mantissa bit (spacing 2^-1 of the binade from
    1 x scale up, so at most 1/4 of the value), and below 1 x scale the grid step is 0.5 x scale
    (at most 0.25 x scale absolute)."""
    _require(fmt, "fp4")
    return weight.detach().abs().float() * 0.25 + _block_scales(weight, fmt) * 0.25
