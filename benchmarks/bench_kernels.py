"""Every kernel-seam op on every backend that can run here, side by side with the torch
reference in one run: forward and backward time, TFLOP/s, bytes moved, error vs the reference.

    python benchmarks/bench_kernels.py                 # GPU: Flash shapes, 4k and 16k rows
    python benchmarks/bench_kernels.py --rows 4096 --ops sparse_attention grouped_experts
    python benchmarks/bench_kernels.py --scale flash   # Flash shapes on CPU too (slow)

Shapes (`flash`, DeepSeek-V4-Flash per layer): sparse attention 64 heads x 512, a window of 128
+ top-k 512 explicit indices (a CSA layer; one sample fills the pack, so every query past the
start sees all its candidates); indexer 64 heads x 128 over the rows / 4 compressed keys, top-k
512; compressor pool [rows / 4, 8, 512] (CSA's overlapping ratio-4 windows); grouped experts
256 experts, top-6, hidden 4096, expert ffn 2048. `cpu` (the default without a GPU) keeps the
widths per head (attention 512, indexer 128) and divides heads by 32 (2 + 2), experts to 8 of
hidden 1024 x ffn 512, rows to 1024 (so top-k 512 sees at most the 256 visible keys): the
reference's times stay comparable across ops and the run stays short.

On CPU the Triton kernels run in Triton's interpreter, whose speed means nothing: there the
Triton rows report correctness only (error vs the reference at a small shape, fp32 and bf16).
FLOPs count the multiply-adds of the op's definition (2 per MAC; attention fwd = QK + PV over
the valid candidates, bwd = 2.5x fwd; the indexer has no backward). Bytes moved count each
input read once and each output written once (candidate keys once per query), a lower bound.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

if "TRITON_INTERPRET" not in os.environ and "--no-interpret" not in sys.argv:
    try:  # decided before triton is first imported (see tests/conftest.py)
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
    except ImportError:
        pass

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from primus_v4 import kernels
from primus_v4.errors import ConfigError

SCALES = {
    "flash": {"heads": 64, "index_heads": 64, "window": 128, "topk": 512,
              "experts": 256, "hidden": 4096, "ffn": 2048},
    "cpu": {"heads": 2, "index_heads": 2, "window": 128, "topk": 512,
            "experts": 8, "hidden": 1024, "ffn": 512},
}  # fmt: skip
HEAD_DIM, INDEX_DIM, TOPK_EXPERTS = 512, 128, 6


def _attention(rows: int, sc: dict, device, dtype, gen):
    h, d, w, k = sc["heads"], HEAD_DIM, sc["window"], sc["topk"]
    p = rows // 4  # CSA's ratio-4 pool follows the rows in the key buffer
    row = torch.arange(rows)
    lo = ((row - (w - 1)).clamp(min=0))[:, None]
    hi = (row + 1)[:, None]
    visible = (row + 1) // 4
    rnd = torch.rand(rows, p, generator=gen).masked_fill(
        torch.arange(p)[None, :] >= visible[:, None], 2.0
    )
    pick = rnd.topk(min(k, p), dim=1, largest=False)
    idx = torch.where(pick.values < 2.0, pick.indices + rows, -1)
    args = [
        torch.randn(rows, h, d, generator=gen),
        torch.randn(rows + p, d, generator=gen),
        torch.randn(h, generator=gen),
    ]
    kw = {"lo_TR": lo, "hi_TR": hi, "idx_TK": idx, "scale": d**-0.5}
    cands = float((hi - lo).sum() + (idx >= 0).sum())
    fwd = 4.0 * h * d * cands
    size = torch.finfo(dtype).bits // 8
    moved = size * (2 * rows * h * d + cands * d)
    return args, kw, (0, 1, 2), fwd, 2.5 * fwd, moved


def _indexer(rows: int, sc: dict, device, dtype, gen):
    h, d, p = sc["index_heads"], INDEX_DIM, rows // 4
    args = [
        torch.randn(rows, h, d, generator=gen),
        torch.rand(rows, h, generator=gen),
        torch.randn(p, d, generator=gen),
    ]
    row = torch.arange(rows)
    kw = {
        "lo_T": torch.zeros(rows, dtype=torch.long),
        "hi_T": (row + 1) // 4,
        "end_T": torch.full((rows,), p),
        "topk": sc["topk"],
        "chunk": 1024,
        "scale": (h * d) ** -0.5,
    }
    size = torch.finfo(dtype).bits // 8
    return args, kw, (), 2.0 * rows * p * h * d, 0.0, size * (rows * h * d + p * d) + 8 * rows * 512


def _pool(rows: int, sc: dict, device, dtype, gen):
    p, m, d = rows // 4, 8, HEAD_DIM
    args = [torch.randn(p, m, d, generator=gen), torch.randn(p, m, d, generator=gen)]
    size = torch.finfo(dtype).bits // 8
    return args, {}, (0, 1), 4.0 * p * m * d, 8.0 * p * m * d, size * (2 * p * m * d + p * d)


def _experts(rows: int, sc: dict, device, dtype, gen):
    e, dh, f = sc["experts"], sc["hidden"], sc["ffn"]
    m = rows * TOPK_EXPERTS
    counts = torch.bincount(torch.randint(e, (m,), generator=gen), minlength=e).tolist()
    args = [
        torch.randn(m, dh, generator=gen),
        counts,
        0.02 * torch.randn(e, 2 * f, dh, generator=gen),
        0.02 * torch.randn(e, dh, f, generator=gen),
    ]
    fwd = 2.0 * m * dh * 3 * f
    size = torch.finfo(dtype).bits // 8
    moved = size * (2 * m * dh + 3 * e * f * dh)
    return args, {"limit": 10.0}, (0, 2, 3), fwd, 2.0 * fwd, moved


CASES: dict[str, Callable] = {
    "sparse_attention": _attention,
    "indexer_topk": _indexer,
    "compressor_pool": _pool,
    "grouped_experts": _experts,
}


def _to(x, device, dtype):
    if isinstance(x, torch.Tensor):
        return x.to(device=device, dtype=dtype) if x.is_floating_point() else x.to(device)
    return x


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_once(fn, args, kw, grad_args, device, dtype, cot_seed=1):
    """(output, input grads, fwd seconds, bwd seconds) of one call on fresh inputs."""
    args = [_to(a, device, dtype) for a in args]
    for i in grad_args:
        args[i].requires_grad_(True)
    kw = {k: _to(v, device, dtype) if k != "scale" else v for k, v in kw.items()}
    _sync(device)
    t0 = time.perf_counter()
    out = fn(*args, **kw)
    _sync(device)
    t1 = time.perf_counter()
    grads, t2 = [], t1
    if grad_args:
        g = torch.Generator().manual_seed(cot_seed)
        out.backward(torch.randn(out.shape, generator=g).to(device, out.dtype))
        _sync(device)
        t2 = time.perf_counter()
        grads = [args[i].grad for i in grad_args]
    return out.detach(), grads, t1 - t0, t2 - t1


def _err(got, want) -> float:
    got, want = got.float().cpu(), want.float().cpu()
    if not got.is_floating_point():  # top-k indices: the share of slots that differ
        return float((got != want).float().mean())
    return float((got - want).abs().max() / want.abs().max().clamp(min=1e-30))


def bench(op, backend, rows, sc, device, dtype, reps, ref=None):
    gen = torch.Generator().manual_seed(0)
    args, kw, grad_args, f_fwd, f_bwd, moved = CASES[op](rows, sc, device, dtype, gen)
    fn = kernels.resolve(op, backend)
    times = []
    for _ in range(reps):
        out, grads, tf, tb = run_once(fn, args, kw, grad_args, device, dtype)
        times.append((tf, tb))
    kept = times[1:] or times  # the first call compiles (Triton) and warms the allocator
    fwd_s, bwd_s = min(t[0] for t in kept), min(t[1] for t in kept)
    result = {"out": out, "grads": grads, "fwd_s": fwd_s, "bwd_s": bwd_s,
              "flops": (f_fwd, f_bwd), "bytes": moved}  # fmt: skip
    if ref is not None:
        errs = [_err(out, ref["out"])] + [
            _err(g, r) for g, r in zip(grads, ref["grads"], strict=True)
        ]
        result["err"] = max(errs)
    return result


def _row(op, rows, backend, dtype, r, ref) -> str:
    f_fwd, f_bwd = r["flops"]
    tf = f"{f_fwd / r['fwd_s'] / 1e12:8.3g}" if r["fwd_s"] else f"{'-':>8}"
    tb = f"{f_bwd / r['bwd_s'] / 1e12:8.3g}" if f_bwd and r["bwd_s"] else f"{'-':>8}"
    speed = ""
    if ref is not None and ref is not r:
        total = r["fwd_s"] + r["bwd_s"]
        speed = f"{(ref['fwd_s'] + ref['bwd_s']) / total:6.2f}x" if total else ""
    err = f"{r['err']:.1e}" if "err" in r else "  ref  "
    return (f"  {op:<17} {rows:>6} {backend:<13} {str(dtype)[6:]:<9} "
            f"{r['fwd_s'] * 1e3:9.2f} {r['bwd_s'] * 1e3:9.2f} {tf} {tb} "
            f"{r['bytes'] / 1e9:8.3f} {err:>8} {speed}")  # fmt: skip


def _record(op, rows, backend, dtype, r, ref) -> dict:
    """One row for --json: TFLOP/s forward and backward, speed vs the torch reference."""
    f_fwd, f_bwd = r["flops"]
    total = r["fwd_s"] + r["bwd_s"]
    return {
        "op": op, "rows": rows, "backend": backend, "dtype": str(dtype)[6:],
        "fwd_ms": r["fwd_s"] * 1e3, "bwd_ms": r["bwd_s"] * 1e3,
        "fwd_tflops": f_fwd / r["fwd_s"] / 1e12 if r["fwd_s"] else None,
        "bwd_tflops": f_bwd / r["bwd_s"] / 1e12 if f_bwd and r["bwd_s"] else None,
        "vs_torch": (ref["fwd_s"] + ref["bwd_s"]) / total if total else None,
        "max_rel_err": r.get("err"),
    }  # fmt: skip


HEADER = (f"  {'op':<17} {'rows':>6} {'backend':<13} {'dtype':<9} {'fwd ms':>9} {'bwd ms':>9} "
          f"{'fTFLOP/s':>8} {'bTFLOP/s':>8} {'GB moved':>8} {'err':>8} vs torch")  # fmt: skip


def _runnable(op: str) -> list[str]:
    names = []
    for backend in kernels.BACKENDS:
        try:
            kernels.choose(op, backend)
        except ConfigError:
            continue
        names.append(backend)
    return names


def interpreter_checks(ops) -> None:
    """CPU: each non-torch backend that runs here, against the reference at a small shape."""
    small = {"heads": 3, "index_heads": 2, "window": 20, "topk": 18}
    print("correctness of the other backends on CPU (Triton: interpreter), small shapes:")
    for op in ops:
        for backend in [b for b in _runnable(op) if b != "torch"]:
            for dtype in (torch.float32, torch.bfloat16):
                args, kw, grad_args, *_ = _small(op, small)
                t0 = time.perf_counter()
                try:
                    got = run_once(kernels.resolve(op, backend), args, kw, grad_args,
                                   torch.device("cpu"), dtype)  # fmt: skip
                except ConfigError as exc:
                    print(f"  {op:<17} {backend:<11} {str(dtype)[6:]:<9} refused: {exc}")
                    continue
                dt = time.perf_counter() - t0
                ref = run_once(kernels.resolve(op, "torch"), args, kw, grad_args,
                               torch.device("cpu"), torch.float32)  # fmt: skip
                errs = [_err(got[0], ref[0])] + [
                    _err(g, r) for g, r in zip(got[1], ref[1], strict=True)
                ]
                print(f"  {op:<17} {backend:<11} {str(dtype)[6:]:<9} max rel err {max(errs):.1e}"
                      f" (out + {len(got[1])} grads vs fp32 reference), {dt:.1f} s")  # fmt: skip


def _small(op, sc):
    if op == "sparse_attention":  # a few query rows, 16-wide heads
        args, kw, ga, *_ = _attention(32, sc, None, torch.float32, torch.Generator().manual_seed(0))
        return [args[0][..., :16].contiguous(), args[1][:, :16].contiguous(), args[2]], kw, ga
    if op == "grouped_experts":
        g = torch.Generator().manual_seed(0)
        counts = [9, 0, 20, 3]
        w_gate_up, w_down = (0.1 * torch.randn(4, *s, generator=g) for s in ((64, 64), (64, 32)))
        args = [torch.randn(32, 64, generator=g), counts, w_gate_up, w_down]
        return args, {"limit": 10.0}, (0, 2, 3)
    args, kw, ga, *_ = CASES[op](256, sc, None, torch.float32, torch.Generator().manual_seed(0))
    return args, kw, ga


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--rows", type=int, nargs="+", default=None)
    ap.add_argument("--scale", choices=list(SCALES), default=None)
    ap.add_argument("--reps", type=int, default=None, help="calls per case (best kept)")
    ap.add_argument("--no-interpret", action="store_true", help="skip the CPU correctness part")
    ap.add_argument("--json", type=Path, default=None, help="also write the timed rows here")
    a = ap.parse_args()
    records: list[dict] = []
    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    scale = a.scale or ("flash" if gpu else "cpu")
    rows_list = a.rows or ([4096, 16384] if gpu else [1024])
    reps = a.reps or (5 if gpu else 1)
    torch.manual_seed(0)
    where = torch.cuda.get_device_name(0) if gpu else f"CPU ({torch.get_num_threads()} threads)"
    print(f"bench_kernels: {where}, scale {scale} {SCALES[scale]}, rows {rows_list}")
    if not gpu and not a.no_interpret:
        interpreter_checks(a.ops)
    print(f"time per call (best of {reps}), bytes moved = lower bound, err = max rel vs torch:")
    print(HEADER)
    for op in a.ops:
        for rows in rows_list:
            for dtype in (torch.bfloat16,) if gpu else (torch.float32,):
                ref = bench(op, "torch", rows, SCALES[scale], device, dtype, reps)
                print(_row(op, rows, "torch", dtype, ref, ref), flush=True)
                records.append(_record(op, rows, "torch", dtype, ref, ref))
                if not gpu:  # other backends' CPU times are an interpreter's (see above)
                    continue
                for backend in [b for b in _runnable(op) if b != "torch"]:
                    try:
                        r = bench(op, backend, rows, SCALES[scale], device, dtype, reps, ref)
                    except ConfigError as exc:
                        print(f"  {op:<17} {rows:>6} {backend:<13} refused: {exc}")
                        continue
                    print(_row(op, rows, backend, dtype, r, ref), flush=True)
                    records.append(_record(op, rows, backend, dtype, r, ref))
    if a.json is not None:
        a.json.write_text(json.dumps({"device": where, "scale": scale, "rows": records}, indent=1))


if __name__ == "__main__":
    main()
