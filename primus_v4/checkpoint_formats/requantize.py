"""Quantize a weight again in the format it was read from, keeping what did not change.

Decoding is exact, but quantizing the decoded values does not always give the stored bytes
back: a ue8m0 scale is chosen from the block's maximum BEFORE rounding, so a block whose maximum
rounded down to half the code limit (e4m3 224, e2m1 3) was stored with the next larger scale,
while its decoded values are quantized afresh with the smaller one (codes 448 / 6). Both decode
to the same values. `requantize` keeps the stored codes and scale of every block whose values
are bit-equal to the stored block's decoded values, and quantizes the other blocks afresh
(`fp8_fp4.quantize`): an unchanged weight is written back byte for byte, a changed block as
any export quantizes it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from primus_v4.checkpoint_formats.fp8_fp4 import QuantFormat, dequantize, quantize


def stored_views(
    weight: torch.Tensor, scale: torch.Tensor, fmt: QuantFormat
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored bytes (any 1-byte dtype, e.g. uint8 read buffers) viewed as the codec's dtypes:
    e4m3 (FP8) or int8 (packed FP4) codes and e8m0 scales."""
    codes = torch.float8_e4m3fn if fmt.kind == "fp8" else torch.int8
    return weight.view(codes), scale.view(torch.float8_e8m0fnu)


def _same_blocks(values: torch.Tensor, stored: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """[blocks of rows, blocks of columns] bool: the block's float32 bits all equal (so -0.0 and
    0.0 differ, as their codes do); blocks hanging over the edges compare their inside."""
    n, k = values.shape
    br, bc = fmt.block_rows, fmt.block_cols
    equal = (values.view(torch.int32) == stored.view(torch.int32)).to(torch.uint8)
    equal = F.pad(equal, (0, -k % bc, 0, -n % br), value=1)
    nb, kb = fmt.scale_shape(n, k)
    return equal.view(nb, br, kb, bc).amin(dim=(1, 3)).bool()


def requantize(
    values: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, *, fmt: QuantFormat
) -> tuple[torch.Tensor, torch.Tensor]:
    """`values` `[N, K]` quantized in `fmt` -> (codes, e8m0 scale) as `fp8_fp4.quantize` gives
    them, except that each block whose values equal the decode of the stored `weight` / `scale`
    (the same format, as stored: see `stored_views`) keeps those stored bytes."""
    weight, scale = stored_views(weight, scale, fmt)
    stored = dequantize(weight, scale, torch.float32, fmt=fmt)
    if tuple(stored.shape) != tuple(values.shape):
        raise ValueError(
            f"values {list(values.shape)} and the stored weight {list(stored.shape)} differ in "
            "shape"
        )
    v = values.detach().to(torch.float32).contiguous()
    same = _same_blocks(v, stored, fmt)
    if bool(same.all()):
        return weight.clone(), scale.clone()
    q, s = quantize(v, fmt=fmt)
    if not bool(same.any()):
        return q, s
    n, cols = q.shape  # FP4: a block's columns are block_cols / 2 bytes of a row
    per_byte = fmt.block_cols if fmt.kind == "fp8" else fmt.block_cols // 2
    keep = same.repeat_interleave(fmt.block_rows, 0)[:n].repeat_interleave(per_byte, 1)[:, :cols]
    q = torch.where(keep, weight.view(torch.uint8), q.view(torch.uint8)).view(q.dtype)
    s = torch.where(same, scale.view(torch.uint8), s.view(torch.uint8)).view(s.dtype)
    return q, s
