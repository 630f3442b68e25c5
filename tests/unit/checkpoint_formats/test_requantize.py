"""requantize: stored blocks whose values did not change keep their bytes (the case a fresh
quantization gets wrong is built on purpose), changed blocks are quantized afresh."""

from __future__ import annotations

import pytest
import torch

from primus_v4.checkpoint_formats.fp8_fp4 import (
    FP4_1X32,
    FP8_1X32,
    FP8_32X32,
    QuantFormat,
    dequantize,
    quantize,
)
from primus_v4.checkpoint_formats.requantize import requantize

# a block maximum just above half the code limit rounds DOWN to exactly half of it (e4m3: 226
# -> 224, spacing 16 there; e2m1: 3.2 -> 3), so the decoded block is also exactly representable
# at the next smaller scale, which a fresh quantization of the decoded values picks
HALF_LIMIT_MAX = {"fp8": 226.0, "fp4": 3.2}


def _weights(fmt: QuantFormat, shape: tuple[int, int]) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    w = torch.randn(*shape, generator=g)
    w[0, 0] = HALF_LIMIT_MAX[fmt.kind]  # the first block's maximum
    return w


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize(
    ("fmt", "shape"),
    [(FP8_32X32, (70, 96)), (FP8_32X32, (64, 50)), (FP8_1X32, (9, 64)), (FP4_1X32, (5, 96))],
)
def test_unchanged_blocks_keep_their_bytes(fmt: QuantFormat, shape: tuple[int, int]) -> None:
    q, s = quantize(_weights(fmt, shape), fmt=fmt)
    values = dequantize(q, s, torch.float32, fmt=fmt)
    fresh_q, fresh_s = quantize(values, fmt=fmt)
    assert int(_bytes(fresh_s)[0, 0]) == int(_bytes(s)[0, 0]) - 1  # fresh: the smaller scale
    assert torch.equal(dequantize(fresh_q, fresh_s, torch.float32, fmt=fmt), values)
    kept_q, kept_s = requantize(values, q, s, fmt=fmt)
    assert kept_q.dtype == q.dtype and kept_s.dtype == s.dtype
    assert torch.equal(_bytes(kept_q), _bytes(q)) and torch.equal(_bytes(kept_s), _bytes(s))


@pytest.mark.parametrize(("fmt", "shape"), [(FP8_32X32, (70, 96)), (FP4_1X32, (5, 96))])
def test_a_changed_block_is_quantized_afresh(fmt: QuantFormat, shape: tuple[int, int]) -> None:
    q, s = quantize(_weights(fmt, shape), fmt=fmt)
    values = dequantize(q, s, torch.float32, fmt=fmt)
    changed = values.clone()
    row, col = shape[0] - 1, shape[1] - 1  # the last block (partial in rows for 70 x 96)
    changed[row, col] += 0.1
    new_q, new_s = requantize(changed, q, s, fmt=fmt)
    fresh_q, fresh_s = quantize(changed, fmt=fmt)
    block_row, block_col = row // fmt.block_rows, col // fmt.block_cols
    keep_s = torch.ones_like(_bytes(s), dtype=torch.bool)
    keep_s[block_row, block_col] = False
    assert torch.equal(_bytes(new_s)[keep_s], _bytes(s)[keep_s])
    assert _bytes(new_s)[block_row, block_col] == _bytes(fresh_s)[block_row, block_col]
    per_byte = fmt.block_cols if fmt.kind == "fp8" else fmt.block_cols // 2
    rows = slice(block_row * fmt.block_rows, (block_row + 1) * fmt.block_rows)
    cols = slice(block_col * per_byte, (block_col + 1) * per_byte)
    assert torch.equal(_bytes(new_q)[rows, cols], _bytes(fresh_q)[rows, cols])
    keep_q = torch.ones_like(_bytes(q), dtype=torch.bool)
    keep_q[rows, cols] = False
    assert torch.equal(_bytes(new_q)[keep_q], _bytes(q)[keep_q])  # the first block kept too


def test_a_shape_mismatch_is_refused() -> None:
    q, s = quantize(torch.randn(32, 64), fmt=FP8_32X32)
    with pytest.raises(ValueError, match=r"values \[64, 32\] and the stored weight \[32, 64\]"):
        requantize(torch.randn(64, 32), q, s, fmt=FP8_32X32)
