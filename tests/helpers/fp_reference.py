"""Bit-level reference decoders of the release's number formats, written from their
definitions (not from the package's tables): FP8 e4m3fn, FP4 e2m1, e8m0 scales."""

from __future__ import annotations

import math


def decode_e4m3(byte: int) -> float:
    """float8_e4m3fn: sign 1, exponent 4 (bias 7), mantissa 3; S.1111.111 is NaN, no inf."""
    sign = -1.0 if byte & 0x80 else 1.0
    exp, man = (byte >> 3) & 0xF, byte & 0x7
    if exp == 0xF and man == 0x7:
        return math.nan
    if exp == 0:
        return sign * (man / 8) * 2.0**-6
    return sign * (1 + man / 8) * 2.0 ** (exp - 7)


def decode_e2m1(code: int) -> float:
    """e2m1: sign 1, exponent 2 (bias 1), mantissa 1; exponent 0 is subnormal (0 or 0.5)."""
    sign = -1.0 if code & 0x8 else 1.0
    exp, man = (code >> 1) & 0x3, code & 0x1
    if exp == 0:
        return sign * man * 0.5
    return sign * (1 + man / 2) * 2.0 ** (exp - 1)


def decode_e8m0(byte: int) -> float:
    return math.nan if byte == 255 else 2.0 ** (byte - 127)
