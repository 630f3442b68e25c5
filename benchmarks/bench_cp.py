"""Per-rank memory of the tiny DeepSeek-V4 under context parallel: CP 1, 2, 4 side by side.

One packed SFT-like row of S tokens (ragged samples of 1..4096 tokens plus trailing padding) is
split contiguously over cp gloo ranks (torchrun, one torch thread per rank); each rank runs one
forward+backward of the whole model (dense, CSA, HCA layers, MoE, mHC, MTP) on its rows.

How memory is measured (CPU): per rank, after a warm-up step on a short pack has allocated the
parameter gradients, glibc is pinned to mmap every large block (MALLOC_MMAP_THRESHOLD_) so freed
tensors leave the RSS, the kernel's peak-RSS mark is reset (/proc/self/clear_refs "5"), then
  activation = VmHWM during the measured fwd+bwd - VmRSS just before it
  peak        = VmHWM (weights, gradients and activations: what the rank needs)
The LM-head cross-entropy runs in row chunks; its [chunk, vocab] working set does not shrink with
CP, so it is set small (--ce-chunk, default 128 rows) to let the benchmark see the activations.

    python benchmarks/bench_cp.py                      # S=32768, CP 1 2 4
    python benchmarks/bench_cp.py --seq 8192 --cps 1 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ACT_BAR = 0.4  # CP=4 per-rank activation memory must be at most 0.4x of CP=1 (ideal 0.25)


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def make_batch(s: int, seed: int = 0):
    """Ragged samples like packed SFT (1..4096 tokens) and a trailing padding segment."""
    import torch

    from primus_v4.data.thd import ThdBatch

    gen = torch.Generator().manual_seed(seed)
    lengths, total = [], 0
    while total < s - 64:
        n = min(int(torch.randint(1, 4097, (1,), generator=gen)), s - 64 - total)
        lengths.append(n)
        total += n
    lengths.append(s - total)  # padding segment
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    ids = torch.randint(0, 129280, (s,), generator=gen)
    pad = torch.zeros(s, dtype=torch.bool)
    pad[int(cu[-2]) :] = True
    mask = (~pad).float()
    mask[(cu[1:] - 1).long()] = 0.0  # the last token of each sample has no target
    return ThdBatch(
        input_ids_S=ids,
        labels_S=torch.roll(ids, -1),
        loss_mask_S=mask,
        position_ids_S=torch.cat([torch.arange(n) for n in lengths]),
        cu_seqlens_N1=cu,
        padding_mask_S=pad,
    )


def child(s: int, ce_chunk: int, out_dir: Path) -> None:
    import torch
    import torch.distributed as dist

    from primus_v4.models.deepseek_v4 import DeepseekV4Config, DeepseekV4Model
    from primus_v4.models.deepseek_v4.infra.cp_batch import required_local_rows, shard_batch
    from primus_v4.models.deepseek_v4.layout import LocalComm
    from primus_v4.parallel.context_parallel import CpComm

    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        dist.init_process_group("gloo")
    comm = CpComm(dist.group.WORLD) if world > 1 else LocalComm()
    cfg = DeepseekV4Config.preset("tiny", ce_chunk_size=ce_chunk)
    torch.manual_seed(0)
    model = DeepseekV4Model(cfg)

    def step(n: int) -> float:
        shard = shard_batch(
            make_batch(n, seed=n),
            cp_rank=rank,
            cp_size=world,
            mtp_depths=cfg.mtp_num_layers or 0,
            min_local_rows=required_local_rows(cfg),
        )
        t0 = time.perf_counter()
        out = model(**shard.model_inputs(comm))
        loss = out.loss_sum + cfg.mtp_loss_scaling_factor * sum(out.mtp_loss_sums) + out.aux_loss
        loss.backward()
        return time.perf_counter() - t0

    step(256 * world)  # warm-up: allocates every parameter gradient, lazy init
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak-RSS mark
    base_kib = _status_kib("VmRSS")
    seconds = step(s)
    peak_kib = _status_kib("VmHWM")
    row = {
        "rank": rank,
        "rows": s // world,
        "seconds": seconds,
        "base_gib": base_kib / 2**20,
        "peak_gib": peak_kib / 2**20,
        "act_gib": (peak_kib - base_kib) / 2**20,
    }
    (out_dir / f"rank{rank}.json").write_text(json.dumps(row))
    if world > 1:
        dist.destroy_process_group()


def run_cp(cp: int, s: int, ce_chunk: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        args = [__file__, "--child", "--seq", str(s), "--ce-chunk", str(ce_chunk), "--out", tmp]
        if cp == 1:
            cmd = [sys.executable, *args]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
            cmd += ["--nproc_per_node", str(cp), *args]
        # A fixed mmap threshold: freed tensors go back to the OS, so RSS follows live memory.
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "131072"}
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if res.returncode != 0:
            raise RuntimeError(f"CP={cp} failed (exit {res.returncode}):\n{res.stderr[-3000:]}")
        return [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(cp)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--ce-chunk", type=int, default=128, help="rows per LM-head CE chunk")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.seq, args.ce_chunk, args.out)
        return 0
    results = {cp: run_cp(cp, args.seq, args.ce_chunk) for cp in args.cps}
    base = max(r["act_gib"] for r in results[args.cps[0]])
    print(f"tiny DeepSeek-V4, S={args.seq}, CE chunk {args.ce_chunk} rows, 1 thread per rank")
    head = f"{'CP':>3} {'rows/rank':>10} {'peak GiB':>9} {'weights+grads GiB':>18}"
    print(f"{head} {'activation GiB':>15} {'x vs CP' + str(args.cps[0]):>9} {'fwd+bwd s':>10}")
    for cp, rows in results.items():
        # The worst rank is what has to fit on a device.
        peak = max(r["peak_gib"] for r in rows)
        act = max(r["act_gib"] for r in rows)
        print(
            f"{cp:>3} {rows[0]['rows']:>10} {peak:>9.2f} {max(r['base_gib'] for r in rows):>18.2f}"
            f" {act:>15.2f} {act / base:>9.2f} {max(r['seconds'] for r in rows):>10.1f}"
        )
    ok = True
    if 1 in results and 4 in results:
        ratio = max(r["act_gib"] for r in results[4]) / max(r["act_gib"] for r in results[1])
        ok = ratio <= ACT_BAR
        print(f"CP=4 / CP=1 per-rank activation memory = {ratio:.3f} (ideal 0.25, bar {ACT_BAR})")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
