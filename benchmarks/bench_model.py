"""Tiny DeepSeek-V4 forward+backward on CPU at growing pack lengths: time and peak memory.

Each length runs in its own subprocess so its peak RSS is its own. Prints one table, then the
32768/8192 time ratio (linear scaling is 4; any [S, S] path would show ~16; the bar is 5) and
whether the longest pack stayed under the memory bar.

    python benchmarks/bench_model.py                       # 8192, 32768, 131072
    python benchmarks/bench_model.py --seqs 8192 32768 --threads 2
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

RATIO_BAR = 5.0
MEM_BAR_GIB = 12.0


def make_pack(s: int, seed: int):
    """Ragged samples (1..4096 tokens, like packed SFT) plus a trailing padding segment."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    lengths, total = [], 0
    while total < s - 64:
        n = int(torch.randint(1, 4097, (1,), generator=gen))
        n = min(n, s - 64 - total)
        lengths.append(n)
        total += n
    lengths.append(s - total)  # padding segment
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    ids = torch.randint(0, 129280, (s,), generator=gen)
    pad = torch.zeros(s, dtype=torch.bool)
    pad[cu[-2] :] = True
    pos = torch.cat([torch.arange(n) for n in lengths])
    labels = torch.roll(ids, -1)
    mask = (~pad).float()
    mask[(cu[1:] - 1).long()] = 0.0  # the last token of each sample has no target
    return ids, cu, pos, pad, labels, mask


def child(s: int, vocab: int | None) -> None:
    import torch
    from megatron.core.packed_seq_params import PackedSeqParams

    from primus_v4.models.deepseek_v4 import DeepseekV4Config, DeepseekV4Model

    overrides = {} if vocab is None else {"vocab_size": vocab}
    torch.manual_seed(0)
    model = DeepseekV4Model(DeepseekV4Config.preset("tiny", **overrides))

    def step(n: int) -> float:
        ids, cu, pos, pad, labels, mask = make_pack(n, seed=n)
        ids = ids % model.cfg.vocab_size
        labels = labels % model.cfg.vocab_size
        psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
        t0 = time.perf_counter()
        out = model(
            ids[None], pos[None], packed_seq_params=psp, labels=labels[None],
            loss_mask=mask[None], padding_mask=pad[None],
        )  # fmt: skip
        loss = out.loss + model.cfg.mtp_loss_scaling_factor * out.mtp_loss + out.aux_loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    step(1024)  # warm-up: lazy init, kernel selection
    seconds = step(s)
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    print(json.dumps({"seq": s, "seconds": seconds, "peak_rss_gib": peak_gib}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seqs", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--vocab", type=int, default=None, help="override the tiny vocab (129280)")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.child is not None:
        child(args.child, args.vocab)
        return 0
    rows = []
    for s in args.seqs:
        cmd = [sys.executable, __file__, "--child", str(s)]
        cmd += ["--threads", str(args.threads)] if args.threads else []
        cmd += ["--vocab", str(args.vocab)] if args.vocab else []
        res = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if res.returncode != 0:
            print(f"S={s}: failed (exit {res.returncode})\n{res.stderr[-3000:]}")
            return 1
        rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
    base = next((r for r in rows if r["seq"] == 8192), rows[0])
    print(f"{'S':>8} {'fwd+bwd s':>10} {'x vs ' + str(base['seq']):>12} {'peak RSS GiB':>13}")
    for r in rows:
        ratio = r["seconds"] / base["seconds"]
        print(f"{r['seq']:>8} {r['seconds']:>10.2f} {ratio:>12.2f} {r['peak_rss_gib']:>13.2f}")
    by_seq = {r["seq"]: r for r in rows}
    ok = True
    if 8192 in by_seq and 32768 in by_seq:
        ratio = by_seq[32768]["seconds"] / by_seq[8192]["seconds"]
        ok &= ratio <= RATIO_BAR
        print(f"time(32768) / time(8192) = {ratio:.2f} (linear 4, bar {RATIO_BAR})")
    if 131072 in by_seq:
        peak = by_seq[131072]["peak_rss_gib"]
        ok &= peak < MEM_BAR_GIB
        print(f"S=131072 peak RSS {peak:.2f} GiB (bar {MEM_BAR_GIB} GiB)")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
