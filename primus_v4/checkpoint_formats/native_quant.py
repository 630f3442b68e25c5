"""The bf16 quantizers of fp8_fp4 as one C pass per block (quant_bf16.c), when a C compiler
is at hand.

Quantizing is what an fp8 export spends its time on: the torch ops of `_quantize_bf16` make
about seven passes over every value (~1.4 ns per value on one core); the C loop makes one
(~0.5 ns). Its codes and scales are `_quantize_bf16`'s, element for element (the same table,
the same exponent rule; tested over every bf16 pattern and against the float32 path).

The source is compiled on first use with `$CC` (default `cc`, `-O3`) into the cache directory
(`$PRIMUS_V4_CACHE_DIR`, else `$XDG_CACHE_HOME/primus_v4`, else `~/.cache/primus_v4`), under a
name that hashes the source, the compiler's version and the machine, written to a temp file and
renamed into place (ranks compiling at once do not see a half-written library). A library is code
this process runs: it is loaded only from a directory created 0700, owned by this user and not
writable by group or others, and only when the file itself is ours and not writable by others;
otherwise it is refused with one warning and the torch path runs. Without a
compiler, or with `PRIMUS_V4_NATIVE_QUANT=0`, `quantize` returns None and the torch path runs:
the same bits, slower. ctypes releases the GIL during the call, so export threads run it in
parallel.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import torch

from primus_v4.durable import private_dir_problem, trusted_file_problem
from primus_v4.log import get_logger

log = get_logger(__name__)

SOURCE = Path(__file__).with_name("quant_bf16.c")
ENV_SWITCH = "PRIMUS_V4_NATIVE_QUANT"


def cache_dir() -> Path:
    explicit = os.environ.get("PRIMUS_V4_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "primus_v4"


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0"


@functools.cache
def _library(compiler: str, *, portable: bool = False) -> ctypes.CDLL | None:
    """The compiled quant_bf16.c (built once per source, compiler and machine), or None with
    the reason logged once. `portable` builds the table path that machines without SSE2 take
    (for tests)."""
    try:
        version = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, timeout=30, check=True
        ).stdout
        source = SOURCE.read_bytes()
        flags = ["-O3", "-std=c99", "-shared", "-fPIC", *(["-DQUANT_BF16_PORTABLE"] * portable)]
        key = hashlib.sha256(
            source + version.encode() + platform.machine().encode() + " ".join(flags).encode()
        ).hexdigest()
        target = cache_dir() / f"quant_bf16-{key[:16]}.so"
        problem = private_dir_problem(target.parent)
        if problem is None and target.is_file():
            problem = trusted_file_problem(target)
        if problem is not None:
            log.warning("native bf16 quantizer refused: %s (someone else could have put code "
                        "there); torch ops quantize (the same bits, slower)", problem)  # fmt: skip
            return None
        if not target.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".quant_bf16-", suffix=".so")
            os.close(fd)
            try:
                subprocess.run(
                    [compiler, *flags, "-o", tmp, str(SOURCE)],
                    capture_output=True, text=True, timeout=120, check=True,
                )  # fmt: skip
                os.replace(tmp, target)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as err:
        detail = getattr(err, "stderr", "") or err
        log.info("native bf16 quantizer unavailable (%s: %s); torch ops quantize", compiler, detail)
        return None
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    common = [ptr, i64, i64, i32, i32, i32, ptr, ptr, ptr]
    lib.quantize_fp4_bf16.argtypes = common
    lib.quantize_fp4_bf16.restype = i64
    lib.quantize_fp8_bf16.argtypes = [*common, ptr]
    lib.quantize_fp8_bf16.restype = i64
    lib.quantize_fp8_bf16_blocks.argtypes = [ptr, i64, i64, i64, i64, *common[3:], ptr]
    lib.quantize_fp8_bf16_blocks.restype = i64
    return lib


def library() -> ctypes.CDLL | None:
    """The native quantizer library, or None (disabled, or no working compiler)."""
    if not enabled():
        return None
    return _library(os.environ.get("CC", "cc"))


def quantize(
    w: torch.Tensor,
    kind: str,
    *,
    block_rows: int,
    block_cols: int,
    carry: int,
    bias: int,
    lowest: int,
    table: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """(codes uint8, exponents int32, blocks holding NaN or inf) of a contiguous CPU bf16
    `[N, K]` (N, K multiples of the block), or None without the library or for an FP4 block
    other than 1x32 (the only one either release stores; its SIMD pass is written for 32
    inputs). The format constants are `fp8_fp4._Bf16Format`'s."""
    if kind == "fp4" and (block_rows, block_cols) != (1, 32):
        return None
    lib = library()
    if lib is None:
        return None
    n, k = w.shape
    ptr = ctypes.c_void_p
    data, consts = ptr(w.data_ptr()), [carry, bias, lowest, ptr(table.data_ptr())]
    if kind == "fp4":
        out = torch.empty(n, k // 2, dtype=torch.uint8)
        exponent = torch.empty(n, k // 32, dtype=torch.int32)
        bad = lib.quantize_fp4_bf16(
            data, n, k, *consts, ptr(out.data_ptr()), ptr(exponent.data_ptr())
        )
        return out, exponent, int(bad)
    out = torch.empty(n, k, dtype=torch.uint8)
    exponent = torch.empty(n // block_rows, k // block_cols, dtype=torch.int32)
    top = torch.empty(k // block_cols, dtype=torch.int32)
    tail = [ptr(out.data_ptr()), ptr(exponent.data_ptr()), ptr(top.data_ptr())]
    if (block_rows, block_cols) == (128, 128):  # V4's entry point: the block compiled in
        bad = lib.quantize_fp8_bf16(data, n, k, *consts, *tail)
    else:
        bad = lib.quantize_fp8_bf16_blocks(data, n, k, block_rows, block_cols, *consts, *tail)
    return out, exponent, int(bad)
