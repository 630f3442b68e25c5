"""One attention layer (tiny widths, real window 128 / ratios 4 and 128), forward + backward on CPU.

Prints time and peak-RSS growth per (kind, S, layout) side by side, each case in a fresh
subprocess so peaks do not mix. Layouts: `packed` = SFT-like samples of 200..4000 tokens,
`single` = one sample filling the pack (worst case for HCA pools and the CSA indexer).
Usage: python benchmarks/bench_attention.py [--seq 8192 32768] [--kinds dense csa hca]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def _case(kind: str, s: int, layout_kind: str) -> dict:
    import torch

    from primus_v4.models.deepseek_v4.attention import Attention
    from primus_v4.models.deepseek_v4.config import DeepseekV4Config
    from primus_v4.models.deepseek_v4.layout import RowLayout

    cfg = DeepseekV4Config.preset("tiny")
    att = Attention(cfg, compress_ratio={"dense": 0, "csa": 4, "hca": 128}[kind], layer_idx=1)
    g = torch.Generator().manual_seed(0)
    if layout_kind == "single":
        lens = [s]
    else:
        lens = []
        while sum(lens) < s:
            lens.append(int(torch.randint(200, 4000, (1,), generator=g)))
        lens[-1] -= sum(lens) - s
    cu = torch.tensor([0, *lens]).cumsum(0)
    layout = RowLayout.from_cu_seqlens(cu, local_rows=s)
    pos = torch.arange(s) - layout.seq_start_T
    x = torch.randn(s, cfg.hidden_size, requires_grad=True)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # CPU time of this process: stable on a shared machine (wall time is printed too).
    t0, c0 = time.perf_counter(), time.process_time()
    att(x, positions_T=pos, layout=layout).square().mean().backward()
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base
    return {
        "kind": kind,
        "S": s,
        "layout": layout_kind,
        "s": dt,
        "cpu_s": cpu,
        "peak_mib": peak / 1024,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--kinds", nargs="+", default=["dense", "csa", "hca"])
    ap.add_argument("--layouts", nargs="+", default=["packed", "single"])
    ap.add_argument("--one", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(_case(args.one[0], int(args.one[1]), args.one[2])))
        return
    rows = []
    for kind in args.kinds:
        for lay in args.layouts:
            for s in args.seq:
                cmd = [sys.executable, __file__, "--one", kind, str(s), lay]
                out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
                rows.append(json.loads(out.strip().splitlines()[-1]))
    head = " ".join(f"{'S=' + str(s) + ' cpu/wall/peak':>30}" for s in args.seq)
    print(f"{'kind':6} {'layout':7} {head}")
    for kind in args.kinds:
        for lay in args.layouts:
            cells = [r for r in rows if r["kind"] == kind and r["layout"] == lay]
            text = " ".join(
                f"{r['cpu_s']:8.2f}s {r['s']:7.2f}s {r['peak_mib']:7.0f}MiB" for r in cells
            )
            ratio = cells[-1]["cpu_s"] / cells[0]["cpu_s"] if len(cells) > 1 else float("nan")
            print(f"{kind:6} {lay:7} {text}   cpu-time ratio last/first {ratio:.2f}")


if __name__ == "__main__":
    main()
