"""Packing benchmark: the Rust tokenizer floor vs a cold and a cache-hit `primus-v4 pack`.

Builds an Alpaca-sized corpus (default 52,000 rows: the 1000 rows of examples/data/alpaca_demo.json
repeated, each made unique), then measures side by side in one run:
  floor      encode_batch of exactly the texts the pipeline encodes: the DeepSeek-V4 chat-mode
             prompt `BOS <User> prompt <Assistant> </think>` and completion `response EOS` of
             each row (in-process, tokenizer loaded, strings pre-built: the least any pipeline
             must spend)
  cold       `primus-v4 pack` in a fresh process on an empty cache dir (wall, startup included;
             reading, shape detection, chat-mode rendering, tokenizing, packing, writing)
  cache hit  the same command again (wall)
  packers    FFD vs BFD on the built sample lengths: packs vs ceil(real_tokens / seq_length)
  disk       cache entry bytes vs five int64 arrays per pack
Usage: python benchmarks/bench_packing.py [--rows 52000] [--seq-length 4096] [--repeat 1]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "examples" / "data" / "alpaca_demo.json"


def make_corpus(path: Path, rows: int) -> list[dict[str, str]]:
    base = json.loads(DEMO.read_text(encoding="utf-8"))
    out = []
    for i in range(rows):
        row = dict(base[i % len(base)])
        # A distinct instruction per copy: no two rows render to the same sample.
        row["instruction"] = f"{row['instruction']} (#{i})"
        out.append(row)
    with path.open("w", encoding="utf-8") as f:
        for row in out:
            f.write(json.dumps(row) + "\n")
    return out


def floor_seconds(rows: list[dict[str, str]]) -> tuple[float, float]:
    """(wall, cpu) seconds; cpu counts the tokenizer's worker threads too."""
    from tokenizers import Tokenizer

    from primus_v4.data.dsv4_format import ASSISTANT, BOS, END_THINK, EOS, USER
    from primus_v4.data.tokenizer import default_tokenizer_dir

    tok = Tokenizer.from_file(str(default_tokenizer_dir() / "tokenizer.json"))
    prompts = [
        BOS
        + USER
        + (f"{r['instruction']}\n\n{r['input']}" if r["input"].strip() else r["instruction"])
        + ASSISTANT
        + END_THINK
        for r in rows
    ]
    responses = [r["output"] + EOS for r in rows]
    start, cpu = time.perf_counter(), time.process_time()
    tok.encode_batch(prompts, add_special_tokens=False)
    tok.encode_batch(responses, add_special_tokens=False)
    return time.perf_counter() - start, time.process_time() - cpu


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_pack(corpus: Path, cache_dir: Path, seq_length: int, stats: Path) -> tuple[float, float]:
    """(wall, cpu) seconds of one `primus-v4 pack` process, startup and imports included."""
    cmd = [sys.executable, "-m", "primus_v4", "pack", "--data", str(corpus)]
    cmd += ["--seq-length", str(seq_length), "--cache-dir", str(cache_dir)]
    cmd += ["--stats-json", str(stats), "--no-progress"]
    start, cpu = time.perf_counter(), _children_cpu()
    subprocess.run(cmd, check=True, capture_output=True, cwd=REPO)
    return time.perf_counter() - start, _children_cpu() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=52_000)
    parser.add_argument("--seq-length", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=1, help="take the best of N (floor, cold)")
    args = parser.parse_args()

    from primus_v4.data.cache import dir_bytes
    from primus_v4.data.packing import pack
    from primus_v4.data.pipeline import PackSpec, build_or_load

    with tempfile.TemporaryDirectory(prefix="bench_packing_") as tmp:
        work = Path(tmp)
        corpus = work / "alpaca_52k.jsonl"
        rows = make_corpus(corpus, args.rows)
        floor, floor_cpu = min(floor_seconds(rows) for _ in range(args.repeat))
        stats_path = work / "stats.json"
        colds = [
            run_pack(corpus, work / f"cache{k}", args.seq_length, stats_path)
            for k in range(args.repeat)
        ]
        cold, cold_cpu = min(colds)
        hit, hit_cpu = run_pack(corpus, work / "cache0", args.seq_length, stats_path)
        stats = json.loads(stats_path.read_text())
        assert stats["cache_hit"], "second run was not a cache hit"

        spec = PackSpec(data=str(corpus), seq_length=args.seq_length, cache_dir=work / "cache0")
        built = build_or_load(spec)
        lengths = np.diff(np.asarray(built._sample_offsets))
        lower = -(-int(lengths.sum()) // args.seq_length)
        packers = {}
        for algorithm in ("ffd", "bfd"):
            start = time.perf_counter()
            _, offsets = pack(lengths, seq_length=args.seq_length, algorithm=algorithm)
            packers[algorithm] = (len(offsets) - 1, time.perf_counter() - start)
        entry_bytes = dir_bytes(built.entry)
        naive_bytes = stats["num_packs"] * args.seq_length * 5 * 8

    print(
        f"bench_packing: {args.rows} rows -> {stats['num_samples']} samples, seq {args.seq_length}"
    )
    print(f"  {'measure':<34}{'wall':>9}{'cpu':>9}  note")
    print(f"  {'floor: encode_batch only':<34}{floor:>8.2f}s{floor_cpu:>8.2f}s  in-process")
    print(
        f"  {'cold primus-v4 pack':<34}{cold:>8.2f}s{cold_cpu:>8.2f}s  "
        f"{cold / floor:.2f}x floor wall, {cold_cpu / floor_cpu:.2f}x floor cpu (target 1.5x)"
    )
    print(f"  {'cache-hit primus-v4 pack':<34}{hit:>8.2f}s{hit_cpu:>8.2f}s  target < 1 s wall")
    print(f"  {'real tokens':<34}{stats['real_tokens']:>18}  lower bound {lower} packs")
    for algorithm, (packs, seconds) in packers.items():
        note = f"packs={packs} ({packs - lower:+d} vs bound), {seconds * 1e3:.0f} ms"
        print(f"  {algorithm.upper() + ' packing':<34}{seconds:>8.3f}s{'':>9}  {note}")
    print(f"  {'packs built by cold run':<34}{stats['num_packs']:>18}  ffd")
    print(
        f"  {'cache entry on disk':<34}{entry_bytes / 2**20:>14.1f} MiB  "
        f"{naive_bytes / entry_bytes:.1f}x smaller than 5 int64 arrays per pack"
    )
    print(
        f"  {'real / supervised fraction':<34}{stats['real_fraction']:>14.4f}  "
        f"{stats['supervised_fraction']:.4f}"
    )


if __name__ == "__main__":
    main()
