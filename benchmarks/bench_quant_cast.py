"""Is the native bf16 quantizer (checkpoint_formats/quant_bf16.c) still needed? Each way of
encoding a bf16 weight in the release's formats, side by side on the same tensors, one thread:

  torch cast   float32 x / 2^e, then torch's own `.to(torch.float8_e4m3fn)` (FP8 only: torch
               has no cast to float4_e2m1fn_x2, only the storage dtype; FP4 codes are compares)
  torch ints   the integer ops on the bf16 bit patterns (PRIMUS_V4_NATIVE_QUANT=0)
  native C     quant_bf16.c, one pass per block (the default where a C compiler exists)

Prints ns per value and whether every path gives the same bytes and scales as the native pass.

    python benchmarks/bench_quant_cast.py [--rows 4096 --cols 4096 --repeat 3]
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from primus_v4.checkpoint_formats import fp8_fp4, native_quant


def _best(fn, repeat: int) -> tuple[float, tuple[torch.Tensor, torch.Tensor]]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def _same(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> bool:
    pairs = zip(a, b, strict=True)
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in pairs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(args.rows, args.cols, generator=gen) * 0.02).to(torch.bfloat16)
    n = w.numel()
    if native_quant.library() is None:
        raise SystemExit("no C compiler: the native pass cannot be measured here")
    rows = []
    for fmt, quantize in (("fp8", fp8_fp4.quantize_fp8), ("fp4", fp8_fp4.quantize_fp4)):
        t_native, ref = _best(lambda q=quantize: q(w), args.repeat)
        os.environ[native_quant.ENV_SWITCH] = "0"
        try:
            t_ints, ints = _best(lambda q=quantize: q(w), args.repeat)
        finally:
            del os.environ[native_quant.ENV_SWITCH]
        # float32 input takes the arithmetic path: for FP8 that is torch's float8_e4m3fn cast
        t_cast, cast = _best(lambda q=quantize: q(w.float()), args.repeat)
        rows.append((fmt, "native C", t_native, True))
        rows.append((fmt, "torch ints", t_ints, _same(ints, ref)))
        rows.append(
            (fmt, "torch cast" if fmt == "fp8" else "torch compares", t_cast, _same(cast, ref))
        )
    print(f"bf16 [{args.rows}, {args.cols}], one thread, best of {args.repeat}")
    print(f"{'format':<7}{'path':<16}{'ns/value':>10}{'x native':>10}  same bytes as native")
    for fmt, path, t, same in rows:
        native = next(r[2] for r in rows if r[0] == fmt and r[1] == "native C")
        print(f"{fmt:<7}{path:<16}{t / n * 1e9:>10.2f}{t / native:>10.2f}  {same}")


if __name__ == "__main__":
    main()
